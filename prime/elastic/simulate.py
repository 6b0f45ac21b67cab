"""prime-simulate --elastic: an elastic job on one machine, with nodes killed and started on cue.

    prime-simulate --nodes 3 --elastic --kill-node 1@step:30 --join-at step:50 -- --config configs/demo.toml
    prime-simulate --nodes 3 --elastic --chaos 300 -- --config configs/demo.toml --train.steps 100000

This process hosts the job's TCPStore (so killing node 0 does not take the
store with it) and starts every node as `python -m prime.train ... --elastic.enabled
true --elastic.external_store true`. It follows the nodes' output for the
job's step (the highest `step N/` or `(step N)` printed so far) and:

  --kill-node R@step:S   SIGKILLs node R (its process group) once the job reached step S
  --join-at step:S       starts a new node (the next free rank) once the job reached step S
  --chaos SECONDS        for that long, every few outer steps kill a random node or start a new one
                         (never fewer than --chaos-min-nodes alive; --chaos-seed picks the sequence)
  --stop-after SECONDS   stop every node (SIGTERM: a clean leave) this long after the start
  --fault R=SPEC         test hook for node R (PRIME_ELASTIC_FAULT): allreduce:K dies inside the
                         all-reduce of outer step K, serve:F dies after serving a fraction F of its
                         state to a joiner, stall:S:SECONDS pauses at inner step S

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
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["run_elastic", "parse_kill", "parse_join", "parse_fault"]

_STEP = re.compile(r"^(?:step\s+(\d+)/|outer \d+ \(step (\d+)\))")
_REGISTERED = re.compile(r"node (\d+): registered as (?:initial node|joiner) \(rank (\d+)")
_EVICTED = re.compile(r"node (\d+) evicted")
_OUTER = re.compile(r"^outer (\d+) \(step (\d+)\)")
_JOINED = re.compile(r"joined at outer step (\d+).*join took ([\d.]+) s, download ([\d.]+) s")


def parse_kill(text: str) -> tuple[int, int]:
    """'1@step:30' -> (1, 30)."""
    m = re.fullmatch(r"(\d+)@step:(\d+)", text)
    if not m:
        raise ValueError(f"--kill-node takes RANK@step:STEP (e.g. 1@step:30), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_fault(text: str) -> tuple[int, str]:
    """'2=allreduce:8' -> (2, 'allreduce:8')."""
    m = re.fullmatch(r"(\d+)=((?:allreduce|serve|stall):[\d.:]+)", text)
    if not m:
        raise ValueError(f"--fault takes RANK=SPEC with SPEC allreduce:K, serve:FRACTION or stall:STEP:SECONDS, "
                         f"got {text!r}")
    return int(m.group(1)), m.group(2)


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


@dataclass
class _State:
    step: int = 0
    nodes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)


class _Launcher:
    def __init__(self, initial: int, train_args: list[str], env: dict, out, faults: Optional[dict] = None):
        import torch.distributed as dist
        from datetime import timedelta

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.initial, self.train_args, self.env, self.out = initial, train_args, env, out
        self.faults = faults or {}
        self.lock = threading.Lock()
        self.s = _State()
        self.pumps: list[threading.Thread] = []

    def say(self, msg: str) -> None:
        with self.lock:
            self.out.write(f"[simulate] {msg}\n")
            self.out.flush()

    def start(self, rank: int) -> None:
        cmd = [sys.executable, "-m", "prime.train", *self.train_args, "--elastic.enabled", "true",
               "--elastic.external_store", "true", "--node-rank", str(rank), "--num-nodes", str(self.initial),
               "--store-addr", f"127.0.0.1:{self.store.port}"]
        env = dict(self.env, PRIME_NODE_RANK=str(rank), PRIME_NUM_NODES=str(self.initial))
        if rank in self.faults:
            env["PRIME_ELASTIC_FAULT"] = self.faults[rank]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        node = _Node(rank, p, time.monotonic())
        with self.lock:
            self.s.nodes[rank] = node
        t = threading.Thread(target=self._pump, args=(node,), daemon=True)
        t.start()
        self.pumps.append(t)

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
                m = _JOINED.search(line)
                if m and not node.joined:
                    node.joined = True
                    self.s.events.append(("join", node.rank, now - node.started, float(m.group(2)),
                                          float(m.group(3))))
                    self.out.write(f"[simulate] node {node.rank} (id {node.node_id}) admitted at outer step "
                                   f"{m.group(1)}: {now - node.started:.1f} s after its start (join {m.group(2)} s, "
                                   f"download {m.group(3)} s)\n")
        node.proc.stdout.close()

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

    def kill(self, rank: int) -> None:
        with self.lock:
            n = self.s.nodes[rank]
            if n.proc.poll() is not None:
                return
            n.killed_at, n.killed_step = time.monotonic(), self.s.step
        try:
            os.killpg(n.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.say(f"killed node {rank} (id {n.node_id}) with SIGKILL at step {n.killed_step}")

    def alive(self) -> list[int]:
        with self.lock:
            return [r for r, n in self.s.nodes.items() if n.proc.poll() is None]

    def stop_all(self) -> None:
        for r in self.alive():
            try:
                os.killpg(self.s.nodes[r].proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for n in list(self.s.nodes.values()):
            try:
                n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait()


def run_elastic(initial: int, train_args: list[str], *, kills=(), joins=(), chaos_s: float = 0.0,
                chaos_seed: Optional[int] = None, chaos_min_nodes: int = 2, chaos_every_steps: int = 0,
                stop_after_s: Optional[float] = None, faults: Optional[dict] = None, env: Optional[dict] = None,
                out=None,
                threads_per_proc: Optional[int] = None) -> int:
    """Runs the elastic job (see the module docstring); returns 0 when every node not killed on purpose exited 0.

    stop_after_s: stop every node (SIGTERM: they leave cleanly) this long after the start, if still running."""
    out = out or sys.stdout
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    if threads_per_proc:
        base_env["OMP_NUM_THREADS"] = str(threads_per_proc)
    L = _Launcher(initial, train_args, base_env, out, faults)
    for r in range(initial):
        L.start(r)
    kills = sorted(kills, key=lambda x: x[1])
    joins = sorted(joins)
    next_rank = initial
    rng = random.Random(chaos_seed)
    if chaos_s:
        L.say(f"chaos for {chaos_s:g} s (seed {chaos_seed}), at least {chaos_min_nodes} nodes alive")
    t_start = time.monotonic()
    chaos_end = t_start + chaos_s
    next_chaos_step = None
    status = 0
    try:
        while True:
            step = L.s.step
            while kills and step >= kills[0][1]:
                r, _ = kills.pop(0)
                if r in L.s.nodes:
                    L.kill(r)
                else:
                    L.say(f"--kill-node {r}: there is no node {r}")
            while joins and step >= joins[0]:
                joins.pop(0)
                L.say(f"starting node {next_rank} (joiner) at step {step}")
                L.start(next_rank)
                next_rank += 1
            if chaos_s and time.monotonic() < chaos_end:
                every = chaos_every_steps or 20
                if next_chaos_step is None:
                    next_chaos_step = step + rng.randint(every, 2 * every)
                elif step >= next_chaos_step:
                    next_chaos_step = step + rng.randint(every, 2 * every)
                    alive = L.alive()
                    if len(alive) > chaos_min_nodes and rng.random() < 0.5:
                        L.kill(rng.choice(alive))
                    else:
                        L.say(f"chaos: starting node {next_rank} (joiner) at step {step}")
                        L.start(next_rank)
                        next_rank += 1
            if stop_after_s is not None and time.monotonic() - t_start > stop_after_s:
                L.say(f"stopping every node after {stop_after_s:g} s (--stop-after)")
                with L.lock:
                    for n in L.s.nodes.values():
                        if n.killed_at is None and n.proc.poll() is None:
                            n.killed_at = time.monotonic()  # on purpose: not a failure
                break
            with L.lock:
                nodes = list(L.s.nodes.values())
            for n in nodes:
                rc = n.proc.poll()
                if rc == -signal.SIGKILL and n.killed_at is None and n.rank in L.faults:
                    with L.lock:  # a --fault hook killed it: time the recovery from now (50 ms polls)
                        n.killed_at, n.killed_step = time.monotonic(), L.s.step
                    L.say(f"node {n.rank} (id {n.node_id}) died from its fault hook {L.faults[n.rank]!r} at step "
                          f"{n.killed_step}")
                    continue
                if rc is not None and rc != 0 and n.killed_at is None and status == 0:
                    status = rc
                    L.say(f"node {n.rank} exited with status {rc} (not killed by us)")
            if all(n.proc.poll() is not None for n in nodes) and not (kills or joins):
                break
            if all(n.proc.poll() is not None for n in nodes) and (kills or joins):
                L.say("every node has exited; skipping the remaining --kill-node/--join-at")
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        L.stop_all()
        for t in L.pumps:
            t.join(timeout=5)
    rec = [e for e in L.s.events if e[0] == "recovery"]
    jn = [e for e in L.s.events if e[0] == "join"]
    if rec or jn:
        L.say("summary: " + "; ".join(
            [f"node {r} killed, recovered in {dt:.2f} s" for _, r, dt in rec]
            + [f"node {r} admitted {dt:.1f} s after start (join {j:.2f} s, download {d:.2f} s)"
               for _, r, dt, j, d in jn]))
    return status
