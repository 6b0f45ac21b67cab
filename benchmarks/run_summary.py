"""Summarizes training runs from their metrics files: the outer step on the critical path against the wire,
compute utilization after the first outer step (after a sparse codec's dense start, whose outer steps send
int8: the phases up to the last one marked dense are left out, and their utilization is stated apart), MFU, and
the memory lines.

    python3 benchmarks/run_summary.py RUN_DIR [RUN_DIR ...] [--rate-mbit R] [--json OUT]

RUN_DIR holds metrics_node<r>.jsonl (metrics.out_dir) and, optionally, the run's log as log.txt (the memory
plan and peaks, the final-weights line). --rate-mbit: the ring's pace per ring (diloco.max_rate_mbit), to
state the wire time of each outer step as bytes sent / rate.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics


def summarize(run: str, rate_mbit: float = 0.0) -> dict:
    out = {"run": run, "nodes": {}}
    for path in sorted(glob.glob(os.path.join(run, "metrics_node*.jsonl"))):
        recs = [json.loads(line) for line in open(path)]
        node = int(re.search(r"node(\d+)", os.path.basename(path)).group(1))
        steps = [r for r in recs if r["kind"] == "step"]
        outers = [r for r in recs if r["kind"] == "outer"]
        last_step = max((r["step"] for r in steps), default=0)
        in_run = [o for o in outers if o.get("phase_compute_s", 1) > 0 or o["step"] < last_step]
        dense = [i for i, o in enumerate(in_run) if o.get("dense")]  # a sparse codec's dense start (int8)
        first = dense[-1] + 1 if dense else 1
        after = in_run[first:]  # every phase after the first outer step, or after the dense start
        comp = sum(o.get("phase_compute_s", 0.0) for o in after)
        wall = sum(o.get("phase_s", 0.0) for o in after)
        start = in_run[:first] if dense else []
        start_wall = sum(o.get("phase_s", 0.0) for o in start)
        mfus = sorted(r["mfu"] for r in steps[3:] if r.get("mfu") is not None)
        rows = []
        for o in outers:
            wire = 8 * o["bytes_sent"] / (rate_mbit * 1e6) if rate_mbit and o.get("bytes_sent") else None
            rows.append({k: o.get(k) for k in ("step", "outer_step", "fragment", "outer_s", "allreduce_s", "prepare_s",
                                                "update_s", "bytes_sent", "utilization", "wait_s", "wire_s",
                                                "gpu_wait_s", "reduce_s", "dense")} | {"wire_est_s": wire})
        out["nodes"][node] = {
            "steps": last_step, "outer": rows,
            "utilization_after_first_outer": comp / wall if wall else None,
            "dense_outer_steps": len(dense),
            "utilization_dense_start": (sum(o.get("phase_compute_s", 0.0) for o in start) / start_wall
                                        if start_wall else None),
            "dense_start_s": start_wall,
            "median_mfu": mfus[len(mfus) // 2] if mfus else None,
            "median_step_s": statistics.median(r["step_s"] for r in steps[3:]) if len(steps) > 3 else None,
        }
    log = os.path.join(run, "log.txt")
    if os.path.exists(log):
        text = open(log, errors="replace").read()
        out["memory_lines"] = [l for l in text.splitlines() if "memory" in l and ("plan" in l or "peak" in l or
                                                                                  "GPU:" in l or "host:" in l)][:16]
        out["final"] = [l for l in text.splitlines() if "final weights" in l or "final outer weights" in l]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--rate-mbit", type=float, default=0.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    res = [summarize(r, a.rate_mbit) for r in a.runs]
    for s in res:
        print(f"== {s['run']}")
        for node, n in sorted(s["nodes"].items()):
            u, m = n["utilization_after_first_outer"], n["median_mfu"]
            print(f"  node {node}: {n['steps']} steps, median step {n['median_step_s'] or 0:.3f} s, MFU "
                  f"{100 * m:.1f}%" if m is not None else f"  node {node}: {n['steps']} steps", end="")
            if n["dense_outer_steps"]:
                print(f", utilization after the dense start ({n['dense_outer_steps']} int8 outer steps, "
                      f"{n['dense_start_s']:.0f} s at {100 * (n['utilization_dense_start'] or 0):.1f}%) "
                      f"{100 * u:.2f}%" if u is not None else "")
            else:
                print(f", utilization after the first outer step {100 * u:.2f}%" if u is not None else "")
            print("    step frag outer_s allreduce_s prepare_s update_s wire_est_s util")
            for o in n["outer"]:
                f = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
                print(f"    {o['step']:>4} {o['fragment'] or 0:>4} {f(o['outer_s']):>7} {f(o['allreduce_s']):>11} "
                      f"{f(o['prepare_s']):>9} {f(o['update_s']):>8} {f(o['wire_est_s']):>10} {f(o['utilization'])}")
        for line in s.get("memory_lines", []) + s.get("final", []):
            print("  " + line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
