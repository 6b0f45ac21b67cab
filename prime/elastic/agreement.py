"""One attempt of an elastic outer step through the job's store: arrive, plan, report, outcome.

The decisions are the pure functions of prime/elastic/membership.py
(first_plan_due / propose_first, retry_plan_due / propose_retry, outcome_due /
decide_outcome); this is the store I/O around them. Every record is signed
under the job secret, and the plan and the outcome are first-writer-wins keys:
whoever writes them, every node reads back the same decision. Every wait reads
the heartbeats again, so a dead node is left out (and a dead coordinator's turn
passes to the next node) within the timeouts instead of waited for.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Callable, Optional

from prime.comm import store_keys as keys
from prime.elastic.membership import (Attempt, Evicted, Membership, MembershipError, Outcome, Plan, decide_outcome,
                                      first_plan_due, outcome_due, propose_first, propose_retry, retry_plan_due)
from prime.sync import FINGERPRINT_PARTS, SAME_START, ReplicaMismatchError, checks_differ

__all__ = ["OuterStepAgreement", "start_mismatches", "UNCHECKED"]

_PARTS = (("processes per node", None), *((FINGERPRINT_PARTS[j], j) for j in (2, 1, 0)))

UNCHECKED = "unchecked"
"""What an initial node whose diloco.check_replicas is false sends instead of its fingerprints: a node that does
not check would otherwise go unchecked by the others, which do."""


def start_mismatches(mine, others: dict, me: Optional[int] = None) -> list:
    """What differs between this node's fingerprints (one [weights hash, settings hash, numel] per process, in
    local-rank order, or UNCHECKED) and each other node's (node id -> the same): one line per kind of
    difference, naming the nodes; [] when all agree. me: the id of the node that `mine` is of (for the
    line on nodes that check and nodes that do not)."""
    every = {**others, **({me: mine} if me is not None else {})}
    off = sorted(i for i, t in every.items() if t == UNCHECKED)
    on = sorted(i for i, t in every.items() if t != UNCHECKED)
    if (off or mine == UNCHECKED) and (on or mine != UNCHECKED):  # some nodes check, some do not
        return [checks_differ(off, on)]
    if mine == UNCHECKED:  # no node checks
        return []
    differ: dict = {what: [] for what, _ in _PARTS}
    for i, theirs in sorted(others.items()):
        if not (isinstance(theirs, list) and all(isinstance(f, list) and len(f) == 3 for f in theirs)) \
                or len(theirs) != len(mine):
            differ["processes per node"].append(i)
            continue
        for what, j in _PARTS[1:]:
            if [f[j] for f in theirs] != [f[j] for f in mine]:
                differ[what].append(i)
    return [f"{what} differ from node(s) {ids}" for what, ids in differ.items() if ids]


class OuterStepAgreement:
    """Membership.attempt (see the module docstring): reads the node's id, signed records, heartbeat monitor
    and timeouts from `membership` at every call."""

    def __init__(self, membership: Membership):
        self.membership = membership

    def attempt(self, k: int, attempt: int, *, prev: Plan, prev_outcome: Optional[Outcome], step: int,
                since: float, allreduce: Callable[[Plan], tuple], plan: Optional[Plan] = None,
                listen: bool = False) -> Attempt:
        """One attempt of outer step k: arrive (attempt 0), agree on the plan, run `allreduce(plan)`, report
        how it went, and agree on the outcome.

        prev: the committed plan of outer step k-1 (attempt 0), else the plan of
        the failed attempt; prev_outcome: that attempt's outcome (retries).
        since: when this node started waiting (its arrival), for the barrier
        timeout. plan: an already known plan (a joiner admitted by it).
        allreduce(plan) returns (ok, error, blamed node id or -1, stats).
        listen: this member is still downloading the state: it takes part with zeros.
        Raises Evicted when the plan leaves this node out."""
        m = self.membership
        t_wait = time.monotonic()
        mine = None  # this node's fingerprints, when its arrival carries them
        if plan is None:
            if attempt == 0:
                arrival = {"step": step, "time": time.time(), **({"listen": True} if listen else {})}
                fp, m.start_fingerprint = m.start_fingerprint, None
                if fp is not None and fp[0] == k:
                    mine = arrival["fingerprint"] = fp[1]
                m.records.put(m.own_key(k, keys.arrival(k, m.node_id)), arrival)
            plan = self._await_plan(k, attempt, prev, since, step, prev_outcome)
        planned_at = time.monotonic()
        if m.node_id not in plan.members:
            raise Evicted(plan.reason_for(m.node_id))
        if mine is not None or m.node_id in plan.joined:  # (a joiner: once, at the outer step admitting it)
            self._compare_start(k, plan, mine)
        ok, error, blame, stats = allreduce(plan)
        allreduce_s = time.monotonic() - planned_at
        m.records.put(m.own_key(k, keys.result(k, plan.attempt, m.node_id)),
                      {"ok": bool(ok), "error": str(error)[:500], "blame": int(blame)})
        outcome = self._await_outcome(k, plan)
        return Attempt(plan=plan, outcome=outcome, ok=bool(ok), error=str(error), stats=stats or {},
                       planned_at=planned_at, wait_s=planned_at - t_wait, allreduce_s=allreduce_s)

    def _await_plan(self, k: int, attempt: int, prev: Plan, since: float, step: int,
                    prev_outcome: Optional[Outcome]) -> Plan:
        """The plan of attempt `attempt` of outer step k; proposes it when it is this node's turn."""
        m = self.membership
        key = keys.plan(k, attempt)
        arrived: dict = {}
        if attempt > 0 and prev_outcome is None:  # the plan of a retry follows an outcome that asked for it
            raise MembershipError(f"internal: no outcome for attempt {attempt - 1} of outer step {k}")
        while True:
            got = m.records.first(key)
            if got is not None:
                return Plan.from_dict(got)
            waited = time.monotonic() - since
            proposal = None
            if attempt == 0:
                arrivals = self._read_new(arrived, lambda i: keys.arrival(k, i), prev.members)
                view = m.monitor.view(prev.members)
                if first_plan_due(prev, arrivals, step, view, waited, m.barrier_timeout):
                    joiners = m.admission.ready_joiners(k - 1, exclude=set(prev.members))
                    proposal = propose_first(k, prev, arrivals, step, view, waited, m.barrier_timeout,
                                             joiners, now=time.time())
            else:
                view = m.monitor.view(prev_outcome.members)
                if retry_plan_due(prev_outcome, view, waited):
                    reports = []
                    if attempt - 1 >= 1:  # the reports of the live members in the last two attempts
                        live = [i for i in prev_outcome.members if not view.is_gone(i)]
                        reports = [self._results(k, a, live) for a in (attempt - 2, attempt - 1)]
                    late = m.admission.ready_joiners(k - 1, exclude=set(prev.members) | set(prev_outcome.members))
                    proposal = propose_retry(k, attempt, prev, prev_outcome, view, reports, late, now=time.time())
            if proposal is not None:
                m.records.set_first(key, asdict(proposal))
                continue  # read back the winner
            time.sleep(m.poll_s)

    def _await_outcome(self, k: int, plan: Plan) -> Outcome:
        """Waits for (or, in its turn, decides) whether the attempt commits (decide_outcome)."""
        m = self.membership
        key = keys.outcome(k, plan.attempt)
        reported: dict = {}
        t0 = time.monotonic()
        while True:
            got = m.records.first(key)
            if got is not None:
                return Outcome.from_dict(got)
            results = self._read_new(reported, lambda i: keys.result(k, plan.attempt, i), plan.members)
            view = m.monitor.view(plan.members)
            waited = time.monotonic() - t0
            if outcome_due(plan, results, view, waited, m.report_timeout):
                decision = decide_outcome(plan, results, view, waited, m.max_attempts, m.min_nodes,
                                          now=time.time())
                m.records.set_first(key, asdict(decision))
                continue
            time.sleep(m.poll_s)

    def _compare_start(self, k: int, plan: Plan, mine: Optional[list]) -> None:
        """Raises ReplicaMismatchError when fingerprints that members of the plan sent with their arrivals
        differ: an initial node's (`mine`) from another's, at its first outer step since the start; or, on a
        joiner that the plan admits (mine None: it downloads the job's state, and sent none), any two. Every
        member that sent them reads the same arrivals of the same plan, as does a joiner, so all of them
        raise before the all-reduce, or none does."""
        m = self.membership
        others = self._read_new({}, lambda i: keys.arrival(k, i), [i for i in plan.members if i != m.node_id])
        sent = {i: a["fingerprint"] for i, a in others.items() if "fingerprint" in a}
        unchecked = mine == UNCHECKED or UNCHECKED in sent.values()  # then the one problem is checks_differ's
        if mine is None:  # a joiner: the initial nodes against the lowest of them
            if len(sent) < 2:
                return
            ref = min(sent)
            problems = start_mismatches(sent.pop(ref), sent, me=ref)
            where = f"which admits this node, the initial nodes' states differ: against node {ref}'s, "
        else:
            problems = start_mismatches(mine, sent, me=m.node_id)
            where = "the first since the start, "
        if problems:
            m.log(f"outer step {k}: the initial nodes' states differ: {'; '.join(problems)}", event="mismatch", k=k)
            rule = "" if unchecked else (
                f" The initial nodes of an elastic launch must {SAME_START} (diloco.check_replicas = false on every "
                "node skips this check).")
            raise ReplicaMismatchError(f"node {m.node_id}: at outer step {k}, {where}{'; '.join(problems)}.{rule}")

    def _read_new(self, seen: dict, key_of: Callable[[int], str], ids) -> dict:
        """The valid records under key_of(i) of the nodes `ids`, reading only those not in `seen` (a node
        writes each such record once) and adding what it reads there: a wait that polls reads each round
        only the records still missing, one store round trip each, instead of every node's again."""
        missing = [i for i in ids if i not in seen]
        if missing:
            for i, v in zip(missing, self.membership.records.get_many([key_of(i) for i in missing])):
                if isinstance(v, dict):
                    seen[i] = v
        return {i: seen[i] for i in ids if i in seen}

    def _results(self, k: int, attempt: int, ids) -> dict:
        return self._read_new({}, lambda i: keys.result(k, attempt, i), list(ids))
