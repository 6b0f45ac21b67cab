"""Who is in an elastic DiLoCo job: registration, heartbeats, and the decisions taken at every outer step.

Everything lives in the job's TCPStore (the one the rings already use), under
the keys below. No node is special: any node may write a decision, and
`compare_set` makes the first writer win, so every node adopts the same one.
The node that normally writes it (the coordinator) is the lowest live id that
has arrived; when it dies, the next one takes over after a grace period.

    secret                  the job secret when none is configured (drawn by the first node; see docs/elastic.md)
    genesis/<r>             claim of initial node r; a node restarted with the same rank finds it taken and joins
    joiners                 counter: joiner ids are initial_nodes, initial_nodes + 1, ...
    hb/<id>                 heartbeat counter (+1 every interval; +LEFT when the node leaves cleanly)
    addr/<id>               host:port of the node's state server (live recovery)
    ready/<id>              a joiner holding the state after outer step s: {"outer_step": s, "mac": ...}
    b/<k>/arrive/<id>       node id finished the inner steps before outer step k
    b/<k>/a<a>/plan         who takes part in attempt a of outer step k (compare_set)
    b/<k>/a<a>/result/<id>  how the all-reduce of that attempt went on node id
    b/<k>/a<a>/outcome      commit, retry or give up (compare_set)
    members                 the newest committed outer step and its members (for joiners)
    slot/<s>                data position of data slot s after the newest outer step (its owner writes it)

Clock: liveness is judged on each observer's own monotonic clock (a heartbeat
counter that stopped moving), so the nodes' clocks need not agree. Wall-clock
times appear only in logs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Callable, Optional

from prime.diloco import OuterSyncError

__all__ = [
    "Membership",
    "Monitor",
    "Plan",
    "Outcome",
    "Evicted",
    "JobFinished",
    "JoinError",
    "MembershipError",
    "wall",
]

logger = logging.getLogger("prime.elastic")

# A node that leaves cleanly adds LEFT to its heartbeat counter: one multi_get then
# tells beats (small numbers) and departures (>= LEFT) apart.
LEFT = 1 << 40
ENV_SECRET = "PRIME_RING_SECRET"


class MembershipError(OuterSyncError):
    """The membership protocol cannot go on (store unreachable, too few nodes, too many failed attempts).

    An OuterSyncError: the outer weights were not changed, and the trainer
    saves a checkpoint and stops (status 3)."""


class Evicted(Exception):
    """This node is not part of the outer step being decided; it must join again (download the state)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw) -> "Plan":
        d = json.loads(raw)
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw) -> "Outcome":
        return cls(**json.loads(raw))


