"""The cost of authenticated (and encrypted) ring frames: one build against another.

Runs benchmarks/bench_allreduce.py (4 ranks x 64 MiB fp32, methods ring-int8 and
ring-fp32, on emulated 1 Gbit/s links with a 1mb tbf burst and on loopback) for
each variant, in rounds (before, after, after+encrypt, before, ...), so that load
from anything else on the machine hits all variants alike; then pools every timed
iteration of a variant and prints medians and ratios.

  before          the tree given by --before (e.g. main's build, CRC32C frames)
  after           the tree given by --after (AES-256-GCM tags on every frame)
  after+encrypt   the same with PRIME_RING_ENCRYPT=1 (payloads encrypted too)

Each tree must hold a built prime/_C*.so; it is put first on PYTHONPATH.

    python benchmarks/bench_ring_auth.py --before /work/main --after . --rounds 3

--cpu measures instead the CPU time (user + system, getrusage) one all-reduce costs
all ranks together: 4 ranks as threads of one process on loopback, per codec. On a
shared machine this is far steadier than wall time, which other processes' load
moves by tens of percent.

    python benchmarks/bench_ring_auth.py --before /work/main --after . --cpu --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def prime_location(tree: str) -> str:
    """Where `import prime` resolves with `tree` first on the path (checked, not assumed)."""
    out = subprocess.run([sys.executable, "-c", "import prime; print(prime.__file__)"], cwd="/",
                         env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def run_variant(tree: str, encrypt: bool, args, out_stem: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": tree, "PRIME_RING_ENCRYPT": "1" if encrypt else "0"}
    argv = [sys.executable, os.path.join(HERE, "bench_allreduce.py"), "--conditions", args.conditions,
            "--world-sizes", str(args.world_size), "--sizes", str(args.size_mib), "--methods", args.methods,
            "--burst", "1mb", "--warmup", "1", "--min-iters", str(args.iters), "--max-iters", str(args.iters),
            "--seed", str(args.seed), "--no-plot", "--out", out_stem]
    subprocess.run(argv, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out_stem + ".json") as f:
        return json.load(f)["rows"]


_CPU_SCRIPT = r"""
import json, resource, sys, threading, torch, torch.distributed as dist
from prime.comm import Ring
world, n, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
store = dist.HashStore()
rings = [None] * world
def build(r):
    rings[r] = Ring(store, r, world, timeout=120, secret=b"bench", job_id="cpu")
threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
[t.start() for t in threads]; [t.join() for t in threads]
inputs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
out = {}
for codec in ("int8", "none"):
    def run(r, k):
        for _ in range(k):
            y = inputs[r].clone()
            rings[r].all_reduce(y, op="sum", codec=codec).wait()
    for k, measure in ((1, False), (iters, True)):
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        threads = [threading.Thread(target=run, args=(r, k)) for r in range(world)]
        [t.start() for t in threads]; [t.join() for t in threads]
        u1 = resource.getrusage(resource.RUSAGE_SELF)
    # the clone is part of it, the same for every build
    out[codec] = ((u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)) / iters
[r.close() for r in rings]
print(json.dumps(out))
"""


def cpu_variant(tree: str, encrypt: bool, args) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "PRIME_RING_ENCRYPT": "1" if encrypt else "0"}
    n = args.size_mib * (1 << 20) // 4
    out = subprocess.run([sys.executable, "-c", _CPU_SCRIPT, str(args.world_size), str(n), str(args.iters)], cwd="/",
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main_cpu(args, variants) -> None:
    cpu: dict = {}
    for rnd in range(args.rounds):
        for name, tree, encrypt in variants:
            for codec, s in cpu_variant(tree, encrypt, args).items():
                cpu.setdefault(codec, {}).setdefault(name, []).append(s)
            print(f"round {rnd + 1}/{args.rounds}: {name} done", flush=True)
    print(f"\nCPU seconds per all-reduce, all {args.world_size} ranks together ({args.size_mib} MiB fp32 each, "
          f"loopback, threads of one process), medians over {args.rounds} rounds of {args.iters}")
    print(f"{'codec':6s} {'before':>8s} {'after':>8s} {'+encrypt':>9s} {'after/before':>12s} {'enc/before':>10s}")
    for codec, by in cpu.items():
        med = {k: statistics.median(v) for k, v in by.items()}
        b, a, e = med["before"], med["after"], med["after+encrypt"]
        print(f"{codec:6s} {b:8.3f} {a:8.3f} {e:9.3f} {a / b:12.3f} {e / b:10.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "cpu_s": cpu}, f, indent=1)
    print(f"\nwrote {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="tree of the baseline build")
    p.add_argument("--after", required=True, help="tree of the build with authenticated frames")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per case and run")
    p.add_argument("--conditions", default="tc-1gbit,loopback")
    p.add_argument("--methods", default="ring-int8,ring-fp32")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu", action="store_true", help="CPU time per all-reduce instead of wall time (see above)")
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/ring_auth[_cpu].json)")
    args = p.parse_args()
    if args.out is None:
        args.out = os.path.join(HERE, "results", "ring_auth_cpu.json" if args.cpu else "ring_auth.json")

    variants = [("before", os.path.abspath(args.before), False), ("after", os.path.abspath(args.after), False),
                ("after+encrypt", os.path.abspath(args.after), True)]
    for name, tree, _ in variants:
        print(f"{name:14s} prime from {prime_location(tree)}", flush=True)
    if args.cpu:
        return main_cpu(args, variants)
    times: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_ring_auth_") as tmp:
        for rnd in range(args.rounds):
            for name, tree, encrypt in variants:
                rows = run_variant(tree, encrypt, args, os.path.join(tmp, f"{name}-{rnd}"))
                for row in rows:
                    if "times_s" not in row:
                        continue
                    key = (row["condition"], row["method"])
                    times.setdefault(key, {}).setdefault(name, []).extend(row["times_s"])
                print(f"round {rnd + 1}/{args.rounds}: {name} done", flush=True)
    summary = []
    print(f"\n{args.world_size} ranks x {args.size_mib} MiB fp32, medians over {args.rounds} rounds x "
          f"{args.iters} iterations")
    print(f"{'condition':12s} {'method':10s} {'before':>9s} {'after':>9s} {'+encrypt':>9s} "
          f"{'after/before':>12s} {'enc/before':>10s}")
    for (cond, method), by in sorted(times.items()):
        med = {k: statistics.median(v) for k, v in by.items()}
        b, a, e = med.get("before"), med.get("after"), med.get("after+encrypt")
        summary.append({"condition": cond, "method": method, "median_s": med, "times_s": by})
        print(f"{cond:12s} {method:10s} {b:9.4f} {a:9.4f} {e:9.4f} {a / b:12.3f} {e / b:10.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": summary}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
