"""prime-simulate: run N DiLoCo nodes on one machine, each its own torchrun, joined by the ring over 127.0.0.1.

    prime-simulate --nodes 2 --procs-per-node 1 -- --config configs/demo.toml

Starts `python -m torch.distributed.run --nproc-per-node P --master-port <free>
-m prime.train <train args> --node-rank r --num-nodes N --store-addr
127.0.0.1:<free>` for r = 0..N-1, prefixes each node's output lines with
`[node r]`, and exits non-zero (after stopping the other nodes) as soon as one
node fails. For demos, tests and benchmarks.

With --elastic (docs/elastic.md) nodes may be killed and started during the
run: `prime-simulate --nodes 3 --elastic --kill-node 1@step:30 --join-at
step:50 -- ...` (see prime/elastic/simulate.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from prime.faults import ENV as FAULTS_ENV
from prime.faults import FaultSpecError, describe, parse_node_fault

__all__ = ["main", "simulate", "free_port", "fault_env"]


def fault_env(faults: dict, rank: int) -> str:
    """The PRIME_FAULTS value of node `rank`: the specs for every node, then its own."""
    return ",".join(faults.get(None, []) + faults.get(rank, []))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM to each node's process group, SIGKILL after grace_s."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _gpu_slices(nodes: int, procs_per_node: int, env: dict) -> list[list[str]]:
    """Disjoint GPUs for each node when the machine has enough (else [] and the nodes share what they see)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d for d in visible.split(",") if d.strip()]
    else:
        try:
            import torch

            ids = [str(i) for i in range(torch.cuda.device_count())]
        except ImportError:
            ids = []
    if len(ids) < nodes * procs_per_node:
        return []
    return [ids[r * procs_per_node : (r + 1) * procs_per_node] for r in range(nodes)]


def simulate(nodes: int, procs_per_node: int, train_args: list[str], *, env: dict | None = None,
             out=None, threads_per_proc: int | None = None, faults: dict | None = None) -> int:
    """Runs the nodes; returns 0 when all succeed, else the first failing node's exit status.

    faults: {node rank or None (every node): [fault specs]} armed through PRIME_FAULTS (prime/faults.py)."""
    out = out or sys.stdout
    store_port = free_port()
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    if threads_per_proc:
        base_env["OMP_NUM_THREADS"] = str(threads_per_proc)
    gpu_slices = _gpu_slices(nodes, procs_per_node, base_env)
    lock = threading.Lock()
    procs, pumps = [], []
    for r in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs_per_node),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "prime.train", *train_args,
            "--node-rank", str(r), "--num-nodes", str(nodes), "--store-addr", f"127.0.0.1:{store_port}",
        ]
        node_env = dict(base_env, PRIME_NODE_RANK=str(r), PRIME_NUM_NODES=str(nodes))
        armed = fault_env(faults or {}, r)
        if armed:
            node_env[FAULTS_ENV] = armed
        if gpu_slices:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_slices[r])
        # Each node in its own process group, so that stopping it stops torchrun's workers too.
        p = subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[node {r}] ", out, lock), daemon=True)
        t.start()
        pumps.append(t)
    status = 0
    try:
        remaining = set(range(nodes))
        while remaining:
            for r in sorted(remaining):
                rc = procs[r].poll()
                if rc is None:
                    continue
                remaining.discard(r)
                if rc != 0 and status == 0:
                    status = rc
                    with lock:
                        out.write(f"[simulate] node {r} exited with status {rc}; stopping the other nodes\n")
                        out.flush()
                    _stop(procs)
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs)
        status = 130
    finally:
        _stop(procs)
        for t in pumps:
            t.join(timeout=5)
    return status


def main(argv=None) -> int:
    """prime-simulate --nodes N --procs-per-node P [--threads T] -- <prime-train arguments>."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1 :]
    else:
        own, train_args = argv, []
    parser = argparse.ArgumentParser(prog="prime-simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--procs-per-node", type=int, default=1, help="processes (devices) per node (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="OMP/torch threads per process (default: torch's)")
    el = parser.add_argument_group("elastic (docs/elastic.md)")
    el.add_argument("--elastic", action="store_true",
                    help="elastic job: this process hosts the store; nodes may be killed and started")
    el.add_argument("--kill-node", action="append", default=[], metavar="R@step:S",
                    help="SIGKILL node R once the job reached step S (repeatable)")
    el.add_argument("--join-at", action="append", default=[], metavar="step:S",
                    help="start a new node once the job reached step S (repeatable)")
    el.add_argument("--chaos", type=float, default=0.0, metavar="SECONDS",
                    help="kill random nodes and start new ones for this long")
    el.add_argument("--chaos-seed", type=int, default=None, help="seed of the chaos sequence")
    el.add_argument("--chaos-min-nodes", type=int, default=2, help="chaos never kills below this many nodes")
    el.add_argument("--chaos-every", type=int, default=20, metavar="STEPS",
                    help="a chaos event every STEPS to 2*STEPS inner steps (default 20)")
    el.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="stop every node (cleanly) this long after the start")
    parser.add_argument("--fault", action="append", default=[], metavar="[R=]POINT@AT[=ACTION]",
                        help="arm a named fault point (prime/faults.py) in node R, or in every node without R= "
                             "(repeatable); e.g. 2=allreduce.inside@8, 1=train.before_step@22=stall:5, "
                             "0=transfer.serve@0.4. Points: " + describe().replace("\n", ";"))
    args = parser.parse_args(own)
    faults: dict = {}
    for text in args.fault:
        try:
            rank, spec = parse_node_fault(text)
        except FaultSpecError as e:
            parser.error(f"--fault {text}: {e}")
        if rank is not None and rank >= args.nodes and not (args.elastic or args.join_at or args.chaos):
            parser.error(f"--fault {text}: there is no node {rank} (--nodes {args.nodes})")
        faults.setdefault(rank, []).append(spec)
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")
    if args.procs_per_node < 1:
        parser.error(f"--procs-per-node must be >= 1, got {args.procs_per_node}")
    if args.elastic or args.kill_node or args.join_at or args.chaos or args.stop_after:
        from prime.elastic.simulate import parse_join, parse_kill, run_elastic

        try:
            kills = [parse_kill(k) for k in args.kill_node]
            joins = [parse_join(j) for j in args.join_at]
        except ValueError as e:
            parser.error(str(e))
        return run_elastic(args.nodes, train_args, kills=kills, joins=joins, chaos_s=args.chaos,
                           chaos_seed=args.chaos_seed, chaos_min_nodes=args.chaos_min_nodes,
                           chaos_every_steps=args.chaos_every, stop_after_s=args.stop_after, faults=faults,
                           threads_per_proc=args.threads or None, procs_per_node=args.procs_per_node)
    return simulate(args.nodes, args.procs_per_node, train_args, threads_per_proc=args.threads or None,
                    faults=faults)


if __name__ == "__main__":
    sys.exit(main())