class Monitor:
    """Heartbeat of this node and liveness of every other, on a thread with its own store connection.

    Every `interval` seconds: add 1 to hb/<me>, then read every known node's
    counter in one multi_get. A node whose counter did not move for `timeout`
    seconds (on this node's clock) is dead; one whose counter passed LEFT left.
    A node never seen counts from the moment this monitor started.
    """

    def __init__(self, store, node_id: int, initial_nodes: int, interval: float, timeout: float):
        self._store = store
        self.node_id, self.initial_nodes = node_id, initial_nodes
        self.interval, self.timeout = interval, timeout
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # id -> (counter, monotonic time it last changed)
        self._exists: set[int] = set()
        self._left: set[int] = set()
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_error: Optional[str] = None

    def start(self) -> None:
        self._store.add(f"hb/{self.node_id}", 1)  # the key exists before anyone looks for it
        self._watch()
        self._thread = threading.Thread(target=self._run, name=f"prime-elastic-hb-{self.node_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.interval):
            try:
                self._store.add(f"hb/{self.node_id}", 1)
                self._watch()
                if warned:
                    logger.warning("elastic node %d: the store answers again", self.node_id)
                warned = False
                self.last_error = None
            except Exception as e:  # the store may be down; keep trying, say so once
                self.last_error = str(e)
                if not warned:
                    logger.warning("elastic node %d: heartbeat failed (store unreachable?): %s", self.node_id, e)
                    warned = True

    def _watch(self) -> None:
        n = self.initial_nodes + int(self._store.add("joiners", 0))
        for i in range(n):
            if i not in self._exists and self._store.check([f"hb/{i}"]):
                self._exists.add(i)
        known = sorted(self._exists)
        values = self._store.multi_get([f"hb/{i}" for i in known]) if known else []
        now = time.monotonic()
        with self._lock:
            for i, raw in zip(known, values):
                v = int(raw)
                if v >= LEFT:
                    self._left.add(i)
                prev = self._seen.get(i)
                if prev is None or prev[0] != v:
                    self._seen[i] = (v, now)

    def silent_s(self, node: int) -> float:
        """Seconds since node's counter last moved (since this monitor started, if never seen)."""
        if node == self.node_id:
            return 0.0
        with self._lock:
            prev = self._seen.get(node)
        return time.monotonic() - (prev[1] if prev else self._t0)

    def left(self, node: int) -> bool:
        with self._lock:
            return node in self._left

    def gone(self, node: int) -> bool:
        """True when the node left cleanly or its heartbeat stopped for longer than the timeout."""
        if node == self.node_id:
            return False
        return self.left(node) or self.silent_s(node) > self.timeout

    def why_gone(self, node: int) -> str:
        if self.left(node):
            return "left cleanly"
        with self._lock:
            seen = node in self._seen
        if not seen:
            return f"never sent a heartbeat ({self.silent_s(node):.1f} s)"
        return f"no heartbeat for {self.silent_s(node):.1f} s (timeout {self.timeout:g} s)"

    def known_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._exists)

    def stop(self, leave: bool) -> bool:
        """Stops the heartbeat; `leave` tells the others at once that this node exits cleanly. False: could not."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 + self.interval)
        if leave:
            try:
                self._store.add(f"hb/{self.node_id}", LEFT)
            except Exception as e:  # the store may be gone already; the others then time us out
                logger.warning("elastic node %d: could not announce the clean exit: %s", self.node_id, e)
                return False
        return True


class Membership:
    """One node's view of the membership: registration, heartbeat, and the per-outer-step agreement.

    store_factory() must return a new client of the job's store (already under
    the run's prefix); the membership keeps one for its own calls and gives the
    heartbeat thread another (a store client is not shared between threads).
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
        self.node_id: int = -1
        self.genesis = False
        self.monitor: Optional[Monitor] = None
        self.registered_at = 0.0
        self._warned: set[int] = set()
        self._own_keys: dict[int, list] = {}

    # -- logging ---------------------------------------------------------------

    def log(self, msg: str, **fields) -> None:
        """Prints a membership event (with the wall-clock time) and records it in the metrics."""
        self._log(f"elastic [{wall()}] node {self.node_id}: {msg}")
        if self._record is not None:
            self._record(msg=msg, time=time.time(), **fields)

    # -- registration ------------------------------------------------------------

    def register(self, start_timeout_s: float = 60.0) -> int:
        """Claims a node id and starts the heartbeat. Initial nodes wait (up to start_timeout_s) for each other.

        Initial node r (r < initial_nodes) gets id r if nobody claimed it before;
        any other node, a restarted one included, is a joiner with a fresh id.
        """
        self.registered_at = time.monotonic()
        token = secrets.token_hex(8)
        if self.node_rank < self.initial_nodes:
            got = self.store.compare_set(f"genesis/{self.node_rank}", "", token)
            self.genesis = (got.decode() if isinstance(got, bytes) else got) == token
        if self.genesis:
            self.node_id = self.node_rank
        else:
            self.node_id = self.initial_nodes + int(self.store.add("joiners", 1)) - 1
        self._secret = self._resolve_secret()
        self.monitor = Monitor(self._factory(), self.node_id, self.initial_nodes, self.hb_interval, self.hb_timeout)
        self.monitor.start()
        role = "initial node" if self.genesis else "joiner"
        self.log(f"registered as {role} (rank {self.node_rank}, pid {os.getpid()})", event="register",
                 role=role)
        if self.genesis:
            deadline = time.monotonic() + start_timeout_s
            keys = [f"hb/{i}" for i in range(self.initial_nodes)]
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
            missing = [i for i in range(self.initial_nodes) if not self.store.check([f"hb/{i}"])]
            if missing:
                self.log(f"initial node(s) {missing} did not register within {start_timeout_s:g} s; starting "
                         "without them (they are evicted at the first outer step)", event="start_missing",
                         missing=missing)
        return self.node_id

    def _resolve_secret(self) -> bytes:
        if self._secret:
            return bytes(self._secret)
        env = os.environ.get(ENV_SECRET)
        if env:
            return env.encode()
        # Nobody configured one: the first node draws it and shares it through the store.
        # Then anyone who can read the store can join (docs/elastic.md, Security).
        got = self.store.compare_set("secret", "", secrets.token_hex(32))
        return got if isinstance(got, bytes) else got.encode()

    @property
    def secret(self) -> bytes:
        return self._secret

    def new_store(self):
        """A new client of the job's store (under the elastic prefix), for another thread."""
        return self._factory()

    def publish_address(self, address: str) -> None:
        self.store.set(f"addr/{self.node_id}", address)

    def address_of(self, node: int) -> Optional[str]:
        return self._get(f"addr/{node}")

    def gone(self, node: int) -> bool:
        return self.monitor.gone(node)

    # -- store helpers -------------------------------------------------------------

    def _get(self, key: str) -> Optional[str]:
        """The value of key, or None when it does not exist (get() would block)."""
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        return raw.decode() if isinstance(raw, bytes) else raw

    def _set_first(self, key: str, value: str) -> str:
        """Writes value unless key exists; returns what the key holds now (the first writer's value)."""
        got = self.store.compare_set(key, "", value)
        return got.decode() if isinstance(got, bytes) else got

    def _mac(self, *parts) -> str:
        msg = "|".join(str(p) for p in (self.run_id, *parts)).encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    # -- outer step: arrival and plan ------------------------------------------------

    def genesis_plan(self, outer_step: int, step: int) -> Plan:
        """The membership before the first outer step: every initial node, slot = id."""
        ids = list(range(self.initial_nodes))
        return Plan(k=outer_step, attempt=0, members=ids, contributors=ids, slots={str(i): i for i in ids},
                    step=step, by=-1, time=time.time())

    def arrive(self, k: int, step: int) -> None:
        """Says that this node has its pseudo-gradient for outer step k ready."""
        self._written(k, f"b/{k}/arrive/{self.node_id}")
        self.store.set(f"b/{k}/arrive/{self.node_id}", json.dumps({"step": step, "time": time.time()}))

    def _written(self, k: int, key: str) -> None:
        self._own_keys.setdefault(k, []).append(key)

    def forget(self, k: int, extra=()) -> None:
        """Deletes this node's own keys of outer step k (arrival, results, and `extra`, e.g. its ring's).

        Called two outer steps later, when nobody reads them any more. Plans and
        outcomes stay: a node that comes back late must find the decision that
        left it out, not take one of its own."""
        for key in self._own_keys.pop(k, []) + list(extra):
            try:
                self.store.delete_key(key)
            except Exception:  # only tidiness
                pass

    def await_plan(self, k: int, attempt: int, prev: Plan, since: float, step: int,
                   prev_outcome: Optional[Outcome] = None) -> Plan:
        """The plan of attempt `attempt` of outer step k; proposes it when this node is the coordinator.

        prev: for attempt 0 the committed plan of outer step k-1, else the plan
        of attempt-1 (whose outcome was a retry). since: when this node started
        waiting (its arrival), for the barrier timeout.
        """
        key = f"b/{k}/a{attempt}/plan"
        while True:
            raw = self._get(key)
            if raw is not None:
                return Plan.from_json(raw)
            if attempt == 0:
                proposal = self._propose_first(k, prev, since, step)
            else:
                proposal = self._propose_retry(k, attempt, prev, prev_outcome, since)
            if proposal is not None:
                self._set_first(key, proposal.to_json())
                continue  # read back the winner
            time.sleep(self.poll_s)

    def _arrivals(self, k: int, ids) -> dict:
        out = {}
        for i in ids:
            raw = self._get(f"b/{k}/arrive/{i}")
            if raw is not None:
                out[i] = json.loads(raw)
        return out

    def _order(self, alive: list[int]) -> tuple[int, float]:
        """This node's position among the live candidates, and how long it lets the ones before it act first."""
        idx = alive.index(self.node_id)
        return idx, idx * max(self.hb_timeout, 1.0)

    def _propose_first(self, k: int, prev: Plan, since: float, step: int) -> Optional[Plan]:
        cands = list(prev.members)
        arrived = self._arrivals(k, cands)
        arrived[self.node_id] = {"step": step}
        alive = sorted(i for i in arrived if not self.monitor.gone(i))
        pending = [i for i in cands if i not in arrived and not self.monitor.gone(i)]
        waited = time.monotonic() - since
        idx, grace = self._order(alive)
        if not ((idx == 0 and (not pending or waited >= self.barrier_timeout))
                or waited >= self.barrier_timeout + grace):
            return None
        evicted = []
        for i in cands:
            if i in alive:
                continue
            if i in pending:
                evicted.append([i, f"missed the outer-step barrier: not there {waited:.1f} s after node "
                                   f"{self.node_id} arrived (timeout {self.barrier_timeout:g} s)"])
            else:
                evicted.append([i, self.monitor.why_gone(i)])
        contributors = []
        for i in alive:
            if int(arrived[i]["step"]) != step:
                evicted.append([i, f"arrived at inner step {arrived[i]['step']}, the others at {step}"])
            else:
                contributors.append(i)
        joiners = self._ready_joiners(k - 1, exclude=set(cands))
        members = sorted(contributors + joiners)
        slots = {str(i): prev.slot_of(i) for i in contributors}
        free = (s for s in range(10 ** 6) if s not in set(slots.values()))
        for j in joiners:
            slots[str(j)] = next(free)
        return Plan(k=k, attempt=0, members=members, contributors=contributors, slots=slots, step=step,
                    joined=joiners, evicted=evicted, by=self.node_id, time=time.time())

    def _ready_joiners(self, outer_step: int, exclude: set) -> list[int]:
        """Joiners that hold the state after `outer_step`, proved the job secret, and are alive."""
        out = []
        n = self.initial_nodes + int(self.store.add("joiners", 0))
        for i in range(n):
            if i in exclude or self.monitor.gone(i):
                continue
            raw = self._get(f"ready/{i}")
            if raw is None:
                continue
            d = json.loads(raw)
            if int(d["outer_step"]) != outer_step:
                continue
            if not hmac.compare_digest(str(d.get("mac", "")), self._mac("ready", i, outer_step)):
                if i not in self._warned:
                    self._warned.add(i)
                    self.log(f"ignoring node {i}: its join request is not signed with the job secret",
                             event="reject", node=i)
                continue
            out.append(i)
        return out

    def _results(self, k: int, attempt: int, ids) -> dict:
        out = {}
        for i in ids:
            raw = self._get(f"b/{k}/a{attempt}/result/{i}")
            if raw is not None:
                out[i] = json.loads(raw)
        return out

    def _propose_retry(self, k: int, attempt: int, prev: Plan, outcome: Optional[Outcome],
                       since: float) -> Optional[Plan]:
        if outcome is None:  # the plan of a retry follows an outcome that asked for it
            raise MembershipError(f"internal: no outcome for attempt {attempt - 1} of outer step {k}")
        members = [i for i in outcome.members if not self.monitor.gone(i)]
        if self.node_id not in members:
            return None
        idx, grace = self._order(members)
        if idx != 0 and time.monotonic() - since < grace:
            return None
        evicted = [[i, self.monitor.why_gone(i)] for i in outcome.members if i not in members]
        evicted += [list(x) for x in outcome.missing]
        if set(prev.members) - set(outcome.members) == set() and outcome.failed:
            blamed = self._most_blamed(k, attempt - 1, members)
            if blamed is not None and len(members) > 1:
                members.remove(blamed)
                evicted.append([blamed, f"blamed by the other nodes for failing attempt {attempt - 1}"])
        slots = {str(i): prev.slot_of(i) for i in members}
        # A joiner that became ready (with the state after k-1) since the previous attempt was
        # planned takes part in this one: the outer state has not changed, and otherwise it
        # would find the job one outer step ahead and download again.
        late = self._ready_joiners(k - 1, exclude=set(prev.members) | set(outcome.members))
        free = (s for s in range(10 ** 6) if s not in set(slots.values()))
        for j in late:
            slots[str(j)] = next(free)
        return Plan(k=k, attempt=attempt, members=sorted(members + late),
                    contributors=[i for i in prev.contributors if i in members], slots=slots, step=prev.step,
                    joined=[i for i in prev.joined if i in members] + late, evicted=evicted, by=self.node_id,
                    time=time.time())

    def _most_blamed(self, k: int, attempt: int, members: list[int]) -> Optional[int]:
        """The member that the failure reports of an attempt name most often (None: no blame).

        Only a second failure with the same members gets here: a transient
        failure is retried once with everyone, a node that keeps breaking the
        ring (alive, but unreachable or broken) is then left out.
        """
        if attempt < 1:
            return None
        counts: dict[int, int] = {}
        for a in (attempt - 1, attempt):
            for r in self._results(k, a, members).values():
                b = r.get("blame", -1)
                if b in members:
                    counts[b] = counts.get(b, 0) + 1
        if not counts:
            return None
        return max(counts, key=lambda i: (counts[i], i))

    # -- outer step: result and outcome ------------------------------------------------

    def report(self, k: int, attempt: int, ok: bool, error: str = "", blame: int = -1) -> None:
        """Publishes how this node's all-reduce of the attempt went."""
        self._written(k, f"b/{k}/a{attempt}/result/{self.node_id}")
        self.store.set(f"b/{k}/a{attempt}/result/{self.node_id}",
                       json.dumps({"ok": ok, "error": error[:500], "blame": blame}))

    def await_outcome(self, k: int, plan: Plan) -> Outcome:
        """Waits for (or, as coordinator, decides) whether attempt plan.attempt of outer step k commits.

        Commit when every member that reported succeeded and the rest are dead:
        a member's all-reduce only succeeds after every member's data went
        through it, so the survivors hold the same average. Otherwise retry
        with the live reporters (or give up after max_attempts).
        """
        key = f"b/{k}/a{plan.attempt}/outcome"
        t0 = time.monotonic()
        while True:
            raw = self._get(key)
            if raw is not None:
                return Outcome.from_json(raw)
            results = self._results(k, plan.attempt, plan.members)
            reporters = sorted(i for i in results if not self.monitor.gone(i))
            pending = [i for i in plan.members if i not in results and not self._dead_or_suspect(i, results)]
            waited = time.monotonic() - t0
            if self.node_id in reporters:
                idx, grace = self._order(reporters)
                if (idx == 0 and (not pending or waited >= self.report_timeout)) or waited >= self.report_timeout + grace:
                    self._set_first(key, self._decide(k, plan, results, waited).to_json())
                    continue
            time.sleep(self.poll_s)

    def _dead_or_suspect(self, node: int, results: dict) -> bool:
        """Gone, or: a reporter's ring broke on it and its heartbeat has been silent for 3 intervals.

        A killed node resets its TCP connections at once, so its neighbours fail
        within milliseconds and blame it; waiting for the full heartbeat timeout
        would only add latency. A node that is alive keeps beating (its thread
        runs apart from training), so it is not suspected however broken its
        links are: it is retried, then left out as blamed (_most_blamed)."""
        if self.monitor.gone(node):
            return True
        blamed = any(r.get("blame") == node for r in results.values())
        return blamed and self.monitor.silent_s(node) > 3 * self.hb_interval

    def _decide(self, k: int, plan: Plan, results: dict, waited: float) -> Outcome:
        missing = []
        for i in plan.members:
            if i not in results:
                if self.monitor.gone(i):
                    why = self.monitor.why_gone(i)
                elif self._dead_or_suspect(i, results):
                    why = (f"its neighbours lost the connection to it and it has sent no heartbeat for "
                           f"{self.monitor.silent_s(i):.1f} s")
                else:
                    why = f"no result after {waited:.1f} s"
                missing.append([i, f"did not report attempt {plan.attempt}: {why}"])
        failed = {str(i): r["error"] for i, r in results.items() if not r["ok"]}
        ok = [i for i in plan.members if i in results and results[i]["ok"]]
        base = dict(k=k, attempt=plan.attempt, failed=failed, missing=missing, by=self.node_id, time=time.time())
        if not failed and ok:
            return Outcome(commit=True, members=ok, **base)
        alive = [i for i in plan.members if i in results and not self._dead_or_suspect(i, results)]
        give_up = ""
        if plan.attempt + 1 >= self.max_attempts:
            give_up = (f"outer step {k} failed {plan.attempt + 1} times (elastic.max_attempts); last errors: "
                       + "; ".join(f"node {i}: {e}" for i, e in failed.items()))
        elif len([i for i in plan.contributors if i in alive]) < self.min_nodes:
            give_up = (f"only {len(alive)} node(s) left for outer step {k}, fewer than elastic.min_nodes "
                       f"({self.min_nodes})")
        return Outcome(commit=False, members=alive, give_up=give_up, **base)

    def publish_committed(self, plan: Plan, outcome: Outcome) -> None:
        """Records outer step k as the newest committed one (monotonic: an older write never wins)."""
        new = json.dumps({"k": plan.k, "members": outcome.members, "step": plan.step, "time": time.time(),
                          "slots": {str(i): plan.slot_of(i) for i in outcome.members}})
        for _ in range(20):
            cur = self._get("members")
            if cur is not None and int(json.loads(cur)["k"]) >= plan.k:
                return
            got = self.store.compare_set("members", cur if cur is not None else "", new)
            if (got.decode() if isinstance(got, bytes) else got) == new:
                return

    def latest_committed(self) -> Optional[dict]:
        """{"k", "members", "step", "slots"} of the newest committed outer step, or None before the first."""
        raw = self._get("members")
        return None if raw is None else json.loads(raw)

    def publish_slot(self, slot: int, state: dict) -> None:
        self.store.set(f"slot/{slot}", json.dumps(state))

    def read_slot(self, slot: int) -> Optional[dict]:
        raw = self._get(f"slot/{slot}")
        return None if raw is None else json.loads(raw)

    # -- joining -----------------------------------------------------------------------

    def set_ready(self, outer_step: int) -> None:
        """Tells the coordinator that this node holds the state after outer_step and may be admitted at the next."""
        self.store.set(f"ready/{self.node_id}", json.dumps(
            {"outer_step": outer_step, "mac": self._mac("ready", self.node_id, outer_step)}))

    def clear_ready(self) -> None:
        try:
            self.store.delete_key(f"ready/{self.node_id}")
        except Exception:  # only tidiness: a stale ready entry is ignored anyway
            pass

    def await_admission(self, outer_step: int, last_step: Optional[int], timeout_s: float) -> Optional[Plan]:
        """Waits to be admitted at outer step outer_step + 1. Returns the plan, or None when the job moved on
        without this node (download a newer state). last_step: the inner step of the job's last outer step
        (None: open-ended). Raises JobFinished / JoinError."""
        k = outer_step + 1
        attempt = 0
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self._get(f"b/{k}/a{attempt}/plan")
            if raw is not None:
                plan = Plan.from_json(raw)
                if self.node_id in plan.members:
                    return plan
                out = self._get(f"b/{k}/a{attempt}/outcome")
                if out is not None:
                    if Outcome.from_json(out).commit:
                        return None
                    attempt += 1
                    continue
            latest = self.latest_committed()
            if latest is not None and int(latest["k"]) >= k:
                return None
            if latest is not None and last_step is not None and int(latest["step"]) >= last_step:
                raise JobFinished(f"the job committed its last outer step (at step {latest['step']}) before this "
                                  "node was admitted")
            members = latest["members"] if latest is not None else list(range(self.initial_nodes))
            if all(self.monitor.gone(i) for i in members):
                raise JoinError(f"every member of the job ({members}) is gone; nobody left to admit this node")
            if time.monotonic() > deadline:
                raise JoinError(f"not admitted at outer step {k} within {timeout_s:g} s (elastic.join_timeout_s)")
            time.sleep(self.poll_s * 5)

    def live_sources(self, last_step: Optional[int] = None) -> list[tuple[int, str]]:
        """(id, address) of the live members of the newest committed outer step: where to download the state.

        last_step: the inner step of the job's last outer step (None: open-ended). Raises
        JobFinished once the job committed that outer step (none is left to be admitted at:
        the members only finish their inner steps and exit), JoinError when they are all gone."""
        latest = self.latest_committed()
        if latest is not None and last_step is not None and int(latest["step"]) >= last_step:
            raise JobFinished(f"the job already committed its last outer step (at step {latest['step']})")
        members = latest["members"] if latest is not None else list(range(self.initial_nodes))
        if all(i == self.node_id or self.monitor.gone(i) for i in members):
            raise JoinError(f"every member of the job ({members}) is gone: nobody to download the state from")
        out = []
        for i in members:
            if i == self.node_id or self.monitor.gone(i):
                continue
            addr = self.address_of(i)
            if addr:
                out.append((i, addr))
        return out

    # -- leaving -----------------------------------------------------------------------

    def leave(self) -> None:
        """Stops the heartbeat and tells the others that this node exits (it is dropped at once)."""
        if self.monitor is not None:
            if self.monitor.stop(leave=True):
                self.log("left cleanly", event="leave")
            self.monitor = None

    def wait_all_gone(self, timeout_s: float) -> None:
        """For the node that hosts the store: returns once every other node left or died (or after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        watch = Monitor(self._factory(), self.node_id, self.initial_nodes, self.hb_interval, self.hb_timeout)
        watch._watch()
        while time.monotonic() < deadline:
            time.sleep(self.hb_interval)
            try:
                watch._watch()
            except Exception:
                return
            if all(watch.gone(i) for i in watch.known_ids() if i != self.node_id):
                return
