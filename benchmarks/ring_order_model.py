"""What a ring order can gain at most: an idealized timing model of the ring schedule on a topology.

The ring (csrc/ring/schedule.cpp) runs 2(N-1) steps; in each, every rank sends one chunk (1/N of
the tensor) to the next rank of the order, segment by segment, and a segment moves on only once it
arrived. This model replays exactly that order of sends with no CPU cost at all: every link sends
at its path's rate (netem.Topology, times the TCP/IP payload share of an MTU-1500 packet) with a
fixed one-way delay, one segment after another; a rank forwards segment k of step s + 1 as soon as
segment k of step s arrived. It is the floor a real ring can reach, so the ratio it prints is the
most a planned order can gain over the rank order at each size: where the tensor is small the
delays around the ring decide (the rank order crosses between regions at every hop), where it is
large the slowest link's rate does, and both orders cross the same 1 Gbit/s paths.

    PYTHONPATH=$PWD python benchmarks/ring_order_model.py [--topology two-regions] [--sizes 4,16,32,64,256]

Measured beside it: benchmarks/RESULTS.md, "Links that differ: ring order".
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netem  # noqa: E402
from prime.comm.links import LinkTable, brute_force_order, plan_order  # noqa: E402

PAYLOAD_SHARE = 1448 / 1500  # TCP payload of an MTU-1500 packet with timestamps (the delay line counts IP bytes)
FRAME_OVERHEAD = 80  # header and tag of every frame (docs/ring.md)
SEGMENT_VALUES = 1 << 18  # the ring's default segment (1 MiB of fp32)
INT8_BYTES_PER_VALUE = 1 + 2 / 64  # int8 at its default block (docs/wire-format.md)


def ring_time(order: list[int], rate: list[list[float]], delay: list[list[float]], values: int,
              bytes_per_value: float = INT8_BYTES_PER_VALUE, segment_values: int = SEGMENT_VALUES) -> float:
    """Seconds until the last segment of the all-gather arrived, for a tensor of `values` values.
    rate[a][b]: payload bytes/s from a to b; delay[a][b]: one-way seconds."""
    n = len(order)
    chunk = values / n
    segs = max(1, -(-int(chunk) // segment_values))
    seg_bytes = chunk / segs * bytes_per_value + FRAME_OVERHEAD
    link_free = [0.0] * n  # the link from position p to p + 1 is busy until
    rank_clock = [0.0] * n  # each rank handles its segments one after another
    arrived = {}  # (receiving position, step, segment) -> time
    done = 0.0
    for s in range(2 * (n - 1)):
        for k in range(segs):
            for p in range(n):
                t = rank_clock[p] if s == 0 else max(rank_clock[p], arrived[(p, s - 1, k)])
                rank_clock[p] = t
                a, b = order[p], order[(p + 1) % n]
                start = max(t, link_free[p])
                link_free[p] = start + seg_bytes / rate[a][b]
                arrived[((p + 1) % n, s, k)] = link_free[p] + delay[a][b]
                done = max(done, arrived[((p + 1) % n, s, k)])
    return done


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="two-regions", help="two-regions[:n] (benchmarks/netem.py)")
    p.add_argument("--sizes", default="4,16,32,48,64,128,256", help="comma list of MiB of fp32 per rank")
    args = p.parse_args(argv)
    n = int(args.topology.split(":")[1]) if ":" in args.topology else 6
    if not args.topology.startswith("two-regions"):
        raise SystemExit(f"--topology {args.topology!r}: only two-regions[:n] is modelled")
    topo = netem.two_regions(n)
    rtt_rows, rate_rows = topo.link_rows()
    table = LinkTable.from_rows(rtt_rows, rate_rows)
    rate = [[r * PAYLOAD_SHARE for r in row] for row in rate_rows]
    planned, best, rank = plan_order(table), brute_force_order(table), list(range(n))
    print(f"# {topo.name}: planned order {planned}, brute-force best {best}, rank order {rank}")
    print(f"{'MiB':>6} {'rank order':>11} {'planned':>9} {'best':>9} {'rank/planned':>13}")
    for mib in (float(x) for x in args.sizes.split(",") if x.strip()):
        values = int(mib * (1 << 20) / 4)
        t_rank, t_plan, t_best = (ring_time(o, rate, topo.delay_s, values) for o in (rank, planned, best))
        print(f"{mib:>6g} {t_rank:>10.3f}s {t_plan:>8.3f}s {t_best:>8.3f}s {t_rank / t_plan:>12.2f}x")


if __name__ == "__main__":
    main()
