"""Elastic nodes of two processes each (`prime-simulate --elastic --procs-per-node 2`), and the chaos driver's rules.

One job of 3 nodes x 2 processes (FSDP2 inside a node, gloo; local rank g of
every node averages on ring g; local rank 0 takes part in the membership for
its node): node 1 is SIGKILLed (its whole process tree) during its inner steps,
node 3 joins (each local rank g downloads shard g from local rank g of a live
node), then node 2 dies inside an all-reduce (fault point allreduce.inside).
The nodes left finish with the same final weights on both local ranks (the
trainer compares shard g with local rank g of every other node and fails the
run otherwise), and the same outer-state digest after every outer step.
Tiny model, short sequences, 2 cores: about 2 minutes.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from prime.elastic.simulate import _Node, chaos_victims
from conftest import needs_ring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INNER = 5
STEPS = 50
HOLD = 22  # the members wait here (after outer step 4) until the joiner holds the state

QUICK = ["--model.name", "tiny", "--train.device", "cpu", "--data.seq_len", "32", "--train.micro_batch_size", "2",
         "--train.threads", "1", "--optim.lr", "3e-3", "--optim.warmup_steps", "5", "--optim.decay_steps", "0",
         "--metrics.plot", "false", "--metrics.log_every", "1", "--diloco.inner_steps", str(INNER),
         "--diloco.timeout_s", "20", "--elastic.heartbeat_interval_s", "0.2", "--elastic.heartbeat_timeout_s", "3",
         "--elastic.barrier_timeout_s", "60", "--elastic.transfer_timeout_s", "10", "--elastic.join_timeout_s", "120",
         "--elastic.digest", "true", "--train.steps", str(STEPS),
         # 100 Mbit/s per link: an all-reduce lasts long enough to die in
         "--diloco.max_rate_mbit", "100"]




def _node(rank: int, member: bool, doomed: bool = False) -> _Node:
    return _Node(rank=rank, proc=None, started=0.0, member=member, doomed=doomed)


def test_chaos_never_kills_the_last_admitted_member():
    a, b, joiner = _node(0, True), _node(1, True), _node(3, False)
    # two members and a joiner still downloading: any of them may die (one member stays)
    assert chaos_victims([a, b, joiner], 1) == [a, b, joiner]
    # one member left: only the joiner may die - it is not a member, and cannot serve the state
    assert chaos_victims([a, joiner], 1) == [joiner]
    assert chaos_victims([a, joiner], 0) == [joiner]  # min 0 still keeps one member
    # a member doomed to die in its next all-reduce counts as gone already
    assert chaos_victims([a, _node(1, True, doomed=True), joiner], 1) == [joiner]
    assert chaos_victims([a, b, joiner], 2) == [joiner]


@needs_ring
def test_nodes_of_two_processes_survive_kills_and_a_join(tmp_path):
    release, trigger, out = tmp_path / "release", tmp_path / "trigger", tmp_path / "metrics"
    hold = f"train.before_step@{HOLD}=hold:{release}"
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "3", "--procs-per-node", "2", "--elastic",
           "--kill-node", "1@step:12", "--join-at", "step:15", "--fault", f"0={hold}", "--fault", f"2={hold}",
           "--fault", f"2=allreduce.inside@file:{trigger}", "--", *QUICK, "--metrics.out_dir", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PRIME_RING_SECRET="procs-test-secret")
    env.pop("PRIME_FAULTS", None)
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    cv = threading.Condition()

    def pump():
        for line in p.stdout:
            with cv:
                lines.append(line.rstrip("\n"))
                cv.notify_all()

    threading.Thread(target=pump, daemon=True).start()

    def wait_for(pattern: str, timeout: float = 240.0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with cv:
            while True:
                for line in lines:
                    m = rx.search(line)
                    if m:
                        return m
                if time.monotonic() > deadline or p.poll() is not None:
                    raise AssertionError(f"never saw /{pattern}/:\n" + "\n".join(lines[-150:]))
                cv.wait(0.2)

    try:
        wait_for(r"\[simulate\] killed node 1 \(id 1\) with SIGKILL")
        got = wait_for(r"\[node 3\] .*downloaded the state after outer step (\d+)")
        release.write_text("")  # the members go on: the joiner is admitted at the next outer step
        admitted = int(wait_for(r"\[simulate\] node 3 \(id 3\) admitted at outer step (\d+)").group(1))
        assert admitted == int(got.group(1)) + 1
        trigger.write_text("")  # node 2 dies inside its next all-reduce
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    time.sleep(0.3)
    text = "\n".join(lines)
    with open(tmp_path / "simulate.log", "w") as f:
        f.write(text)
    assert p.returncode == 0, text[-6000:]
    assert re.search(r"\[simulate\] node 2 \(id 2\) died from its fault point allreduce\.inside@file:", text), text[-4000:]
    assert re.search(r"recovery: node 1 \(id 1\) was killed", text) and re.search(r"recovery: node 2 \(id 2\)", text)
    # the nodes left (0 and 3) agree on their final weights, on both local ranks (else the run fails)
    finals = {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in re.finditer(
        r"\[node (\d+)\] final weights identical on all (\d+) nodes: blake2b ([0-9a-f]+) \(local rank 0\)", text)}
    assert set(finals) == {0, 3} and {n for n, _ in finals.values()} == {2}, finals
    assert finals[0][1] == finals[3][1]
    # the same outer state (local rank 0's shard) on every node after every outer step
    by_step: dict[int, dict] = {}
    members: dict[int, list] = {}
    for name in os.listdir(out):
        if name.startswith("metrics_node"):
            with open(out / name) as f:
                for r in map(json.loads, f):
                    if r["kind"] == "outer":
                        by_step.setdefault(r["outer_step"], {})[r["node"]] = r["digest"]
                        members[r["outer_step"]] = r["members"]
    assert sorted(by_step) == list(range(1, STEPS // INNER + 1)), sorted(by_step)
    for k, d in by_step.items():
        assert len(set(d.values())) == 1, f"outer step {k}: nodes differ: {d}"
    assert members[1] == [0, 1, 2] and members[STEPS // INNER] == [0, 3], members
    assert set(by_step[admitted]) == {0, 2, 3}


@needs_ring
def test_nodes_of_two_processes_whose_weights_differ_stop_every_process_at_the_first_outer_step(tmp_path):
    """Two elastic nodes of two processes each (one torchrun a node, the store in this process), node 1 started
    with another seed: local rank 0 of each node finds the difference in the arrivals of outer step 1, and its
    other process stops with the same error (LocalRanks' lead); every process and both torchruns exit 3."""
    from datetime import timedelta

    import torch.distributed as dist

    from prime.simulate import free_port

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PRIME_RING_SECRET="procs-test-secret")
    for k in ("PRIME_FAULTS", "PRIME_NODE_RANK", "PRIME_NUM_NODES", "PRIME_STORE_ADDR"):
        env.pop(k, None)
    procs = []
    for rank, seed in ((0, 5), (1, 6)):
        cmd = [sys.executable, "-m", "prime.torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "-m", "prime.train",
               *QUICK, "--train.steps", str(4 * INNER), "--train.seed", str(seed), "--elastic.enabled", "true",
               "--elastic.external_store", "true", "--node-rank", str(rank), "--num-nodes", "2",
               "--store-addr", f"127.0.0.1:{store.port}", "--metrics.out_dir", str(tmp_path / "metrics")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(outs)
    with open(tmp_path / "torchruns.log", "w") as f:
        f.write(text)
    assert [p.returncode for p in procs] == [3, 3], text[-6000:]
    for rank, out in enumerate(outs):
        stops = re.findall(r"prime-train: stopped: node (\d+): at outer step 1, the first since the start, "
                           r"outer weights differ from node\(s\) \[(\d+)\]", out)
        assert stops == [(str(rank), str(1 - rank))] * 2, out[-4000:]  # both processes of the node
    assert "final weights" not in text and "outer 1 (" not in text, text[-4000:]
