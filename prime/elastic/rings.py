"""The rings of an elastic node: one per attempt of an outer step, reused across outer steps when it can be.

ElasticRings makes (or reuses) the ring for a plan's members and runs one
all-reduce attempt on it, giving up early when a member dies: while the ring
forms and while the all-reduce runs, it polls the heartbeat monitor, so that a
dead peer gives an error on every survivor at once instead of a wait for the
ring's timeout. ElasticSync (prime/elastic/node.py) holds one per process.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch

from prime import faults
from prime.codecs import wire_codec
from prime.elastic.membership import Membership, Plan
from prime.sync import is_comm_error, start_all_reduce, work_stats

__all__ = ["ElasticRings"]


class ElasticRings:
    """The ring of this process for the members of a plan (ring g: local rank g of every member).

    timeout_s, streams, max_rate, quant_error: the rings' settings (prime.comm.Ring);
    codec and block_size: what the all-reduce puts on the wire (ElasticSync.bind sets them).
    """

    def __init__(self, membership: Membership, *, timeout_s: float, streams: Optional[int],
                 max_rate: Optional[float], quant_error: bool):
        self.membership = membership
        self.timeout_s, self.streams, self.max_rate, self.quant_error = timeout_s, streams, max_rate, quant_error
        self.codec, self.block_size = "int8", 64
        self.dense: Callable[[int], bool] = lambda k: False  # a sparse codec's dense start (FragmentSchedule.dense)
        self.keep: Optional[int] = None  # topk: the values kept per chunk
        self.keep_average: Optional[int] = None  # topk: the values an owner keeps per chunk of the average
        self.dropped: Optional[torch.Tensor] = None
        """topk: what the owners' selections of this process's last all-reduce dropped (kept only when its
        attempt commits: ElasticSync takes it then)."""
        self.ring = None
        self.link_history: dict = {}  # what the rings so far measured of the links (Ring.link_history)
        self._members: Optional[list] = None
        self._k: Optional[int] = None  # the outer step last committed through self.ring
        self._attempt: Optional[tuple] = None  # (outer step, attempt) self.ring serves now

    def allreduce(self, k: int, plan: Plan, g: torch.Tensor, op: str, codec: Optional[str] = None):
        """One attempt: (ok, error message, blamed node or -1, stats). Gives up early when a member dies.
        codec: the wire codec (None: the outer step's); a second all-reduce of the same attempt (token counts
        before the average) goes through the same ring."""
        members = plan.members
        codec, block_size = wire_codec(self.codec, self.block_size, self.dense(k)) if codec is None else \
            (codec, self.block_size)
        if codec == "topk":
            self.dropped = None
        if len(members) == 1:
            self.drop()
            return True, "", -1, {}
        if self.membership.monitor is not None:  # a joiner this node's monitor has not swept yet is not dead
            self.membership.monitor.expect(members)
        # The ring of outer step k-1 serves again only when every member holds it: the same members
        # committed k-1 through it, and nobody joins now (a joiner, or a node back from an eviction,
        # has none). Otherwise a fresh ring under a fresh name.
        # A second all-reduce of the same attempt (token counts first) uses the attempt's ring.
        reuse = self.ring is not None and self._members == members and (
            (self._k == k - 1 and plan.attempt == 0 and not plan.joined) or self._attempt == (k, plan.attempt))
        if not reuse:
            failed = self._form(k, plan.attempt, members)
            if failed is not None:
                return failed
        self._attempt = (k, plan.attempt)
        ring = self.ring
        self._k = None  # set again once this outer step commits through it
        try:
            work, dropped = start_all_reduce(ring, g, op, codec, block_size, self.keep, self.keep_average)
            if dropped is not None:
                self.dropped = dropped
            faults.hit("allreduce.inside", k, log=self.membership.log)
            while not work.is_completed():
                dead = self._dead_member(members)
                if dead is not None:
                    self.drop()  # the others see "closed" at once; everyone reports and retries
                    return False, f"node {dead} died during the all-reduce", dead, {}
                time.sleep(0.005)
            work.wait()
            return True, "", -1, work_stats(work)
        except Exception as e:
            if not is_comm_error(e):
                raise
            self.drop()
            return False, str(e), _blame(e, members, self.membership.node_id), {}

    def _form(self, k: int, attempt: int, members: list) -> Optional[tuple]:
        """Builds a fresh ring for `members` on a thread; None once it stands, else the attempt's failed result
        (a member died meanwhile, or the ring could not form)."""
        self.drop()
        builder = _RingBuilder(lambda: self._make(k, attempt, members))
        builder.start()
        while builder.is_alive():
            dead = self._dead_member(members)
            if dead is not None:
                builder.abandon()
                return False, f"node {dead} died while the ring was forming", dead, {}
            builder.join(timeout=0.02)
        if builder.error is not None:
            e = builder.error
            if not is_comm_error(e):
                raise e
            return False, str(e), _blame(e, members, self.membership.node_id), {}
        self.ring, self._members = builder.ring, list(members)
        return None

    def _make(self, k: int, attempt: int, members: list):
        from prime.comm import Ring

        m = self.membership
        rank = members.index(m.node_id)
        store, job_id = m.ring_store(k, attempt, rank)
        kwargs = {"timeout": timedelta(seconds=self.timeout_s), "secret": m.secret,
                  "job_id": job_id, "quant_error": self.quant_error}
        if self.streams:
            kwargs["streams"] = self.streams
        if self.max_rate:
            kwargs["max_rate"] = self.max_rate
        # What the earlier rings measured of the links: the new members' order is planned with it.
        kwargs["link_history"] = self.link_history
        return Ring(store, rank, len(members), **kwargs)

    def _dead_member(self, members: list) -> Optional[int]:
        return next((i for i in members if self.membership.gone(i)), None)

    def committed(self, k: int) -> None:
        """Outer step k committed through the current ring (if any): it may serve outer step k+1."""
        if self.ring is not None:
            self._k = k

    def drop(self) -> None:
        """Closes the current ring (keeping what it measured of the links for the next ring's order)."""
        if self.ring is not None:
            self.link_history = getattr(self.ring, "link_history", dict)()  # for the next ring's order
            try:
                self.ring.close()
            except Exception:  # already broken; closing is best effort
                pass
        self.ring, self._members, self._k, self._attempt = None, None, None, None


class _RingBuilder(threading.Thread):
    """Builds a Ring on a thread, so that the caller can give up on it when a member dies meanwhile."""

    def __init__(self, factory: Callable[[], object]):
        super().__init__(daemon=True, name="prime-elastic-ring")
        self._factory = factory
        self._lock = threading.Lock()
        self.abandoned = False
        self.ring = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            ring = self._factory()
        except BaseException as e:  # reported to the caller
            self.error = e
            return
        with self._lock:
            if self.abandoned:
                ring.close()
            else:
                self.ring = ring

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            if self.ring is not None:
                self.ring.close()
                self.ring = None


def _blame(e: BaseException, members: list, me: int) -> int:
    """The node a ring error points at, as a node id (-1: none).

    A failure this rank saw itself (lost connection, timeout, corrupt frame,
    failed handshake) names the neighbour involved. A failure relayed from
    another rank ("peer_failed") names only the rank that noticed first, which
    is usually not the culprit: no blame."""
    if getattr(e, "kind", "") == "peer_failed":
        return -1
    r = getattr(e, "peer", -1)
    if isinstance(r, int) and 0 <= r < len(members) and members[r] != me:
        return members[r]
    return -1
