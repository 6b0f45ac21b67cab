"""prime-simulate: run N DiLoCo nodes on one machine, each its own torchrun, joined by the ring over 127.0.0.1.

    prime-simulate --nodes 2 --procs-per-node 1 -- --config configs/demo.toml

Checks the training arguments first (a bad setting: one line naming the
field, status 2, no node started). Then starts `python -m prime.torchrun
--nproc-per-node P --master-port <free> -m prime.train <train args>
--node-rank r --num-nodes N --store-addr 127.0.0.1:<free>` (torchrun with
prime's stop rules) for r = 0..N-1, prefixes each node's output lines with
`[node r]`, and exits non-zero (after stopping the other nodes) as soon as one
node fails. For demos, tests and benchmarks. `--procs-per-node 2,1` gives
each node its own count (node 0 FSDP2 over 2 processes, node 1 one process
on every ring: prime/shares.py).

SIGTERM, SIGINT or SIGHUP to this process stops every node: the signal goes to
every process of every node, which stop within train.stop_grace_s; what is
still running 5 s after that is SIGKILLed (a second signal: at once). The exit
status is then 128 + the signal's number. Killed outright (SIGKILL), this
process takes its nodes with it (prime.stop.die_with_parent). docs/stopping.md.

With --elastic (docs/elastic.md) nodes may be killed and started during the
run: `prime-simulate --nodes 3 --elastic --kill-node 1@step:30 --join-at
step:50 -- ...` (see prime/elastic/simulate.py).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from prime import stop
from prime.faults import ENV as FAULTS_ENV
from prime.faults import FaultSpecError, describe, parse_node_fault

__all__ = ["main", "simulate", "free_port", "fault_env", "process_tree", "running", "signal_pids",
           "LauncherSignals", "stop_nodes", "check_train_args", "node_env"]


def fault_env(faults: dict, rank: int) -> str:
    """The PRIME_FAULTS value of node `rank`: the specs for every node, then its own."""
    return ",".join(faults.get(None, []) + faults.get(rank, []))


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel draws ports from for bind(0) and connect() (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, drawn at random below the kernel's ephemeral range where
    there is room (10000 up): a port handed on to a launcher is bound a moment later, and in between every bind(0)
    and connect() of the machine (rings, stores, tests) may take any free port of the ephemeral range."""
    lo, _ = _ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(64 if lo > 12000 else 0):
        port = rng.randrange(10000, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()
    stream.close()


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first (torchrun starts its workers in sessions of their own, so
    a signal to a node's process group does not reach them: the stop walks the tree)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [pid], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_pids(pids, sig: int) -> None:
    """Sends `sig` to every pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class LauncherSignals:
    """prime-simulate's own SIGTERM, SIGINT and SIGHUP: the first raises prime.stop.Stopped in the main thread
    (the launcher then stops its nodes within the grace); another one during that stop kills them at once."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.again = False
        self._before: dict = {}

    def install(self) -> None:
        for sig in stop.SIGNALS:
            self._before[sig] = signal.signal(sig, self._on_signal)

    def hold(self) -> None:
        """From now on a signal only hurries the stop (the teardown must not be interrupted)."""
        self.signum = self.signum or -1

    def uninstall(self) -> None:
        """Puts back the handlers that were there before install()."""
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise stop.Stopped(signum)
        self.again = True


def stop_nodes(procs: list[subprocess.Popen], sig: int, grace_s: float, hurry=lambda: False) -> list[int]:
    """Sends `sig` to every process of each node's tree (launcher and workers), waits up to grace_s for all of
    them to end (each training process stops within its own train.stop_grace_s), then SIGKILLs what is left.
    hurry() true: kill at once. Returns the pids that had to be killed."""
    tree = [pid for p in procs if p.poll() is None for pid in process_tree(p.pid)]
    signal_pids(tree, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not hurry():
        for p in procs:
            p.poll()  # reaps the launchers (the workers are reaped by them, or by init)
        if not any(running(pid) for pid in tree):
            return []
        time.sleep(0.05)
    # Those left, and anything they started meanwhile.
    left = [pid for pid in dict.fromkeys(tree + [c for pid in tree if running(pid) for c in process_tree(pid)])
            if running(pid)]
    signal_pids(left, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return left


def check_train_args(train_args: list[str], nodes: int, elastic: bool = False):
    """The Config the nodes will build from `train_args` (as node 0 sees it); raises ValueError naming the field,
    before any node starts."""
    from prime.config import config_from_argv

    extra = ["--elastic.enabled", "true", "--elastic.external_store", "true"] if elastic else []
    return config_from_argv([*train_args, *extra, "--node-rank", "0", "--num-nodes", str(nodes),
                             "--store-addr", "127.0.0.1:1"])


def node_env(env: dict, grace_s: float) -> dict:
    """What every node's launcher gets besides its own settings: it dies with this process (prime.stop), and
    torchrun waits for its stopping workers a little longer than they may take."""
    return dict(env, **{stop.ENV_PARENT: str(os.getpid()),
                        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(math.ceil(grace_s)) + 5)})


def visible_gpus(env: dict) -> list[str]:
    """The GPU ids the nodes may be given (CUDA_VISIBLE_DEVICES, else every GPU torch sees)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def _gpu_slices(nodes: int, procs_per_node, env: dict) -> list[list[str]]:
    """Disjoint GPUs for each node when the machine has enough (else [] and the nodes share what they see).
    procs_per_node: one count for every node, or a list of one per node."""
    procs = _per_node(procs_per_node, nodes)
    ids = visible_gpus(env)
    if len(ids) < sum(procs):
        return []
    starts = [sum(procs[:r]) for r in range(nodes)]
    return [ids[a : a + p] for a, p in zip(starts, procs)]


def _per_node(procs_per_node, nodes: int) -> list:
    return list(procs_per_node) if isinstance(procs_per_node, (list, tuple)) else [procs_per_node] * nodes


def _procs_args(counts: list) -> list:
    """The prime-train arguments that tell every node every node's count (none when they are equal): the rings and
    the data shards follow from it."""
    return ["--nodes.procs", ",".join(map(str, counts))] if len(set(counts)) > 1 else []


def simulate(nodes: int, procs_per_node, train_args: list[str], *, env: dict | None = None,
             out=None, threads_per_proc: int | None = None, faults: dict | None = None, grace_s: float = 30.0,
             node_args: dict | None = None) -> int:
    """Runs the nodes; returns 0 when all succeed, else the first failing node's exit status, or 128 + N when
    signal N stopped this process (its nodes were stopped with it, within grace_s; docs/stopping.md).

    faults: {node rank or None (every node): [fault specs]} armed through PRIME_FAULTS (prime/faults.py).
    node_args: {node rank: [prime-train arguments]} for that node only, after train_args (--slow-node).
    procs_per_node: processes of every node, or a list of one count per node (nodes.procs: prime/shares.py)."""
    out = out or sys.stdout
    counts = _per_node(procs_per_node, nodes)
    train_args = [*train_args, *_procs_args(counts)]
    store_port = free_port()
    base_env = node_env(dict(os.environ if env is None else env), grace_s)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    if threads_per_proc:
        base_env["OMP_NUM_THREADS"] = str(threads_per_proc)
    gpu_slices = _gpu_slices(nodes, procs_per_node, base_env)
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock:
            out.write(f"[simulate] {msg}\n")
            out.flush()

    signals = LauncherSignals()
    signals.install()
    procs, pumps = [], []
    status = 0
    try:
        for r in range(nodes):
            cmd = [
                sys.executable, "-m", "prime.torchrun", "--nnodes", "1", "--nproc-per-node", str(counts[r]),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "prime.train", *train_args,
                "--node-rank", str(r), "--num-nodes", str(nodes), "--store-addr", f"127.0.0.1:{store_port}",
                *(node_args or {}).get(r, []),
            ]
            env_r = dict(base_env, PRIME_NODE_RANK=str(r), PRIME_NUM_NODES=str(nodes))
            armed = fault_env(faults or {}, r)
            if armed:
                env_r[FAULTS_ENV] = armed
            if gpu_slices:
                env_r["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_slices[r])
            # Each node in its own session: a Ctrl-C in the terminal reaches this process only, which stops
            # the nodes in order (stop_nodes).
            p = subprocess.Popen(cmd, env=env_r, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[node {r}] ", out, lock), daemon=True)
            t.start()
            pumps.append(t)
        remaining = set(range(nodes))
        while remaining:
            for r in sorted(remaining):
                rc = procs[r].poll()
                if rc is None:
                    continue
                remaining.discard(r)
                if rc != 0 and status == 0:
                    status = rc
                    say(f"node {r} exited with status {rc}; stopping the other nodes")
                    stop_nodes(procs, signal.SIGTERM, grace_s + 5)
            time.sleep(0.05)
    except stop.Stopped as e:
        t0 = time.monotonic()
        killed = stop_nodes(procs, e.signum, grace_s + 5, hurry=lambda: signals.again)
        status = e.code
        say(f"stopped by {stop.signal_name(e.signum)}: every node stopped "
            + (f"within {time.monotonic() - t0:.1f} s" if not killed else
               f"({len(killed)} process(es) still running after the grace were killed)")
            + f"; exit status {status}")
    finally:
        signals.hold()
        stop_nodes(procs, signal.SIGTERM, grace_s + 5, hurry=lambda: signals.again)
        for t in pumps:
            t.join(timeout=5)
        signals.uninstall()
    return status


def main(argv=None) -> int:
    """prime-simulate --nodes N --procs-per-node P [--threads T] -- <prime-train arguments>."""
    status = _main(sys.argv[1:] if argv is None else argv)
    if argv is None:  # every node is gone: skip torch's teardown (about 1 s; seconds more in a stop's grace)
        stop.exit_now(status)
    return status


def _parser() -> argparse.ArgumentParser:
    """prime-simulate's own flags (those before '--')."""
    parser = argparse.ArgumentParser(prog="prime-simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--procs-per-node", default="1", metavar="P[,P...]",
                        help="processes (devices) per node: one count for every node, or one per node, each the "
                             "largest or 1 (e.g. 2,1: FSDP2 over 2 on node 0, one process on node 1; default 1)")
    parser.add_argument("--threads", type=int, default=0, help="OMP/torch threads per process (default: torch's)")
    parser.add_argument("--slow-node", action="append", default=[], metavar="R:F",
                        help="node R's inner steps take F times their time (train.slowdown; an emulated slower "
                             "node; repeatable; with elastic nodes also a joiner's rank)")
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
    return parser


def _node_faults(parser: argparse.ArgumentParser, args) -> dict:
    """--fault: {node rank (None: every node): [fault specs]}; a bad one ends with the parser's error."""
    faults: dict = {}
    for text in args.fault:
        try:
            rank, spec = parse_node_fault(text)
        except FaultSpecError as e:
            parser.error(f"--fault {text}: {e}")
        if rank is not None and rank >= args.nodes and not (args.elastic or args.join_at or args.chaos):
            parser.error(f"--fault {text}: there is no node {rank} (--nodes {args.nodes})")
        faults.setdefault(rank, []).append(spec)
    return faults


def _slow_nodes(parser: argparse.ArgumentParser, texts: list, nodes: int) -> dict:
    """--slow-node: {node rank: its extra train flags} (`nodes`: the ranks allowed; elastic: a joiner's rank may be
    beyond --nodes); a bad one ends with the parser's error."""
    node_args: dict = {}
    for text in texts:
        try:
            rank, factor = parse_slow_node(text, nodes)
        except ValueError as e:
            parser.error(f"--slow-node {text}: {e}")
        node_args[rank] = ["--train.slowdown", repr(factor)]
    return node_args


def _main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1 :]
    else:
        own, train_args = argv, []
    parser = _parser()
    args = parser.parse_args(own)
    faults = _node_faults(parser, args)
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")
    elastic = bool(args.elastic or args.kill_node or args.join_at or args.chaos or args.stop_after)
    from prime.shares import parse_procs

    try:
        procs = parse_procs(args.procs_per_node, args.nodes, "--procs-per-node")
    except ValueError as e:
        parser.error(str(e))
    if len(set(procs)) > 1 and elastic:
        parser.error(f"--procs-per-node {args.procs_per_node}: nodes that run different numbers of processes need a "
                     "fixed set of nodes (no --elastic, --kill-node, --join-at, --chaos or --stop-after)")
    procs_per_node = procs if len(set(procs)) > 1 else procs[0]
    node_args = _slow_nodes(parser, args.slow_node, args.nodes if not elastic else 1 << 20)
    try:  # every node would stop on a bad setting: say it once, before starting any
        cfg = check_train_args(train_args + _procs_args(procs), args.nodes, elastic)
    except ValueError as e:
        print(f"prime-simulate: error: {e}", file=sys.stderr)
        return 2
    grace_s = cfg.train.stop_grace_s
    if elastic:
        from prime.elastic.simulate import parse_join, parse_kill, run_elastic

        try:
            kills = [parse_kill(k) for k in args.kill_node]
            joins = [parse_join(j) for j in args.join_at]
        except ValueError as e:
            parser.error(str(e))
        return run_elastic(args.nodes, train_args, kills=kills, joins=joins, chaos_s=args.chaos,
                           chaos_seed=args.chaos_seed, chaos_min_nodes=args.chaos_min_nodes,
                           chaos_every_steps=args.chaos_every, stop_after_s=args.stop_after, faults=faults,
                           threads_per_proc=args.threads or None, procs_per_node=procs_per_node,
                           grace_s=grace_s, node_args=node_args)
    return simulate(args.nodes, procs_per_node, train_args, threads_per_proc=args.threads or None,
                    faults=faults, grace_s=grace_s, node_args=node_args)


def parse_slow_node(text: str, nodes: int) -> tuple[int, float]:
    """'R:F' -> (node rank R, slowdown F >= 1); ValueError naming what is wrong."""
    rank, _, factor = text.partition(":")
    try:  # (without ':' the factor is '', which float() refuses)
        r, f = int(rank), float(factor)
    except ValueError:
        raise ValueError("expected R:F, a node rank and a slowdown factor, e.g. 1:2.0") from None
    if not 0 <= r < nodes:
        raise ValueError(f"there is no node {rank} (--nodes {nodes})")
    if not 1 <= f <= 100:  # (also false for nan)
        raise ValueError(f"the slowdown must be in [1, 100], got {factor}")
    return r, f


if __name__ == "__main__":
    sys.exit(main())
