"""Every node's outcome of a fixed ring's all-reduce, agreed through the job's store.

A rank's all-reduce can fail after its peers received all they needed from it: they complete while it raises
(docs/ring-failures.md). Agreeing within a node is then not enough: a node that completed would apply the outer
step and one that failed would not, and the replicas would differ. So after each all-reduce (each piece of a
pipelined one, each attempt), every node writes how it went as a signed record, and the first process to see a
failure, every node's success, or the timeout writes the decision into a first-writer-wins key. Every process of
every node acts on that decision only: all apply, or all restore their input and retry.

    outcomes = StoreOutcomes(connect, secret, run_id, scope, node=r, nodes=n, timeout_s=300)
    outcomes.decide("c7a0j3", ok)   # True (apply) / False (retry) the same everywhere; None: no decision learned

The records are signed under the job secret and keyed by the launch's name (drawn fresh by the nodes and exchanged
over their rings), so a record of an earlier launch is never read. What remains: a stranger who deletes a decision
after some nodes read it, and a node's report with it, can make later readers decide again without that node
(docs/security.md).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Optional

from prime.comm import store_keys as keys
from prime.comm.signed_store import SignedStore

__all__ = ["StoreOutcomes"]

WAIT_S = 0.5
"""How long one wait for the decision lasts before the reports are read again (for the timeout)."""

KEEP_DECISIONS = 8
"""Decisions node 0 keeps in the store (older ones are deleted): more than a pipelined average's window."""


class StoreOutcomes:
    """The decisions of one ring's all-reduces (see the module docstring).

    connect():  a new client of the job's store (under the job's prefix); one is made per thread that decides
                (a background average decides on its own thread, and a store client is not shared)
    secret:     the job secret; job: the run id (records are signed for the job "trainer/<job>", as the
                trainer's others); scope: the launch's name and the ring (every key carries it)
    node:       this node's rank; nodes: how many report
    timeout_s:  how long to wait for every report before deciding without the missing ones (a failure), and
                for a decision before giving up (None)."""

    def __init__(self, connect: Callable[[], object], secret: bytes, job: str, scope: str, *, node: int, nodes: int,
                 timeout_s: float, poll_s: float = 0.002, max_poll_s: float = 0.05):
        if not 0 <= node < nodes:
            raise ValueError(f"node must be in [0, nodes={nodes}), got {node}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.connect, self.secret, self.scope, self.job = connect, secret, scope, job
        self.node, self.nodes, self.timeout_s = node, nodes, timeout_s
        self.poll_s, self.max_poll_s = poll_s, max_poll_s
        self._local = threading.local()
        self._decided: list = []  # names this node's ring decided, oldest first (node 0 deletes old decisions)

    def _records(self) -> SignedStore:
        records = getattr(self._local, "records", None)
        if records is None:
            records = self._local.records = SignedStore(self.connect(), self.secret, f"trainer/{self.job}")
        return records

    def decide(self, name: str, ok: bool) -> Optional[bool]:
        """Reports this node's outcome of all-reduce `name` (ok: it worked on every process of the node) and
        returns the decision every node reads: True when every node's worked, False when one failed or did not
        report within timeout_s. None when no decision could be learned (the store failed, or every slot of the
        decision key holds a forged record): the caller must stop, since other nodes may have applied."""
        try:
            return self._decide(name, ok)
        except Exception:  # the store's errors (DistStoreError, a closed connection), ForgedRecordsError
            return None

    def _decide(self, name: str, ok: bool) -> bool:
        records = self._records()
        report = keys.outcome_report(self.scope, name, self.node)
        decision = keys.outcome_decision(self.scope, name)
        records.put(report, {"ok": bool(ok)})
        deadline = time.monotonic() + self.timeout_s
        seen: dict = {self.node: bool(ok)}  # its own report is known: one store read fewer each time reports are read
        pause, woken = self.poll_s, False
        while True:
            got = _verdict(records.first(decision))
            if got is None:
                missing = [n for n in range(self.nodes) if n not in seen]
                for n, v in zip(missing, records.get_many([keys.outcome_report(self.scope, name, n)
                                                           for n in missing])):
                    if isinstance(v, dict) and isinstance(v.get("ok"), bool):
                        seen[n] = v["ok"]
                verdict = None
                if not all(seen.values()):
                    verdict = False  # a node failed: nobody applies
                elif len(seen) == self.nodes:
                    verdict = True
                elif time.monotonic() >= deadline:
                    verdict = False  # a node did not report: it may not have the average
                if verdict is not None:
                    got = _verdict(records.set_first(decision, {"commit": verdict}))
            if got is not None:
                self._tidy(records, name, report)
                return got
            now = time.monotonic()
            if now >= deadline + self.timeout_s:
                raise TimeoutError(f"no decision under store key {decision!r} after {2 * self.timeout_s:g} s")
            if len(seen) < self.nodes and now < deadline and not woken:
                # Reports are missing: the last node to report decides. Wait for its decision on the store's
                # side (it wakes us as soon as the key is written). Woken without a valid decision there (a
                # stranger's record), the reads go on at the polling pace instead.
                woken = _wait(records.store, decision, min(WAIT_S, deadline - now))
                if woken:
                    continue
            time.sleep(pause)
            pause = min(2 * pause, self.max_poll_s)

    def _tidy(self, records: SignedStore, name: str, report: str) -> None:
        """Deletes this node's report once the decision is known, and (node 0) decisions KEEP_DECISIONS old:
        every process of the ring has read those, since a pipelined average launches at most its window of
        pieces (3) ahead of the last one it decided, and node 0 decided a piece only once every node launched it."""
        records.delete(report)
        if self.node != 0:
            return
        self._decided.append(name)
        while len(self._decided) > KEEP_DECISIONS:
            records.delete(keys.outcome_decision(self.scope, self._decided.pop(0)))


def _wait(store, key: str, seconds: float) -> bool:
    """Whether `key` exists within `seconds` (the store's own wait: no polling); False on its timeout."""
    try:
        store.wait([key], timedelta(seconds=max(seconds, 0.001)))
        return True
    except Exception:  # the store's timeout (DistStoreError); a real store failure shows in the next read
        return False


def _verdict(record) -> Optional[bool]:
    """The decision a record holds, or None (none yet, or not a decision)."""
    if isinstance(record, dict) and isinstance(record.get("commit"), bool):
        return record["commit"]
    return None
