"""A joiner's download of the outer state (prime.elastic.fetch_state) over loopback, timed end to end.

    python3 benchmarks/bench_join_fetch.py --gib 1 --repeats 3
    python3 benchmarks/bench_join_fetch.py --gib 1 --repeats 3 --before /tmp/old-tree --out R.json

One StateServer and one fetch_state in this process, over 127.0.0.1, of --gib GiB of random fp32 in two
tensors; every download is checked against state_digest. With --before (a checkout of an earlier version,
its extension built or copied in), each repeat runs that tree and this one in turn, in fresh processes, so
that the machine's noise falls on both alike; the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(gib: float, downloads: int) -> list:
    import torch

    from prime.elastic import StateServer, fetch_state, state_digest

    n = int(gib * (1 << 30)) // 4
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    parts = [torch.randn(n // 3, generator=gen), torch.randn(n - n // 3, generator=gen)]
    want = state_digest(parts)
    server = StateServer(b"bench-secret-" * 3, "bench", 0)
    server.publish(1, parts, {"inner_step": 10})
    out = []
    try:
        for _ in range(downloads):
            dst = [torch.empty_like(p) for p in parts]
            t0 = time.perf_counter()
            r = fetch_state(dst, lambda: [(0, server.address)], secret=b"bench-secret-" * 3, job="bench", my_id=1,
                            check_meta=lambda meta: None, timeout_s=60)
            out.append(time.perf_counter() - t0)
            if r.digest != want:
                raise SystemExit("bench_join_fetch: the download does not match the served state")
    finally:
        server.close()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the state (GiB of fp32)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per tree (2 downloads each)")
    ap.add_argument("--before", default=None, help="the root of a checkout of an earlier version")
    ap.add_argument("--out", default=None, help="JSON with every sample")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_one(args.gib, 2)))
        return {}
    trees = {"now": HERE, **({"before": os.path.abspath(args.before)} if args.before else {})}
    samples: dict = {name: [] for name in trees}
    for _ in range(args.repeats):
        for name, root in trees.items():  # alternated
            env = dict(os.environ, PYTHONPATH=root)
            got = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--gib", str(args.gib)],
                                 env=env, cwd=root, check=True, capture_output=True, text=True)
            samples[name] += json.loads(got.stdout.strip().splitlines()[-1])
    med = {name: statistics.median(s) for name, s in samples.items()}
    for name in trees:
        print(f"{name:6s} {args.gib:g} GiB: median {med[name]:.3f} s  ({args.gib * 1.0737 / med[name]:.2f} GB/s)  "
              f"samples {[round(x, 3) for x in samples[name]]}")
    if "before" in med:
        print(f"now / before: x{med['before'] / med['now']:.2f} faster")
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "gib": args.gib,
              "samples_s": samples, "median_s": med}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
