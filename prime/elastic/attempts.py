"""The attempts of one elastic outer step, until one commits (steps 1-3 of prime/elastic/node.py's docstring).

Each attempt is one Membership.attempt on local rank 0 (arrive, plan, the
all-reduce, report, outcome) while the node's other processes run the same
plan on their own rings (LocalRanks.lead); an attempt that failed is retried
with the survivors, on a new ring, after the caller restored its input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from prime.elastic.join import JoinInfo
from prime.elastic.local_ranks import LocalRanks
from prime.elastic.membership import Attempt, Evicted, Membership, MembershipError, Plan, reduce_op, wall
from prime.elastic.rings import ElasticRings
from prime.sync import OuterSyncError, SyncResult

__all__ = ["ElasticReport", "OuterStepAttempts"]


@dataclass
class ElasticReport:
    """What an elastic outer step did beyond OuterStepResult (its `details`)."""

    joined: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    """[id, reason] of the nodes dropped at this outer step."""
    wait_s: float = 0.0
    """From this node's arrival to the plan (waiting for the slowest node, or for the timeout of a dead one)."""
    recovery_s: Optional[float] = None
    """When the outer step lost a node: from the first failure this node saw (or its arrival, if the plan
    already dropped the node) to the commit. None when nothing failed."""
    digest: Optional[str] = None
    """SHA-256 of the outer weights and momentum after the step (elastic digest on)."""
    rejoined: Optional[JoinInfo] = None
    """Set when this node joined at this outer step (a new node, or back after an eviction): the trainer
    must take the new step and data slot."""


