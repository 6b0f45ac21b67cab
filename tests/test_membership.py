"""The elastic membership decisions as pure functions (prime.elastic.membership): no store, no processes.

Each decision takes what a node has read (arrivals, results, a View of who is
gone, ready joiners) and returns a plan or an outcome; these tests check them
against the rules of docs/elastic.md in milliseconds. The store I/O around them
is tested in test_elastic.py (processes) and test_store_security.py.
"""

import random

import pytest
import torch

from prime.elastic.membership import (
    Evicted,
    MembershipError,
    Outcome,
    Plan,
    View,
    decide_outcome,
    first_plan_due,
    most_blamed,
    outcome_due,
    propose_first,
    propose_retry,
    reduce_op,
    retry_plan_due,
)


def committed(ids, step=10, k=1):
    return Plan(k=k, attempt=0, members=list(ids), contributors=list(ids), slots={str(i): i for i in ids}, step=step)


def view(me, gone=(), silent=None, timeout=10.0, interval=1.0):
    return View(me=me, gone={i: f"node {i} is dead" for i in gone}, silent=dict(silent or {}),
                hb_interval=interval, hb_timeout=timeout)


# -- the plan of attempt 0 ---------------------------------------------------------------------------


def test_everyone_arrived_the_lowest_id_plans_at_once_and_the_others_wait():
    prev = committed([0, 1, 2])
    arrivals = {0: {"step": 20}, 1: {"step": 20}, 2: {"step": 20}}
    assert first_plan_due(prev, arrivals, 20, view(0), 0.0, 60)
    assert not first_plan_due(prev, arrivals, 20, view(1), 0.0, 60)
    plan = propose_first(2, prev, arrivals, 20, view(0), 0.0, 60, joiners=[])
    assert plan.members == plan.contributors == [0, 1, 2] and plan.evicted == [] and plan.joined == []
    assert plan.slots == {"0": 0, "1": 1, "2": 2} and plan.step == 20 and plan.k == 2 and plan.by == 0
    assert reduce_op(plan) == ("avg", 1)


def test_a_listener_stays_a_member_without_contributing_and_keeps_its_slot():
    # node 3 joined earlier and still downloads the state: it arrives with "listen" and takes part with zeros
    prev = Plan(k=4, attempt=0, members=[0, 2, 3], contributors=[0, 2], slots={"0": 0, "2": 2, "3": 1}, step=20)
    arrivals = {0: {"step": 25}, 2: {"step": 25}, 3: {"step": 25, "listen": True}}
    assert first_plan_due(prev, arrivals, 25, view(0), 0.0, 60)  # the barrier waits for listeners too
    assert not first_plan_due(prev, {0: {"step": 25}, 2: {"step": 25}}, 25, view(0), 0.0, 60)
    plan = propose_first(5, prev, arrivals, 25, view(0), 0.0, 60, joiners=[4])
    assert plan.members == [0, 2, 3, 4] and plan.contributors == [0, 2] and plan.joined == [4]
    assert plan.slots == {"0": 0, "2": 2, "3": 1, "4": 3} and plan.evicted == []
    assert reduce_op(plan) == ("sum", 2)  # the average over the two contributors only
    # the listener coordinating (lowest live id) decides the same: its own "listen" is kept
    prev = Plan(k=4, attempt=0, members=[1, 2], contributors=[2], slots={"1": 1, "2": 2}, step=20)
    arrivals = {1: {"step": 25, "listen": True}, 2: {"step": 25}}
    plan = propose_first(5, prev, arrivals, 25, view(1), 0.0, 60, joiners=[])
    assert plan.members == [1, 2] and plan.contributors == [2]


def test_the_coordinator_waits_for_a_live_node_until_the_barrier_timeout():
    prev = committed([0, 1, 2])
    arrivals = {0: {"step": 20}, 2: {"step": 20}}  # node 1 is alive but not there yet
    assert not first_plan_due(prev, arrivals, 20, view(0), 59.0, 60)
    assert first_plan_due(prev, arrivals, 20, view(0), 60.0, 60)
    plan = propose_first(2, prev, arrivals, 20, view(0), 60.0, 60, joiners=[])
    assert plan.members == [0, 2]
    assert [i for i, _ in plan.evicted] == [1] and "missed the outer-step barrier" in plan.evicted[0][1]


