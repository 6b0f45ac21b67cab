"""The outer state: flat fp32 outer weights and momentum of one process's share of a model (or of a fragment).

    state = OuterState(model.parameters(), block_size=64)
    state.take()                      # outer weights := the model's current weights
    ...                               # inner steps move the model away
    g = state.new_buffer()
    state.pseudo_gradient(g)          # g = outer - local
    ...                               # average g across nodes (prime.sync)
    state.update(g, load=True)        # outer Nesterov step; local weights := outer weights

For the parameters this process holds (the local shard of each FSDP2
DTensor, or the whole tensor of a plain module), the outer weights and
momentum are flat fp32 buffers, each parameter starting a new codec block, so
that no int8 block of the all-reduce spans two parameters.

Two places matter: where the outer weights and momentum live (`device`, the
state's *home*) and where the arithmetic runs (the *work device*: the
parameters' device). Work buffers (the pseudo-gradient, the start point of
overlap) are always made on the work device, so on a GPU model the all-reduce
reduces on the GPU and only int8 bytes cross PCIe.

    "gpu"   home on the parameters' GPU: every pass is a GPU kernel over the buffers
    "cpu"   home in CPU memory (pinned when the parameters are on a GPU). On a GPU model
            every pass *streams* the home buffers through the GPU in pieces
            (_PIPE_CHUNK values), double-buffered on side streams: a piece is copied
            in, computed on by the same GPU kernels as "gpu", and (for the update)
            copied back, while the next piece crosses PCIe the other way. The host CPU
            does no per-element arithmetic; only piece copies cross PCIe.
    "auto"  "gpu" when the home buffers fit in the GPU's free memory less what training
            will still allocate and a margin for activations (AUTO_GPU_MARGIN_BYTES),
            else "cpu"; logged (prime.outer). prime.memory plans the whole run.

With error feedback (prime/feedback.py) a third home buffer, the residual,
lives beside the outer weights and momentum (the same home, streamed the same
way): compensate() turns the pseudo-gradient into the node's contribution,
commit_residual() writes what it lost once the average is back.

The passes of an outer step: one over the parameters for the pseudo-gradient
and its squared norm (pseudo_gradient), then after the average one update pass
(update, with the copy into the model fused in). Each pass may cover a flat
range [lo, hi) only (a piece of a pipelined outer step: prime.pipeline), cut at
`ranges()`. With overlap (prime/diloco.py) a lookahead pass computes the next
start point without touching the momentum: the passes only overlap runs are
prime.overlap.OverlapPasses, mixed in here.

The update's arithmetic is prime.update's: the default Nesterov SGD, each
operation rounded once, so that every node, on any CPU or GPU and whether its
state is resident or streamed, computes the same bits from the same average;
or a custom torch optimizer (`optimizer_factory`) over views of the outer
weights.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable, Optional

import torch

from prime.feedback import compensate
from prime.ops import DEFAULT_BLOCK_SIZE
from prime import layout
from prime.layout import (AUTO_GPU_MARGIN_BYTES, AUTO_GPU_MARGIN_FRACTION, OUTER_STATE_DEVICES,  # noqa: F401
                          FlatLayout, choose_device, pending_training_bytes, resolve_device, staging_bytes)
from prime.overlap import OverlapPasses
from prime.update import NesterovUpdate, PlainAverage, OuterOptimizerFactory, TorchOptimizerUpdate

__all__ = ["OuterState", "OuterOptimizerFactory", "OUTER_STATE_DEVICES", "AUTO_GPU_MARGIN_BYTES",
           "AUTO_GPU_MARGIN_FRACTION", "pending_training_bytes", "resolve_device", "choose_device",
           "staging_bytes", "home_buffer_count"]

logger = logging.getLogger("prime.outer")


def home_buffer_count(error_feedback: bool) -> int:
    """Flat fp32 buffers of the layout an outer state keeps in its home: outer weights and momentum, and with
    error feedback the residual."""
    return 2 + bool(error_feedback)


class OuterState(FlatLayout, OverlapPasses):
    """Outer weights and momentum (or a torch outer optimizer), flat fp32.

    params:            the model's parameters (FSDP2 DTensors or plain tensors), or a fragment's
    block_size:        codec block size; every parameter starts a new block
    outer_lr, outer_momentum, nesterov: the default outer update (prime.update.NesterovUpdate)
    optimizer_factory: replaces the default update (see prime.update.OuterOptimizerFactory)
    device:            "cpu", "gpu" or "auto": the home of the outer weights and momentum (module docstring)
    extra_buffers:     work buffers beyond the pseudo-gradient that the caller will ask new_buffer() for;
                       counted by device="auto"
    inner_optimizer:   the inner optimizer, if any: device="auto" counts the state it will still make
                       (pending_training_bytes)
    stream:            stream the home buffers through the work device in staged pieces (None: exactly when
                       they live on another device than the parameters; True on a CPU model runs the
                       streamed passes with CPU staging, for tests)
    error_feedback:    the codec ("int8" or "fp4") whose error this node feeds back (prime.feedback): a third home
                       buffer, the residual, beside the outer weights and momentum; None: no error feedback
    shard:             shard(p) -> the tensor of parameter p this state holds (None: the local shard; prime.shares)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        optimizer_factory: Optional[OuterOptimizerFactory] = None,
        device: str = "cpu",
        extra_buffers: int = 0,
        inner_optimizer: Optional[torch.optim.Optimizer] = None,
        stream: Optional[bool] = None,
        pending_bytes: int = 0,
        error_feedback: Optional[str] = None,
        feedback_keep: Optional[int] = None,
        feedback_decay: float = 1.0,
        shard: Optional[Callable] = None,
    ):
        feedback = error_feedback is not None
        super().__init__(params, block_size=block_size, device=device, home_buffers=home_buffer_count(feedback),
                         extra_buffers=extra_buffers, inner_optimizer=inner_optimizer, stream=stream,
                         pending_bytes=pending_bytes, shard=shard)
        self.feedback_codec = error_feedback
        """The codec whose quantization error this node feeds back (prime.feedback), or None."""
        self.feedback_keep = feedback_keep
        """topk: the values kept per chunk of block_size (prime.sparse); None for the block codecs."""
        self.feedback_decay = feedback_decay
        """Error feedback: the share of the residual added to the next pseudo-gradient (prime.feedback)."""
        self.outer = self._home_buffer()
        """The outer weights (padding: 0)."""
        self._grad: Optional[torch.Tensor] = None
        self.taken = False
        """True once the outer weights hold something (take(), load_state_dict() or a download)."""
        self.residual: Optional[torch.Tensor] = self._home_buffer() if error_feedback is not None else None
        """Error feedback: what this node's contributions lost to the codec so far (padding: 0; None: off)."""
        self.rule: Optional[NesterovUpdate] = None
        """The default outer update (None: a custom outer optimizer)."""
        self.optimizer: Optional[TorchOptimizerUpdate] = None
        """A custom outer optimizer over views of the outer weights (None: the default update)."""
        self.momentum: Optional[torch.Tensor] = None
        self.dense_rule = PlainAverage()
        """The update of a sparse codec's dense start (update(dense=True)): the average as it is."""
        if optimizer_factory is None:
            self.rule = NesterovUpdate(outer_lr, outer_momentum, nesterov)
            self.momentum = self._home_buffer()
        else:
            self.optimizer = TorchOptimizerUpdate(optimizer_factory, self.outer, self.offsets, self.sizes,
                                                  self.shapes, self.device)

    # -- the outer step's parts --------------------------------------------------

    def take(self) -> None:
        """Outer weights := the model's current weights (momentum and optimizer state are kept)."""
        self.gather(self.outer)
        self.taken = True

    def ensure_taken(self) -> None:
        """take() unless the outer weights already hold something."""
        if not self.taken:
            self.take()

    @torch.no_grad()
    def pseudo_gradient(self, g: torch.Tensor, anchor: Optional[torch.Tensor] = None, lo: int = 0,
                        hi: Optional[int] = None, at: int = 0) -> float:
        """g = anchor - local over [lo, hi) (anchor: the outer weights by default, else a work buffer; padding 0;
        `at`: g holds the values from flat value `at` on, e.g. a buffer of range [lo, hi) only with at = lo);
        returns the squared L2 norm of that part of g (float64 sums of fp32 dot products per piece; not
        bit-critical: it is reported and checked for finiteness only). One pass: the subtraction and the sum
        of squares run on each piece while it is hot."""
        sq = torch.zeros((), dtype=torch.float64, device=g.device)

        def body(p, a, gv):
            p.subtract_from(a, gv)
            sq.add_(torch.dot(gv[: p.n], gv[: p.n]).double())

        if anchor is None:
            self._walk(body, home=(self.outer,), work=(g,), lo=lo, hi=hi, work_at=at)
        else:
            if at:
                raise ValueError("pseudo_gradient: an anchor buffer needs g of the whole layout (at = 0)")
            self._walk(body, work=(anchor, g), lo=lo, hi=hi)
        return float(sq)  # one host sync on a GPU

    @torch.no_grad()
    def int8_error_sq(self, g: torch.Tensor) -> float:
        """Sum of squares of the int8 round-trip error of g (quantize, dequantize, subtract), by whole codec
        blocks: a separate pass, for rings that do not report their own quantization error."""
        from prime import ops

        err = torch.zeros((), dtype=torch.float64, device=g.device)
        bs = self.block_size
        chunk = (layout.inspect_piece(g.is_cuda) // bs) * bs or bs  # whole blocks, as the ring cuts them
        for s in range(0, g.numel(), chunk):
            c = g[s : s + chunk]
            q, scales = ops.quantize_int8(c, bs, check_finite=False)
            d = ops.dequantize_int8(q, scales, bs)
            d.sub_(c)
            err += torch.dot(d, d).double()
        return float(err)

    @torch.no_grad()
    def inspect(self, g: torch.Tensor, compression_error: bool) -> tuple[float, Optional[float]]:
        """L2 norm of g and, when asked, the relative L2 error of its int8 quantize/dequantize round trip."""
        sq = 0.0
        bs = layout.inspect_piece(g.is_cuda)
        for s in range(0, g.numel(), bs):
            c = g[s : s + bs]
            sq += float(torch.dot(c, c).double())
        norm = math.sqrt(sq)
        if not compression_error:
            return norm, None
        if not math.isfinite(sq):
            return norm, float("nan")
        return norm, (math.sqrt(self.int8_error_sq(g)) / norm if norm > 0 else 0.0)

    @torch.no_grad()
    def update(self, g: torch.Tensor, *, load: bool = False, norm: bool = False, lo: int = 0,
               hi: Optional[int] = None, at: int = 0, shift: Optional[torch.Tensor] = None,
               keep: Optional[float] = None, dense: bool = False) -> Optional[float]:
        """The outer step on the fp32 outer weights over [lo, hi), from the averaged pseudo-gradient g (a work
        buffer holding the values from flat value `at` on; same bits on CPU, GPU and streamed). `load`: also copy
        the new outer weights into the model, piece by piece as they are computed. `shift`: in the same pass,
        shift_to_outer(shift, keep) with the new outer weights (overlap's midway step). `norm`: return the
        squared L2 norm of g (fp32 dot products per piece, summed in float64), else None. `dense`: an outer step
        of a sparse codec's dense start: the average is applied as it is (PlainAverage), the momentum untouched."""
        sq = torch.zeros((), dtype=torch.float64, device=g.device) if norm else None
        if self.optimizer is not None:
            if dense:
                raise ValueError("a dense start needs the default outer update (outer_optimizer=None)")
            if lo != 0 or at != 0 or (hi is not None and hi != self.numel):
                raise ValueError("a custom outer_optimizer updates the whole state at once (no pipelined pieces)")
            self.optimizer.step(g)
            if load:
                self.scatter(self.outer)
            if norm:
                self._walk(lambda p, gv: sq.add_(torch.dot(gv, gv).double()), work=(g,))
            return float(sq) if norm else None
        rule = self.dense_rule if dense else self.rule
        tmp = self._scratch(1)[0]

        def body(p, mc, wc, gc, *sc):
            rule.step(mc, wc, gc, tmp[: gc.numel()])
            if norm:
                sq.add_(torch.dot(gc, gc).double())  # while gc is hot
            if load:
                p.write(wc)
            if sc:
                torch.sub(wc, sc[0], out=sc[0])  # shift_to_outer, while the new outer weights are hot
                if keep is not None:
                    sc[0].mul_(keep)
                p.write(sc[0], add=True)

        if shift is None:
            self._walk(body, home=(self.momentum, self.outer), work=(g,), write_home=True, lo=lo, hi=hi,
                       work_at=at)
        else:
            if at or load:
                raise ValueError("update(shift=...) covers whole-layout buffers and shifts instead of loading")
            self._walk(lambda p, mc, wc, gc, sc_: body(p, mc, wc, gc, sc_), home=(self.momentum, self.outer),
                       work=(g, shift), write_home=True, lo=lo, hi=hi)
        return float(sq) if norm else None

    @torch.no_grad()
    def add_to_model(self, delta: torch.Tensor) -> None:
        """Local weights += delta (a work buffer of the layout), one fp32 rounding per value."""
        self._walk(lambda p, dc: p.write(dc, add=True), work=(delta,))

    @torch.no_grad()
    def compensate(self, g: torch.Tensor, *, lo: int = 0, hi: Optional[int] = None, at: int = 0,
                   commit: bool = False) -> None:
        """Error feedback on the pseudo-gradient g over [lo, hi) (a work buffer holding the values from flat value
        `at` on): g := dequantize(quantize(g + residual)), the contribution the ring will send without further loss
        (prime.feedback). `commit`: also residual := (g + residual) - that, in the same pass; without it the
        residual is left as it is (commit_residual() does it once the average is back)."""
        codec, bs, keep, decay = self.feedback_codec, self.block_size, self.feedback_keep, self.feedback_decay

        def body(p, ec, gc):
            compensate(gc, ec, codec, bs, commit, keep, decay)

        self._walk(body, home=(self.residual,), work=(g,), write_home=commit, lo=lo, hi=hi, work_at=at)

    @torch.no_grad()
    def commit_residual(self, lo: int = 0, hi: Optional[int] = None, scale: float = 1.0) -> None:
        """Error feedback, once the average of a synchronous outer step is back and before update() applies it:
        residual := what this node's contribution lost, over [lo, hi), recomputed from the outer weights, the
        local weights and the residual as they were when compensate() made the contribution (the same operations,
        so the same bits; `scale`: the contribution's weight, prime.weights). Until now the residual was
        untouched, so that a failed average leaves it as it was. topk: residual := 0 over [lo, hi), and
        add_to_residual() then adds what the ring's selections dropped."""
        codec, bs, keep, decay = self.feedback_codec, self.block_size, self.feedback_keep, self.feedback_decay
        if codec == "topk":  # the ring hands back all the contribution lost (add_to_residual): nothing to recompute
            self.residual[lo:hi].zero_()
            return
        tmp = self._scratch(1)[0]

        def body(p, wc, ec):
            t = tmp[: wc.numel()]
            p.subtract_from(wc, t)  # pseudo_gradient()'s subtraction
            if scale != 1.0:
                t.mul_(scale)
            compensate(t, ec, codec, bs, True, keep, decay)

        self._walk(body, home=(self.outer, self.residual), write_home=True, lo=lo, hi=hi)

    @torch.no_grad()
    def add_to_residual(self, dropped: Optional[torch.Tensor], lo: int = 0, hi: Optional[int] = None) -> None:
        """Error feedback of a sparse codec, after commit_residual() (or compensate(commit=True), which set the
        residual to 0): residual += `dropped` over [lo, hi), all this node's contribution lost: its selections of
        its values of the shards others own, and of the average of the shard it owns (a buffer of the range, from
        the sync: Sync.take_dropped; None: nothing)."""
        if dropped is None or self.residual is None:
            return
        if dropped.is_cuda:  # made on the collective's stream (Sync.take_dropped), read on this one
            dropped.record_stream(torch.cuda.current_stream(dropped.device))
        d = dropped.to(self.work_device, non_blocking=False)
        self._walk(lambda p, ec, dc: ec.add_(dc), home=(self.residual,), work=(d,), write_home=True, lo=lo, hi=hi,
                   work_at=lo)

    def reset_residual(self) -> None:
        """Error feedback: residual := 0 (a node that joins holds no contribution's error)."""
        if self.residual is not None:
            self.residual.zero_()

    def load_into_model(self, src: Optional[torch.Tensor] = None, lo: int = 0, hi: Optional[int] = None) -> None:
        """Local weights := outer weights (or `src`, a buffer of the same layout), over [lo, hi)."""
        self.scatter(self.outer if src is None else src, lo, hi)

    # -- identity and state ----------------------------------------------------------

    def settings(self) -> dict:
        """What every node must agree on for the outer step to mean the same everywhere."""
        opt = self.rule.settings() if self.optimizer is None else self.optimizer.settings()
        return {**opt, "block_size": self.block_size, "shapes": [list(s) for s in self.shapes], "numel": self.numel}

    def tensors(self) -> list:
        """The flat state a joining node must download (outer weights and momentum)."""
        if self.optimizer is not None:
            raise ValueError("a custom outer_optimizer keeps its state per parameter; elastic joins need the "
                             "default outer update (outer_optimizer=None)")
        return [self.outer, self.momentum]

    def state_dict(self) -> dict:
        """Outer weights and momentum (or the outer optimizer's state): CPU tensors (copies when on a GPU; the
        buffers themselves when they live in CPU memory: they change only at this state's next outer step)."""
        self.ensure_taken()
        sd = {"outer": self.outer.cpu(), "numel": self.numel, "block_size": self.block_size}
        if self.optimizer is None:
            sd["momentum"] = self.momentum.cpu()
        else:
            sd["outer_optimizer"] = self.optimizer.state_dict()
        if self.residual is not None:
            sd["residual"] = self.residual.cpu()  # this node's own: it differs from node to node
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); a different layout raises ValueError."""
        if "block_size" in sd and int(sd["block_size"]) != self.block_size:
            # (every parameter starts a block: the layout depends on it)
            raise ValueError(
                f"the checkpoint's outer state was written with diloco.block_size = {int(sd['block_size'])}, this "
                f"run has {self.block_size}: set diloco.block_size = {int(sd['block_size'])} to resume it (unset, "
                "it is the codec's default: 64 for int8, 256 for fp4)"
            )
        if int(sd["numel"]) != self.numel:
            raise ValueError(
                f"the checkpoint's outer state has {sd['numel']} values but this process's shard needs "
                f"{self.numel}: resume with the same model, processes per node, diloco.fragments and "
                "diloco.block_size (unset, it is the codec's default: 64 for int8, 256 for fp4; a checkpoint that "
                "does not record it was written at 256 unless diloco.block_size was set)"
            )
        if (self.optimizer is None) != ("momentum" in sd):
            raise ValueError("the checkpoint's outer state was written with "
                             + ("the default outer update" if "momentum" in sd else "a custom outer_optimizer")
                             + ": resume with the same outer_optimizer setting")
        self.outer.copy_(sd["outer"])
        if self.optimizer is None:
            self.momentum.copy_(sd["momentum"])
        else:
            self.optimizer.load_state_dict(sd["outer_optimizer"])
        if self.residual is not None:
            if "residual" in sd:
                self.residual.copy_(sd["residual"])
            else:
                self.residual.zero_()
                logger.info("error feedback: the checkpoint holds no residual (written without error feedback); "
                            "starting from zero")
        elif "residual" in sd:
            logger.warning("the checkpoint holds an error-feedback residual but diloco.error_feedback is off here: "
                           "the residual is dropped")
        self.taken = True
