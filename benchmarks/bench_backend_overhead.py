"""Per-call cost of the torch.distributed backend "prime" over the direct Ring call.

Two rank processes on 127.0.0.1. Each rank holds a prime.comm.Ring and a backend="prime"
process group with the same codec, and alternates them call by call (ring, pg, ring, pg,
...) on the same tensor, so that load drift hits both alike; rank 0 prints the median time
of each and the difference. Small tensors measure the fixed cost per call (Python, the
Work object, the completion thread); large ones are dominated by the ring itself.

    PYTHONPATH=$PWD python benchmarks/bench_backend_overhead.py                 # int8, 1 KiB and 1 MiB
    PYTHONPATH=$PWD python benchmarks/bench_backend_overhead.py --codec none --sizes 256:300,262144:100
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta


def rank_main(rank: int, port: int, codec: str, cases: list[tuple[int, int]]) -> None:
    import torch
    import torch.distributed as dist

    import prime  # noqa: F401  (registers the backend)
    from prime.comm import Ring
    from prime.comm.backend import PrimeOptions

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("prime", store=store, rank=rank, world_size=2, pg_options=PrimeOptions(codec=codec))
    ring = Ring(dist.PrefixStore("direct", store), rank, 2, job_id="direct")
    try:
        for n, reps in cases:
            x = torch.randn(n)
            direct, through_pg = [], []
            for _ in range(reps):  # avg keeps the values bounded over many calls
                t0 = time.perf_counter()
                ring.all_reduce(x, op="avg", codec=codec).wait()
                direct.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dist.all_reduce(x, op=dist.ReduceOp.AVG)
                through_pg.append(time.perf_counter() - t0)
            if rank == 0:
                a, b = statistics.median(direct), statistics.median(through_pg)
                print(f"{n:>10} values x {reps:>4}  codec {codec}: direct Ring {a * 1e3:8.3f} ms   "
                      f"dist.all_reduce {b * 1e3:8.3f} ms   difference {(b - a) * 1e3:+.3f} ms", flush=True)
    finally:
        ring.close()
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--codec", choices=("int8", "none"), default="int8")
    p.add_argument("--sizes", default="256:300,262144:100", help="comma list of values:calls (default %(default)s)")
    args = p.parse_args()
    cases = [tuple(int(v) for v in item.split(":")) for item in args.sizes.split(",")]
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"machine: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; command: python "
          + " ".join(sys.argv))
    mp.spawn(rank_main, args=(port, args.codec, cases), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
