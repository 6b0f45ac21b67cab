"""The codecs of the outer step's all-reduce, in one table: what the rest of prime asks of a codec.

    CODECS["int8"].lossy, .default_block, .feedback_default, .wire_bytes(n, block), .own_error_pass, .sparse
    CODECS["topk"].outer_settings(outer_lr=None, ...)   # unset settings -> the codec's defaults

Config validation, DiLoCo, error feedback, the memory plan and the metrics read this
table; the formats themselves are prime.ops (Python face, torch reference) and
csrc/codec/ (docs/wire-format.md). A new codec is a row here plus its ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prime import ops

__all__ = ["Codec", "CODECS", "codec", "names", "DENSE_START", "wire_codec"]


@dataclass(frozen=True)
class Codec:
    name: str
    lossy: bool
    """The average is not the exact one: error feedback may run, the ring reports its error."""
    default_block: Optional[int]
    """Values per scale when diloco.block_size is unset (None: no blocks)."""
    feedback_default: bool
    """Error feedback when diloco.error_feedback is unset: on where the error per quantization would add up over
    outer steps (fp4, about 11%); off for int8 (0.7%), where it makes no measurable difference in loss
    (benchmarks/RESULTS.md, "Error feedback")."""
    own_error_pass: bool
    """DiLoCo can measure the codec's error by a quantize/dequantize pass of its own when the ring does not
    report it (int8)."""
    sparse: bool = False
    """Per chunk of block_size values only the largest (diloco.density of them) travel (prime.sparse): error
    feedback is always on, and the ring hands back all a contribution lost (its selections', and as a shard's
    owner what its selection of the average dropped; the owner's own values of its shard enter unselected)."""
    outer_lr: float = 0.7
    """The outer learning rate when diloco.outer_lr is unset."""
    outer_momentum: float = 0.9
    """The outer (Nesterov) momentum when diloco.outer_momentum is unset."""
    feedback_decay: float = 1.0
    """Error feedback's decay of the residual when diloco.feedback_decay is unset."""
    density: Optional[float] = None
    """A sparse codec's share of each chunk per contribution when diloco.density is unset."""
    average_density: Optional[float] = None
    """A sparse codec's share of each chunk of the owners' averages when diloco.density and
    diloco.average_density are both unset (with density set, the average keeps that density)."""

    def outer_settings(self, outer_lr=None, outer_momentum=None, feedback_decay=None, density=None,
                       average_density=None) -> dict:
        """The settings given, each unset one (None) replaced by this codec's default: outer_lr, outer_momentum,
        feedback_decay, density and average_density (the last two None for a codec that is not sparse)."""
        if self.sparse and average_density is None:
            average_density = self.average_density if density is None else density
        return dict(outer_lr=self.outer_lr if outer_lr is None else outer_lr,
                    outer_momentum=self.outer_momentum if outer_momentum is None else outer_momentum,
                    feedback_decay=self.feedback_decay if feedback_decay is None else feedback_decay,
                    density=self.density if density is None else density,
                    average_density=average_density)

    def wire_bytes(self, n: int, block_size: Optional[int] = None, density: Optional[float] = None) -> int:
        """Bytes of n values in a ring payload (prime.ops.wire_bytes; topk: prime.sparse.payload_bytes)."""
        if self.sparse:
            from prime import sparse

            chunk = block_size or self.default_block
            return sparse.payload_bytes(n, chunk, sparse.keep_for_density(density or self.density, chunk))
        return ops.wire_bytes(n, block_size, self.name)

    def bytes_per_value(self, block_size: Optional[int] = None, density: Optional[float] = None) -> float:
        """Wire bytes per value for a long tensor (the header left out)."""
        n = 1 << 20
        return (self.wire_bytes(n, block_size, density) - (ops.INT8_HEADER_BYTES if self.name == "int8" else 0)) / n


DENSE_START = ("int8", 64)
"""The codec and block size of a sparse codec's dense start (prime.fragments.FragmentSchedule.dense): each
fragment's first outer steps send the pseudo-gradient as int8, the default dense codec, in blocks of 64 (of the
sparse chunk when it is smaller, so that every parameter starts a block)."""


def wire_codec(codec: str, block_size: int, dense: bool) -> tuple:
    """(codec, block size) an outer step puts on the wire: the job's, or in a dense start DENSE_START's codec in
    blocks of min(64, the chunk)."""
    return (DENSE_START[0], min(DENSE_START[1], block_size)) if dense else (codec, block_size)


TOPK_DEFAULTS = dict(outer_lr=3.0, outer_momentum=0.0, feedback_decay=0.8, density=48 / 4096,
                     average_density=96 / 4096)
"""topk's outer step when its settings are unset: 48 of every 4096 values per contribution and 96 per chunk of
the owners' averages (0.0222 bytes a value, 1/45 of int8's), the residual decayed by 0.8, and a plain outer
update of lr 3 (no momentum: error feedback is the memory). The best of the settings measured (docs/codec.md,
"The sparse codec"): within 1% of int8's loss on the tiny model over 160 outer steps; with the update int8
takes (Nesterov, lr 0.7, momentum 0.9) topk was +40% there."""


CODECS = {
    "int8": Codec("int8", lossy=True, default_block=ops.DEFAULT_BLOCK_SIZE, feedback_default=False,
                  own_error_pass=True),
    "fp4": Codec("fp4", lossy=True, default_block=ops.DEFAULT_FP4_BLOCK_SIZE, feedback_default=True,
                 own_error_pass=False),
    "topk": Codec("topk", lossy=True, default_block=4096, feedback_default=True, own_error_pass=False, sparse=True,
                  **TOPK_DEFAULTS),
    "none": Codec("none", lossy=False, default_block=None, feedback_default=False, own_error_pass=False),
}
"""Every codec by its name (diloco.codec); int8 is the default."""


def names() -> str:
    """'int8', 'fp4', 'topk' or 'none': for messages."""
    quoted = [repr(n) for n in CODECS]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def codec(name: str, field: str = "codec") -> Codec:
    """The codec called `name`; ValueError naming the field and the codecs otherwise."""
    if name not in CODECS:
        raise ValueError(f"{field} must be {names()}, got {name!r}")
    return CODECS[name]
