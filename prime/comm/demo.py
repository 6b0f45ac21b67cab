"""A 4-rank ring all-reduce on this machine: time, bytes on the wire, error.

    python -m prime.comm.demo [--world-size 4] [--numel 4194304] [--rate-mbit 100]

Each rank is a process on 127.0.0.1 with its own Gaussian tensor; the ranks
average them with the exact codec ("none") and with int8, first over plain
loopback, then with every rank's uplink capped by the ring's own rate limiter
(a stand-in for a slow internet link on a machine without tc).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import time
from typing import Dict, List, Optional

import torch

__all__ = ["run_ring_demo"]

_SEED = 1234


def _input(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(_SEED + rank))


def _rank_main(rank: int, world_size: int, port: int, numel: int, links, results) -> None:
    import torch.distributed as dist

    from prime.comm import Ring

    # The ranks share this machine's cores; the codec runs on this many threads.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    x = _input(rank, numel)
    out = []
    for name, rate in links:
        with Ring(store, rank, world_size, timeout=120, max_rate=rate, job_id=f"demo/{name}") as ring:
            for codec in ("none", "int8"):
                y = x.clone()
                t0 = time.perf_counter()
                work = ring.all_reduce(y, op="avg", codec=codec)
                work.wait()
                seconds = time.perf_counter() - t0
                digest = hashlib.sha256(y.numpy().tobytes()).hexdigest()
                # numpy, not a tensor: torch would pass a tensor by shared-memory handle,
                # which dies with this process.
                out.append((name, codec, seconds, work.stats(), digest, y.numpy() if rank == 0 else None))
    results.put((rank, out))


def run_ring_demo(world_size: int = 4, numel: int = 1 << 22, rate_mbit: Optional[float] = 100.0) -> List[Dict]:
    """Runs the demo and prints one line per (link, codec); returns the rows as dicts.

    rate_mbit: the emulated uplink of every rank for the second run (None: loopback only)."""
    import torch.distributed as dist

    links = [("loopback", 0.0)]
    if rate_mbit:
        links.append((f"{rate_mbit:g} Mbit/s", rate_mbit * 1e6 / 8))
    from prime.comm.rendezvous import host_store

    store = host_store("127.0.0.1", 0)  # loopback only: the ranks draw their secret into it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, store.port, numel, links, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    by_rank = {}
    try:
        for _ in range(world_size):
            rank, out = results.get(timeout=600)
            by_rank[rank] = out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()

    exact = torch.stack([_input(r, numel).double() for r in range(world_size)]).mean(0)
    fp32_bytes = 4 * numel
    print(
        f"ring all-reduce: {world_size} ranks on 127.0.0.1, {numel} fp32 values ({fp32_bytes / 2**20:.0f} MiB) "
        f"per rank, op=avg"
    )
    print(f"  {'link':<14} {'codec':<6} {'time':>9} {'sent/rank':>11} {'vs fp32':>8} {'rel. L2 err':>12}  same bytes on all ranks")
    rows = []
    for i, (name, codec, seconds, stats, _, y) in enumerate(by_rank[0]):
        slowest = max(by_rank[r][i][2] for r in range(world_size))
        same = len({by_rank[r][i][4] for r in range(world_size)}) == 1
        err = float((torch.from_numpy(y).double() - exact).norm() / exact.norm())
        none_bytes = by_rank[0][i - 1][3].bytes_sent if codec == "int8" else stats.bytes_sent
        row = {
            "link": name,
            "codec": codec,
            "seconds": slowest,
            "bytes_sent": stats.bytes_sent,
            "ratio_vs_fp32": stats.bytes_sent / none_bytes,
            "rel_l2_error": err,
            "identical": same,
        }
        rows.append(row)
        print(
            f"  {name:<14} {codec:<6} {1e3 * slowest:7.0f} ms {stats.bytes_sent / 2**20:7.2f} MiB "
            f"{row['ratio_vs_fp32']:7.3f}x {100 * err:11.4f}%  {'yes' if same else 'NO'}"
        )
    if len(links) > 1:
        t = {(r["link"], r["codec"]): r["seconds"] for r in rows}
        name = links[1][0]
        print(f"  over the {name} uplink int8 is {t[(name, 'none')] / t[(name, 'int8')]:.1f}x faster than fp32")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="emulated uplink per rank; 0: skip")
    args = parser.parse_args()
    run_ring_demo(args.world_size, args.numel, args.rate_mbit or None)


if __name__ == "__main__":
    main()
