"""Who is in an elastic DiLoCo job: registration, heartbeats, and the decisions taken at every outer step.

Everything lives in the job's TCPStore (the one the rings already use), under
the keys of prime.comm.store_keys, and every record is signed under the job
secret (prime.comm.signed_store): a record someone without the secret wrote
or replayed is ignored. No node is special: any node may write a decision,
and first-writer-wins keys make every node adopt the same one. The node that
normally writes it (the coordinator) is the lowest live id that has arrived;
when it dies, the next one takes over after a grace period.

The module has two halves:

- the decisions, as pure functions of what a node has read (arrivals,
  results, liveness as a View, ready joiners): first_plan_due / propose_first,
  retry_plan_due / propose_retry, most_blamed, outcome_due / decide_outcome,
  reduce_op. They are unit-tested without processes (tests/test_membership.py);
- Membership, the store I/O around them: registration, the heartbeat Monitor,
  and attempt() (one call per attempt of an outer step) and commit(). It holds
  the attempt's store I/O (OuterStepAgreement, prime/elastic/agreement.py) and
  the joins' (Admission, prime/elastic/admission.py).

Clock: liveness is judged on each observer's own monotonic clock (a heartbeat
whose sequence number stopped growing), so the nodes' clocks need not agree.
Wall-clock times appear only in logs.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable, Optional

from prime.comm import store_keys as keys
from prime.comm.signed_store import SignedStore, read_counter
from prime.sync import LeftBehind, OuterSyncError

__all__ = [
    "Membership",
    "Monitor",
    "Plan",
    "Outcome",
    "View",
    "Attempt",
    "Evicted",
    "JobFinished",
    "JoinError",
    "MembershipError",
    "first_plan_due",
    "propose_first",
    "retry_plan_due",
    "propose_retry",
    "most_blamed",
    "outcome_due",
    "decide_outcome",
    "reduce_op",
    "wall",
]

logger = logging.getLogger("prime.elastic")

ENV_SECRET = "PRIME_RING_SECRET"
MAX_JOINERS = 1024
"""Node ids the monitor looks at beyond the initial nodes (the joiner counter is unsigned: a stranger could
inflate it; ids past this are not watched)."""

NEW_IDS_PER_SWEEP = 16
"""Joiner ids without a heartbeat record yet that one sweep of the monitor checks for one (a store round trip
each): the newest half, where a joiner that just registered is, and half of the others in turn. Ids that never
get a record (a joiner that died before its first beat, a counter a stranger inflated) then cost a sweep at most
this many round trips, however many there are."""


def bump(store, key: str) -> int:
    """The store's `add(key, 1)`; a MembershipError that says why when the key holds no number (a stranger wrote
    over the counter, and the server dropped this connection)."""
    try:
        return int(store.add(key, 1))
    except Exception as e:  # DistNetworkError / DistStoreError
        raise MembershipError(f"could not count on store key {key!r} ({e}): a record that is not a number was "
                              "written over the counter (a stranger with access to the store?)") from e


def sample_ids(pending: list, count: int, turn: int) -> tuple[list, int]:
    """(at most `count` of the ascending ids `pending` for one sweep to read, the next sweep's turn): all of them
    when they fit, else the newest half (where a process that just started is) and half of the others from
    position `turn` on, so that ids which never get a record (a counter a stranger inflated) cost a sweep at
    most `count` reads, and every id is read in turn."""
    if len(pending) <= count:
        return pending, turn
    half = count // 2
    rest = pending[:-half]
    start = turn % len(rest)
    return (rest + rest)[start:start + half] + pending[-half:], turn + half


class MembershipError(OuterSyncError):
    """The membership protocol cannot go on (store unreachable, too few nodes, too many failed attempts).

    An OuterSyncError: the outer weights were not changed, and the trainer
    saves a checkpoint and stops (status 3)."""


class Evicted(LeftBehind):
    """This node is not part of the outer step being decided; it must join again (download the state)."""


class JobFinished(Exception):
    """The job reached its last step before this node could be admitted."""


class JoinError(RuntimeError):
    """A node could not join: no peer to download from, a wrong job secret, or another configuration."""


def wall(t: Optional[float] = None) -> str:
    """A wall-clock time for logs: 2026-11-03 12:34:56.789."""
    return datetime.fromtimestamp(time.time() if t is None else t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


@dataclass
class Plan:
    """Who takes part in attempt `attempt` of outer step `k`, and why the others do not."""

    k: int
    attempt: int
    members: list
    """Node ids in ring order (ascending)."""
    contributors: list
    """Members that send a pseudo-gradient; a joiner takes part with zeros and only receives the average."""
    slots: dict
    """Data slot of each member (str(id) -> slot)."""
    step: int
    """Inner step count at this outer step (the same on every contributor)."""
    joined: list = field(default_factory=list)
    """Joiners admitted at this outer step."""
    evicted: list = field(default_factory=list)
    """[id, reason] of every candidate left out."""
    by: int = -1
    """The node that wrote the decision."""
    time: float = 0.0
    """Wall-clock time of the decision (for logs)."""

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        d["slots"] = {str(k): int(v) for k, v in d["slots"].items()}
        return cls(**d)

    def slot_of(self, node: int) -> int:
        return int(self.slots[str(node)])

    def reason_for(self, node: int) -> str:
        for i, why in self.evicted:
            if i == node:
                return why
        return "not among the candidates of this outer step"


@dataclass
class Outcome:
    """How attempt `attempt` of outer step `k` ended."""

    k: int
    attempt: int
    commit: bool
    members: list
    """Nodes that committed (commit) or take part in the next attempt (retry)."""
    failed: dict = field(default_factory=dict)
    """str(id) -> error of members whose all-reduce failed."""
    missing: list = field(default_factory=list)
    """[id, reason] of members that never reported."""
    give_up: str = ""
    """Non-empty: the job cannot go on (the reason)."""
    by: int = -1
    time: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "Outcome":
        return cls(**d)


# -- the decisions (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """What one node knows of the others' liveness at one moment (from its heartbeat monitor)."""

    me: int
    gone: dict = field(default_factory=dict)
    """id -> why, for every node this node holds gone (left cleanly, or silent beyond the timeout)."""
    silent: dict = field(default_factory=dict)
    """id -> seconds since its heartbeat last advanced (missing: 0)."""
    hb_interval: float = 1.0
    hb_timeout: float = 10.0

    def is_gone(self, node: int) -> bool:
        return node != self.me and node in self.gone

    def why_gone(self, node: int) -> str:
        return self.gone.get(node, "alive")

    def silent_s(self, node: int) -> float:
        return 0.0 if node == self.me else float(self.silent.get(node, 0.0))

    def suspect(self, node: int, results: dict) -> bool:
        """Gone, or: a reporter's ring broke on it and its heartbeat has been silent for 3 intervals.

        A killed node resets its TCP connections at once, so its neighbours fail
        within milliseconds and blame it; waiting for the full heartbeat timeout
        would only add latency. A node that is alive keeps beating (its thread
        runs apart from training), so it is not suspected however broken its
        links are: it is retried, then left out as blamed (most_blamed)."""
        if self.is_gone(node):
            return True
        blamed = any(r.get("blame") == node for r in results.values())
        return blamed and self.silent_s(node) > 3 * self.hb_interval

    @property
    def grace_unit(self) -> float:
        """How long each node lets the one before it in line act first."""
        return max(self.hb_timeout, 1.0)


def coordinator_turn(me: int, line: list, waited: float, all_in: bool, timeout: float, grace_unit: float) -> bool:
    """Whether `me` decides now: the first in line once everyone is in (or after `timeout`), the i-th in line
    after timeout + i * grace_unit (the ones before it died meanwhile)."""
    if me not in line:
        return False
    idx = line.index(me)
    return (idx == 0 and (all_in or waited >= timeout)) or waited >= timeout + idx * grace_unit


def _arrived(prev: Plan, arrivals: dict, me: int, step: int) -> dict:
    out = {i: a for i, a in arrivals.items() if i in prev.members}
    out[me] = {**arrivals.get(me, {}), "step": step}
    return out


def first_plan_due(prev: Plan, arrivals: dict, step: int, view: View, waited: float,
                   barrier_timeout: float) -> bool:
    """Whether this node writes the plan of attempt 0 now (see coordinator_turn).

    prev: the committed plan of the previous outer step; arrivals: id -> {"step"} of its members that arrived;
    waited: seconds since this node arrived."""
    arrived = _arrived(prev, arrivals, view.me, step)
    alive = sorted(i for i in arrived if not view.is_gone(i))
    pending = [i for i in prev.members if i not in arrived and not view.is_gone(i)]
    return coordinator_turn(view.me, alive, waited, not pending, barrier_timeout, view.grace_unit)


def propose_first(k: int, prev: Plan, arrivals: dict, step: int, view: View, waited: float,
                  barrier_timeout: float, joiners: list, now: float = 0.0) -> Plan:
    """The plan of attempt 0 of outer step k: the previous members that arrived at the same inner step and
    are alive contribute, except listeners (joiners still downloading, arrival {"listen": true}: they stay
    members and take part with zeros); ready joiners (already checked: alive, signed, holding the state
    after k-1, or listeners) take part with zeros and get free data slots; every other candidate is
    evicted, with the reason."""
    arrived = _arrived(prev, arrivals, view.me, step)
    alive = sorted(i for i in arrived if not view.is_gone(i))
    evicted, contributors, listeners = [], [], []
    for i in prev.members:
        if i in alive:
            continue
        if i not in arrived and not view.is_gone(i):
            evicted.append([i, f"missed the outer-step barrier: not there {waited:.1f} s after node "
                               f"{view.me} arrived (timeout {barrier_timeout:g} s)"])
        else:
            evicted.append([i, view.why_gone(i)])
    for i in alive:
        if int(arrived[i]["step"]) != step:
            evicted.append([i, f"arrived at inner step {arrived[i]['step']}, the others at {step}"])
        elif arrived[i].get("listen") is True:
            listeners.append(i)
        else:
            contributors.append(i)
    joiners = sorted(j for j in joiners if j not in prev.members and j not in contributors)
    slots = {str(i): prev.slot_of(i) for i in contributors + listeners}
    _give_slots(slots, joiners)
    return Plan(k=k, attempt=0, members=sorted(contributors + listeners + joiners), contributors=contributors,
                slots=slots,
                step=step, joined=joiners, evicted=evicted, by=view.me, time=now)


def _give_slots(slots: dict, joiners: list) -> None:
    """Gives each joiner the lowest data slot nobody holds."""
    taken = set(slots.values())
    free = (s for s in range(10 ** 6) if s not in taken)
    for j in joiners:
        slots[str(j)] = next(free)


def retry_plan_due(outcome: Outcome, view: View, waited: float) -> bool:
    """Whether this node writes the plan of a retry now: the first live member of the failed attempt at
    once, the others after their grace."""
    members = [i for i in outcome.members if not view.is_gone(i)]
    return coordinator_turn(view.me, members, waited, True, 0.0, view.grace_unit)


def most_blamed(reports: list, members: list) -> Optional[int]:
    """The member that failure reports name most often (ties: the highest id); None: nobody is blamed.

    reports: the results (id -> {"blame"}) of the two latest attempts. Only a
    second failure with the same members gets here: a transient failure is
    retried once with everyone, a node that keeps breaking the ring (alive,
    but unreachable or broken) is then left out."""
    counts: dict[int, int] = {}
    for results in reports:
        for r in results.values():
            b = r.get("blame", -1)
            if b in members:
                counts[b] = counts.get(b, 0) + 1
    if not counts:
        return None
    return max(counts, key=lambda i: (counts[i], i))


def propose_retry(k: int, attempt: int, prev: Plan, outcome: Outcome, view: View, blame_reports: list,
                  late_joiners: list, now: float = 0.0) -> Plan:
    """The plan of attempt `attempt` (>= 1) of outer step k after `outcome` asked for a retry.

    The live members of the outcome take part; when the same members failed
    again, the one most blamed (blame_reports: results of attempts attempt-2
    and attempt-1, empty for attempt 1) is left out. Joiners that became ready
    meanwhile (holding the state after k-1) take part: the outer state has not
    changed, and otherwise they would find the job one outer step ahead."""
    members = [i for i in outcome.members if not view.is_gone(i)]
    evicted = [[i, view.why_gone(i)] for i in outcome.members if i not in members]
    evicted += [list(x) for x in outcome.missing]
    if set(prev.members) - set(outcome.members) == set() and outcome.failed and blame_reports:
        blamed = most_blamed(blame_reports, members)
        if blamed is not None and len(members) > 1:
            members.remove(blamed)
            evicted.append([blamed, f"blamed by the other nodes for failing attempt {attempt - 1}"])
    slots = {str(i): prev.slot_of(i) for i in members}
    late = sorted(j for j in late_joiners if j not in prev.members and j not in outcome.members)
    _give_slots(slots, late)
    return Plan(k=k, attempt=attempt, members=sorted(members + late),
                contributors=[i for i in prev.contributors if i in members], slots=slots, step=prev.step,
                joined=[i for i in prev.joined if i in members] + late, evicted=evicted, by=view.me, time=now)


def outcome_due(plan: Plan, results: dict, view: View, waited: float, report_timeout: float) -> bool:
    """Whether this node decides the outcome of the attempt now: the first live reporter once every member
    reported or is dead (or after report_timeout), the others after their grace."""
    reporters = sorted(i for i in results if not view.is_gone(i))
    pending = [i for i in plan.members if i not in results and not view.suspect(i, results)]
    return coordinator_turn(view.me, reporters, waited, not pending, report_timeout, view.grace_unit)


def decide_outcome(plan: Plan, results: dict, view: View, waited: float, max_attempts: int, min_nodes: int,
                   now: float = 0.0) -> Outcome:
    """Commit when every member that reported succeeded (and at least one did): a member's all-reduce only
    succeeds after every member's data went through it, so the survivors hold the same average; members
    that did not report are dropped. Otherwise retry with the live reporters, or give up after
    max_attempts or below min_nodes contributors."""
    missing = []
    for i in plan.members:
        if i in results:
            continue
        if view.is_gone(i):
            why = view.why_gone(i)
        elif view.suspect(i, results):
            why = (f"its neighbours lost the connection to it and it has sent no heartbeat for "
                   f"{view.silent_s(i):.1f} s")
        else:
            why = f"no result after {waited:.1f} s"
        missing.append([i, f"did not report attempt {plan.attempt}: {why}"])
    failed = {str(i): r["error"] for i, r in results.items() if not r["ok"]}
    ok = [i for i in plan.members if i in results and results[i]["ok"]]
    base = dict(k=plan.k, attempt=plan.attempt, failed=failed, missing=missing, by=view.me, time=now)
    if not failed and ok:
        return Outcome(commit=True, members=ok, **base)
    alive = [i for i in plan.members if i in results and not view.suspect(i, results)]
    give_up = ""
    if plan.attempt + 1 >= max_attempts:
        give_up = (f"outer step {plan.k} failed {plan.attempt + 1} times (elastic.max_attempts); last errors: "
                   + "; ".join(f"node {i}: {e}" for i, e in failed.items()))
    elif len([i for i in plan.contributors if i in alive]) < min_nodes:
        give_up = (f"only {len(alive)} node(s) left for outer step {plan.k}, fewer than elastic.min_nodes "
                   f"({min_nodes})")
    return Outcome(commit=False, members=alive, give_up=give_up, **base)


def reduce_op(plan: Plan) -> tuple[str, int]:
    """How the members average: (ring op, divisor applied after it).

    Everyone contributes: the ring averages ("avg", 1). Joiners take part with
    zeros: the ring sums and every node divides by the number of contributors
    (one fp32 division, the same bits everywhere), so the average is over the
    contributors, not over the members."""
    if len(plan.contributors) == len(plan.members):
        return "avg", 1
    return "sum", len(plan.contributors)


# -- heartbeats --------------------------------------------------------------------------------------


class Monitor:
    """Liveness of every node, on a thread with its own store connection, and (given `beat_records`, a second
    connection) this node's heartbeat, on a thread of its own: a slow read of the others' records, e.g. of many
    ids a stranger made the joiner counter hand out, never delays this node's beat.

    Every `interval` seconds: write a signed heartbeat record {node, seq, left}
    with the next sequence number (when beating), and read every known node's record
    (SignedStore.get_many: when all are there, a check and a multi_get, three
    round trips to the store whatever the node count; never a long wait). A
    node whose valid records stopped advancing for `timeout` seconds (on this
    node's clock) is dead; one that signed left=True left. A
    node never seen counts from the moment this monitor started. A record that
    is not validly signed, or whose sequence number went back (a replay), is
    ignored: nobody without the secret can keep a dead node alive, evict a live
    one (beyond overwriting its record faster than it beats), or make it leave.
    """

    def __init__(self, records: SignedStore, node_id: int, initial_nodes: int, interval: float, timeout: float,
                 beat_records: Optional[SignedStore] = None, chore: Optional[Callable[[], object]] = None):
        self.beats = beat_records is not None  # False: watch only (a node's other processes: local rank 0 beats)
        self._chore = chore  # more work for the watch thread after each sweep (a member answers launch asks)
        self._records = records
        self._beat_records = beat_records
        self.node_id, self.initial_nodes = node_id, initial_nodes
        self.interval, self.timeout = interval, timeout
        self._lock = threading.Lock()
        self._seq = 0
        self._seen: dict[int, tuple[int, float]] = {}  # id -> (newest seq, monotonic time it advanced)
        self._exists: set[int] = set()
        self._left: set[int] = set()
        self._t0 = time.monotonic()
        self._expected: dict[int, float] = {}  # id never seen -> when it was named a member (expect())
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._beater: Optional[threading.Thread] = None
        self._warned_cap = False
        self._turn = 0  # where the next sweep's look at the older joiner ids without a record starts
        self.last_error: Optional[str] = None

    def _beat(self, left: bool = False) -> None:
        if not self.beats:
            return
        self._seq += 1
        self._beat_records.put(keys.heartbeat(self.node_id), {"node": self.node_id, "seq": self._seq, "left": left})

    def start(self) -> None:
        self._beat()  # the key exists before anyone looks for it
        self._sweep()
        if self.beats:
            self._beater = threading.Thread(target=self._run, args=(self._beat, "heartbeat"),
                                            name=f"prime-elastic-beat-{self.node_id}", daemon=True)
            self._beater.start()
        self._thread = threading.Thread(target=self._run, args=(self._sweep, "reading the heartbeats"),
                                        name=f"prime-elastic-hb-{self.node_id}", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], None], what: str) -> None:
        warned = False
        while not self._stop.wait(self.interval):
            try:
                work()
                if warned:
                    logger.warning("elastic node %d: the store answers again", self.node_id)
                warned = False
                self.last_error = None
            except Exception as e:  # the store may be down; keep trying, say so once
                self.last_error = str(e)
                if not warned:
                    logger.warning("elastic node %d: %s failed (store unreachable?): %s", self.node_id, what, e)
                    warned = True

    def _sweep(self) -> None:
        self.watch()
        if self._chore is not None:
            self._chore()

    def watch(self) -> None:
        """Reads every known node's heartbeat record once."""
        store = self._records.store
        n = self.initial_nodes + read_counter(store, keys.JOINERS)
        if n > self.initial_nodes + MAX_JOINERS:
            if not self._warned_cap:
                self._warned_cap = True
                logger.warning("elastic node %d: the joiner counter says %d nodes; watching only the first %d "
                               "(a stranger inflating the counter?)", self.node_id, n, self.initial_nodes + MAX_JOINERS)
            n = self.initial_nodes + MAX_JOINERS
        for i in self._ids_to_look_for(n):
            if store.check([keys.heartbeat(i)]):
                self._exists.add(i)
        known = sorted(self._exists)
        values = self._records.get_many([keys.heartbeat(i) for i in known]) if known else []
        now = time.monotonic()
        with self._lock:
            for i, v in zip(known, values):
                if v is None:
                    continue
                try:
                    node, seq, left = int(v["node"]), int(v["seq"]), bool(v["left"])
                except (KeyError, TypeError, ValueError):
                    self._records.reject(keys.heartbeat(i), "a signed heartbeat without node, seq and left")
                    continue
                if node != i:
                    self._records.reject(keys.heartbeat(i), f"a heartbeat of node {node} under node {i}'s key")
                    continue
                prev = self._seen.get(i)
                if prev is not None and seq < prev[0]:
                    self._records.reject(keys.heartbeat(i), f"a replayed heartbeat (sequence {seq} after {prev[0]})")
                    continue
                if left:
                    self._left.add(i)
                if prev is None or seq > prev[0]:
                    self._seen[i] = (seq, now)

    def _ids_to_look_for(self, n: int) -> list[int]:
        """The ids below n without a heartbeat record yet that this sweep checks: every initial node's (their
        count is configured), and NEW_IDS_PER_SWEEP of the joiners' (the newest half, and half of the rest in
        turn)."""
        initial = [i for i in range(min(n, self.initial_nodes)) if i not in self._exists]
        joiners, self._turn = sample_ids([i for i in range(self.initial_nodes, n) if i not in self._exists],
                                         NEW_IDS_PER_SWEEP, self._turn)
        return initial + joiners

    def silent_s(self, node: int) -> float:
        """Seconds since node's heartbeat last advanced (since this monitor started, if never seen)."""
        if node == self.node_id:
            return 0.0
        with self._lock:
            prev = self._seen.get(node)
            since = prev[1] if prev else self._expected.get(node, self._t0)
        return time.monotonic() - since

    def expect(self, nodes) -> None:
        """These nodes are members of what this node takes part in now: one this monitor never saw (a joiner
        that began to beat after this monitor's last sweep) counts as silent from now on, not from the
        monitor's start, so that it is not taken for dead before a sweep could see it."""
        now = time.monotonic()
        with self._lock:
            for i in nodes:
                if i not in self._seen:
                    self._expected.setdefault(i, now)

    def left(self, node: int) -> bool:
        with self._lock:
            return node in self._left

    def gone(self, node: int) -> bool:
        """True when the node left cleanly or its heartbeat stopped for longer than the timeout."""
        if node == self.node_id:
            return False
        return self.left(node) or self.silent_s(node) > self.timeout

    def was_seen(self, node: int) -> bool:
        """Whether a valid heartbeat of the node was ever read (a node that signs with another secret never is)."""
        with self._lock:
            return node in self._seen

    def why_gone(self, node: int) -> str:
        if self.left(node):
            return "left cleanly"
        if not self.was_seen(node):
            return f"never sent a valid heartbeat ({self.silent_s(node):.1f} s)"
        return f"no heartbeat for {self.silent_s(node):.1f} s (timeout {self.timeout:g} s)"

    def view(self, ids) -> View:
        """A snapshot of the liveness of `ids` for the decisions."""
        ids = list(ids)
        return View(me=self.node_id, gone={i: self.why_gone(i) for i in ids if self.gone(i)},
                    silent={i: self.silent_s(i) for i in ids}, hb_interval=self.interval, hb_timeout=self.timeout)

    def known_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._exists)

    def stop(self, leave: bool) -> bool:
        """Stops the heartbeat; `leave` tells the others at once that this node exits cleanly. False: could not."""
        self._stop.set()
        for thread in (self._beater, self._thread):
            if thread is not None:
                thread.join(timeout=5 + self.interval)
        if leave:
            try:
                self._beat(left=True)
            except Exception as e:  # the store may be gone already; the others then time us out
                logger.warning("elastic node %d: could not announce the clean exit: %s", self.node_id, e)
                return False
        return True


