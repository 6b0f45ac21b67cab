"""Every launch of an elastic job under a name of its own, so that no process reads a record of an earlier one.

Store records are signed under the job secret for the run id (prime.comm.signed_store). A stranger who kept an
earlier launch's records (same secret, same run id) could write them into the next launch's store: initial
slots claimed before their nodes claim them, resume offers, heartbeats, decisions. So the records of a launch
live under its name (``launch/<name>/`` of the elastic prefix) and are signed for ``<run id>/<name>``, and a
process takes a name only from a record that answers a fresh nonce of its own:

    founder (node rank 0)  where no launch of this run is live in the store, draws the name (64 random bits)
                           and records it as the store's current launch (``launch/current``)
    every other process    asks: writes a fresh nonce under the next ask index (``launch/ask/<i>``), and
                           takes the name from a member's signed answer under ``launch/for/<nonce>``, which no
                           earlier launch can have written
    members                answer the asks on their heartbeat-watch thread (LaunchDoor: a few a sweep, the
                           newest first and the others in turn, among the newest MAX_ASKS indices; an asker
                           whose index falls MAX_ASKS / 2 behind the counter, or not below it (a stranger
                           lowered it), asks again)

Rank 0 asks too, and judges nothing before a live launch had two heartbeat intervals to answer (its members
answer within a sweep). It founds where the store then names no launch of the run (a fresh store, a fresh run
id, or a record a stranger deleted: the live launch's members write it back), or where the one named neither
answered nor advanced a heartbeat for heartbeat_timeout_s (the job's own rule for a dead node), or every node of
it left. Node 0 founds at once only where it made the store itself. A restarted node 0 so joins the live launch,
and a whole job started again in the same store starts a new one. A stranger can delay a start (replayed
heartbeats look alive), never make a process take an earlier launch's name; a process reads an earlier launch's
heartbeats and end record only to judge whether it is over. What no scheme over a store anyone may write can
prevent: a stranger who deletes the asks and the answers as they appear can make a restarted node 0 found a
launch of its own beside the live one (it then trains alone; the live launch is not changed, and its members
warn when the store's current launch is not theirs).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Optional

from prime.comm import store_keys as keys
from prime.comm.signed_store import SignedStore, read_counter
from prime.elastic.membership import JobFinished, JoinError, MembershipError, Monitor, bump, sample_ids

__all__ = ["Launch", "LaunchDoor", "find_launch", "launch_job"]

ASKS_PER_SWEEP = 16
"""Ask indices without an answer that one sweep of a member reads (a store round trip each when missing)."""
MAX_ASKS = 1024
"""How far back a member looks among the ask indices (the counter is unsigned: a stranger could inflate it)."""
LOOK_BACK = 256
"""Asks before its own that a member answers (those of the processes that started with it)."""
QUIET_SWEEPS = 2
"""How many heartbeat intervals node 0 waits for an answer before it founds a launch where the store names none:
a live launch's members answer within a sweep, so a restarted node 0 joins it even if a stranger deleted
``launch/current``."""

_NAME = re.compile(r"[0-9a-f]{16}")
_NONCE = re.compile(r"[0-9a-f]{32}")


def launch_job(run_id: str, name: str) -> str:
    """The job the records of launch `name` are signed for."""
    return f"{run_id}/{name}"


def _name(record) -> Optional[str]:
    """The launch name a record holds, or None."""
    name = record.get("launch") if isinstance(record, dict) else None
    return name if isinstance(name, str) and _NAME.fullmatch(name) else None


@dataclass
class Launch:
    """What find_launch() found."""

    name: str
    founded: bool
    """This process founded the launch (node rank 0 only)."""
    ask: int
    """This process's first ask index: where its door starts to look (LaunchDoor). Not a later one it asked
    again under: the other initial nodes asked about when it first did."""


class LaunchDoor:
    """A member's answers to the asks, one sweep at a time (see the module docstring).

    records: signed for the run id, under the elastic prefix, on the calling thread's own store connection
    since:   the first ask index this member answers: its own, less LOOK_BACK (the asks of processes that started
             just before it, e.g. the other initial nodes of the launch it founded; older ones had their answers)

    Each sweep also writes the launch's name as the store's current launch where that record is missing or
    names another launch (a stranger deleted it, or wrote back an earlier launch's): node 0, restarted, would
    otherwise watch the wrong launch. It warns once when the record named another launch with a valid
    signature: two launches of one run would then fight over it, each warning."""

    def __init__(self, records: SignedStore, name: str, since: int = 0,
                 warn: Optional[Callable[[str], None]] = None):
        self.records, self.name = records, name
        self.since = max(0, since - LOOK_BACK)
        self.warn = warn or (lambda msg: None)
        self._warned = False
        self._done: set = set()
        self._turn = 0
        self._high = 0  # the ask counter at the last sweep
        self._warned_back = False

    def answer(self) -> int:
        """Answers the asks written since the last sweep (ASKS_PER_SWEEP at most); returns how many."""
        current = self.records.get(keys.LAUNCH_CURRENT)
        if _name(current) != self.name:
            if current is not None and not self._warned:
                self._warned = True
                self.warn(f"the store named launch {_name(current)} of this run as its current launch, not this "
                          f"one ({self.name}): written back (a stranger's replay, or a second launch of the run)")
            self.records.put(keys.LAUNCH_CURRENT, {"launch": self.name})
        n = read_counter(self.records.store, keys.LAUNCH_ASKS)
        if n < self._high:  # lowered or deleted (a stranger): the asks under it reuse indices, read them all again
            if not self._warned_back:
                self._warned_back = True
                self.warn(f"the ask counter went back from {self._high} to {n} (a stranger's write?): answering "
                          "the asks under it again")
            self.since, self._done = 0, set()
        self._high = n
        lo = max(self.since, n - MAX_ASKS)
        self._done = {i for i in self._done if i >= lo}
        look, self._turn = sample_ids([i for i in range(lo, n) if i not in self._done], ASKS_PER_SWEEP, self._turn)
        answered = 0
        for i, ask in zip(look, self.records.get_many([keys.launch_ask(i) for i in look]) if look else []):
            if ask is None:  # not written yet (its asker is between the add and the put), or never will be
                continue
            self._done.add(i)
            nonce = ask.get("nonce") if isinstance(ask, dict) else None
            if isinstance(nonce, str) and _NONCE.fullmatch(nonce):
                self.records.put(keys.launch_answer(nonce), {"launch": self.name})
                answered += 1
        return answered


def find_launch(records: SignedStore, launch_records: Callable[[str], SignedStore], *, node_rank: int,
                initial_nodes: int, interval: float, timeout: float, wait_s: float,
                log: Callable[[str], None], poll_s: float = 0.02, fresh_store: bool = False) -> Launch:
    """The launch this process is part of, by the rules of the module docstring.

    records:          signed for the run id, under the elastic prefix
    launch_records:   launch_records(name): the records of launch `name` (its heartbeats are watched)
    interval, timeout: the job's heartbeat interval and timeout
    wait_s:           how long to wait for an answer before giving up (MembershipError)
    fresh_store:      this process made the store (node 0 hosts it): no launch can be live there

    Raises, for a joiner (node_rank >= initial_nodes) when no node of the launch the store names is alive:
    JobFinished when that launch recorded its end (Membership.mark_ended), else JoinError."""
    nonce = secrets.token_hex(16)
    i = first = bump(records.store, keys.LAUNCH_ASKS) - 1
    records.put(keys.launch_ask(i), {"nonce": nonce, "rank": node_rank})
    if node_rank == 0 and fresh_store:
        return Launch(_found(records), True, first)
    quiet_s = max(QUIET_SWEEPS * interval, 0.5)  # a live launch answers within a sweep of its members
    t0 = time.monotonic()
    named: Optional[str] = None
    watch: Optional[Monitor] = None
    since = t0  # when the launch named now began to be watched
    pause = poll_s
    while True:
        got = _name(records.get(keys.launch_answer(nonce)))
        if got is not None:
            return Launch(got, False, first)
        asks = read_counter(records.store, keys.LAUNCH_ASKS)
        if asks - i > MAX_ASKS // 2 or asks <= i:
            # others asked since, or a stranger inflated the counter: before this ask falls out of the indices
            # the members read, ask again under the newest one (the same nonce); likewise when a stranger
            # lowered or deleted it, since the members read only the indices below it
            i = bump(records.store, keys.LAUNCH_ASKS) - 1
            records.put(keys.launch_ask(i), {"nonce": nonce, "rank": node_rank})
        now = time.monotonic()
        current = _name(records.get(keys.LAUNCH_CURRENT))
        if current != named:  # (re)watch the launch the store names now: it may have changed (a new founding)
            named, since = current, now
            view = launch_records(named) if named is not None else None
            watch = Monitor(view, -1, initial_nodes, interval, timeout) if view is not None else None
            if node_rank == 0 and named is not None:
                log(f"the store names launch {named} of this run: founding a new launch only if it does not "
                    f"answer and none of its heartbeats advances for {timeout:g} s")
        if watch is not None:
            watch.watch()
        # Nothing is judged before a live launch had a sweep to answer (its members answer within one).
        if now - t0 >= quiet_s and now - since >= quiet_s:
            if named is None and node_rank == 0:
                return Launch(_found(records), True, first)  # the store names no launch, and none answered
            # A joiner gives a launch that looks over the heartbeat timeout first: node 0 of a job started again
            # may be about to found the next one (the store then names it, and it answers).
            if watch is not None and (node_rank == 0 or now - since >= timeout):
                known = watch.known_ids()
                left = bool(known) and all(watch.left(j) for j in known)  # every node of it left cleanly
                if left or now - since >= timeout and all(watch.gone(j) for j in known):
                    why = "every node of it left" if left else f"no heartbeat of it advanced for {timeout:g} s"
                    if node_rank == 0:
                        log(f"launch {named} is over ({why}): founding a new launch")
                        return Launch(_found(records), True, first)
                    if node_rank >= initial_nodes:
                        ended = view.get(keys.LAUNCH_ENDED)
                        if isinstance(ended, dict):
                            raise JobFinished(f"launch {named} of this run committed its last outer step (at step "
                                              f"{ended.get('step')}) and {why}: the job ended")
                        raise JoinError(f"no node of launch {named} of this run is alive (none answered this "
                                        f"node's ask; {why}): nothing to join")
        if now - t0 > wait_s:
            whom = "node rank 0 founds each launch: is it running?" if named is None else \
                f"launch {named} of this run looks alive but did not answer (a stranger replaying its heartbeats?)"
            other = " Records signed with another secret are in the store: is PRIME_RING_SECRET the job's?" \
                if records.rejected else ""
            raise MembershipError(f"no launch of this run answered this process's ask within {wait_s:g} s; {whom} "
                                  f"(the same run id and PRIME_RING_SECRET on every node?).{other}")
        time.sleep(pause)
        pause = min(2 * pause, interval / 2)


def _found(records: SignedStore) -> str:
    name = secrets.token_hex(8)
    records.put(keys.LAUNCH_CURRENT, {"launch": name})
    return name