def test_a_dead_node_is_not_waited_for_and_is_evicted_with_the_reason():
    prev = committed([0, 1, 2])
    arrivals = {0: {"step": 20}, 2: {"step": 20}}
    v = view(0, gone=[1])
    assert first_plan_due(prev, arrivals, 20, v, 0.0, 60)
    plan = propose_first(2, prev, arrivals, 20, v, 0.0, 60, joiners=[])
    assert plan.members == [0, 2] and plan.evicted == [[1, "node 1 is dead"]]


def test_the_next_in_line_takes_over_after_its_grace_when_the_coordinator_is_silent():
    prev = committed([0, 1, 2])
    arrivals = {0: {"step": 20}, 1: {"step": 20}, 2: {"step": 20}}
    # node 0 arrived but does not decide (say it hangs): node 1 decides after timeout + 1 grace, node 2 after 2
    assert not first_plan_due(prev, arrivals, 20, view(1, timeout=5), 60 + 4.9, 60)
    assert first_plan_due(prev, arrivals, 20, view(1, timeout=5), 60 + 5.0, 60)
    assert not first_plan_due(prev, arrivals, 20, view(2, timeout=5), 60 + 9.9, 60)
    assert first_plan_due(prev, arrivals, 20, view(2, timeout=5), 60 + 10.0, 60)


def test_a_node_at_another_inner_step_is_evicted():
    prev = committed([0, 1, 2])
    arrivals = {0: {"step": 20}, 1: {"step": 15}, 2: {"step": 20}}
    plan = propose_first(2, prev, arrivals, 20, view(0), 0.0, 60, joiners=[])
    assert plan.members == plan.contributors == [0, 2]
    assert plan.evicted == [[1, "arrived at inner step 15, the others at 20"]]


def test_joiners_take_part_without_contributing_and_get_the_free_slots():
    prev = Plan(k=3, attempt=0, members=[0, 2], contributors=[0, 2], slots={"0": 0, "2": 2}, step=30)
    arrivals = {0: {"step": 30}, 2: {"step": 30}}
    plan = propose_first(4, prev, arrivals, 30, view(0), 0.0, 60, joiners=[5, 4, 0])  # 0 is no joiner
    assert plan.members == [0, 2, 4, 5] and plan.contributors == [0, 2] and plan.joined == [4, 5]
    assert plan.slot_of(4) == 1 and plan.slot_of(5) == 3 and plan.slot_of(0) == 0 and plan.slot_of(2) == 2
    assert reduce_op(plan) == ("sum", 2)


