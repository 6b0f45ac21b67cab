"""Error feedback for the compressed pseudo-gradient all-reduce (the block codecs; the sparse codec's ring
hands the residual back itself, see compensate()).

A lossy codec (int8, fp4) loses part of every node's pseudo-gradient; error
feedback (1-bit Adam, DiLoCoX, SparseLoCo) keeps that part per node, as a
residual, and adds it to the node's next pseudo-gradient, so that what one
outer step loses the next one sends. Per node, for each outer step (of each
fragment, at its own sync):

    p  = pseudo_gradient + residual          one fp32 addition
    y  = dequantize(quantize(p))             the codec's round trip (prime.ops), by the ring's blocks
    residual = p - y                         one fp32 subtraction
    the node's contribution to the all-reduce is y

The ring then quantizes y again, and that second quantization is lossless:
a round trip of the codec is a fixed point of it (fp4: every block's largest
value a = |y| decodes from the code 6 and the block's scale s, and (6 * s) / 6
rounds back to s; int8: the scale is the smallest grid value 2^(k/18) with
a / s <= 127.5, so the largest value codes as 123..127, and a' / 127.5 of the
decoded block lies between s and the grid value below it, which rounds up to s
again; docs/wire-format.md). So the block gets the same codes and the same
scale (an int8 block whose codes are all 0, values below 2^-127, may come back
with the scale 0: the same decoded zeros). Checked bit for bit on every fp32 scale of several binades, on every
int8 grid value of several octaves and on the real ring by
tests/test_feedback.py. So each node's contribution enters the sum exactly as
y, whichever schedule runs, and the residual is exactly what the node's
contribution lost. What the residual does not hold: the errors of quantizing
*sums* (the owner's final quantization in both schedules, and in the `ring`
schedule the partial sums at each hop), which are not one node's, nor an int8
block that a ring payload sends as zeros because its values are all below about
2^-14 of the payload's largest (docs/wire-format.md, "On the wire"; docs/training.md,
"Error feedback").

The residual is the node's own memory: it is not averaged, differs from node
to node, lives beside the outer weights (prime.outer.OuterState.residual) and
is saved in the node's checkpoints; a node that joins (elastic) starts from a
zero residual.
"""

from __future__ import annotations

from typing import Optional

import torch

from prime import ops
from prime.codecs import CODECS

__all__ = ["resolve_error_feedback", "check_feedback_decay", "round_trip", "compensate"]

LOSSY_CODECS = tuple(name for name, c in CODECS.items() if c.lossy)
DEFAULT_ON = tuple(name for name, c in CODECS.items() if c.feedback_default)
"""Codecs with error feedback on when it is not set (prime.codecs: Codec.feedback_default)."""


def resolve_error_feedback(error_feedback: Optional[bool], codec: str, name: str = "error_feedback") -> bool:
    """Whether error feedback runs: `error_feedback` as given, or (None) on for fp4 and off for int8. True with
    codec "none" raises ValueError (an exact average loses nothing to feed back)."""
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"{name} must be True, False or None (on for codec fp4, off for int8), got {error_feedback!r}")
    if error_feedback is None:
        return codec in DEFAULT_ON
    if not error_feedback and CODECS.get(codec) is not None and CODECS[codec].sparse:
        raise ValueError(f"{name} = false is refused with codec {codec!r}: each round sends only the largest values "
                         "of every chunk, and error feedback is what sends the rest in later rounds; leave it unset")
    if error_feedback and codec not in LOSSY_CODECS:
        raise ValueError(f"{name} = true needs a lossy codec (int8 or fp4); codec {codec!r} averages exactly, so there "
                         "is no quantization error to feed back: set it to false or leave it unset")
    return error_feedback


def check_feedback_decay(decay, error_feedback: bool, name: str = "feedback_decay") -> float:
    """decay as a float in (0, 1]; a decay other than 1 without error feedback raises ValueError naming `name`."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
        raise ValueError(f"{name} must be a number in (0, 1] (1: the residual is kept whole), got {decay!r}")
    if decay != 1 and not error_feedback:
        raise ValueError(f"{name} = {decay!r} needs error feedback (codec fp4 or topk, or error_feedback = true): "
                         "without it there is no residual to decay")
    return float(decay)


def round_trip(x: torch.Tensor, codec: str, block_size: int, keep: Optional[int] = None) -> torch.Tensor:
    """dequantize(quantize(x)) with the codec's fastest backend for x's device (every backend gives the same
    bits). Non-finite blocks come back as NaN (the caller checks finiteness). topk: decode(encode(x)) with
    `keep` values per chunk of block_size (prime.sparse: on x's GPU with the CUDA or Triton kernels where the
    build or triton has them, else on the CPU); a tensor that is not finite comes back as NaN."""
    if codec == "topk":
        from prime import sparse

        flat = x.reshape(-1)
        if not bool(torch.isfinite(flat).all()):
            return torch.full_like(x, float("nan"))
        return sparse.decode(sparse.encode(flat, block_size, keep), flat.numel(), block_size, keep).to(x.device).view_as(x)
    if codec == "int8":
        q, s = ops.quantize_int8(x, block_size, check_finite=False)
        return ops.dequantize_int8(q, s, block_size).view_as(x)
    assert codec == "fp4", codec
    q, s = ops.quantize_fp4(x, block_size, check_finite=False)
    return ops.dequantize_fp4(q, s, x.numel(), block_size).view_as(x)


def compensate(g: torch.Tensor, residual: torch.Tensor, codec: str, block_size: int, commit: bool,
               keep: Optional[int] = None, decay: float = 1.0) -> None:
    """g := dequantize(quantize(g + decay x residual)) and, with `commit`, residual := (g + decay x residual) -
    that: the step of error feedback on one piece of whole codec blocks (g a work view, residual a view of the
    home buffer or its staged copy). decay < 1 forgets old residual geometrically (SparseLoCo's accumulator).

    topk: g := g + decay x residual, dense, and with `commit` residual := 0. The ring selects (each rank its values
    of the shards others own; the owner adds its own shard dense, unselected) and hands back everything the
    contribution lost, both selections' (Sync.take_dropped, added to the residual once the average is back)."""
    if decay == 1.0:
        g.add_(residual)
    else:  # two roundings, not add_(alpha=): a fused multiply-add in some kernels and not in others
        g.add_(torch.mul(residual, decay))
    if codec == "topk":
        if commit:
            residual.zero_()
        return
    y = round_trip(g, codec, block_size, keep)
    if commit:
        torch.sub(g, y, out=residual)
    g.copy_(y)
