"""The sparse collective's arithmetic (prime/sparse.py owner_average): bytes per rank and error against N.

    python benchmarks/bench_sparse_collective.py          # ~1 min on the 2-core CPU
    python benchmarks/bench_sparse_collective.py --quick

Every rank contributes a tensor of student-t(3) values (heavy tails, as pseudo-gradients have): a part shared
by all ranks plus a part of its own, mixed so that two ranks' contributions have correlation rho. For each
world size N the table gives:

  - the payload bytes each rank sends (the most of any rank) and how many times fewer than int8 sends in its
    ring or direct schedule (2 (N - 1) / N x the int8 payload);
  - the relative L2 error ||average - exact mean|| / ||exact mean|| of one round;
  - the part of it the owners' second selection adds: the same round with each owner's sum sent exactly.

One round's error is large by design (each rank keeps 1.56% of its values); what a round leaves out stays in
the ranks' residuals (error feedback) and is sent in later rounds. The fidelity benchmark says what it costs in
loss. This is the reference arithmetic, not the wire: the bytes are the payloads' sizes, not measured on sockets.
Writes benchmarks/results/sparse_collective_<date>-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from prime import ops, sparse  # noqa: E402


def contributions(world: int, n: int, rho: float, seed: int) -> list:
    """world tensors of student-t(3) values, pairwise correlation rho (a shared part and an own part)."""
    gen = torch.Generator().manual_seed(seed)

    def draw():  # student-t(3): a normal over the root of a chi-squared(3) / 3
        chi2 = (torch.randn(3, n, generator=gen, dtype=torch.float64) ** 2).sum(0)
        return torch.randn(n, generator=gen, dtype=torch.float64) / (chi2 / 3).sqrt()

    shared = draw()
    return [(rho ** 0.5 * shared + (1 - rho) ** 0.5 * draw()).float() for _ in range(world)]


def one_round(cs: list, chunk: int, k: int) -> dict:
    world = len(cs)
    mean = sum(c.double() for c in cs) / world
    got = sparse.owner_average(cs, chunk, k)
    err = float((got.average.double() - mean).norm() / mean.norm())
    # the same round with the owners' averages sent exactly: the first selection's error alone (an owner adds
    # its own values exact, as the collective does)
    first = torch.zeros_like(mean)
    for o, (lo, hi) in enumerate(sparse.shards(mean.numel(), world, chunk)):
        for r, c in enumerate(cs):
            part = c[lo:hi] if r == o else sparse.decode(sparse.encode(c[lo:hi], chunk, k), hi - lo, chunk, k)
            first[lo:hi] += part.double()
    first /= world
    err_first = float((first - mean).norm() / mean.norm())
    int8 = 2 * (world - 1) / world * ops.wire_bytes(mean.numel(), codec="int8")
    return {"world": world, "bytes_per_rank": max(got.sent), "int8_bytes_per_rank": int8,
            "fewer_than_int8": int8 / max(got.sent), "error": err, "error_first_selection_only": err_first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer values and world sizes")
    ap.add_argument("--values", type=int, default=1 << 18, help="values of each contribution")
    ap.add_argument("--k", type=int, default=64, help="values kept per chunk of 4096")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = (1 << 16) if args.quick else args.values
    worlds = (2, 4) if args.quick else (2, 4, 8, 16)
    rows = []
    print(f"{n} values per rank, k = {args.k} of {sparse.CHUNK} (density {args.k / sparse.CHUNK:.2%}); "
          f"student-t(3), pairwise correlation rho")
    print(f"{'rho':>4} {'N':>3} {'bytes/rank':>11} {'int8/rank':>11} {'fewer':>7} {'error':>7} {'1st sel.':>8}")
    for rho in (0.0, 0.5, 0.9):
        for world in worlds:
            row = dict(rho=rho, **one_round(contributions(world, n, rho, args.seed + world), sparse.CHUNK, args.k))
            rows.append(row)
            print(f"{rho:4.1f} {world:3d} {row['bytes_per_rank']:11d} {row['int8_bytes_per_rank']:11.0f} "
                  f"{row['fewer_than_int8']:6.1f}x {row['error']:7.3f} {row['error_first_selection_only']:8.3f}")
    out = os.path.join(HERE, "results", f"sparse_collective_{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                   "values": n, "k": args.k, "chunk": sparse.CHUNK, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
