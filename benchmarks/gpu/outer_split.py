"""Each outer step of a run, from its metrics records: the all-reduce and the ring's own split of it.

    python benchmarks/gpu/outer_split.py RUN_DIR              # one line per node and outer step
    python benchmarks/gpu/outer_split.py --brief RUN_DIR LOG  # one line for a summary table

--brief: the mean compute utilization of the outer steps after the first, or after a sparse codec's dense start
(the last outer step marked dense; each node's; not the final syncs after the last inner step), the mean outer
step on the critical path, and whether the log says the final weights are identical.
"""

import glob
import json
import sys

KEYS = ("allreduce_s", "outer_s", "wait_s", "total_s", "wire_s", "reduce_s", "gpu_wait_s", "gpu_codec_s", "h2d_s",
        "d2h_s", "staging_s", "auth_s", "commit_s", "stage_s", "utilization")


def outer_records(run_dir: str) -> list:
    recs = []
    for path in sorted(glob.glob(run_dir + "/metrics_node*.jsonl")):
        with open(path) as f:
            recs += [r for r in map(json.loads, f) if r.get("kind") == "outer"]
    return recs


def main(argv: list) -> int:
    if argv and argv[0] == "--brief":
        run_dir, log = argv[1], argv[2]
        # (the final syncs after the last inner step train nothing: their utilization is 0 by construction)
        every = outer_records(run_dir)
        last_dense = max((r.get("outer_step", 0) for r in every if r.get("dense")), default=0)
        after = max(1, last_dense)
        recs = [r for r in every if r.get("outer_step", 0) > after and not r.get("final_sync")]
        util = [r["utilization"] for r in recs if isinstance(r.get("utilization"), (int, float))]
        outer = [r["outer_s"] for r in recs if isinstance(r.get("outer_s"), (int, float))]
        text = open(log, errors="replace").read()
        agree = "weights identical" if "final weights identical" in text else "NO weight agreement line"
        parts = []
        if util:
            parts.append(f"utilization {100 * sum(util) / len(util):.1f}% after "
                         + (f"the dense start (outer {last_dense})" if last_dense else "outer 1"))
        if outer:
            parts.append(f"outer step {sum(outer) / len(outer):.2f} s")
        print(", ".join(parts + [agree]))
        return 0
    for r in outer_records(argv[0]):
        print(f"  node {r.get('node')} outer {r.get('outer_step')}: "
              + " ".join(f"{k}={r[k]:.3f}" for k in KEYS if isinstance(r.get(k), (int, float))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
