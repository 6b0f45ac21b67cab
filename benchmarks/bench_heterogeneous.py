"""Nodes of different speeds: compute utilization per node in steps phases against time phases.

    python3 benchmarks/bench_heterogeneous.py --slow 2 --phase-seconds 6 --out benchmarks/results/heterogeneous/cpu_demo_2x
    python3 benchmarks/bench_heterogeneous.py --slow 2 --phase-seconds 6 --repeats 3 -- --train.steps 60

Runs `prime-simulate --nodes 2 --slow-node 1:F -- --config configs/demo.toml` twice, side by side in one
process: with diloco.phase = steps (every node runs inner_steps inner steps, the fast one waits) and with
diloco.phase = time (every node trains for phase_seconds, the outer step weighs them by their inner steps).
Both record a hash of the outer weights after every outer step (metrics.outer_hash), which must be the same on
both nodes at every outer step. Arguments after `--` go to prime-train in both runs. Reports, per node, the
compute utilization of every outer step after the first (median and minimum), of the whole run, the inner steps
trained and the weights of the last outer step; writes <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: str, slow: float, phase_seconds: float, extra: list, out_dir: str, procs: str = "1") -> dict:
    args = ["--config", "configs/demo.toml", "--metrics.out_dir", out_dir, "--metrics.outer_hash", "true",
            "--metrics.plot", "false", *extra]
    if mode == "time":
        args += ["--diloco.phase", "time", "--diloco.phase_seconds", repr(phase_seconds)]
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", "--procs-per-node", procs,
           "--slow-node", f"1:{slow:g}", "--", *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{mode}: prime-simulate failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    nodes = {}
    for n in (0, 1):
        with open(os.path.join(out_dir, f"metrics_node{n}.jsonl")) as f:
            recs = [json.loads(line) for line in f]
        outer = [r for r in recs if r["kind"] == "outer"]
        summary = next(r for r in recs if r["kind"] == "summary")
        util = [r["utilization"] for r in outer[1:]]  # after the first outer step
        nodes[n] = {"outer_utilization_median": statistics.median(util), "outer_utilization_min": min(util),
                    "run_utilization": summary["utilization"], "inner_steps_trained": summary["steps"],
                    "outer_steps": len(outer), "last_weights": outer[-1].get("node_weights"),
                    "last_node_steps": outer[-1].get("node_steps"), "hashes": [r["outer_hash"] for r in outer],
                    "wall_s": summary["wall_s"]}
    same = nodes[0]["hashes"] == nodes[1]["hashes"] and len(nodes[0]["hashes"]) > 0
    return {"mode": mode, "identical_after_every_outer_step": same, "nodes": nodes,
            "final": [line for line in p.stdout.splitlines() if "final weights identical" in line][:1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slow", type=float, default=2.0, help="node 1's inner steps take this many times their time")
    ap.add_argument("--phase-seconds", type=float, default=6.0, help="diloco.phase_seconds of the time run")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (steps, time), alternated")
    ap.add_argument("--procs", default="1", help="prime-simulate --procs-per-node (e.g. 2,1: node 0 FSDP2 over 2 "
                    "processes, node 1 one process on both rings; outer hashes then compare ring 0's rows)")
    ap.add_argument("--out", default="")
    a, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for mode in ("steps", "time"):
                r = run(mode, a.slow, a.phase_seconds, extra, os.path.join(tmp, f"{mode}{i}"), a.procs)
                results.append(r)
                n0, n1 = r["nodes"][0], r["nodes"][1]
                print(f"{mode:5s} | node 0: outer steps after the first {100 * n0['outer_utilization_median']:.1f}% "
                      f"median, {100 * n0['outer_utilization_min']:.1f}% min, run {100 * n0['run_utilization']:.1f}%, "
                      f"{n0['inner_steps_trained']} inner steps | node 1: {100 * n1['outer_utilization_median']:.1f}% "
                      f"median, {100 * n1['outer_utilization_min']:.1f}% min, run {100 * n1['run_utilization']:.1f}%, "
                      f"{n1['inner_steps_trained']} inner steps | last weights {n0['last_weights']} | identical after "
                      f"every outer step: {r['identical_after_every_outer_step']}", flush=True)
    meta = {"slow": a.slow, "procs": a.procs, "phase_seconds": a.phase_seconds, "extra": extra,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "argv": sys.argv[1:]}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".json", "w") as f:
            json.dump({"meta": meta, "runs": results}, f, indent=1)
    return 0 if all(r["identical_after_every_outer_step"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
