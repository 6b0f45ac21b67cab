"""The relative L2 error of one int8 round trip (quantize, dequantize), by block size and data.

Fresh standard-normal and Student-t(3) tensors of n values, one per seed, encoded with the
public ops (prime.ops.quantize_int8 / dequantize_int8, the fastest backend here), against
the input in float64. Prints the median and the range over the seeds: the figures of
docs/wire-format.md, "Error bound" (tests/test_ops.py::test_quantization_error_bound asserts
the default block's).

    python benchmarks/bench_int8_error.py                       # blocks 64 and 256, 100 seeds
    python benchmarks/bench_int8_error.py --blocks 32,64,128,256 --seeds 20
    python benchmarks/bench_int8_error.py --blocks 64 --seeds 20 --scale-rules   # the scale's rounding

--scale-rules also encodes the Gaussian data, in plain torch, with the scale rules the format
could have had: fp32 a / 127 (inv = 127 / a, the format before block 64), a / 127 rounded up
or to the nearest bf16 (2 bytes on the wire: the format before one-byte scales), and a / 127.5
rounded up to a grid of 2^(k / steps) for 16 and 18 steps an octave (18: the format, the model
checked equal to prime.ops bit for bit), and counts the values a second round trip changes (a
round trip is a fixed point when none change).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prime import ops  # noqa: E402


def draw(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    z = torch.randn(n, generator=g, dtype=torch.float64)  # Student-t(3): z / sqrt(chi2_3 / 3)
    chi2 = (torch.randn(n, 3, generator=g, dtype=torch.float64) ** 2).sum(1)
    return (z / torch.sqrt(chi2 / 3)).float()


def round_trip_error(x: torch.Tensor, block: int) -> float:
    q, s = ops.quantize_int8(x, block)
    y = ops.dequantize_int8(q, s, block)
    return float((y.double() - x.double()).norm() / x.double().norm())


def round_trip_with_rule(x: torch.Tensor, block: int, rule: str) -> torch.Tensor:
    """One int8 round trip of x (n a multiple of block, finite) with the scale rule `rule`."""
    b = x.view(-1, block)
    a = b.abs().amax(dim=1)
    s32 = a / torch.full_like(a, 127.0)
    if rule == "fp32":
        scale, num, den = s32, torch.full_like(a, 127.0), a
    elif rule.startswith("grid"):
        steps = int(rule.split("-")[1])
        t = (a / torch.full_like(a, 127.5)).double()
        # the smallest fp32(2^(k / steps)) >= t, k an integer: a float64 guess, then exact corrections
        k = torch.ceil(steps * torch.log2(t.clamp_min(2.0**-126)))
        for _ in range(2):
            k = torch.where(torch.exp2((k - 1) / steps).float().double() >= t, k - 1, k)
            k = torch.where(torch.exp2(k / steps).float().double() < t, k + 1, k)
        scale = torch.where(a > 0, torch.exp2(k / steps).float(), 0.0)
        num, den = torch.ones_like(a), scale
    else:
        bits = s32.view(torch.int32).to(torch.int64)
        bits = (bits + 0xFFFF) if rule == "bf16-up" else (bits + 0x7FFF + ((bits >> 16) & 1))
        scale = (bits & 0xFFFF0000).to(torch.int32).view(torch.float32)
        num, den = torch.ones_like(a), scale
    inv = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
    inv = torch.where(torch.isinf(inv), 0.0, inv)
    q = torch.round(b * inv[:, None]).clamp(-127, 127).to(torch.int8)  # (as int8: no -0)
    return (q.to(torch.float32) * scale[:, None]).view(-1)


def compare_rules(blocks, seeds, n) -> None:
    for block in blocks:
        for rule in ("fp32", "bf16-up", "bf16-nearest", "grid-16", "grid-18"):
            errs, changed = [], 0
            for s in seeds:
                x = draw("gaussian", n, torch.Generator().manual_seed(s))
                y = round_trip_with_rule(x, block, rule)
                if rule == "grid-18":  # the model is the format
                    q, sc = ops.quantize_int8(x, block)
                    assert torch.equal(ops.dequantize_int8(q, sc, block).view(torch.int32), y.view(torch.int32))
                errs.append(float((y.double() - x.double()).norm() / x.double().norm()))
                changed += int((round_trip_with_rule(y, block, rule) != y).sum())
            errs.sort()
            print(f"   gaussian block {block:4d} scale {rule:>12}: median {100 * errs[len(errs) // 2]:.4f}%, range "
                  f"{100 * errs[0]:.4f}-{100 * errs[-1]:.4f}%; a second round trip changed {changed} of "
                  f"{len(seeds) * n} values", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", default="64,256")
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--n", type=int, default=1 << 20)
    p.add_argument("--first-seed", type=int, default=1000)
    p.add_argument("--scale-rules", action="store_true", help="compare the scale's rounding rules (Gaussian data)")
    args = p.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"machine: {platform.node()}; backend {ops.available_backends('cpu')[0]}; n {args.n}; "
          f"seeds {args.first_seed}..{args.first_seed + args.seeds - 1}")
    if args.scale_rules:
        compare_rules(blocks, range(args.first_seed, args.first_seed + args.seeds), args.n)
        return 0
    for kind in ("gaussian", "student-t3"):
        for block in blocks:
            errs = sorted(round_trip_error(draw(kind, args.n, torch.Generator().manual_seed(s)), block)
                          for s in range(args.first_seed, args.first_seed + args.seeds))
            print(f"{kind:>11} block {block:4d} ({1 + ops.SCALE_BYTES['int8'] / block:.4f} bytes/value on the wire): "
                  f"median {100 * errs[len(errs) // 2]:.3f}%, range {100 * errs[0]:.3f}-{100 * errs[-1]:.3f}%",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
