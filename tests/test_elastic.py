"""Elastic nodes: kills, joins, live recovery from a peer, the job secret (prime.elastic).

Every node is a real `python -m prime.train` process with the `tiny` model on
short sequences; the test process hosts the job's TCPStore (as
`python -m prime.elastic.store` would) and kills nodes with SIGKILL. Two
scenarios run once each (module fixtures) and several tests check what they
left behind: the metrics JSONL files (every outer step's members and the
SHA-256 of the outer weights and momentum on every node) and the final
checkpoints (compared bit for bit with torch.equal, independently of the
digests). Heartbeats every 0.2 s, dead after 3 s; ring timeout 10 s.

PRIME_CHAOS=1 also runs the long chaos test (nodes killed and started at
random for a few minutes; PRIME_CHAOS_ARGS adds training arguments, e.g.
"--diloco.fragments 4 --diloco.overlap true").
"""

import hashlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

from prime.simulate import free_port
from conftest import needs_ring
from hand_launch import HandLaunch, landed_set, launch_client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "test-job-secret"
HB_TIMEOUT = 3.0
RING_TIMEOUT = 10.0
INNER = 5
STEPS_A = 100
HOLD_A = 17  # scenario A's survivors wait here (after outer step 3) for the joiner

QUICK = ["--model.name", "tiny", "--train.device", "cpu", "--data.seq_len", "64", "--train.micro_batch_size", "4", "--train.threads", "1",
         "--optim.lr", "3e-3", "--optim.warmup_steps", "5", "--optim.decay_steps", "0", "--metrics.plot", "false",
         "--metrics.log_every", "1", "--diloco.inner_steps", str(INNER), "--diloco.timeout_s", str(RING_TIMEOUT),
         "--elastic.enabled", "true", "--elastic.external_store", "true", "--elastic.heartbeat_interval_s", "0.2",
         "--elastic.heartbeat_timeout_s", str(HB_TIMEOUT), "--elastic.barrier_timeout_s", "60",
         "--elastic.transfer_timeout_s", "10", "--elastic.join_timeout_s", "120", "--elastic.digest", "true",
         "--checkpoint.async_save", "false",
         # 100 Mbit/s per link: an all-reduce takes ~0.2 s, so a node can die in the middle of one
         "--diloco.max_rate_mbit", "100"]




pytestmark = needs_ring


class Job:
    """An elastic job on this machine: the store in this process, each node a prime.train process."""

    def __init__(self, tmp, initial: int, steps: int, seed: int, extra=()):
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.tmp, self.initial = str(tmp), initial
        self.out, self.ck = os.path.join(self.tmp, "metrics"), os.path.join(self.tmp, "ck")
        self.args = QUICK + ["--train.steps", str(steps), "--train.seed", str(seed), "--num-nodes", str(initial),
                             "--store-addr", f"127.0.0.1:{self.store.port}", "--metrics.out_dir", self.out,
                             "--checkpoint.dir", self.ck, *extra]
        self.procs: dict[int, subprocess.Popen] = {}
        self.lines: dict[int, list] = {}
        self.killed: dict[int, float] = {}
        self._cv = threading.Condition()

    def start(self, rank: int, env=None, args=()) -> None:
        e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                 PYTHONUNBUFFERED="1", PRIME_RING_SECRET=SECRET)
        for k in ("PRIME_NODE_RANK", "PRIME_NUM_NODES", "PRIME_STORE_ADDR", "PRIME_FAULT_EXIT_AFTER_STEP",
                  "PRIME_FAULTS"):
            e.pop(k, None)
        e.update(env or {})
        cmd = [sys.executable, "-m", "prime.train", *self.args, "--node-rank", str(rank), *args]
        p = subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs[rank], self.lines[rank] = p, []
        threading.Thread(target=self._pump, args=(rank, p), daemon=True).start()

    def _pump(self, rank: int, p) -> None:
        for line in p.stdout:
            with self._cv:
                self.lines[rank].append((time.time(), line.rstrip("\n")))
                self._cv.notify_all()

    def wait_line(self, rank: int, pattern: str, timeout: float = 120) -> tuple:
        """(time, line) of the first line of node `rank` matching the regex."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for t, line in self.lines[rank]:
                    if rx.search(line):
                        return t, line
                left = deadline - time.monotonic()
                if left <= 0 or (self.procs[rank].poll() is not None and not self._pending(rank)):
                    raise AssertionError(f"node {rank} never printed /{pattern}/:\n" + self.text(rank))
                self._cv.wait(min(left, 0.2))

    def _pending(self, rank: int) -> bool:
        return False

    def launch(self, timeout: float = 60) -> tuple:
        """(the store prefix, the signing job) of the launch node 0 founded (prime.elastic.launch)."""
        import torch.distributed as dist

        from prime.comm import store_keys as keys
        from prime.comm.signed_store import SignedStore

        run = SignedStore(dist.PrefixStore("prime/prime/elastic", self.store), SECRET.encode(), "prime")
        deadline = time.monotonic() + timeout
        while (got := run.get(keys.LAUNCH_CURRENT)) is None:
            assert time.monotonic() < deadline, "node 0 founded no launch"
            time.sleep(0.05)
        return f"prime/prime/elastic/{keys.launch_prefix(got['launch'])}", f"prime/{got['launch']}"

    def wait_ready(self, node_id: int, outer_step: int, timeout: float = 120) -> None:
        """Waits until joiner `node_id` says it holds the state after `outer_step` (its ready key in the store)."""
        import torch.distributed as dist

        from prime.comm.signed_store import SignedStore

        prefix, job = self.launch()
        store = SignedStore(dist.PrefixStore(prefix, self.store), SECRET.encode(), job)
        key = f"ready/{node_id}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            offer = store.get(key)  # signed by the joiner
            if offer is not None and offer["outer_step"] == outer_step:
                return
            time.sleep(0.05)
        raise AssertionError(f"node {node_id} never became ready with outer step {outer_step}:\n"
                             + "\n".join(self.text(r) for r in self.procs))

    def kill(self, rank: int) -> float:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.killed[rank] = time.time()
        return self.killed[rank]

    def wait(self, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        codes = {}
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError("nodes hung:\n" + "\n".join(self.text(q) for q in self.procs))
        time.sleep(0.3)  # let the pumps drain
        return codes

    def stop(self) -> None:
        """Kills what is left and writes each node's output to <tmp>/node<r>.log (for failures)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for r in self.procs:
            with open(os.path.join(self.tmp, f"node{r}.log"), "w") as f:
                f.write(self.text(r) + "\n")

    def text(self, rank: int) -> str:
        return f"----- node {rank} -----\n" + "\n".join(line for _, line in self.lines.get(rank, []))

    def records(self, rank: int, kind: str) -> list:
        path = os.path.join(self.out, f"metrics_node{rank}.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [r for r in map(json.loads, f) if r["kind"] == kind]

    def outer(self, rank: int) -> dict:
        """outer step -> its record, for node `rank`."""
        return {r["outer_step"]: r for r in self.records(rank, "outer")}

    def final_state(self, rank: int) -> dict:
        d = os.path.join(self.ck, f"node{rank}")
        last = sorted(x for x in os.listdir(d) if x.startswith("step_"))[-1]
        return torch.load(os.path.join(d, last, "rank0.pt"), weights_only=True)


def _assert_identical(job: Job, ranks) -> int:
    """Every outer step recorded by two of `ranks` has the same digest on both. Returns the number of
    comparisons made (pairs of nodes per step); callers assert it, so a run with no shared steps fails."""
    return _assert_same_digests({r: job.outer(r) for r in ranks})


def _assert_same_digests(outer_by_rank: dict) -> int:
    by_step: dict[int, dict] = {}
    for r, records in outer_by_rank.items():
        for k, rec in records.items():
            digest = rec["digest"]
            # a SHA-256 in hex: a missing or empty digest must not compare equal to another one
            assert isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest), (
                f"node {r}, outer step {k}: digest {digest!r} is not a SHA-256 hex string")
            by_step.setdefault(k, {})[r] = digest
    checks = 0
    for k, d in sorted(by_step.items()):
        assert len(set(d.values())) == 1, f"outer step {k}: digests differ between nodes: {d}"
        checks += len(d) - 1
    return checks