def test_random_first_plans_follow_the_rules():
    """On random candidates, arrivals, deaths and joiners: every candidate is either a contributor or evicted
    with a reason; contributors arrived alive at the coordinator's step; slots are distinct."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(300):
        cands = sorted(rng.sample(range(12), rng.randint(1, 8)))
        me = rng.choice(cands)
        arrivals = {i: {"step": rng.choice([40, 40, 40, 35])} for i in cands if rng.random() < 0.8}
        arrivals[me] = {"step": 40}
        gone = [i for i in cands if i != me and rng.random() < 0.2]
        joiners = [j for j in range(12, 16) if rng.random() < 0.3]
        plan = propose_first(5, committed(cands, step=35, k=4), arrivals, 40, view(me, gone), 61.0, 60, joiners)
        want = sorted(i for i in cands if i in arrivals and i not in gone and arrivals[i]["step"] == 40)
        assert plan.contributors == want, (seed, plan)
        assert plan.members == sorted(want + joiners) and plan.joined == sorted(joiners)
        assert sorted(i for i, _ in plan.evicted) == sorted(set(cands) - set(want)), (seed, plan)
        assert all(why for _, why in plan.evicted)
        slots = [plan.slot_of(i) for i in plan.members]
        assert len(set(slots)) == len(slots) and all(plan.slot_of(i) == i for i in want)


# -- outcomes ------------------------------------------------------------------------------------------


def plan_of(members, contributors=None, attempt=0, k=7):
    contributors = members if contributors is None else contributors
    return Plan(k=k, attempt=attempt, members=list(members), contributors=list(contributors),
                slots={str(i): n for n, i in enumerate(members)}, step=70)


def ok():
    return {"ok": True, "error": "", "blame": -1}


def failed(blame=-1, error="connection lost"):
    return {"ok": False, "error": error, "blame": blame}


def test_every_member_succeeded_commit():
    p = plan_of([0, 1, 2])
    results = {0: ok(), 1: ok(), 2: ok()}
    assert outcome_due(p, results, view(0), 0.0, 30) and not outcome_due(p, results, view(1), 0.0, 30)
    o = decide_outcome(p, results, view(0), 0.0, max_attempts=5, min_nodes=1)
    assert o.commit and o.members == [0, 1, 2] and o.failed == {} and o.missing == [] and not o.give_up


def test_a_member_that_died_after_its_data_went_through_is_dropped_from_the_commit():
    p = plan_of([0, 1, 2])
    results = {0: ok(), 2: ok()}
    assert not outcome_due(p, results, view(0), 1.0, 30)  # node 1 is alive: wait for its report
    assert outcome_due(p, results, view(0, gone=[1]), 1.0, 30)
    o = decide_outcome(p, results, view(0, gone=[1]), 1.0, max_attempts=5, min_nodes=1)
    assert o.commit and o.members == [0, 2] and [i for i, _ in o.missing] == [1]


def test_a_blamed_silent_member_is_not_waited_for():
    p = plan_of([0, 1, 2])
    results = {0: failed(blame=1), 2: failed(blame=1)}
    assert not outcome_due(p, results, view(0, silent={1: 2.9}), 0.1, 30)
    v = view(0, silent={1: 3.1})
    assert outcome_due(p, results, v, 0.1, 30)
    o = decide_outcome(p, results, v, 0.1, max_attempts=5, min_nodes=1)
    assert not o.commit and not o.give_up and o.members == [0, 2] and set(o.failed) == {"0", "2"}


def test_a_failure_is_retried_then_the_job_gives_up_after_max_attempts():
    p = plan_of([0, 1], attempt=3)
    results = {0: failed(), 1: failed()}
    o = decide_outcome(p, results, view(0), 0.0, max_attempts=5, min_nodes=1)
    assert not o.commit and not o.give_up and o.members == [0, 1]
    o = decide_outcome(plan_of([0, 1], attempt=4), results, view(0), 0.0, max_attempts=5, min_nodes=1)
    assert not o.commit and "failed 5 times" in o.give_up


def test_too_few_contributors_left_gives_up():
    p = plan_of([0, 1, 2, 3], contributors=[0, 1, 2])  # 3 is a joiner
    results = {0: failed(), 3: failed()}
    o = decide_outcome(p, results, view(0, gone=[1, 2]), 0.0, max_attempts=5, min_nodes=2)
    assert not o.commit and "fewer than elastic.min_nodes (2)" in o.give_up


def test_nobody_reported_ok_is_no_commit():
    p = plan_of([0])
    o = decide_outcome(p, {}, view(0), 40.0, max_attempts=5, min_nodes=1)
    assert not o.commit


# -- retries -------------------------------------------------------------------------------------------


def test_a_retry_goes_on_with_the_live_members_and_admits_late_joiners():
    prev = plan_of([0, 1, 2])
    out = Outcome(k=7, attempt=0, commit=False, members=[0, 2], failed={"0": "lost 1"},
                  missing=[[1, "did not report attempt 0"]])
    assert retry_plan_due(out, view(0), 0.0) and not retry_plan_due(out, view(2), 0.0)
    assert retry_plan_due(out, view(2, timeout=5), 5.0)  # node 0 silent: node 2 after one grace
    plan = propose_retry(7, 1, prev, out, view(0), [], late_joiners=[9])
    assert plan.attempt == 1 and plan.members == [0, 2, 9] and plan.contributors == [0, 2] and plan.joined == [9]
    assert plan.slot_of(9) == 1 and [i for i, _ in plan.evicted] == [1] and plan.step == prev.step


def test_the_same_members_failing_twice_leave_out_the_most_blamed():
    prev = plan_of([0, 1, 2], attempt=1)
    out = Outcome(k=7, attempt=1, commit=False, members=[0, 1, 2], failed={"0": "x", "2": "y"})
    reports = [{0: failed(blame=1), 2: failed(blame=1)}, {0: failed(blame=1), 1: failed(blame=2)}]
    assert most_blamed(reports, [0, 1, 2]) == 1
    plan = propose_retry(7, 2, prev, out, view(0), reports, late_joiners=[])
    assert plan.members == [0, 2] and plan.evicted[-1][0] == 1 and "blamed" in plan.evicted[-1][1]
    # the first retry keeps everyone (no reports passed: a transient failure)
    first = propose_retry(7, 1, plan_of([0, 1, 2]), Outcome(k=7, attempt=0, commit=False, members=[0, 1, 2],
                                                             failed={"0": "x"}), view(0), [], [])
    assert first.members == [0, 1, 2]


def test_a_node_left_out_of_the_retry_never_plans_it():
    out = Outcome(k=7, attempt=0, commit=False, members=[0, 2], failed={"0": "x"})
    assert not retry_plan_due(out, view(1), 1e9)


# -- the average is over the contributors ---------------------------------------------------------------


@pytest.mark.parametrize("joiners", [0, 1, 2])
def test_the_elastic_average_is_over_the_contributors(joiners):
    """Members all-reduce with reduce_op(plan): joiners send zeros, the ring sums (or averages) in fp32, and
    every node divides by the divisor. The result is the float64 mean of the contributors' tensors only."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    contributors = [0, 1, 2]
    members = contributors + [10 + j for j in range(joiners)]
    plan = plan_of(members, contributors)
    grads = {i: torch.randn(1000, generator=gen) if i in contributors else torch.zeros(1000) for i in members}
    op, divisor = reduce_op(plan)
    total = torch.zeros(1000)
    for i in members:  # a ring in ring order, fp32 like the exact codec
        total += grads[i]
    got = total / len(members) if op == "avg" else total
    if divisor != 1:
        got = got / divisor
    want = torch.stack([grads[i].double() for i in contributors]).mean(0)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6), (seed, (got.double() - want).abs().max())
    # averaging over the members instead would be off by a factor len(contributors) / len(members)
    if joiners:
        wrong = total.double() / len(members)
        assert not torch.allclose(wrong, want, rtol=0, atol=1e-3)


