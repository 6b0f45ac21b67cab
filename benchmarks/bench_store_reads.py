"""Reading many signed store records over a slow path: a round trip per key against a check and a multi_get.

The elastic heartbeat monitor reads every known node's record each interval (1 s by default), and an
elastic outer step's agreement reads every node's offer and result. The store may be a continent away.
SignedStore.get_many reads them either a key at a time (read_now: one compare_set each, which never
waits for a key) or batched (a check of all the keys and, when all are there, one multi_get under a
short timeout; prime.comm.signed_store.read_many). Here the store runs in one network namespace and the
reader in another, joined by the delay line (benchmarks/netem.py) at --rtt-ms; the reader writes the
signed heartbeat records of N nodes, then sweeps them both ways in turn (the order alternating), and
checks that both read back exactly what it wrote. Prints and writes medians per N.

    python benchmarks/bench_store_reads.py --nodes 8,30,100 --rtt-ms 100 --sweeps 9 \\
        --out benchmarks/results/store_reads_rtt100

Needs root and /dev/net/tun (netem.support()).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

PORT = 29650
SECRET = b"bench-store-reads"


def serve(host: str) -> None:
    """The store: a libuv TCPStore server on host:PORT until stdin closes."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(host, PORT, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                          use_libuv=True)
    print("ready", flush=True)
    sys.stdin.read()
    del store


def read(host: str, nodes: list[int], sweeps: int, seed: int) -> None:
    """The reader: writes N nodes' heartbeat records, sweeps them both ways, prints one JSON line."""
    from datetime import timedelta

    import torch.distributed as dist

    from prime.comm.signed_store import SignedStore

    rng = random.Random(seed)
    client = dist.TCPStore(host, PORT, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
    rows = []
    for n in nodes:
        s = SignedStore(dist.PrefixStore(f"bench/{n}", client), SECRET, "bench")
        ks = [f"hb/{i}" for i in range(n)]
        values = [{"node": i, "seq": rng.randrange(1 << 30), "left": False} for i in range(n)]
        for k, v in zip(ks, values):
            s.put(k, v)
        times: dict = {"keywise": [], "batched": []}
        for r in range(sweeps):
            for how in (("keywise", "batched") if r % 2 == 0 else ("batched", "keywise")):
                s._batched = how == "batched"
                t0 = time.perf_counter()
                got = s.get_many(ks)
                times[how].append(time.perf_counter() - t0)
                if got != values:
                    raise SystemExit(f"{how} read of {n} records returned something else than was written")
        k, b = statistics.median(times["keywise"]), statistics.median(times["batched"])
        rows.append({"nodes": n, "keywise_s": k, "batched_s": b, "ratio": k / b, "times": times})
    print(json.dumps(rows), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,30,100", help="comma-separated node counts (records per sweep)")
    p.add_argument("--rtt-ms", type=float, default=100.0, help="round trip between the reader and the store")
    p.add_argument("--sweeps", type=int, default=9, help="sweeps of each way per node count")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="", help="write OUT.json")
    p.add_argument("--role", choices=["store", "reader"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    args = p.parse_args()
    nodes = [int(x) for x in args.nodes.split(",")]
    if args.role == "store":
        serve(args.host)
        return 0
    if args.role == "reader":
        read(args.host, nodes, args.sweeps, args.seed)
        return 0

    import netem

    why = netem.support()
    if why:
        print(f"bench_store_reads: {why}", file=sys.stderr)
        return 2
    topo = netem.Topology.uniform(2, 1e9, args.rtt_ms / 1e3)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    me = [sys.executable, os.path.abspath(__file__)]
    with netem.Emulator(topo) as net:
        print(net.describe(), flush=True)
        store = subprocess.Popen(net.exec_argv(0, me + ["--role", "store", "--host", net.addr(0)]), env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            if store.stdout.readline().strip() != "ready":
                raise SystemExit("the store did not start")
            out = subprocess.run(net.exec_argv(1, me + ["--role", "reader", "--host", net.addr(0), "--nodes",
                                                        args.nodes, "--sweeps", str(args.sweeps), "--seed",
                                                        str(args.seed)]),
                                 env=env, capture_output=True, text=True, check=True)
        finally:
            store.stdin.close()
            store.wait(timeout=10)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"RTT {args.rtt_ms:g} ms to the store, median of {args.sweeps} sweeps each, the ways alternating")
    print(f"{'nodes':>6} {'a key at a time':>16} {'batched':>9} {'ratio':>7}")
    for r in rows:
        print(f"{r['nodes']:>6} {r['keywise_s']:>15.3f}s {r['batched_s']:>8.3f}s {r['ratio']:>6.1f}x")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"rtt_ms": args.rtt_ms, "sweeps": args.sweeps, "command": " ".join(sys.argv), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
