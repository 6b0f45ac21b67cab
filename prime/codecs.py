"""The codecs of the outer step's all-reduce, in one table: what the rest of prime asks of a codec.

    CODECS["int8"].lossy, .default_block, .feedback_default, .wire_bytes(n, block), .own_error_pass, .sparse

Config validation, DiLoCo, error feedback, the memory plan and the metrics read this
table; the formats themselves are prime.ops (Python face, torch reference) and
csrc/codec/ (docs/wire-format.md). A new codec is a row here plus its ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prime import ops

__all__ = ["Codec", "CODECS", "codec", "names"]


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

    def wire_bytes(self, n: int, block_size: Optional[int] = None, density: Optional[float] = None) -> int:
        """Bytes of n values in a ring payload (prime.ops.wire_bytes; topk: prime.sparse.payload_bytes)."""
        if self.sparse:
            from prime import sparse

            chunk = block_size or self.default_block
            return sparse.payload_bytes(n, chunk, sparse.keep_for_density(density or DEFAULT_DENSITY, chunk))
        return ops.wire_bytes(n, block_size, self.name)

    def bytes_per_value(self, block_size: Optional[int] = None, density: Optional[float] = None) -> float:
        """Wire bytes per value for a long tensor (the header left out)."""
        n = 1 << 20
        return (self.wire_bytes(n, block_size, density) - (ops.INT8_HEADER_BYTES if self.name == "int8" else 0)) / n


DEFAULT_DENSITY = 1 / 64
"""topk: the share of each chunk's values kept (64 of 4096, 0.028 bytes a value) when diloco.density is unset."""


CODECS = {
    "int8": Codec("int8", lossy=True, default_block=ops.DEFAULT_BLOCK_SIZE, feedback_default=False,
                  own_error_pass=True),
    "fp4": Codec("fp4", lossy=True, default_block=ops.DEFAULT_FP4_BLOCK_SIZE, feedback_default=True,
                 own_error_pass=False),
    "topk": Codec("topk", lossy=True, default_block=4096, feedback_default=True, own_error_pass=False, sparse=True),
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
