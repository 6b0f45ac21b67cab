"""prime-simulate --elastic: an elastic job on one machine, with nodes killed and started on cue.

    prime-simulate --nodes 3 --elastic --kill-node 1@step:30 --join-at step:50 -- --config configs/demo.toml
    prime-simulate --nodes 3 --elastic --chaos 300 -- --config configs/demo.toml --train.steps 100000

This process hosts the job's TCPStore (so killing node 0 does not take the
store with it) and starts every node as `python -m prime.train ... --elastic.enabled
true --elastic.external_store true`. It follows the nodes' output for the
job's step (the highest `step N/` or `(step N)` printed so far) and:

  --kill-node R@step:S   SIGKILLs node R (its process and every process below it) once the job reached step S
  --join-at step:S       starts a new node (the next free rank) once the job reached step S
  --chaos SECONDS        for that long, every few outer steps kill a random node (SIGKILL from
                         outside, or its fault point allreduce.inside: it dies inside its next
                         all-reduce) or start a new one; never the last admitted member (a joiner
                         still downloading is not one), never below --chaos-min-nodes members;
                         --chaos-seed replays a sequence (the seed is printed)
  --stop-after SECONDS   stop every node (SIGTERM: a clean leave) this long after the start
  --fault [R=]SPEC       a named fault point (prime/faults.py) armed in node R (every node without R=),
                         e.g. 2=allreduce.inside@8, 0=transfer.serve@0.4, 1=train.before_step@22=stall:5
  --procs-per-node P     each node is a torchrun of P processes (FSDP inside the node; local rank g
                         of every node averages on ring g)

and prints, for every kill, the fault-to-recovery time (from the kill to the
first outer step that the survivors committed without the dead node) and,
for every join, the time from the start of the new node to its admission.
The run ends when every node has exited; the status is 0 when every node that
was not killed on purpose exited 0.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["run_elastic", "parse_kill", "parse_join", "chaos_victims"]

_STEP = re.compile(r"^(?:step\s+(\d+)/|outer \d+ \(step (\d+)\))")
_REGISTERED = re.compile(r"node (\d+): registered as (?:initial node|joiner) \(rank (\d+)")
_EVICTED = re.compile(r"node (\d+) evicted")
_OUTER = re.compile(r"^outer (\d+) \(step (\d+)\)")
_JOINED = re.compile(r"joined at outer step (\d+).*join took ([\d.]+) s, download ([\d.]+) s")
_LEFT_OUT = re.compile(r"node (\d+): evicted at outer step")
_FAULT_KILL = re.compile(r"fault (\S+): SIGKILL")


def parse_kill(text: str) -> tuple[int, int]:
    """'1@step:30' -> (1, 30)."""
    m = re.fullmatch(r"(\d+)@step:(\d+)", text)
    if not m:
        raise ValueError(f"--kill-node takes RANK@step:STEP (e.g. 1@step:30), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_join(text: str) -> int:
    """'step:50' -> 50."""
    m = re.fullmatch(r"step:(\d+)", text)
    if not m:
        raise ValueError(f"--join-at takes step:STEP (e.g. step:50), got {text!r}")
    return int(m.group(1))


@dataclass
class _Node:
    rank: int
    proc: subprocess.Popen
    started: float
    node_id: Optional[int] = None
    killed_at: Optional[float] = None
    killed_step: int = 0
    recovered: bool = False
    evicted_seen: bool = False
    joined: bool = False
    member: bool = False
    """An admitted member as far as its output tells (initial node, or joined and not evicted since)."""
    doomed: bool = False
    """Chaos armed its allreduce.inside fault: it dies in its next all-reduce."""
    drained: bool = False
    """Its output was read to the end (a fault point's last words included)."""
    gpu_slot: Optional[int] = None
    """The GPUs it was given (ElasticSimulation.gpu_slots), if any."""


@dataclass
class _State:
    step: int = 0
    nodes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)


