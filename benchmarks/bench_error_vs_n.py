"""All-reduce error against the number of ranks, for both schedules (int8; fp4 with --codecs).

Each of N ranks (threads of this process, each with its own prime.comm.Ring on 127.0.0.1)
holds n independent standard-normal values; they average them with codec="int8" (or each of
--codecs). The
table gives the relative L2 error of the result against the float64 mean, and whether
every rank ended with the same bits:

    ring    every hop re-quantizes the partial sum: the error grows like sqrt(N)
    direct  each rank's values are quantized once and summed in fp32 by the chunk's owner,
            whose sum is quantized once: e * sqrt(1 + (N-1)/N) for one quantization's e,
            at most sqrt(2) e whatever N (docs/ring.md, "Error bounds")

    python benchmarks/bench_error_vs_n.py                         # N = 2..16, 1 Mi values, the default block
    python benchmarks/bench_error_vs_n.py --blocks 256,128,64 --world-sizes 2,4,8,16
    python benchmarks/bench_error_vs_n.py --codecs fp4 --world-sizes 2,8 # a 4-bit codec: N = 8 against N = 2

Output: the table, and benchmarks/results/error_vs_n.json (with --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import threading
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the prime of this checkout

import torch  # noqa: E402

TARGET = 0.009  # the int8 error the direct schedule is asked to stay under at every N


def inputs(seed: int, world: int, n: int) -> list:
    """Independent standard-normal inputs, one per rank, from (seed, rank)."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed * 1009 + r)) for r in range(world)]


def all_reduce_threads(xs: list, schedule: str, block, codec: str = "int8", timeout_s: float = 120.0) -> list:
    """Averages xs[r] across len(xs) rings (threads of this process); returns every rank's result.
    block None: all_reduce's default for the codec."""
    import torch.distributed as dist

    from prime.comm import Ring

    world = len(xs)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out, errors = [None] * world, []

    def rank(r: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60))
            with Ring(client, r, world, timeout=timeout_s, secret=b"error-vs-n", job_id=f"evn-{codec}-{schedule}-{block}",
                      schedule=schedule) as ring:
                y = xs[r].clone()
                work = ring.all_reduce(y, op="avg", codec=codec, block_size=block)
                work.wait()
                assert work.stats().schedule == schedule
                out[r] = y
        except BaseException as e:  # reported below
            errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"rank(s) failed: {errors}")
    return out


def measure(world: int, n: int, schedule: str, block, seed: int, codec: str = "int8") -> dict:
    """The relative L2 error of one all-reduce against the float64 mean, and the ranks' agreement
    (block None: all_reduce's default for the codec, which the row names)."""
    from prime.ops import default_block_size

    xs = inputs(seed, world, n)
    ys = all_reduce_threads(xs, schedule, block, codec)
    block = default_block_size(codec) if block is None else block
    ref = torch.stack([x.double() for x in xs]).mean(0)
    identical = all(torch.equal(ys[0].view(torch.int32), y.view(torch.int32)) for y in ys[1:])
    err = float((ys[0].double() - ref).norm() / ref.norm())
    return {"world_size": world, "n": n, "codec": codec, "schedule": schedule, "block_size": block, "rel_l2_err": err,
            "bit_identical": identical}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default=",".join(str(w) for w in range(2, 17)))
    p.add_argument("--n", type=int, default=1 << 20, help="values per rank (default 1 Mi)")
    p.add_argument("--schedules", default="direct,ring")
    p.add_argument("--codecs", default="int8", help="comma list of codecs (int8, fp4, ...)")
    p.add_argument("--blocks", default="default",
                   help="comma list of block sizes; 'default': all_reduce's default for the codec (int8 64, fp4 256)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/error_vs_n.json)")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    worlds = [int(w) for w in args.world_sizes.split(",")]
    schedules = [s.strip() for s in args.schedules.split(",")]
    blocks = [None if b.strip() == "default" else int(b) for b in args.blocks.split(",")]
    codecs = [c.strip() for c in args.codecs.split(",")]
    cases = [(c, s, b) for c in codecs for s in schedules for b in blocks]
    from prime.ops import default_block_size

    def name(c, s, b):
        b = f"b{default_block_size(c)} (default)" if b is None else f"b{b}"
        return f"{s} {b}" if codecs == ["int8"] else f"{c} {s} {b}"

    torch.set_num_threads(1)
    command = "python benchmarks/bench_error_vs_n.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    print(f"machine: {platform.node()} {os.cpu_count()} cpus; seed {seed}\ncommand: {command}")
    rows = []
    t0 = time.time()
    header = f"{'N':>3} " + " ".join(f"{name(*case):>16}" for case in cases)
    print(header)
    for world in worlds:
        cells = []
        for codec, schedule, block in cases:
            row = measure(world, args.n, schedule, block, seed, codec)
            rows.append(row)
            mark = "" if row["bit_identical"] else " DIFFER"
            flag = "" if (codec, schedule) != ("int8", "direct") or row["rel_l2_err"] <= TARGET else " >0.9%"
            cells.append(f"{100 * row['rel_l2_err']:>9.3f}%{flag:>6}{mark}")
        print(f"{world:>3} " + " ".join(f"{c:>16}" for c in cells), flush=True)
    print(f"relative L2 error of op='avg' against the float64 mean, {args.n} independent N(0,1) values per rank; "
          f"'>0.9%': over the int8 target of the direct schedule; DIFFER: ranks ended with different bits "
          f"({time.time() - t0:.0f} s)")
    out = args.out or os.path.join(HERE, "results", "error_vs_n.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": command, "machine": f"{platform.node()} {os.cpu_count()} cpus", "seed": seed,
                   "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