# -- the store I/O -------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """What one attempt of an outer step gave (Membership.attempt)."""

    plan: Plan
    outcome: Outcome
    ok: bool
    """This node's all-reduce succeeded."""
    error: str
    stats: dict
    planned_at: float
    """Monotonic time at which this node knew the plan."""
    wait_s: float
    """Waiting for the plan."""
    allreduce_s: float


class Membership:
    """One node's view of the membership: registration, heartbeat, and the per-outer-step agreement.

    store_factory() must return a new client of the job's store (already under
    the run's prefix); the membership keeps one for its own calls and gives the
    heartbeat thread another (a store client is not shared between threads).
    secret: the job secret (default $PRIME_RING_SECRET; without either, one is
    drawn into the store, which only a one-host job may do).
    fresh_store: this process made the store (node 0 hosts it): node 0 founds
    its launch at once (prime.elastic.launch).
    """

    def __init__(
        self,
        store_factory: Callable[[], object],
        *,
        node_rank: int,
        initial_nodes: int,
        run_id: str = "prime",
        secret: Optional[bytes] = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        barrier_timeout_s: float = 300.0,
        report_timeout_s: float = 360.0,
        max_attempts: int = 5,
        min_nodes: int = 1,
        log: Optional[Callable[[str], None]] = None,
        record: Optional[Callable[..., None]] = None,
        poll_s: float = 0.02,
        fresh_store: bool = False,
    ):
        if heartbeat_interval_s <= 0 or heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({heartbeat_interval_s}) > 0"
            )
        self._factory = store_factory
        self.store = store_factory()
        self.node_rank, self.initial_nodes, self.run_id = node_rank, initial_nodes, run_id
        self._secret = secret
        self.hb_interval, self.hb_timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.barrier_timeout, self.report_timeout = barrier_timeout_s, report_timeout_s
        self.max_attempts, self.min_nodes = max_attempts, min_nodes
        self._log = log or (lambda msg: logger.info("%s", msg))
        self._record = record
        self.poll_s = poll_s
        self.fresh_store = fresh_store  # node 0's process made the store: no launch of the run can be live there
        self.node_id: int = -1
        self.genesis = False
        self.launch = ""
        """This launch's name (register() or attach()): the records of the launch live under it
        (prime.elastic.launch)."""
        self.monitor: Optional[Monitor] = None
        self.records: Optional[SignedStore] = None
        self.registered_at = 0.0
        self._own_keys: dict[int, list] = {}
        self._latest: Optional[dict] = None
        self.local_rank = 0  # attach() sets it in the other processes of a node
        self.start_fingerprint: Optional[tuple] = None
        """(outer step k, [[weights hash, settings hash, numel] of each process of the node]): an initial node's
        state at its first outer step, sent with its arrival at k and compared with the other members'
        (prime.elastic.agreement; ElasticSync.verify sets it)."""
        # The per-outer-step agreement and the joins, through this membership's store records (imported
        # here: their modules import this one's Plan, Outcome and errors).
        from prime.elastic.admission import Admission
        from prime.elastic.agreement import OuterStepAgreement

        self.agreement = OuterStepAgreement(self)
        self.admission = Admission(self)

    # -- logging ---------------------------------------------------------------

    def log(self, msg: str, **fields) -> None:
        """Prints a membership event (with the wall-clock time) and records it in the metrics."""
        who = f"node {self.node_id}" if self.node_id >= 0 else f"rank {self.node_rank}"  # before it has an id
        self._log(f"elastic [{wall()}] {who}: {msg}")
        if self._record is not None:
            self._record(msg=msg, time=time.time(), **fields)

    @property
    def job(self) -> str:
        """What this launch's records, rings and state transfers are bound to: the run id and the launch's name."""
        from prime.elastic.launch import launch_job

        return launch_job(self.run_id, self.launch) if self.launch else self.run_id

    def _signed(self, store) -> SignedStore:
        return SignedStore(store, self._secret, self.job, warn=lambda msg: self.log(msg, event="reject"))

    def _enter(self, launch: str) -> None:
        """From now on, every store connection of this membership is under launch `launch`'s prefix."""
        import torch.distributed as dist

        prefix, base = keys.launch_prefix(launch), self._factory
        self.launch, self._base_factory = launch, base
        self._factory = lambda: dist.PrefixStore(prefix, base())
        self.store = dist.PrefixStore(prefix, self.store)
        self.records = self._signed(self.store)

    def _find_launch(self, start_timeout_s: float):
        """Takes the live launch's name, or founds one (node rank 0), and enters it; returns what was found
        (prime.elastic.launch.Launch: whether it founded it, its ask index)."""
        import torch.distributed as dist

        from prime.elastic.launch import find_launch, launch_job

        def launch_records(name: str) -> SignedStore:  # on the main thread's connection, as `run` below
            return SignedStore(dist.PrefixStore(keys.launch_prefix(name), self.store), self._secret,
                               launch_job(self.run_id, name), warn=lambda msg: self.log(msg, event="reject"))

        run = SignedStore(self.store, self._secret, self.run_id, warn=lambda msg: self.log(msg, event="reject"))
        found = find_launch(run, launch_records, node_rank=self.node_rank, initial_nodes=self.initial_nodes,
                            interval=self.hb_interval, timeout=self.hb_timeout,
                            wait_s=start_timeout_s + self.hb_timeout, log=self.log, poll_s=self.poll_s,
                            fresh_store=self.fresh_store)
        self._enter(found.name)
        return found

    # -- registration ------------------------------------------------------------

    def register(self, start_timeout_s: float = 60.0) -> int:
        """Claims a node id and starts the heartbeat. Initial nodes wait (up to start_timeout_s) for each other.

        Initial node r (r < initial_nodes) gets id r if nobody claimed it before;
        any other node, a restarted one included, is a joiner with a fresh id.
        """
        self.registered_at = time.monotonic()
        self._secret = self._resolve_secret()
        found = self._find_launch(start_timeout_s)
        if self.node_rank < self.initial_nodes:
            token = secrets.token_hex(8)
            got = self.records.set_first(keys.genesis(self.node_rank), {"rank": self.node_rank, "token": token})
            self.genesis = got.get("token") == token
        if self.genesis:
            self.node_id = self.node_rank
        else:
            self.node_id = self.initial_nodes + bump(self.store, keys.JOINERS) - 1
        # The heartbeat threads warn through the logger only (the metrics writer belongs to the main thread).
        def warn(msg: str) -> None:
            logger.warning("elastic node %d: %s", self.node_id, msg)

        from prime.elastic.launch import LaunchDoor

        watch = self._base_factory()  # the watch thread's connection: it also answers the asks (the run's keys)
        door = LaunchDoor(SignedStore(watch, self._secret, self.run_id, warn=warn), self.launch, since=found.ask,
                          warn=warn)
        self.monitor = Monitor(self._signed_quietly(watch_base=watch, warn=warn), self.node_id, self.initial_nodes,
                               self.hb_interval, self.hb_timeout, beat_records=self._signed_quietly(warn=warn),
                               chore=door.answer)
        self.monitor.start()
        role = "initial node" if self.genesis else "joiner"
        how = "founded" if found.founded else "entered"
        self.log(f"registered as {role} (rank {self.node_rank}, pid {os.getpid()}; {how} launch {self.launch})",
                 event="register", role=role, launch=self.launch, founded=found.founded)
        if self.genesis:
            deadline = time.monotonic() + start_timeout_s
            hb = [keys.heartbeat(i) for i in range(self.initial_nodes)]
            while any(v is None for v in self.records.get_many(hb)) and time.monotonic() < deadline:
                time.sleep(0.05)
            missing = [i for i, v in enumerate(self.records.get_many(hb)) if v is None]
            if missing:
                self.log(f"initial node(s) {missing} did not register within {start_timeout_s:g} s; starting "
                         "without them (they are evicted at the first outer step)", event="start_missing",
                         missing=missing)
        return self.node_id

    def _signed_quietly(self, warn: Callable[[str], None], watch_base=None) -> SignedStore:
        """This launch's records on a new store connection (or on `watch_base`, a connection to the run's keys),
        warning through `warn`: for the heartbeat threads, which must not write the metrics (the main thread's)."""
        import torch.distributed as dist

        store = self._factory() if watch_base is None else dist.PrefixStore(keys.launch_prefix(self.launch),
                                                                             watch_base)
        return SignedStore(store, self._secret, self.job, warn=warn)

    def attach(self, node_id: int, genesis: bool, secret: bytes, launch: str, local_rank: int) -> None:
        """For local rank g > 0 of a node with several processes: the node registered through its local rank
        0 (register()), which beats for it and takes part in every decision. This process only watches the
        heartbeats (to give up on a ring when a member dies), forms ring g and serves shard g."""
        assert local_rank > 0, local_rank
        self.registered_at = time.monotonic()
        self.node_id, self.genesis, self._secret, self.local_rank = node_id, genesis, secret, local_rank
        self._enter(launch)
        self.monitor = Monitor(self._signed_quietly(warn=lambda msg: logger.warning("elastic node %d: %s",
                                                                                    self.node_id, msg)),
                               self.node_id, self.initial_nodes, self.hb_interval, self.hb_timeout)
        self.monitor.start()

    def _resolve_secret(self) -> bytes:
        if self._secret:
            return bytes(self._secret)
        env = os.environ.get(ENV_SECRET)
        if env:
            return env.encode()
        # Nobody configured one: the first node draws it and shares it through the store. Then anyone
        # who can read the store can join, so only a job whose store and addresses are all on loopback may.
        from prime.comm.rendezvous import require_secret_or_one_host, resolve_addresses

        require_secret_or_one_host(self.store, resolve_addresses(self.store, None, None)[1],
                                   f"elastic node (rank {self.node_rank})")
        got = self.store.compare_set(keys.SECRET, "", secrets.token_hex(32))
        return got if isinstance(got, bytes) else got.encode()

    @property
    def secret(self) -> bytes:
        return self._secret

    def new_store(self):
        """A new client of the job's store (under the elastic prefix), for another thread."""
        return self._factory()

    def publish_address(self, address: str) -> None:
        """This process's state server (local rank g serves shard g)."""
        self.records.put(keys.state_addr(self.node_id, self.local_rank), address)

    def address_of(self, node: int) -> Optional[str]:
        return self.records.get(keys.state_addr(node))

    def gone(self, node: int) -> bool:
        return self.monitor.gone(node)

    def own_key(self, k: int, key: str) -> str:
        """`key`, written by this process for outer step k: tidy() deletes it with the outer step's other keys."""
        self._own_keys.setdefault(k, []).append(key)
        return key

    def ring_store(self, k: int, attempt: int, rank: int):
        """(store, job_id) for the ring of attempt `attempt` of outer step k, on a new store connection (an
        abandoned ring builder may still wait on it while this node's main thread goes on). The ring's keys
        are deleted with the outer step's other keys (commit())."""
        import torch.distributed as dist

        g = self.local_rank  # ring g: local rank g of every member
        self._own_keys.setdefault(k, []).extend(keys.elastic_ring_keys(self.job, k, attempt, rank, g))
        return (dist.PrefixStore(keys.ring_prefix(k, attempt, g), self.new_store()),
                keys.ring_job_id(self.job, k, attempt, g))

    # -- one attempt of an outer step ------------------------------------------------------------

    def genesis_plan(self, outer_step: int, step: int) -> Plan:
        """The membership before the first outer step: every initial node, slot = id."""
        ids = list(range(self.initial_nodes))
        return Plan(k=outer_step, attempt=0, members=ids, contributors=ids, slots={str(i): i for i in ids},
                    step=step, by=-1, time=time.time())

    def attempt(self, k: int, attempt: int, *, prev: Plan, prev_outcome: Optional[Outcome], step: int,
                since: float, allreduce: Callable[[Plan], tuple], plan: Optional[Plan] = None,
                listen: bool = False) -> Attempt:
        """One attempt of outer step k: arrive (attempt 0), agree on the plan, run `allreduce(plan)`, report
        how it went, and agree on the outcome (prime.elastic.agreement.OuterStepAgreement.attempt says more).
        Raises Evicted when the plan leaves this node out."""
        return self.agreement.attempt(k, attempt, prev=prev, prev_outcome=prev_outcome, step=step, since=since,
                                      allreduce=allreduce, plan=plan, listen=listen)

    def commit(self, plan: Plan, outcome: Outcome, slot_state: Optional[dict] = None) -> None:
        """After this node applied the committed outer step plan.k: records it as the newest committed one
        (for joiners), publishes this node's data position (slot_state, contributors only), and deletes
        this node's keys of outer step k-2 and older (nobody reads them any more; plans and outcomes stay:
        a node that comes back late must find the decision that left it out, not take one of its own)."""
        self._publish_committed(plan, outcome)
        if slot_state is not None:
            self.records.put(keys.slot(plan.slot_of(self.node_id)), slot_state)
        self.tidy(plan.k)

    def tidy(self, k: int) -> None:
        """Deletes this process's keys of outer step k-2 and older (commit() does it; the other processes of
        a node call it for their rings' keys)."""
        for old in [j for j in self._own_keys if j <= k - 2]:
            for key in self._own_keys.pop(old):
                try:
                    self.store.delete_key(key)
                except Exception:  # only tidiness
                    pass

    def _publish_committed(self, plan: Plan, outcome: Outcome) -> None:
        """Records outer step k as the newest committed one (monotonic: an older write never wins)."""
        new = {"k": plan.k, "members": outcome.members, "step": plan.step, "time": time.time(),
               "slots": {str(i): plan.slot_of(i) for i in outcome.members}}
        for _ in range(20):
            raw, cur = self.records.get_raw_and_value(keys.COMMITTED)
            if cur is not None and int(cur["k"]) >= plan.k:
                return
            if self.records.replace(keys.COMMITTED, raw, new):
                return

    def latest_committed(self) -> Optional[dict]:
        """{"k", "members", "step", "slots"} of the newest committed outer step, or None before the first.
        Never goes back (a replayed older record is ignored)."""
        cur = self.records.get(keys.COMMITTED)
        if cur is not None and (self._latest is None or int(cur["k"]) >= int(self._latest["k"])):
            self._latest = cur
        return self._latest

    def read_slot(self, slot: int) -> Optional[dict]:
        return self.records.get(keys.slot(slot))

    # -- joining -----------------------------------------------------------------------

    def set_ready(self, outer_step: int, listen: bool = False) -> None:
        """Tells the coordinator that this node holds the state after outer_step and may be admitted at the next;
        listen: admit it at any outer step (it downloads the state while it takes part with zeros)."""
        self.admission.set_ready(outer_step, listen)

    def clear_ready(self) -> None:
        """Withdraws this node's join offer (it was admitted)."""
        self.admission.clear_ready()

    def await_admission(self, outer_step: int, last_step: Optional[int], timeout_s: float) -> Optional[Plan]:
        """Waits to be admitted at outer step outer_step + 1 (prime.elastic.admission.Admission.await_admission):
        the plan, or None when the job moved on without this node. Raises JobFinished / JoinError."""
        return self.admission.await_admission(outer_step, last_step, timeout_s)

    def live_sources(self, last_step: Optional[int] = None) -> list[tuple[int, str]]:
        """(id, address) of the live members of the newest committed outer step: where to download the state
        (prime.elastic.admission.Admission.live_sources). Raises JobFinished / JoinError."""
        return self.admission.live_sources(last_step)

    # -- leaving -----------------------------------------------------------------------

    def mark_ended(self, step: int) -> None:
        """Records that this launch committed its last outer step (at inner step `step`): a joiner that finds no
        live node of it stops with JobFinished instead of JoinError (prime.elastic.launch)."""
        try:
            # landed: a joiner that sees every node of this launch leave reads it once, on another connection
            self.records.put(keys.LAUNCH_ENDED, {"step": int(step)}, landed=True)
        except Exception as e:  # only a nicer message for a late joiner
            logger.warning("elastic node %d: could not record the launch's end: %s", self.node_id, e)

    def leave(self) -> None:
        """Stops the heartbeat and tells the others that this node exits (it is dropped at once)."""
        if self.monitor is not None:
            if self.monitor.stop(leave=True) and self.monitor.beats:
                self.log("left cleanly", event="leave")
            self.monitor = None

    def wait_all_gone(self, timeout_s: float) -> None:
        """For the node that hosts the store: returns once every other node left or died (or after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        watch = Monitor(self._signed(self._factory()), self.node_id, self.initial_nodes, self.hb_interval,
                        self.hb_timeout)
        watch.watch()
        while time.monotonic() < deadline:
            time.sleep(self.hb_interval)
            try:
                watch.watch()
            except Exception:
                return
            if all(watch.gone(i) for i in watch.known_ids() if i != self.node_id):
                return
