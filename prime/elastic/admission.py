"""Joins through the job's store: a joiner's offer, its wait for admission, and where it downloads from.

A joiner signs a join offer (it holds the state after outer step s, or listens);
the coordinator of the next outer step reads the offers that are signed with the
job secret and alive (ready_joiners) and admits them in its plan. A joiner
downloads the state from the live members of the newest committed outer step, at
the addresses they signed (live_sources). A record that is not validly signed is
ignored, and reported.
"""

from __future__ import annotations

import time
from typing import Optional

from prime.comm import store_keys as keys
from prime.comm.signed_store import read_counter
from prime.elastic.membership import (MAX_JOINERS, NEW_IDS_PER_SWEEP, JobFinished, JoinError, Membership,
                                      Outcome, Plan)

__all__ = ["Admission"]


class Admission:
    """Membership's joins (see the module docstring): reads the node's id, signed records and heartbeat monitor
    from `membership` at every call."""

    def __init__(self, membership: Membership):
        self.membership = membership
        self._warned: set[int] = set()  # nodes whose unsigned join offer was already reported

    # -- the joiner ----------------------------------------------------------------------

    def set_ready(self, outer_step: int, listen: bool = False) -> None:
        """Tells the coordinator that this node holds the state after outer_step and may be admitted at the next;
        listen: admit it at any outer step (it downloads the state while it takes part with zeros)."""
        m = self.membership
        m.records.put(keys.join_offer(m.node_id), {"node": m.node_id, "outer_step": outer_step,
                                                   **({"listen": True} if listen else {})})

    def clear_ready(self) -> None:
        """Withdraws this node's join offer (it was admitted)."""
        try:
            self.membership.store.delete_key(keys.join_offer(self.membership.node_id))
        except Exception:  # only tidiness: a stale ready entry is ignored anyway
            pass

    def await_admission(self, outer_step: int, last_step: Optional[int], timeout_s: float) -> Optional[Plan]:
        """Waits to be admitted at outer step outer_step + 1. Returns the plan, or None when the job moved on
        without this node (download a newer state). last_step: the inner step of the job's last outer step
        (None: open-ended). Raises JobFinished / JoinError."""
        m = self.membership
        k = outer_step + 1
        attempt = 0
        deadline = time.monotonic() + timeout_s
        while True:
            got = m.records.first(keys.plan(k, attempt))
            if got is not None:
                plan = Plan.from_dict(got)
                # An attempt that was decided already is over, with this node in it or not (a node evicted at
                # a later attempt of the same outer step finds its earlier plans here): the next one, or a newer
                # state where it committed.
                out = m.records.first(keys.outcome(k, attempt))
                if out is not None:
                    if Outcome.from_dict(out).commit:
                        return None
                    attempt += 1
                    continue
                if m.node_id in plan.members:
                    return plan
            latest = m.latest_committed()
            if latest is not None and int(latest["k"]) >= k:
                return None
            if latest is not None and last_step is not None and int(latest["step"]) >= last_step:
                raise JobFinished(f"the job committed its last outer step (at step {latest['step']}) before this "
                                  "node was admitted")
            members = latest["members"] if latest is not None else list(range(m.initial_nodes))
            if all(m.monitor.gone(i) for i in members):
                raise JoinError(f"every member of the job ({members}) is gone; nobody left to admit this node"
                                + self._secret_hint())
            if time.monotonic() > deadline:
                raise JoinError(f"not admitted at outer step {k} within {timeout_s:g} s (elastic.join_timeout_s)")
            time.sleep(m.poll_s * 5)

    def live_sources(self, last_step: Optional[int] = None) -> list[tuple[int, str]]:
        """(id, address) of the live members of the newest committed outer step: where to download the state.

        last_step: the inner step of the job's last outer step (None: open-ended). Raises
        JobFinished once the job committed that outer step (none is left to be admitted at:
        the members only finish their inner steps and exit), JoinError when they are all gone."""
        m = self.membership
        latest = m.latest_committed()
        if latest is not None and last_step is not None and int(latest["step"]) >= last_step:
            raise JobFinished(f"the job already committed its last outer step (at step {latest['step']})")
        members = latest["members"] if latest is not None else list(range(m.initial_nodes))
        if all(i == m.node_id or m.monitor.gone(i) for i in members):
            raise JoinError(f"every member of the job ({members}) is gone: nobody to download the state from"
                            + self._secret_hint())
        out, forged = [], 0
        live = [i for i in members if i != m.node_id and not m.monitor.gone(i)]
        ks = [keys.state_addr(i, m.local_rank) for i in live]  # local rank g downloads shard g from local rank g
        for i, key, raw in zip(live, ks, m.records.raw_many(ks)):  # never waits for a key deleted meanwhile
            addr = None if raw is None else m.records.open(key, raw)
            if isinstance(addr, str):
                out.append((i, addr))
            elif raw is not None:
                forged += 1
                m.records.reject(key)
        if forged and not out and latest is None:
            raise JoinError(
                f"node {m.node_id} could not download the job's state: the address records of its members "
                f"{members} are not signed with this node's secret (and no committed outer step is): this node's "
                "PRIME_RING_SECRET differs from the job's (or a stranger rewrote them)")
        return out

    def _secret_hint(self) -> str:
        records = self.membership.records
        if records is not None and records.rejected:
            return (" (this node ignored store records not signed with its secret: if the job runs, this node's "
                    "PRIME_RING_SECRET differs from the job's)")
        return ""

    # -- the coordinator -------------------------------------------------------------------

    def ready_joiners(self, outer_step: int, exclude: set) -> list[int]:
        """Joiners that hold the state after `outer_step`, signed their offer with the job secret, and are alive."""
        m = self.membership
        out = []
        n = m.initial_nodes + min(read_counter(m.store, keys.JOINERS), MAX_JOINERS)
        # Read: the offers of the nodes whose heartbeat record the monitor found (a joiner writes one when it
        # registers) and of the newest ids (one that registered since the monitor's last sweep), but not of
        # those that beat and are gone since, whose ids pile up over a long run with many joins (a read is a
        # store round trip at most) and whose offers would not count. One that never beat with a valid record
        # is read, so that a node signing with another secret is reported.
        newest = range(max(m.initial_nodes, n - NEW_IDS_PER_SWEEP // 2), n)
        ids = [i for i in sorted(set(m.monitor.known_ids()) | set(newest))
               if i < n and i not in exclude and not (m.monitor.was_seen(i) and m.monitor.gone(i))]
        ks = [keys.join_offer(i) for i in ids]
        for i, key, raw in zip(ids, ks, m.records.raw_many(ks)):  # never waits for a key deleted meanwhile
            if raw is None:
                continue
            d = m.records.open(key, raw)
            if not isinstance(d, dict) or d.get("node") != i:
                if i not in self._warned:
                    self._warned.add(i)
                    m.log(f"ignoring node {i}: its join request is not signed with the job secret",
                          event="reject", node=i)
                continue
            if (int(d.get("outer_step", -1)) == outer_step or d.get("listen") is True) and not m.monitor.gone(i):
                out.append(i)
        return out