def test_digest_comparison_can_fail():
    """The helper the scenarios rely on: counts shared steps, and raises on a difference or a non-digest."""
    a, b = "a" * 64, "b" * 64
    assert _assert_same_digests({0: {1: {"digest": a}, 2: {"digest": b}}, 3: {2: {"digest": b}}}) == 1
    assert _assert_same_digests({0: {1: {"digest": a}}, 1: {2: {"digest": a}}}) == 0
    with pytest.raises(AssertionError, match="outer step 2: digests differ"):
        _assert_same_digests({0: {2: {"digest": a}}, 1: {2: {"digest": b}}})
    with pytest.raises(AssertionError, match="not a SHA-256"):
        _assert_same_digests({0: {2: {"digest": None}}, 1: {2: {"digest": None}}})


def _sha(state: dict) -> str:
    h = hashlib.sha256()
    for t in (state["outer"], state["momentum"]):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- scenario A: kill in the inner steps, a join, kill in the all-reduce ------------------------


@pytest.fixture(scope="module")
def scenario_a(tmp_path_factory):
    """3 nodes. Node 1 is SIGKILLed during inner steps; node 3 joins the 2 survivors; then node 2 SIGKILLs
    itself inside the all-reduce of the next outer step. Nodes 0 and 3 finish the run.

    The moments that matter are pinned with the hold hook, not with timing, so that the scenario is the
    same on a slow CI machine and on a fast host."""
    seed = random.randrange(1000)
    print(f"seed {seed}")
    tmp = tmp_path_factory.mktemp("a")
    trigger = os.path.join(str(tmp), "die-in-allreduce")
    # The survivors wait at inner step HOLD_A (after outer step 3) until the joiner holds the state: on a
    # fast machine they would otherwise run to the end while the joiner's Python starts.
    release = os.path.join(str(tmp), "release")
    hold = f"train.before_step@{HOLD_A}=hold:{release}"
    job = Job(tmp, initial=3, steps=STEPS_A, seed=seed)
    job.start(0, env={"PRIME_FAULTS": hold})
    # node 1 waits at inner step 12 for a file that never comes: killed there, surely inside its inner steps
    job.start(1, env={"PRIME_FAULTS": f"train.before_step@12=hold:{os.path.join(str(tmp), 'never')}"})
    job.start(2, env={"PRIME_FAULTS": f"allreduce.inside@file:{trigger},{hold}"})
    try:
        job.wait_line(1, r"holding at inner step 12")
        job.kill(1)
        job.wait_line(0, r"nodes \[0, 2\] \(node 1 evicted")
        job.wait_line(0, r"holding at inner step")
        job.wait_line(2, r"holding at inner step")
        job.start(3)
        job.wait_ready(3, HOLD_A // INNER)
        open(release, "w").close()
        job.wait_line(3, r"joined at outer step")
        open(trigger, "w").close()
        codes = job.wait()
    finally:
        job.stop()
    print(f"node logs under {job.tmp}")
    yield job, codes, seed


def test_survivors_finish_after_a_kill_in_the_inner_steps(scenario_a):
    job, codes, seed = scenario_a
    assert codes[0] == 0 and codes[3] == 0, "\n".join(job.text(r) for r in job.procs)
    plans = [r for r in job.records(0, "membership") if r.get("event") == "plan"]
    first = next(p for p in plans if any(i == 1 for i, _ in p["evicted"]))
    reason = next(w for i, w in first["evicted"] if i == 1)
    assert "no heartbeat" in reason, reason
    k = first["k"]
    assert k == 3, f"node 1 died at step 12, in the inner steps before outer step 3; evicted at {k}"
    # the interrupted outer step was finished by the two survivors, bit-identical
    for r in (0, 2):
        rec = job.outer(r)[k]
        assert rec["members"] == [0, 2] and rec["contributors"] == 2
    assert job.outer(0)[k]["digest"] == job.outer(2)[k]["digest"]
    # no hang beyond the configured timeouts: committed within heartbeat timeout + ring timeout of the kill
    t_commit = next(t for t, line in job.lines[0] if line.startswith(f"outer {k} "))
    assert t_commit - job.killed[1] < HB_TIMEOUT + RING_TIMEOUT, t_commit - job.killed[1]


def test_joiner_receives_identical_state_and_stays_identical(scenario_a):
    job, codes, seed = scenario_a
    joined = next(r for r in job.records(3, "membership") if r.get("event") == "joined")
    # the last download (an earlier one is stale when the job committed an outer step before admitting it)
    dl = [r for r in job.records(3, "membership") if r.get("event") == "downloaded"][-1]
    s = dl["outer_step"]
    # the downloaded state is the committed state of outer step s on the running nodes, bit for bit
    assert job.outer(0)[s]["digest"].startswith(dl["msg"].split("digest ")[1][:16])
    assert joined["outer_step"] == s + 1
    assert job.outer(3)[s + 1]["members"] == [0, 2, 3]
    assert _assert_identical(job, [0, 2, 3]) > 0
    assert job.outer(3)[s + 1]["digest"] == job.outer(0)[s + 1]["digest"] == job.outer(2)[s + 1]["digest"]


def test_survivors_finish_after_a_kill_in_the_allreduce(scenario_a):
    job, codes, seed = scenario_a
    assert codes[2] == -signal.SIGKILL, job.text(2)
    k = max(job.outer(2)) + 1  # node 2 died inside the all-reduce of this outer step
    rec = job.outer(0)[k]
    assert rec["members"] == [0, 3], rec
    # either the attempt failed and the survivors retried without node 2, or (if node 2 died after its
    # last frame left) they completed with its contribution and dropped it; both leave them identical
    assert any(i == 2 for i, _ in rec["evicted"]), rec
    assert job.outer(3)[k]["digest"] == rec["digest"]
    # training went on to the end with the two survivors, identical after every outer step
    last = STEPS_A // INNER
    assert k < last and max(job.outer(0)) == max(job.outer(3)) == last
    # nodes 0 and 3 both recorded every outer step from k to the end (and agreed at each)
    assert _assert_identical(job, [0, 1, 2, 3]) >= last - k + 1
    a, b = job.final_state(0), job.final_state(3)
    fa, fb = a["diloco"]["fragments"][0], b["diloco"]["fragments"][0]
    assert torch.equal(fa["outer"], fb["outer"])
    assert torch.equal(fa["momentum"], fb["momentum"])
    assert _sha(fa) == job.outer(0)[last]["digest"]  # the digests are what they say
    assert a["step"] == b["step"] == STEPS_A


def test_loss_goes_down_across_membership_changes(scenario_a):
    job, codes, seed = scenario_a
    ls = {r["step"]: r["loss"] for r in job.records(0, "step")}
    first, last = sum(ls[s] for s in range(1, 4)) / 3, sum(ls[s] for s in range(91, 101)) / 10
    assert last < first - 1.0, (first, last, seed)


def test_a_joiner_that_starts_after_the_job_ended_has_nothing_to_do(scenario_a):
    """Once the job committed its last outer step and no node of it is alive, a new node stops at once with
    status 0 (the launch recorded its end), not with an error after waiting to be admitted."""
    job, _, _ = scenario_a
    job.start(9)
    code = job.procs[9].wait(timeout=120)
    time.sleep(0.3)  # let the pump drain
    out = job.text(9)
    assert code == 0, out
    assert "committed its last outer step" in out and "nothing to do" in out, out


# -- scenario B: the source of a live recovery dies; strangers try to join -------------------------


def _forge_join_requests(job: Job, stop: threading.Event, out: list) -> None:
    """A fake node that registers and beats like a real one, but signs its join requests with a wrong secret."""
    import hmac

    import torch.distributed as dist

    store = dist.PrefixStore(job.launch()[0], dist.TCPStore("127.0.0.1", job.store.port, is_master=False))
    node = job.initial + int(store.add("joiners", 1)) - 1
    out.append(node)
    while not stop.is_set():
        store.add(f"hb/{node}", 1)
        if store.check(["members"]):
            k = json.loads(store.get("members").split(b":", 2)[2])["k"]  # a signed record: "ps1:<mac>:<json>"
            mac = hmac.new(b"not-the-secret", f"prime|ready|{node}|{k}".encode(), hashlib.sha256).hexdigest()
            store.set(f"ready/{node}", json.dumps({"outer_step": k, "mac": mac}))
        time.sleep(0.1)


def _wait_forged(job: Job, forged: list, timeout: float = 30) -> None:
    """Waits until the forger planted its join request (for the outer step the job holds at)."""
    import torch.distributed as dist

    store = dist.PrefixStore(job.launch()[0], job.store)
    deadline = time.monotonic() + timeout
    while not (forged and store.check([f"ready/{forged[0]}"])):
        assert time.monotonic() < deadline, "the forger planted no join request"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scenario_b(tmp_path_factory):
    """2 nodes. Node 2 joins; its source (node 0: id 2 mod 2 sources) SIGKILLs itself after serving 40% of
    the state, and node 2 must finish the download from node 1. Meanwhile a node with a wrong secret
    (rank 3) tries to join, and a fake node plants join requests signed with a wrong secret."""
    seed = random.randrange(1000)
    print(f"seed {seed}")
    tmp = tmp_path_factory.mktemp("b")
    # Both nodes wait at inner step HOLD_B (after outer step 2) until the joiner holds the state, the node
    # with the wrong secret gave up and a forged join request is planted: on a fast machine the job would
    # otherwise end while the newcomers' Python starts.
    release = os.path.join(str(tmp), "release")
    hold = f"train.before_step@{HOLD_B}=hold:{release}"
    job = Job(tmp, initial=2, steps=STEPS_B, seed=seed)
    job.start(0, env={"PRIME_FAULTS": f"transfer.serve@0.4,{hold}"})
    job.start(1, env={"PRIME_FAULTS": hold})
    stop, forged = threading.Event(), []
    forger = threading.Thread(target=_forge_join_requests, args=(job, stop, forged), daemon=True)
    try:
        job.wait_line(0, r"holding at inner step")
        job.wait_line(1, r"holding at inner step")
        job.start(2)
        job.wait_line(2, r"registered as joiner")  # id 2, so its first source is node 0 (2 mod 2)
        forger.start()
        job.start(3, env={"PRIME_RING_SECRET": "not-the-secret"})
        job.wait_ready(2, HOLD_B // INNER)
        job.procs[3].wait(timeout=120)
        _wait_forged(job, forged)
        open(release, "w").close()
        job.wait_line(2, r"joined at outer step")
        codes = job.wait()
    finally:
        stop.set()
        job.stop()
    print(f"node logs under {job.tmp}")
    yield job, codes, forged


STEPS_B = 80
HOLD_B = 12  # scenario B's nodes wait here (after outer step 2) for the newcomers


def test_joiner_resumes_from_another_peer_when_its_source_dies(scenario_b):
    job, codes, _ = scenario_b
    assert codes[0] == -signal.SIGKILL, job.text(0)
    assert codes[1] == 0 and codes[2] == 0, job.text(1) + job.text(2)
    downloads = [r for r in job.records(2, "membership") if r.get("event") == "downloaded"]
    dl = next((r for r in downloads if len(r["segments"]) > 1), None)
    assert dl is not None, f"no download was resumed: {downloads}"
    segs = dl["segments"]
    assert segs[0][0] == 0 and segs[0][1] == 0 and 0 < segs[0][2] < dl["bytes"], segs  # part from node 0
    assert segs[-1][0] == 1 and segs[-1][1] == segs[0][2] and segs[-1][2] == dl["bytes"], segs  # rest from node 1
    assert any("node 0" in f for f in dl["failures"]), dl["failures"]
    s = dl["outer_step"]
    assert job.outer(1)[s]["digest"].startswith(dl["msg"].split("digest ")[1][:16])
    # after the join nodes 1 and 2 stay identical to the end
    assert _assert_identical(job, [0, 1, 2]) > 0
    last = STEPS_B // INNER
    assert max(job.outer(1)) == max(job.outer(2)) == last
    assert job.outer(2)[last]["members"] == [1, 2]
    a, b = job.final_state(1), job.final_state(2)
    a, b = a["diloco"]["fragments"][0], b["diloco"]["fragments"][0]
    assert torch.equal(a["outer"], b["outer"])
    assert torch.equal(a["momentum"], b["momentum"])


def test_a_node_with_the_wrong_secret_cannot_join(scenario_b):
    job, codes, _ = scenario_b
    out = job.text(3)
    assert codes[3] == 3, out
    # it cannot learn the launch's name: the members read its ask as forged, and it theirs
    assert "could not register" in out and "PRIME_RING_SECRET the job's" in out, out
    assert not os.path.exists(os.path.join(job.ck, "node3")) or not os.listdir(os.path.join(job.ck, "node3"))
    for r in (1, 2):
        assert all(3 not in rec["members"] for rec in job.outer(r).values())
    # the job's store records are signed with the job's secret: node 3 ignored them and never dialled a member
    assert "ignoring a store record" in out, out


def test_a_forged_join_request_is_ignored(scenario_b):
    job, codes, forged = scenario_b
    assert forged, "the forger never ran"
    fake = forged[0]
    for r in (0, 1, 2):
        assert all(fake not in rec["members"] for rec in job.outer(r).values())
    assert any(f"ignoring node {fake}: its join request is not signed" in line
               for r in (0, 1, 2) for _, line in job.lines[r])


# -- scenario C: a node alive but too slow is evicted at the barrier and joins again ------------------


@pytest.fixture(scope="module")
def scenario_c(tmp_path_factory):
    """2 nodes, barrier timeout 2 s. Node 1 stalls 5 s in its inner steps (its heartbeat goes on): node 0
    evicts it at the barrier and trains alone; node 1 finds itself evicted, downloads the state and is
    admitted again."""
    seed = random.randrange(1000)
    print(f"seed {seed}")
    job = Job(tmp_path_factory.mktemp("c"), initial=2, steps=STEPS_C, seed=seed,
              extra=["--elastic.barrier_timeout_s", "2"])
    # node 0 pauses too (at step 22, alone by then): the run must not end before node 1 is back
    job.start(0, env={"PRIME_FAULTS": "train.before_step@22=stall:5"})
    job.start(1, env={"PRIME_FAULTS": "train.before_step@13=stall:5"})
    try:
        codes = job.wait()
    finally:
        job.stop()
    print(f"node logs under {job.tmp}")
    yield job, codes


STEPS_C = 80


def test_a_slow_node_is_evicted_at_the_barrier_and_rejoins(scenario_c):
    job, codes = scenario_c
    assert codes == {0: 0, 1: 0}, job.text(0) + job.text(1)
    plan = next(r for r in job.records(0, "membership") if r.get("event") == "plan")
    assert plan["k"] == 3 and plan["members"] == [0], plan
    assert "missed the outer-step barrier" in plan["evicted"][0][1], plan
    ev = next(r for r in job.records(1, "membership") if r.get("event") == "evicted")
    assert ev["k"] == 3
    joined = next(r for r in job.records(1, "membership") if r.get("event") == "joined")
    k = joined["outer_step"]
    assert job.outer(0)[k]["members"] == [0, 1] and job.outer(0)[k]["joined"] == [1]
    assert job.outer(1)[k]["digest"] == job.outer(0)[k]["digest"]
    assert _assert_identical(job, [0, 1]) >= STEPS_C // INNER - k
    # node 1 continued from the job's step, not from where it stalled
    steps1 = [r["step"] for r in job.records(1, "step")]
    assert steps1 == sorted(set(steps1)) and steps1[-1] == STEPS_C
    assert joined["inner_step"] == k * INNER and (k * INNER + 1) in steps1


# -- time phases: a straggler does not hold the others past the grace window ------------------------


def test_in_time_phases_a_straggler_is_left_out_after_the_grace_window_and_rejoins(tmp_path):
    """diloco.phase = time, 3 nodes, phases of 2 s, a grace window (elastic.barrier_timeout_s) of 1.5 s; node 1's
    inner steps take 2x their time, so node 0 trains more of them in every phase and weighs more. Node 2 stalls
    6 s (3 phases) inside an inner step: nodes 0 and 1 wait for it no longer than the grace window, average
    without it (their counts only), and node 2 is admitted again; every outer step the nodes share has the same
    digest and the same counts, and the run ends with the same weights on all 3."""
    seed = random.randrange(1000)
    print(f"seed {seed}")
    grace = 1.5
    job = Job(tmp_path, initial=3, steps=60, seed=seed,
              extra=["--diloco.inner_steps", "10", "--diloco.phase", "time", "--diloco.phase_seconds", "2",
                     "--elastic.barrier_timeout_s", str(grace)])
    job.start(0)
    job.start(1, args=["--train.slowdown", "2"])
    job.start(2, env={"PRIME_FAULTS": "train.before_step@15=stall:6"})
    try:
        codes = job.wait()
    finally:
        job.stop()
    assert codes == {0: 0, 1: 0, 2: 0}, job.text(0) + job.text(1) + job.text(2)
    plan = next(r for r in job.records(0, "membership") if r.get("event") == "plan" and r.get("evicted"))
    assert plan["members"] == [0, 1] and plan["evicted"][0][0] == 2, plan
    assert "missed the outer-step barrier" in plan["evicted"][0][1], plan
    k = plan["k"]
    left_out = job.outer(0)[k]
    assert left_out["node_steps"] == job.outer(1)[k]["node_steps"] and len(left_out["node_steps"]) == 2, left_out
    assert left_out["wait_s"] < grace + 2.0, left_out  # held for the grace window, not the ring's 60 s
    for step, rec in job.outer(0).items():  # the counts travel with the average: every member logs the same
        assert all(job.outer(r).get(step, rec)["node_steps"] == rec["node_steps"] for r in (1, 2)), step
        assert abs(sum(rec["node_weights"]) - 1) < 1e-9
    first = job.outer(0)[1]["node_steps"]
    assert first[0] > 1.4 * first[1], first  # node 1 is 2x slower: about half of node 0's inner steps
    joined = next(r for r in job.records(2, "membership") if r.get("event") == "joined")
    assert joined["outer_step"] > k
    assert _assert_identical(job, [0, 1, 2]) >= 1
    finals = {r: re.search(r"final weights identical on all (\d+) nodes: blake2b (\w+)", job.text(r)) for r in (0, 1, 2)}
    assert all(m and m.group(1) == "3" for m in finals.values()), finals
    assert len({m.group(2) for m in finals.values()}) == 1


# -- scenario D: a download slower than a round converges (the joiner listens meanwhile) -------------


STEPS_D = 220
HOLD_D = 200  # the members wait here until the joiner is in: on a fast machine the job would end first. The joiner
# must be admitted at an outer step before this one (the members wait before its inner steps): its second download
# (~3.4 s) starts near step 60 and needs well under the ~140 steps left (with HOLD_D = 100 a fast, lightly loaded
# machine ran the 40 steps before it in 3.5 s, the joiner came to be admitted exactly at the held outer step, and
# the members were evicted after the barrier's 60 s)


def test_a_join_whose_download_is_slower_than_a_round_converges(tmp_path):
    """2 nodes serve their state at 32 Mbit/s (the 13 MiB state of the tiny model: about 3.4 s, several rounds).
    The joiner's first download is stale when it ends; it joins as a listener - a member that takes part
    in every round with zeros - while it downloads again, then applies the averages it received meanwhile:
    admitted with the members' bits (digests), and the run ends with the same final weights on all 3."""
    seed = random.randrange(1000)
    print(f"seed {seed}")
    release = tmp_path / "release"
    job = Job(tmp_path, initial=2, steps=STEPS_D, seed=seed,
              extra=["--elastic.transfer_max_rate_mbit", "32", "--elastic.transfer_timeout_s", "30"])
    joined_file = tmp_path / "joined"
    # the job waits at step 12 until the joiner runs, and at HOLD_D until it joined (a slow machine never waits there)
    hold = f"train.before_step@12=hold:{release},train.before_step@{HOLD_D}=hold:{joined_file}"
    job.start(0, env={"PRIME_FAULTS": hold})
    job.start(1, env={"PRIME_FAULTS": hold})
    try:
        job.wait_line(0, r"holding at inner step 12")
        job.start(2)
        job.wait_line(2, r"registered as joiner")
        release.write_text("")
        job.wait_line(2, r"joined at outer step", timeout=240)
        joined_file.write_text("")
        codes = job.wait(timeout=300)
    finally:
        job.stop()
    text = job.text(2)
    assert codes == {0: 0, 1: 0, 2: 0}, job.text(0) + text
    assert "joining as a listener" in text, text
    dl = next(r for r in job.records(2, "membership") if r.get("event") == "downloaded" and "missed" in r)
    # the job committed outer steps during the download (it took longer than a round): the joiner applied
    # the averages of those, received as a listener
    assert dl["missed"] and dl["missed"] == list(range(dl["outer_step"] + 1, dl["missed"][-1] + 1)), dl
    assert any(r.get("event") == "stale" for r in job.records(2, "membership"))
    joined = next(r for r in job.records(2, "membership") if r.get("event") == "joined")
    k = joined["outer_step"]
    assert k == dl["missed"][-1] + 1, (k, dl)
    o0, o2 = job.outer(0), job.outer(2)
    assert o2[k]["digest"] == o0[k]["digest"] and o0[k]["members"] == [0, 1, 2]
    assert _assert_identical(job, [0, 1, 2]) >= 1
    finals = {r: re.search(r"final weights identical on all (\d+) nodes: blake2b (\w+)", job.text(r)) for r in (0, 1, 2)}
    assert all(m and m.group(1) == "3" for m in finals.values()), finals
    assert len({m.group(2) for m in finals.values()}) == 1


# -- the average is over the nodes that contributed (API level, nodes as threads) -------------------


class _ApiNode:
    """One elastic node of the API test: prime.DiLoCo over an ElasticSync, no inner optimizer."""

    def __init__(self, model, sync, **diloco):
        from prime.diloco import DiLoCo

        self.model, self.sync, self.node_id = model, sync, sync.node_id
        self.diloco = DiLoCo(model, None, sync, inner_steps=1, codec="none", measure_compression_error=False,
                             **diloco)
        self.outer, self.momentum = self.diloco.state.outer, self.diloco.state.momentum

    def start(self):
        self.sync.start(self.diloco.outer_step, self.diloco.inner_step)

    def join(self):
        return self.diloco.sync()  # a joiner's first outer step downloads the state and is admitted

    def step(self):
        return self.diloco.step()

    def close(self):
        self.diloco.close()
        self.sync.close()


def _api_node(port: int, rank: int, initial: int, w0: torch.Tensor, **diloco):
    """An elastic node around a bias-free Linear whose weights start at w0 (exact codec, 1 s heartbeats)."""
    import torch.distributed as dist

    from prime.elastic import ElasticSync, Membership

    def factory():
        return dist.PrefixStore("api/elastic", dist.TCPStore("127.0.0.1", port, is_master=False))

    model = torch.nn.Linear(w0.shape[1], w0.shape[0], bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    m = Membership(factory, node_rank=rank, initial_nodes=initial, run_id="api", secret=b"api-secret",
                   heartbeat_interval_s=0.2, heartbeat_timeout_s=HB_TIMEOUT, barrier_timeout_s=60,
                   report_timeout_s=30)
    return _ApiNode(model, ElasticSync(m, ring_timeout_s=RING_TIMEOUT, start_timeout_s=30), **diloco)


def _run_threads(fns) -> list:
    out, errs = [None] * len(fns), []

    def call(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # surfaced below
            errs.append(e)

    ts = [threading.Thread(target=call, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    assert not any(t.is_alive() for t in ts), "a node hung"
    return out


def _expected(outer: torch.Tensor, momentum: torch.Tensor, deltas: list) -> torch.Tensor:
    """The outer step in float64: mean of the contributors' pseudo-gradients, Nesterov (lr 0.7, mu 0.9)."""
    avg = torch.stack([d.double() for d in deltas]).mean(0)
    m = 0.9 * momentum.double() + avg
    return outer.double() - 0.7 * (avg + 0.9 * m)


def test_the_average_is_over_the_nodes_that_contributed():
    """3 nodes average; one leaves, 2 average; a joiner takes part without contributing, 2 average.
    Checked against float64 references, and the joiner ends bit-identical to the others."""
    import torch.distributed as dist

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    w0 = torch.randn(24, 40, generator=gen)
    nodes = _run_threads([lambda r=r: _api_node(store.port, r, 3, w0) for r in range(3)])
    joiner = None
    try:
        for n in nodes:
            n.start()

        def outer_step(active):
            """Moves each active node's weights by its own random delta, runs the outer step, checks it."""
            ref_outer, ref_mom = active[0].outer.clone(), active[0].momentum.clone()
            deltas = []
            for n in active:
                with torch.no_grad():
                    n.model.weight.sub_(torch.randn(w0.shape, generator=gen))
                deltas.append(ref_outer[: w0.numel()].view_as(w0).double() - n.model.weight.detach().double())
            results = _run_threads([n.step for n in active])
            want = _expected(ref_outer[: w0.numel()].view_as(w0), ref_mom[: w0.numel()].view_as(w0), deltas)
            for n in active:
                got = n.outer[: w0.numel()].view_as(w0).double()
                assert torch.allclose(got, want.view_as(w0), rtol=1e-5, atol=1e-5), (got - want.view_as(w0)).abs().max()
                assert torch.equal(n.outer, active[0].outer) and torch.equal(n.momentum, active[0].momentum)
            return results

        r = outer_step(nodes)
        assert r[0].members == [0, 1, 2] and r[0].contributors == 3
        nodes[2].close()  # leaves cleanly: dropped at once, no timeout
        t0 = time.monotonic()
        r = outer_step(nodes[:2])
        assert time.monotonic() - t0 < HB_TIMEOUT, "a clean leave must not wait for the heartbeat timeout"
        assert r[0].members == [0, 1] and r[0].details.evicted == [[2, "left cleanly"]]
        joiner = _api_node(store.port, 5, 3, torch.zeros_like(w0))  # rank 5 >= 3 initial nodes: a joiner
        got = []
        jt = threading.Thread(target=lambda: got.append(joiner.join()), daemon=True)
        jt.start()
        ready = launch_client(store.port, joiner.sync.membership)
        deadline = time.monotonic() + 60
        while not ready.check([f"ready/{joiner.node_id}"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        r = outer_step(nodes[:2])  # the joiner takes part with zeros: the average is still over 2
        jt.join(60)
        assert got and got[0].outer_step == 3
        assert r[0].members == [0, 1, joiner.node_id] and r[0].contributors == 2 and r[0].details.joined == [joiner.node_id]
        assert torch.equal(joiner.outer, nodes[0].outer) and torch.equal(joiner.momentum, nodes[0].momentum)
        assert torch.equal(joiner.model.weight, nodes[0].model.weight)
        r = _run_threads([n.step for n in (nodes[0], nodes[1], joiner)])  # and then it contributes
        assert r[0].contributors == 3 and torch.equal(joiner.outer, nodes[0].outer)
    finally:
        for n in nodes + ([joiner] if joiner else []):
            n.close()


def test_initial_nodes_that_start_from_different_states_all_stop_at_their_first_outer_step():
    """Node 1 starts from other weights, node 2 with another outer lr: at the first outer step every node
    raises ReplicaMismatchError naming what differs and where, before anything is averaged; the outer
    weights stay as they were. The same nodes started alike average (the check can pass)."""
    import torch.distributed as dist

    from prime.diloco import ReplicaMismatchError

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(8, 12, generator=gen)
    w1 = w0.clone()
    w1[random.randrange(8), random.randrange(12)] += 1e-3
    for differ in (True, False):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        starts = [(w0, 0.7), (w1, 0.7), (w0, 0.5)] if differ else [(w0, 0.7)] * 3
        nodes = _run_threads([lambda r=r, w=w, lr=lr: _api_node(store.port, r, 3, w, outer_lr=lr)
                              for r, (w, lr) in enumerate(starts)])
        try:
            for n in nodes:
                n.start()
            before = [n.outer.clone() for n in nodes]
            for n in nodes:
                with torch.no_grad():
                    n.model.weight.sub_(torch.randn(w0.shape, generator=gen))
            got = [None] * 3

            def step(i):
                try:
                    got[i] = nodes[i].step()
                except ReplicaMismatchError as e:
                    got[i] = e

            _run_threads([lambda i=i: step(i) for i in range(3)])
        finally:
            for n in nodes:
                n.close()
        if not differ:
            assert all(r.members == [0, 1, 2] and r.contributors == 3 for r in got), got
            assert torch.equal(nodes[0].outer, nodes[1].outer) and torch.equal(nodes[0].outer, nodes[2].outer)
            continue
        assert all(isinstance(e, ReplicaMismatchError) for e in got), got
        weights = {0: [1], 1: [0, 2], 2: [1]}  # node 2's weights are node 0's
        settings = {0: [2], 1: [2], 2: [0, 1]}
        for i, e in enumerate(got):
            msg = str(e)
            assert msg.startswith(f"node {i}: at outer step 1, the first since the start"), msg
            assert f"outer weights differ from node(s) {weights[i]}" in msg, msg
            assert f"outer step) differ from node(s) {settings[i]}" in msg, msg
            assert "sizes differ" not in msg and "per node differ" not in msg, msg
            assert torch.equal(nodes[i].outer, before[i])


def test_a_joiner_admitted_where_the_initial_nodes_differ_stops_with_them():
    """Two initial nodes whose weights differ, and a joiner ready before their first outer step: the plan of
    that step admits it, and it stops with the initial nodes, naming their difference, instead of going on to a
    ring that nobody else forms."""
    import torch.distributed as dist

    from prime.diloco import ReplicaMismatchError

    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    w0 = torch.randn(8, 12, generator=gen)
    w1 = w0.clone()
    w1[random.randrange(8), random.randrange(12)] -= 1e-3
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = _run_threads([lambda r=r, w=w: _api_node(store.port, r, 2, w) for r, w in enumerate([w0, w1])])
    joiner = None
    try:
        for n in nodes:
            n.start()
        joiner = _api_node(store.port, 5, 2, torch.zeros_like(w0))
        got = [None] * 3

        def run(i, fn):
            try:
                got[i] = fn()
            except ReplicaMismatchError as e:
                got[i] = e

        jt = threading.Thread(target=run, args=(2, joiner.join), daemon=True)
        jt.start()
        ready = launch_client(store.port, joiner.sync.membership)
        deadline = time.monotonic() + 60
        while not ready.check([f"ready/{joiner.node_id}"]):
            assert time.monotonic() < deadline, "the joiner never became ready"
            time.sleep(0.05)
        _run_threads([lambda i=i: run(i, nodes[i].step) for i in range(2)])
        jt.join(60)
        assert not jt.is_alive(), "the joiner hung"
        assert all(isinstance(e, ReplicaMismatchError) for e in got), got
        assert str(got[2]).startswith(f"node {joiner.node_id}: at outer step 1, which admits this node, the initial "
                                      "nodes' states differ: against node 0's, outer weights differ from node(s) [1]")
        assert "outer weights differ from node(s) [1]" in str(got[0]) and "from node(s) [0]" in str(got[1])
    finally:
        for n in nodes + ([joiner] if joiner else []):
            n.close()


def test_start_mismatches_names_each_kind_of_difference():
    """The comparison on its own: per process (local rank) of a node, sizes, settings and weights."""
    from prime.elastic.agreement import start_mismatches

    rng = random.Random()
    mine = [[rng.getrandbits(64), rng.getrandbits(64), rng.randrange(1, 1 << 40)] for _ in range(2)]

    def changed(g, j):
        other = [list(f) for f in mine]
        other[g][j] ^= 1 << rng.randrange(40)
        return other

    assert start_mismatches(mine, {3: [list(f) for f in mine], 5: [list(f) for f in mine]}) == []
    assert start_mismatches(mine, {3: changed(1, 0), 5: mine}) == ["outer weights differ from node(s) [3]"]
    assert start_mismatches(mine, {3: changed(0, 1), 4: changed(1, 1)}) == [
        "settings (inner_steps, outer lr/momentum, codec, shapes, outer step) differ from node(s) [3, 4]"]
    assert start_mismatches(mine, {3: changed(0, 2), 4: mine[:1], 6: "junk"}) == [
        "processes per node differ from node(s) [4, 6]", "shard sizes differ from node(s) [3]"]


def test_start_mismatches_names_the_nodes_that_do_not_check():
    """A node whose diloco.check_replicas is false sends UNCHECKED: where some nodes check and some do not,
    every node's comparison names both sets; where none checks, nothing differs."""
    from prime.elastic.agreement import UNCHECKED, start_mismatches

    rng = random.Random()
    mine = [[rng.getrandbits(64), rng.getrandbits(64), rng.randrange(1, 1 << 40)]]
    line = "diloco.check_replicas is false on node(s) [2, 5] and true on node(s) [0, 3]: set it alike on every node"
    assert start_mismatches(mine, {2: UNCHECKED, 3: mine, 5: UNCHECKED}, me=0) == [line]
    assert start_mismatches(UNCHECKED, {0: mine, 3: mine, 5: UNCHECKED}, me=2) == [line]
    assert start_mismatches(UNCHECKED, {0: UNCHECKED, 3: UNCHECKED}, me=2) == []
    other = [[mine[0][0] ^ 1, *mine[0][1:]]]
    assert start_mismatches(mine, {3: other}, me=0) == ["outer weights differ from node(s) [3]"]


def test_an_initial_node_that_does_not_check_replicas_stops_the_launch_with_the_others(tmp_path):
    """Node 1 runs with diloco.check_replicas = false, node 0 with the default: instead of node 0 checking
    alone (and node 1 never compared), both stop with status 3 at outer step 1 and say to set it alike."""
    for r, line in _first_outer_step_stops(tmp_path, ["--diloco.check_replicas", "false"]).items():
        assert "diloco.check_replicas is false on node(s) [1] and true on node(s) [0]" in line, line


def _first_outer_step_stops(tmp_path, node1_args: list) -> dict:
    """Two prime.train processes, node 1 with node1_args: both must exit 3 at outer step 1, before anything
    was averaged. Returns each node's line that says why."""
    job = Job(tmp_path, initial=2, steps=4 * INNER, seed=5)
    try:
        job.start(0)
        job.start(1, args=node1_args)
        codes = job.wait(120)
    finally:
        job.stop()
    assert codes == {0: 3, 1: 3}, "\n".join(job.text(r) for r in (0, 1))
    lines = {}
    for r in (0, 1):
        _, lines[r] = job.wait_line(r, r"at outer step 1, the first since the start", timeout=1)
        assert all(o.get("outer_step", 0) < 1 for o in job.records(r, "outer")), job.records(r, "outer")
    return lines


def test_an_initial_node_with_another_seed_stops_the_launch_at_the_first_outer_step(tmp_path):
    """Two prime.train processes whose initial weights differ (another --train.seed): both stop with status 3
    at outer step 1, naming each other, instead of training apart and finding out at the end."""
    for r, line in _first_outer_step_stops(tmp_path, ["--train.seed", "6"]).items():
        assert f"outer weights differ from node(s) [{1 - r}]" in line, line
        assert "settings (inner_steps" not in line, line


# -- the state transfer alone (in-process) -------------------------------------------------------


def _served_state(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n // 3 + 5, generator=g)]


def test_transfer_copies_the_state_exactly_and_survives_an_update_in_flight():
    """A download keeps the state it started with when the server's tensors change mid-way (retract()),
    lands bit for bit, and a second joiner then gets the new state."""
    from prime.elastic import StateServer, fetch_state, state_digest
    from prime.elastic.transfer import PIECE

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    parts = _served_state(seed, 3 * PIECE // 4 + 123)  # several pieces, a partial last one
    old = [p.clone() for p in parts]
    total = sum(p.numel() * 4 for p in parts)
    server = StateServer(b"k" * 32, "job", 0, max_rate=total / 1.0)  # ~1 s per download
    try:
        server.publish(7, parts, {"inner_step": 70})
        dst, got = [torch.zeros_like(p) for p in parts], []
        t = threading.Thread(target=lambda: got.append(fetch_state(
            dst, lambda: [(0, server.address)], secret=b"k" * 32, job="job", my_id=1,
            check_meta=lambda meta: None, timeout_s=10)), daemon=True)
        t.start()
        time.sleep(0.3)
        server.retract()  # an outer step: the tensors change under the download
        assert server.stats.frozen_copies == 1, "the download was not in flight"
        for p in parts:
            p.mul_(-2.0)
        server.publish(8, parts, {"inner_step": 80})
        t.join(30)
        assert got and got[0].step == 7 and got[0].meta["inner_step"] == 70
        assert all(torch.equal(a, b) for a, b in zip(dst, old))
        assert got[0].digest == state_digest(old) != state_digest(parts)
        dst2 = [torch.zeros_like(p) for p in parts]
        r = fetch_state(dst2, lambda: [(0, server.address)], secret=b"k" * 32, job="job", my_id=2,
                        check_meta=lambda meta: None, timeout_s=10)
        assert r.step == 8 and all(torch.equal(a, b) for a, b in zip(dst2, parts))
    finally:
        server.close()


def test_transfer_refuses_a_wrong_secret_and_another_config():
    from prime.elastic import StateServer, TransferError, fetch_state

    parts = _served_state(1, 1000)
    server = StateServer(b"right", "job", 0)
    try:
        server.publish(1, parts, {"settings": {"numel": 1000}})
        dst = [torch.zeros_like(p) for p in parts]
        with pytest.raises(TransferError) as e:
            fetch_state(dst, lambda: [(0, server.address)], secret=b"wrong", job="job", my_id=1,
                        check_meta=lambda meta: None, timeout_s=5)
        assert e.value.kind == "auth" and "secret" in str(e.value)
        assert all(not d.any() for d in dst)
        deadline = time.monotonic() + 5  # the server's thread notes the rejection when it sees the hang-up
        while server.stats.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats.rejected == 1 and server.stats.bytes_sent == 0
        with pytest.raises(TransferError) as e:
            fetch_state(dst, lambda: [(0, server.address)], secret=b"right", job="job", my_id=1,
                        check_meta=lambda meta: "numel differs", timeout_s=5)
        assert e.value.kind == "mismatch"
    finally:
        server.close()


def test_a_joiner_backs_off_a_refused_source_and_takes_one_that_answers():
    """A dead source stays listed until its heartbeat times out: the joiner asks it again only after a
    growing pause (not every few ms), and downloads from a live source as soon as one is listed."""
    import socket

    from prime.elastic import StateServer, fetch_state

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    parts = _served_state(seed, 5000)
    server = StateServer(b"k" * 32, "job", 1)
    dead = socket.create_server(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nobody listens there any more: connection refused, as from a killed node
    try:
        server.publish(3, parts, {})
        t0 = time.monotonic()

        def sources():
            live = [(1, server.address)] if time.monotonic() - t0 > 1.0 else []
            return [(0, f"127.0.0.1:{port}")] + live

        dst = [torch.zeros_like(p) for p in parts]
        r = fetch_state(dst, sources, secret=b"k" * 32, job="job", my_id=0, check_meta=lambda meta: None,
                        timeout_s=10)
        assert r.step == 3 and all(torch.equal(a, b) for a, b in zip(dst, parts))
        assert r.segments == [[1, 0, r.total_bytes]], r.segments
        assert all(f.startswith("node 0: ") and "refused" in f for f in r.failures), r.failures
        # pauses of 0.1, 0.2, 0.4 s... before node 1 shows up after 1 s: about 4 tries, not one every few ms
        assert 2 <= len(r.failures) <= 6, r.failures
    finally:
        server.close()


def _membership(port: int, rank: int, initial: int, secret: bytes = b"m-secret"):
    import torch.distributed as dist

    from prime.elastic import Membership

    def factory():
        return dist.PrefixStore("m/elastic", dist.TCPStore("127.0.0.1", port, is_master=False))

    return Membership(factory, node_rank=rank, initial_nodes=initial, run_id="m", secret=secret,
                      heartbeat_interval_s=0.2, heartbeat_timeout_s=HB_TIMEOUT, barrier_timeout_s=60)


def test_a_joiner_stops_at_once_when_the_job_committed_its_last_outer_step():
    """After the last outer step there is nothing left to be admitted at: a joiner stops (JobFinished)
    instead of downloading a state that no outer step will take it in with."""
    import torch.distributed as dist

    from prime.elastic import JobFinished

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launch = HandLaunch(store.port, "m", b"m-secret")
    raw = launch.records  # nodes 0 and 1, written by hand
    for i in (0, 1):
        raw.put(f"hb/{i}", {"node": i, "seq": 1, "left": False})
        raw.put(f"addr/{i}", f"127.0.0.1:{1000 + i}")
    m = _membership(store.port, 5, 2)
    m.register()
    try:
        def commit(k):
            raw.put("members", {"k": k, "members": [0, 1], "step": k * INNER, "time": 0.0,
                                "slots": {"0": 0, "1": 1}})

        commit(15)
        assert [i for i, _ in m.live_sources(16 * INNER)] == [0, 1]
        commit(16)
        with pytest.raises(JobFinished):
            m.live_sources(16 * INNER)
        with pytest.raises(JobFinished):
            m.await_admission(16, 16 * INNER, timeout_s=5)
        assert [i for i, _ in m.live_sources(None)] == [0, 1]  # an open-ended job goes on
    finally:
        m.leave()
        launch.close()


def test_a_node_evicted_at_a_retry_does_not_take_part_in_an_attempt_already_decided():
    """Node 2 was a member of attempt 0 of outer step 5, which failed, and was left out of attempt 1. Waiting
    to be admitted again after its download, it finds attempt 0's plan with itself in it: that attempt is over
    (its outcome is written), and the node waits for the next plan that takes it instead of forming attempt
    0's ring again (which its other members formed long ago)."""
    from dataclasses import asdict

    import torch.distributed as dist

    from prime.elastic import Outcome, Plan

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launch = HandLaunch(store.port, "m", b"m-secret")
    signed = launch.records
    for i in (0, 1):
        signed.put(f"hb/{i}", {"node": i, "seq": 1, "left": False})
    node = _membership(store.port, 5, 2)
    node.register()
    try:
        k, me = 5, node.node_id
        both = Plan(k=k, attempt=0, members=[0, me], contributors=[0, me], slots={"0": 0, str(me): 1},
                    step=k * INNER)
        signed.put(f"b/{k}/a0/plan", asdict(both))
        signed.put(f"b/{k}/a0/outcome", asdict(Outcome(k=k, attempt=0, commit=False, members=[0],
                                                       failed={str(me): "closed"}, by=0)))
        signed.put(f"b/{k}/a1/plan", asdict(Plan(k=k, attempt=1, members=[0], contributors=[0], slots={"0": 0},
                                                 step=k * INNER, evicted=[[me, "blamed"]])))
        signed.put(f"b/{k}/a1/outcome", asdict(Outcome(k=k, attempt=1, commit=False, members=[0],
                                                       failed={"0": "retry"}, by=0)))
        again = Plan(k=k, attempt=2, members=[0, me], contributors=[0], slots={"0": 0, str(me): 1},
                     step=k * INNER, joined=[me])
        signed.put(f"b/{k}/a2/plan", asdict(again))
        got = node.await_admission(k - 1, None, timeout_s=10)
        assert got is not None and got.attempt == 2 and got.joined == [me], got
    finally:
        node.leave()
        launch.close()


def test_a_joiner_this_node_never_saw_is_not_dead_before_a_sweep_could_see_it():
    """A joiner that began to beat just after this node's last heartbeat sweep, admitted at once: this node's
    monitor has never seen it, yet the ring must not give up on it as dead (Monitor.expect)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = _membership(store.port, 0, 1)
    m.register(start_timeout_s=5)
    try:
        time.sleep(HB_TIMEOUT + 0.3)
        assert m.gone(9), "an id never seen counts as silent since the monitor started"
        m.monitor.expect([0, 9])
        assert not m.gone(9)
        time.sleep(HB_TIMEOUT + 0.3)
        assert m.gone(9), "a member that never beats is dead a heartbeat timeout after it was expected"
    finally:
        m.leave()


def test_a_joiner_ready_during_a_failed_attempt_takes_part_in_the_retry():
    """Outer step 5, attempt 0 with nodes [0, 1] fails (node 1 died). A joiner that became ready with the
    state after outer step 4 meanwhile is admitted in attempt 1 (taking the free data slot), not left to
    download the job's next state; a join request signed with another secret is not."""
    import hashlib
    import hmac

    import torch.distributed as dist

    from dataclasses import asdict

    from prime.elastic import Outcome, Plan

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launch = HandLaunch(store.port, "m", b"m-secret")  # node 0 enters it (the test's thread answers its ask)
    raw = launch.records.store
    signed = launch.records  # node 1 and the decisions of attempt 0, written by hand
    signed.put("hb/1", {"node": 1, "seq": 1, "left": False})
    m = _membership(store.port, 0, 2)
    m.register(start_timeout_s=5)
    joiner = _membership(store.port, 7, 2)
    joiner.register()
    fake = 2 + int(raw.add("joiners", 1)) - 1
    raw.add(f"hb/{fake}", 1)
    try:
        assert joiner.node_id == 2 and fake == 3
        # Node 0's monitor sees the joiner beat before the coordinator looks for offers: one it never saw counts
        # as silent since the monitor started, which a slow store connect (a reverse DNS lookup on some
        # machines) can put more than the heartbeat timeout back.
        deadline = time.monotonic() + 10
        while not m.monitor.was_seen(2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.monitor.was_seen(2)
        k = 5
        prev = Plan(k=k, attempt=0, members=[0, 1], contributors=[0, 1], slots={"0": 0, "1": 1}, step=k * INNER)
        signed.put(f"b/{k}/a0/plan", asdict(prev))
        joiner.set_ready(k - 1)
        raw.wait([f"ready/{joiner.node_id}"])  # on the store before the coordinator reads the offers once
        mac = hmac.new(b"not-the-secret", f"m|ready|{fake}|{k - 1}".encode(), hashlib.sha256).hexdigest()
        landed_set(raw, f"ready/{fake}", json.dumps({"outer_step": k - 1, "mac": mac}))
        outcome = Outcome(k=k, attempt=0, commit=False, members=[0], failed={"0": "connection to rank 1 lost"},
                          missing=[[1, "did not report attempt 0"]])
        signed.put(f"b/{k}/a0/outcome", asdict(outcome))
        planned = []

        def stop_at_the_plan(p):
            planned.append(p)
            raise InterruptedError

        with pytest.raises(InterruptedError):
            m.attempt(k, 1, prev=prev, prev_outcome=outcome, step=k * INNER, since=time.monotonic(),
                      allreduce=stop_at_the_plan)
        plan = planned[0]
        assert plan.attempt == 1 and plan.members == [0, 2], plan
        assert plan.contributors == [0] and plan.joined == [2] and plan.slot_of(2) == 1, plan
        got = joiner.await_admission(k - 1, None, timeout_s=10)  # the joiner's side finds the retry's plan
        assert got is not None and got.attempt == 1 and got.members == [0, 2]
    finally:
        joiner.leave()
        m.leave()
        launch.close()


# -- chaos (long; PRIME_CHAOS=1) ------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("PRIME_CHAOS") != "1", reason="long chaos run: set PRIME_CHAOS=1")
def test_chaos(tmp_path):
    """prime-simulate --elastic --chaos: nodes killed and started at random for PRIME_CHAOS_SECONDS (180);
    PRIME_CHAOS_SEED replays a run (the seed is printed).

    Training never stops (no gap between two outer steps longer than the failure timeouts allow), the
    loss goes down, and every pair of nodes that committed an outer step holds the same bits after it."""
    seconds = float(os.environ.get("PRIME_CHAOS_SECONDS", "180"))
    seed = int(os.environ.get("PRIME_CHAOS_SEED") or random.randrange(1 << 16))
    print(f"chaos seed {seed} (replay: PRIME_CHAOS=1 PRIME_CHAOS_SEED={seed})")
    out = str(tmp_path / "metrics")
    args = QUICK + ["--train.steps", "1000000", "--metrics.out_dir", out, "--metrics.log_every", "5",
                    "--optim.lr", "1e-3", *shlex.split(os.environ.get("PRIME_CHAOS_ARGS", ""))]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PRIME_RING_SECRET=SECRET)
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "3", "--elastic", "--chaos", str(seconds),
           "--chaos-seed", str(seed), "--chaos-min-nodes", "1", "--chaos-every", "8",
           "--stop-after", str(seconds + 30), "--", *args]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=seconds + 300)
    with open(tmp_path / "simulate.log", "w") as f:
        f.write(p.stdout + p.stderr)
    print(f"log: {tmp_path / 'simulate.log'}")
    assert p.returncode == 0, f"chaos seed {seed}: " + (p.stdout + p.stderr)[-5000:]
    assert f"seed {seed}" in p.stdout
    # SIGKILLs from outside, and deaths inside an all-reduce (fault point allreduce.inside)
    kills = p.stdout.count("with SIGKILL") + p.stdout.count("died from its fault point")
    joins = p.stdout.count("(joiner) at step")
    assert kills >= 2 and joins >= 2, (kills, joins)
    outer: dict[int, dict] = {}
    losses: dict[int, list] = {}
    times = []
    for name in os.listdir(out):
        if not name.startswith("metrics_node"):
            continue
        with open(os.path.join(out, name)) as f:
            lines = [line for line in f.read().split("\n") if line]
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                # only the last line, of a node SIGKILLed while it wrote it, may be cut short
                assert i == len(lines) - 1, f"chaos seed {seed}: {name} line {i + 1} is not JSON: {line[:200]!r}"
        for r in records:
            if r["kind"] == "outer":
                # the digest is of the state after digest_step (with overlap: the average applied at this call)
                if "digest" in r and r.get("digest_step", r["outer_step"]) > 0:  # (overlap: none applied yet)
                    outer.setdefault(r.get("digest_step", r["outer_step"]), {})[r["node"]] = r["digest"]
                times.append((r["outer_step"], r["time"]))
            elif r["kind"] == "step":
                losses.setdefault(r["step"], []).append(r["loss"])
    ks = sorted({k for k, _ in times})
    assert ks == list(range(1, ks[-1] + 1)), "an outer step is missing"
    # every outer step has a digest but the last few, in flight or not yet reported when the run was stopped
    # (with overlap, one per fragment at most)
    missing = [k for k in ks if k not in outer]
    assert all(k > ks[-1] - 8 for k in missing), f"outer steps without a digest: {missing}"
    for k in sorted(outer):
        assert len(set(outer[k].values())) == 1, f"outer step {k}: nodes differ: {outer[k]}"
    first_commit = {}
    for k, t in times:
        first_commit[k] = min(t, first_commit.get(k, t))
    gaps = [first_commit[k + 1] - first_commit[k] for k in ks[:-1]]
    # the slowest outer step may include a heartbeat timeout, a ring timeout and a barrier retry
    assert max(gaps) < HB_TIMEOUT + 2 * RING_TIMEOUT + 15, max(gaps)
    steps = sorted(losses)
    early = [sum(losses[s]) / len(losses[s]) for s in steps[:20]]
    late = [sum(losses[s]) / len(losses[s]) for s in steps[-50:]]
    assert sum(late) / len(late) < sum(early) / len(early) - 1.0, (early[:5], late[-5:])
    print(f"{len(ks)} outer steps, {kills} kills, {joins} joins, largest gap {max(gaps):.1f} s")