def test_an_outcome_that_commits_a_member_whose_all_reduce_failed_is_not_applied():
    """No outcome decided from this run's reports commits a member whose all-reduce failed (decide_outcome above),
    but one read from the store might (a record of another run): the node leaves (Evicted, to join again) instead
    of applying what its buffer holds, its own pseudo-gradient, as the average."""
    from types import SimpleNamespace

    from prime.elastic.attempts import OuterStepAttempts
    from prime.elastic.membership import Attempt, Evicted, Outcome, Plan

    plan = Plan(k=3, attempt=0, members=[0, 1], contributors=[0, 1], slots={}, step=30)
    outcome = Outcome(k=3, attempt=0, commit=True, members=[0, 1])
    attempts = OuterStepAttempts(SimpleNamespace(node_id=1, log=lambda *a, **kw: None), None, None)
    attempts._attempt = lambda *a, **kw: Attempt(plan=plan, outcome=outcome, ok=False, error="connection lost",
                                                 stats={}, planned_at=0.0, wait_s=0.0, allreduce_s=0.0)
    g = torch.randn(8)
    before = g.clone()
    with pytest.raises(Evicted, match="this node's all-reduce failed"):
        attempts.run(3, g, 30, prev=plan, since=0.0)
    assert torch.equal(g, before)


def test_local_rank_0s_errors_reach_the_other_processes_named_by_where_they_happened():
    """LocalRanks' _portable: what the node's other processes raise for local rank 0's error. Decisions pass
    as they are (ReplicaMismatchError too: every process stops alike); other errors become MembershipError
    naming the outer step, or the registration."""
    import torch.distributed as dist

    from prime.elastic.local_ranks import _portable
    from prime.sync import ReplicaMismatchError

    for e in (Evicted("late"), ReplicaMismatchError("node 1: outer weights differ")):
        assert _portable(e, 4) is e
    k = random.randrange(1, 1000)
    got = _portable(dist.DistError("connection reset"), k)
    assert isinstance(got, MembershipError) and str(got).startswith(f"outer step {k}: the job's store is unreachable")
    got = _portable(dist.DistError("connection reset"), None)
    assert str(got).startswith("registration: the job's store is unreachable from local rank 0 (connection reset")
    assert str(_portable(KeyError("x"), None)) == "registration: local rank 0 of this node failed: KeyError: 'x'"
