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
                           newest first and the others in turn)

Rank 0 asks too. In a store where no process of the run asked before it (a fresh store, or a fresh run id) it
founds at once; in one that names no launch of the run, once no answer came for two heartbeat intervals (a live
launch answers within a sweep, and writes ``launch/current`` back where a stranger deleted it). Where one is named, it founds only once that launch answered nothing and none
of its heartbeats advanced for heartbeat_timeout_s (the job's own rule for a dead node), or every node of it left:
a restarted node 0 joins the live launch, a whole job started again in the same store starts a new one. A
stranger can delay a start (replayed heartbeats look alive; a replayed ``launch/current`` makes rank 0 watch it
first), never make a process take an earlier launch's name.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Optional

from prime.comm import store_keys as keys
from prime.comm.signed_store import SignedStore
from prime.elastic.membership import JobFinished, JoinError, MembershipError, Monitor, sample_ids

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
    """This process's ask index: where its door starts to look (LaunchDoor)."""


class LaunchDoor:
    """A member's answers to the asks, one sweep at a time (see the module docstring).

    records: signed for the run id, under the elastic prefix, on the calling thread's own store connection
    since:   the first ask index this member answers: its own, less LOOK_BACK (the asks of processes that started
             just before it, e.g. the other initial nodes of the launch it founded; older ones had their answers)

    Each sweep also writes the launch's name back as the store's current launch where that record is gone (a
    stranger deleted it): node 0, restarted, would otherwise take the store for an empty one."""

    def __init__(self, records: SignedStore, name: str, since: int = 0):
        self.records, self.name = records, name
        self.since = max(0, since - LOOK_BACK)
        self._done: set = set()
        self._turn = 0

    def answer(self) -> int:
        """Answers the asks written since the last sweep (ASKS_PER_SWEEP at most); returns how many."""
        if self.records.get(keys.LAUNCH_CURRENT) is None:
            self.records.put(keys.LAUNCH_CURRENT, {"launch": self.name})
        n = int(self.records.store.add(keys.LAUNCH_ASKS, 0))
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
                log: Callable[[str], None], poll_s: float = 0.02) -> Launch:
    """The launch this process is part of, by the rules of the module docstring.

    records:          signed for the run id, under the elastic prefix
    launch_records:   launch_records(name): the records of launch `name` (its heartbeats are watched)
    interval, timeout: the job's heartbeat interval and timeout
    wait_s:           how long to wait for an answer before giving up (MembershipError)

    Raises, for a joiner (node_rank >= initial_nodes) when no node of the launch the store names is alive:
    JobFinished when that launch recorded its end (Membership.mark_ended), else JoinError."""
    nonce = secrets.token_hex(16)
    i = int(records.store.add(keys.LAUNCH_ASKS, 1)) - 1
    records.put(keys.launch_ask(i), {"nonce": nonce, "rank": node_rank})
    quiet_s = max(QUIET_SWEEPS * interval, 0.5)  # a live launch answers within a sweep of its members
    t0 = time.monotonic()
    named: Optional[str] = None
    watch: Optional[Monitor] = None
    pause = poll_s
    while True:
        got = _name(records.get(keys.launch_answer(nonce)))
        if got is not None:
            return Launch(got, False, i)
        waited = time.monotonic() - t0
        if watch is None:
            named = _name(records.get(keys.LAUNCH_CURRENT))
            if named is not None:
                view = launch_records(named)
                watch = Monitor(view, -1, initial_nodes, interval, timeout)
                if node_rank == 0:
                    log(f"the store names launch {named} of this run: founding a new launch only if it does not "
                        f"answer and none of its heartbeats advances for {timeout:g} s")
            elif node_rank == 0 and (i == 0 or waited >= quiet_s):
                # The store names no launch, and none answered; or no process of this run ever asked before
                # this one (every member of a launch asks when it starts): no launch of the run ever ran here.
                return Launch(_found(records), True, i)
        if watch is not None:
            watch.watch()
            known = watch.known_ids()
            left = bool(known) and all(watch.left(j) for j in known)  # every node of it left cleanly
            if left or waited >= timeout and all(watch.gone(j) for j in known):
                why = "every node of it left" if left else f"no heartbeat of it advanced for {timeout:g} s"
                if node_rank == 0:
                    log(f"launch {named} is over ({why}): founding a new launch")
                    return Launch(_found(records), True, i)
                if node_rank >= initial_nodes:
                    ended = view.get(keys.LAUNCH_ENDED)
                    if isinstance(ended, dict):
                        raise JobFinished(f"launch {named} of this run committed its last outer step (at step "
                                          f"{ended.get('step')}) and {why}: the job ended")
                    raise JoinError(f"no node of launch {named} of this run is alive (none answered this node's "
                                    f"ask; {why}): nothing to join")
        if waited > wait_s:
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