class OuterStepAttempts:
    """Runs the attempts of an outer step on every process of this node (see the module docstring)."""

    def __init__(self, membership: Membership, local: LocalRanks, rings: ElasticRings):
        self.membership, self.local, self.rings = membership, local, rings
        self._own: Optional[tuple] = None  # this process's (result, planned at, all-reduce s) of the attempt
        self.weighs = False
        """Token weights (time phases): before each attempt's average every member sends its count of inner
        steps on the attempt's ring (exact), and the result's counts are the contributors'."""
        self._trained: Optional[int] = None  # this node's count for the outer step being attempted
        self._counts: Optional[list] = None  # the contributors' counts of the last attempt's exchange

    def run(self, k: int, g: torch.Tensor, inner_step: int, *, prev: Plan, since: float,
            recompute: Optional[Callable[[torch.Tensor], None]] = None,
            first_plan: Optional[Plan] = None, listen: bool = False,
            trained: Optional[int] = None) -> tuple[SyncResult, tuple]:
        """Attempts outer step k until an outcome commits; g then holds the average. Returns the result and
        (plan, outcome, contributed) of the commit. prev: the committed plan of outer step k-1. trained: this
        node's count (token weights). Raises Evicted."""
        m = self.membership
        self._trained, self._counts = trained, None
        me = m.node_id
        plan = first_plan
        outcome = None
        attempt = plan.attempt if plan is not None else 0
        first_failure: Optional[float] = None
        stats, ar_s, wait_s = {}, 0.0, 0.0
        lost: list = []
        while True:
            a = self._attempt(k, attempt, prev=prev, prev_outcome=outcome, step=inner_step,
                              since=since if attempt == 0 else time.monotonic(), plan=plan, g=g, listen=listen)
            plan, outcome, ok, err, st = a.plan, a.outcome, a.ok, a.error, a.stats
            wait_s, ar_s = wait_s + a.wait_s, ar_s + a.allreduce_s
            contributes = me in plan.contributors
            if plan.evicted:
                lost += plan.evicted
                if first_failure is None:
                    first_failure = since if attempt == 0 else a.planned_at
            if not ok and first_failure is None:
                first_failure = a.planned_at + a.allreduce_s
            if outcome.commit:
                if me not in outcome.members:
                    raise Evicted(f"outer step {k} committed without this node's result ({err or 'it was late'})")
                if not ok:  # no outcome decided from this run's reports commits a member whose all-reduce failed:
                    # g holds this node's own input, not the average; applying it would split the replicas
                    raise Evicted(f"outer step {k}: the outcome commits with this node among its members, but this "
                                  f"node's all-reduce failed ({err}); not applying it")
                if outcome.missing:  # died after its data went through: the average has it, the node is out
                    lost += outcome.missing
                    m.log(f"outer step {k} committed by nodes {outcome.members}; " + "; ".join(
                        f"node {i} evicted: {w} (its pseudo-gradient is in the average)" for i, w in outcome.missing),
                        event="commit_without", k=k, members=outcome.members, missing=outcome.missing)
                stats = st
                self.rings.committed(k)
                break
            self.rings.drop()
            if first_failure is None:
                first_failure = time.monotonic()
            lost += outcome.missing
            self._failed(k, plan, outcome)
            if me not in outcome.members:
                raise Evicted(f"left out of the retry of outer step {k}")
            if contributes and ok and recompute is not None:
                recompute(g)  # our all-reduce had worked: restore our own input
            prev, plan, attempt = plan, None, plan.attempt + 1
        _, divisor = reduce_op(plan)
        if divisor != 1:
            g.div_(divisor)  # the sum over the contributors -> their average
        return SyncResult(
            members=list(outcome.members), contributors=len(plan.contributors), attempts=plan.attempt + 1,
            allreduce_s=ar_s, stats=stats, contributed=contributes, outer_step=k, inner_step=plan.step,
            counts=self._counts if self.weighs else None,
            details=ElasticReport(joined=list(plan.joined), evicted=[list(x) for x in lost], wait_s=wait_s,
                                  recovery_s=None if first_failure is None else time.monotonic() - first_failure),
        ), (plan, outcome, contributes)

    def _failed(self, k: int, plan: Plan, outcome) -> None:
        """Logs an attempt that did not commit; raises OuterSyncError when the job cannot go on."""
        self.membership.log(
            f"outer step {k} attempt {plan.attempt} failed ("
            + "; ".join([f"node {i}: {e}" for i, e in outcome.failed.items()]
                        + [f"node {i}: {w}" for i, w in outcome.missing]) + ")",
            event="attempt_failed", k=k, attempt=plan.attempt, failed=outcome.failed, missing=outcome.missing)
        if outcome.give_up:
            raise OuterSyncError(outcome.give_up)

    def lead(self, fn: Callable[[], object], k: int, g: Optional[torch.Tensor] = None):
        """LocalRanks.lead: fn() on local rank 0, its value on every process of the node; meanwhile the other
        processes run the all-reduce of every plan local rank 0 hands them (_node_allreduce), on their own ring."""
        return self.local.lead(fn, k, lambda plan: self._follow(k, plan, g))

    def _attempt(self, k: int, attempt: int, *, prev: Plan, prev_outcome, step: int, since: float,
                 plan: Optional[Plan], g: torch.Tensor, listen: bool = False) -> Attempt:
        """One attempt of outer step k on every process of the node (Membership.attempt on local rank 0).
        ok, error and stats are this process's own ring's: a process whose all-reduce worked restores its
        input before a retry, whatever the node's other rings did."""
        m = self.membership
        self._own = None
        t0 = time.monotonic()
        a = self.lead(lambda: m.attempt(k, attempt, prev=prev, prev_outcome=prev_outcome, step=step, since=since,
                                        plan=plan, allreduce=lambda p: self._node_allreduce(k, p, g),
                                        listen=listen), k, g)
        if self._own is None:  # assert: the plan names this node (else Evicted was raised)
            raise MembershipError(f"internal: outer step {k}: no all-reduce ran for the plan")
        (ok, err, _, stats), planned_at, ar_s = self._own
        return Attempt(plan=a.plan, outcome=a.outcome, ok=bool(ok), error=str(err), stats=stats or {},
                       planned_at=planned_at, wait_s=planned_at - t0, allreduce_s=ar_s)

    def _node_allreduce(self, k: int, plan: Plan, g: torch.Tensor):
        """Local rank 0's all-reduce of an attempt: hands the plan to the node's other processes, runs its
        own ring, and reports the node's combined result to the membership."""
        self.local.hand_out(plan)
        t0 = time.monotonic()
        res = self._allreduce_plan(k, plan, g)
        self._own = (res, t0, time.monotonic() - t0)
        return self.local.combine(res)

    def _follow(self, k: int, plan: Plan, g: torch.Tensor) -> None:
        """Another process's all-reduce of the plan local rank 0 handed out, on its own ring."""
        t0 = time.monotonic()
        res = self._allreduce_plan(k, plan, g)
        self.local.combine(res)
        self._own = (res, t0, time.monotonic() - t0)

    def _allreduce_plan(self, k: int, plan: Plan, g: torch.Tensor):
        """The all-reduce of one attempt (Membership.attempt calls it once the plan is known)."""
        self._log_plan(plan)
        if self.weighs:
            counts, failed = self._exchange_counts(k, plan)
            if failed is not None:
                return failed
            self._counts = counts
        if self.membership.node_id not in plan.contributors:
            g.zero_()  # a joiner receives the average without adding to it
        return self.rings.allreduce(k, plan, g, reduce_op(plan)[0])

    def _exchange_counts(self, k: int, plan: Plan) -> tuple:
        """Every member's count on the attempt's ring (an exact sum of 16-bit pieces in each member's own slots:
        authenticated, and the same on every member); a node that does not contribute sends 0. Returns (the
        contributors' counts in member order, None) or (None, the failed all-reduce's result)."""
        from prime.weights import LIMBS, from_limbs, to_limbs

        me, members = self.membership.node_id, plan.members
        vec = torch.zeros(len(members) * LIMBS, dtype=torch.float32)
        mine = (self._trained or 0) if me in plan.contributors else 0
        at = members.index(me) * LIMBS
        vec[at : at + LIMBS] = torch.tensor(to_limbs(mine), dtype=torch.float32)
        res = self.rings.allreduce(k, plan, vec, "sum", codec="none")
        if not res[0]:
            return None, res
        table = vec.view(len(members), LIMBS).to(torch.int64).tolist()
        return [from_limbs(table[i]) for i, node in enumerate(members) if node in plan.contributors], None

    def _log_plan(self, plan: Plan) -> None:
        if plan.attempt == 0 and not plan.joined and not plan.evicted:
            return  # the same members as before: nothing to say
        parts = []
        if plan.joined:
            parts.append(f"joined: {plan.joined}")
        for i, why in plan.evicted:
            parts.append(f"node {i} evicted: {why}")
        self.membership.log(
            f"outer step {plan.k} attempt {plan.attempt}: nodes {plan.members} ({'; '.join(parts) or 'retry'}), "
            f"decided by node {plan.by} at {wall(plan.time)}",
            event="plan", k=plan.k, attempt=plan.attempt, members=plan.members, joined=plan.joined,
            evicted=plan.evicted, by=plan.by, decided_at=plan.time)
