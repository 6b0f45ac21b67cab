"""Numerical model of the int8 ring's error: how it grows with ranks and shrinks with block size.

The ring (csrc/ring/schedule.cpp) sends each reduce-scatter hop the quantized partial sum;
the receiver dequantize-adds it into fp32 with its own values; the owner quantizes the final
sum once; the all-gather forwards those bytes verbatim. So a value is quantized N times, at
partial sums of 1, 2, ..., N ranks. This script replays exactly that with the pure-torch
reference codec (prime.ops, docs/wire-format.md) on standard normal inputs and prints the
relative L2 error against the float64 sum, next to a single quantization of the exact sum,
for block sizes 256, 128 and 64 (the default) and the bytes per value each costs on the wire
(one byte a value plus a 1-byte scale per block).

    PYTHONPATH=$PWD python benchmarks/ring_int8_error_model.py [--seed S] [--n N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prime import ops  # noqa: E402


def ring_error(xs: list[torch.Tensor], block: int) -> tuple[float, float]:
    """(relative L2 error of the ring's int8 sum, of one quantization of the exact sum)."""

    def q(v: torch.Tensor) -> torch.Tensor:
        scales_q = ops.quantize_int8_reference(v, block)
        return ops.dequantize_int8_reference(*scales_q, block).view(-1)

    exact = sum(x.double() for x in xs)
    acc = xs[0].clone()
    for x in xs[1:]:  # N-1 reduce-scatter hops
        acc = q(acc) + x
    final = q(acc)  # the owner's single quantization of the complete sum
    once = q(exact.float())
    norm = exact.norm()
    return float((final.double() - exact).norm() / norm), float((once.double() - exact).norm() / norm)


def main() -> None:
    """Prints the table for 2, 4 and 8 ranks."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=None, help="default: fresh (printed)")
    p.add_argument("--n", type=int, default=1 << 22, help="values per rank (default 4Mi)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    print(f"seed {seed}, n {args.n} standard normal values per rank")
    g = torch.Generator().manual_seed(seed)
    for world in (2, 4, 8):
        xs = [torch.randn(args.n, generator=g) for _ in range(world)]
        for block in (256, 128, 64):
            ring, once = ring_error(xs, block)
            print(f"N={world} block={block:3d} bytes/value={1 + ops.SCALE_BYTES['int8'] / block:.4f}  ring {100 * ring:.3f}%  "
                  f"one quantization of the exact sum {100 * once:.3f}%")


if __name__ == "__main__":
    main()