def kill_node(pid: int, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to a node's process and every process below it (its workers first)."""
    from prime.simulate import process_tree, signal_pids

    signal_pids(process_tree(pid)[::-1], sig)


def chaos_victims(nodes: list, min_members: int) -> list:
    """The nodes chaos may kill now: any live node whose death leaves at least max(1, min_members) live
    admitted members that are not doomed. A joiner still downloading is not a member: it cannot serve the
    state, so killing the last member would leave nobody to download from."""
    members = [n for n in nodes if n.member and not n.doomed]
    need = max(1, min_members)
    return [n for n in nodes if not n.doomed and len([m for m in members if m is not n]) >= need]


class _Launcher:
    def __init__(self, initial: int, train_args: list[str], env: dict, out, faults: Optional[dict] = None,
                 procs_per_node: int = 1, chaos_dir: Optional[str] = None, grace_s: float = 30.0,
                 node_args: Optional[dict] = None):
        from datetime import timedelta

        from prime.comm.rendezvous import host_store

        # loopback only: nodes without a secret draw one into it (docs/security.md)
        self.store = host_store("127.0.0.1", 0, timeout=timedelta(seconds=60))
        self.initial, self.train_args, self.env, self.out = initial, train_args, env, out
        self.faults, self.node_args = faults or {}, node_args or {}
        self.procs_per_node, self.chaos_dir, self.grace_s = procs_per_node, chaos_dir, grace_s
        from prime.simulate import visible_gpus

        # GPUs of their own for as many nodes as the machine has room for (a joiner takes a dead node's)
        ids = visible_gpus(env)
        self.gpu_slots = [ids[i * procs_per_node : (i + 1) * procs_per_node] for i in range(len(ids) // procs_per_node)]
        self.lock = threading.Lock()
        self.s = _State()
        self.pumps: list[threading.Thread] = []

    def say(self, msg: str) -> None:
        with self.lock:
            self.out.write(f"[simulate] {msg}\n")
            self.out.flush()

    def die_file(self, rank: int) -> str:
        return os.path.join(self.chaos_dir, f"die-{rank}")

    def start_joiner(self, step: int, by: str = "") -> None:
        """Starts the next node (ranks count up from 0 in the order nodes start) as a joiner, saying so."""
        with self.lock:
            rank = len(self.s.nodes)
        self.say(f"{by}starting node {rank} (joiner) at step {step}")
        self.start(rank)

    def start(self, rank: int) -> None:
        from prime.faults import ENV as FAULTS_ENV
        from prime.simulate import fault_env, free_port

        launch = [sys.executable]
        if self.procs_per_node > 1:  # one torchrun per node, as on a real multi-GPU machine (prime's stop rules)
            launch += ["-m", "prime.torchrun", "--nnodes", "1", "--nproc-per-node", str(self.procs_per_node),
                       "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd = [*launch, "-m", "prime.train", *self.train_args, "--elastic.enabled", "true",
               "--elastic.external_store", "true", "--node-rank", str(rank), "--num-nodes", str(self.initial),
               "--store-addr", f"127.0.0.1:{self.store.port}", *self.node_args.get(rank, [])]
        env = dict(self.env, PRIME_NODE_RANK=str(rank), PRIME_NUM_NODES=str(self.initial))
        slot = self._gpu_slot(rank)
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_slots[slot])
        armed = fault_env(self.faults, rank)
        if self.chaos_dir is not None:  # chaos may make this node die inside its next all-reduce
            armed = ",".join(filter(None, [armed, f"allreduce.inside@file:{self.die_file(rank)}"]))
        if armed:
            env[FAULTS_ENV] = armed
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        node = _Node(rank, p, time.monotonic(), member=rank < self.initial)
        node.gpu_slot = slot
        with self.lock:
            self.s.nodes[rank] = node
        t = threading.Thread(target=self._pump, args=(node,), daemon=True)
        t.start()
        self.pumps.append(t)

    def _gpu_slot(self, rank: int) -> Optional[int]:
        """The GPU slot of a node started now: the lowest no live node holds, else rank mod the slots (None:
        no GPUs of their own to give)."""
        if not self.gpu_slots:
            return None
        with self.lock:
            held = {n.gpu_slot for n in self.s.nodes.values() if n.proc.poll() is None}
        free = [s for s in range(len(self.gpu_slots)) if s not in held]
        return free[0] if free else rank % len(self.gpu_slots)

    def _pump(self, node: _Node) -> None:
        prefix = f"[node {node.rank}] "
        for raw in iter(node.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            now = time.monotonic()
            with self.lock:
                self.out.write(prefix + line + "\n")
                self.out.flush()
                m = _STEP.search(line)
                if m:
                    self.s.step = max(self.s.step, int(m.group(1) or m.group(2)))
                m = _REGISTERED.search(line)
                if m and int(m.group(2)) == node.rank:
                    node.node_id = int(m.group(1))
                for ev in _EVICTED.finditer(line):
                    self._on_evicted(int(ev.group(1)), now)
                m = _OUTER.search(line)
                if m:
                    self._on_outer(node, int(m.group(1)), now)
                if _LEFT_OUT.search(line):
                    node.member = False
                if _FAULT_KILL.search(line) and node.killed_at is None:
                    # a fault point killed it (--fault, or chaos): time the recovery from now
                    node.killed_at, node.killed_step = now, self.s.step
                    self.out.write(f"[simulate] node {node.rank} (id {node.node_id}) died from its fault point "
                                   f"{_FAULT_KILL.search(line).group(1)} at step {node.killed_step}\n")
                m = _JOINED.search(line)
                if m:
                    node.member = True
                if m and not node.joined:
                    node.joined = True
                    self.s.events.append(("join", node.rank, now - node.started, float(m.group(2)),
                                          float(m.group(3))))
                    self.out.write(f"[simulate] node {node.rank} (id {node.node_id}) admitted at outer step "
                                   f"{m.group(1)}: {now - node.started:.1f} s after its start (join {m.group(2)} s, "
                                   f"download {m.group(3)} s)\n")
        node.proc.stdout.close()
        node.drained = True

    def _on_evicted(self, node_id: int, now: float) -> None:
        for n in self.s.nodes.values():
            if n.node_id == node_id and n.killed_at is not None:
                n.evicted_seen = True

    def _on_outer(self, reporter: _Node, k: int, now: float) -> None:
        for n in self.s.nodes.values():
            if n.killed_at is not None and not n.recovered and getattr(n, "evicted_seen", False) \
                    and n is not reporter:
                n.recovered = True
                dt = now - n.killed_at
                self.s.events.append(("recovery", n.rank, dt))
                self.out.write(f"[simulate] recovery: node {n.rank} (id {n.node_id}) was killed at step "
                               f"{n.killed_step}; the survivors committed outer step {k} without it {dt:.2f} s "
                               "after the kill\n")

    def doom(self, rank: int) -> None:
        """Chaos: node `rank` dies inside its next all-reduce (its fault point allreduce.inside@file:...)."""
        with self.lock:
            n = self.s.nodes[rank]
            n.doomed = True
        with open(self.die_file(rank), "w"):
            pass
        self.say(f"chaos: node {rank} (id {n.node_id}) will die inside its next all-reduce (fault point "
                 f"allreduce.inside) at step {self.s.step}")

    def kill(self, rank: int) -> None:
        with self.lock:
            n = self.s.nodes[rank]
            if n.proc.poll() is not None:
                return
            n.doomed = True
            n.killed_at, n.killed_step = time.monotonic(), self.s.step
        kill_node(n.proc.pid)
        self.say(f"killed node {rank} (id {n.node_id}) with SIGKILL at step {n.killed_step}")

    def alive(self) -> list[int]:
        with self.lock:
            return [r for r, n in self.s.nodes.items() if n.proc.poll() is None]

    def stop_all(self, sig: int = signal.SIGTERM, hurry=lambda: False) -> list[int]:
        """Stops every node (a clean leave), within the grace; returns the pids that had to be killed."""
        from prime.simulate import stop_nodes

        with self.lock:
            procs = [n.proc for n in self.s.nodes.values()]
        return stop_nodes(procs, sig, self.grace_s + 5, hurry=hurry)


class _Chaos:
    """--chaos: for `seconds` from the start, one event every `every` to 2 x `every` steps (every: 20 when 0),
    drawn from Random(seed): a kill (SIGKILL, or for an admitted member, half the time, death inside its next
    all-reduce) or a joiner, the mix kept even (at most two of a kind ahead), never leaving fewer than
    max(1, min_nodes) admitted members alive (chaos_victims)."""

    def __init__(self, seconds: float, seed: int, min_nodes: int, every: int, t_start: float):
        self.seed, self.min_nodes, self.every = seed, min_nodes, every or 20
        self.end = t_start + seconds
        self.rng = random.Random(seed)
        self.next_step: Optional[int] = None
        self.kills = self.joins = 0

    def tick(self, L: "_Launcher", step: int) -> None:
        """The event due at `step`, if any (nothing once the chaos time is over)."""
        if time.monotonic() >= self.end:
            return
        rng, every = self.rng, self.every
        if self.next_step is None:
            self.next_step = step + rng.randint(every, 2 * every)
            return
        if step < self.next_step:
            return
        self.next_step = step + rng.randint(every, 2 * every)
        with L.lock:
            live = [n for n in L.s.nodes.values() if n.proc.poll() is None]
            victims = sorted(chaos_victims(live, self.min_nodes), key=lambda n: n.rank)
        kill = rng.random() < 0.5
        if abs(self.kills - self.joins) >= 2:  # keep the mix even: at most two of a kind ahead
            kill = self.kills < self.joins
        if victims and kill:
            self.kills += 1
            victim = rng.choice(victims)
            if victim.member and rng.random() < 0.5:
                L.doom(victim.rank)
            else:
                L.kill(victim.rank)
        else:
            self.joins += 1
            L.start_joiner(step, by="chaos: ")


def _failed_status(L: "_Launcher", nodes: list, status: int) -> int:
    """status, or the exit status of the first of `nodes` that failed on its own (not killed by us), said once."""
    for n in nodes:
        rc = n.proc.poll()
        if rc is not None and rc != 0 and n.killed_at is None and n.drained and status == 0:
            status = rc
            L.say(f"node {n.rank} exited with status {rc} (not killed by us)")
    return status


def run_elastic(initial: int, train_args: list[str], *, kills=(), joins=(), chaos_s: float = 0.0,
                chaos_seed: Optional[int] = None, chaos_min_nodes: int = 2, chaos_every_steps: int = 0,
                stop_after_s: Optional[float] = None, faults: Optional[dict] = None, env: Optional[dict] = None,
                out=None, threads_per_proc: Optional[int] = None, procs_per_node: int = 1,
                grace_s: float = 30.0, node_args: Optional[dict] = None) -> int:
    """Runs the elastic job (see the module docstring); returns 0 when every node not killed on purpose exited 0,
    or 128 + N when signal N stopped this process (every node stopped with it, within grace_s).

    stop_after_s: stop every node (SIGTERM: they leave cleanly) this long after the start, if still running.
    node_args: {node rank: [prime-train arguments]} for that node only (--slow-node), joiners included."""
    from prime import stop
    from prime.simulate import LauncherSignals, node_env

    out = out or sys.stdout
    base_env = node_env(dict(os.environ if env is None else env), grace_s)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    if threads_per_proc:
        base_env["OMP_NUM_THREADS"] = str(threads_per_proc)
    chaos_dir = tempfile.mkdtemp(prefix="prime-chaos-") if chaos_s else None
    L = _Launcher(initial, train_args, base_env, out, faults, procs_per_node=procs_per_node, chaos_dir=chaos_dir,
                  grace_s=grace_s, node_args=node_args)
    signals = LauncherSignals()
    signals.install()
    kills = sorted(kills, key=lambda x: x[1])
    joins = sorted(joins)
    t_start = time.monotonic()
    chaos = None
    if chaos_s:
        chaos = _Chaos(chaos_s, random.randrange(1 << 31) if chaos_seed is None else chaos_seed, chaos_min_nodes,
                       chaos_every_steps, t_start)
        L.say(f"chaos for {chaos_s:g} s, seed {chaos.seed} (replay: --chaos-seed {chaos.seed}), never fewer than "
              f"{max(1, chaos_min_nodes)} admitted members alive")
    status = 0
    try:
        for r in range(initial):
            L.start(r)
        while True:
            if _act(L, kills, joins, chaos, stop_after_s, t_start):
                break
            with L.lock:
                nodes = list(L.s.nodes.values())
            status = _failed_status(L, nodes, status)
            if all(n.proc.poll() is not None and n.drained for n in nodes) and not (kills or joins):
                break
            if all(n.proc.poll() is not None for n in nodes) and (kills or joins):
                L.say("every node has exited; skipping the remaining --kill-node/--join-at")
                break
            time.sleep(0.05)
    except stop.Stopped as e:
        status = _stop_on_signal(L, e, hurry=lambda: signals.again)
    finally:
        signals.hold()
        L.stop_all(hurry=lambda: signals.again)
        for t in L.pumps:
            t.join(timeout=5)
        signals.uninstall()
        if chaos_dir is not None:
            shutil.rmtree(chaos_dir, ignore_errors=True)
    _say_summary(L)
    return status


def _act(L: _Launcher, kills: list, joins: list, chaos, stop_after_s: Optional[float], t_start: float) -> bool:
    """What is due at the job's step now: --kill-node, --join-at, chaos; True once --stop-after stopped the job
    (every node still running marked as stopped on purpose, not as failed)."""
    step = L.s.step
    while kills and step >= kills[0][1]:  # --kill-node
        r, _ = kills.pop(0)
        if r in L.s.nodes:
            L.kill(r)
        else:
            L.say(f"--kill-node {r}: there is no node {r}")
    while joins and step >= joins[0]:  # --join-at
        joins.pop(0)
        L.start_joiner(step)
    if chaos is not None:
        chaos.tick(L, step)
    if stop_after_s is None or time.monotonic() - t_start <= stop_after_s:
        return False
    L.say(f"stopping every node after {stop_after_s:g} s (--stop-after)")
    with L.lock:
        for n in L.s.nodes.values():
            if n.killed_at is None and n.proc.poll() is None:
                n.killed_at = time.monotonic()  # on purpose: not a failure
    return True


def _stop_on_signal(L: _Launcher, e, hurry) -> int:
    """A signal stopped this process: every node stopped with it (on purpose, not failed), one line saying so;
    returns the exit status (128 + the signal)."""
    from prime import stop

    t0 = time.monotonic()
    with L.lock:
        for n in L.s.nodes.values():
            n.killed_at = n.killed_at or time.monotonic()  # stopped on purpose: not a failure
    killed = L.stop_all(e.signum, hurry=hurry)
    L.say(f"stopped by {stop.signal_name(e.signum)}: every node stopped "
          + (f"within {time.monotonic() - t0:.1f} s" if not killed else
             f"({len(killed)} process(es) still running after the grace were killed)")
          + f"; exit status {e.code}")
    return e.code


def _say_summary(L: _Launcher) -> None:
    """One line: each recovery from a killed node and each admitted joiner, with their times."""
    rec = [e for e in L.s.events if e[0] == "recovery"]
    jn = [e for e in L.s.events if e[0] == "join"]
    if rec or jn:
        L.say("summary: " + "; ".join(
            [f"node {r} killed, recovered in {dt:.2f} s" for _, r, dt in rec]
            + [f"node {r} admitted {dt:.1f} s after start (join {j:.2f} s, download {d:.2f} s)"
               for _, r, dt, j, d in jn]))
