"""prime.outcomes: every node applies an all-reduce, or none does, through one decision in the store.

Nodes are threads on one store for the decisions themselves; two processes on a real ring for the failure that
needs them: a rank whose all-reduce fails after its peer already had all it needed (the peer completes, it raises).
"""

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from prime.comm import store_keys as keys
from prime.comm.signed_store import SignedStore
from prime.outcomes import StoreOutcomes

from conftest import needs_ring

SEED = random.randrange(1 << 30)
SECRET = b"outcomes-test-secret-0123456789ab"


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"test_outcomes SEED={SEED}")


def _decide_all(store, oks, *, timeout_s=5.0, name="c0a0j0", scope="L/g0", delays=None):
    """Every node's decision of all-reduce `name` (oks[r]: node r's outcome; None: node r never reports)."""
    nodes = len(oks)
    got = [None] * nodes
    delays = delays or [0.0] * nodes

    def node(r):
        time.sleep(delays[r])
        o = StoreOutcomes(lambda: store, SECRET, "job", scope, node=r, nodes=nodes, timeout_s=timeout_s)
        got[r] = o.decide(name, oks[r])

    threads = [threading.Thread(target=node, args=(r,)) for r in range(nodes) if oks[r] is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


@pytest.mark.parametrize("nodes", [1, 2, 5])
def test_every_node_reads_one_decision(nodes):
    rng = random.Random(SEED + nodes)
    store = dist.HashStore()
    assert _decide_all(store, [True] * nodes) == [True] * nodes
    failed = rng.randrange(nodes)
    oks = [r != failed for r in range(nodes)]
    delays = [rng.uniform(0, 0.2) for _ in range(nodes)]
    assert _decide_all(store, oks, name="c1a0j0", delays=delays) == [False] * nodes, f"failed={failed} SEED={SEED}"


def test_a_node_that_never_reports_fails_the_decision_after_the_timeout_and_a_late_report_changes_nothing():
    store = dist.HashStore()
    t0 = time.monotonic()
    got = _decide_all(store, [True, True, None], timeout_s=0.5)
    assert got[:2] == [False, False] and time.monotonic() - t0 < 5
    late = StoreOutcomes(lambda: store, SECRET, "job", "L/g0", node=2, nodes=3, timeout_s=0.5)
    assert late.decide("c0a0j0", True) is False


def test_records_a_stranger_writes_or_replays_decide_nothing():
    store = dist.HashStore()
    # unsigned junk in the decision key and in node 1's report: ignored, the nodes decide from their own reports
    store.set(keys.outcome_decision("L/g0", "c0a0j0"), '{"commit": false}')
    store.set(keys.outcome_report("L/g0", "c0a0j0", 1), "ps1:00:{\"ok\": false}")
    assert _decide_all(store, [True, True]) == [True, True]
    # a valid decision of another launch, copied under this launch's key: its MAC binds the old key, so it is no
    # decision here (a True one would otherwise make a node that failed apply)
    old = SignedStore(store, SECRET, "trainer/job")
    old.put(keys.outcome_decision("OLD/g0", "c0a0j0"), {"commit": True})
    store.set(keys.outcome_decision("NEW/g0", "c0a0j0"), store.get(keys.outcome_decision("OLD/g0", "c0a0j0")))
    assert _decide_all(store, [True, False], scope="NEW/g0") == [False, False]


def test_a_store_that_fails_gives_no_decision():
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("the store went away")

    o = StoreOutcomes(lambda: Broken(), SECRET, "job", "L/g0", node=0, nodes=2, timeout_s=1.0)
    assert o.decide("c0a0j0", True) is None


def test_a_node_counts_its_own_outcome_even_when_its_report_is_deleted_from_the_store():
    """A node knows how its own all-reduce went: it never reads its report back (one store read fewer per decision
    over a WAN link), so a stranger who deletes that report as soon as it is written cannot stall its decision."""

    class Deleting:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            return getattr(self.store, name)

        def set(self, key, value):
            self.store.set(key, value)
            if key == keys.outcome_report("L/g0", "c0a0j0", 0):
                self.store.delete_key(key)

    store = Deleting(dist.HashStore())
    o = StoreOutcomes(lambda: store, SECRET, "job", "L/g0", node=0, nodes=1, timeout_s=3.0)
    assert o.decide("c0a0j0", True) is True  # False, at the timeout, when it waits for its own report


def test_reports_are_deleted_and_node_0_keeps_only_the_newest_decisions():
    store = dist.HashStore()
    for c in range(12):
        assert _decide_all(store, [True, True], name=f"c{c}a0j0") == [True, True]
        assert not any(store.check([keys.outcome_report("L/g0", f"c{c}a0j0", r)]) for r in (0, 1))
    # each node's StoreOutcomes above was new: node 0 deleted nothing but its reports; one that decides them all
    o = StoreOutcomes(lambda: store, SECRET, "job", "L/g1", node=0, nodes=1, timeout_s=1.0)
    for c in range(12):
        assert o.decide(f"c{c}a0j0", True) is True
    kept = [c for c in range(12) if store.check([keys.outcome_decision("L/g1", f"c{c}a0j0")])]
    assert kept == list(range(4, 12))


# -- the failure that needs them -------------------------------------------------------------------------------


def _rank_asymmetric_failure(ctx, agree: bool):
    from torch import nn

    from prime import faults
    from prime.comm import Ring
    from prime.diloco import DiLoCo, OuterSyncError
    from prime.sync import RingSync

    n = 256 * 256
    if ctx.rank == 0:  # a bit flipped near the end of all rank 0 sends: its last all-gather frame, which
        faults.arm(f"ring.send@{n * 4 - 100}")  # arrives last (a slow uplink), after rank 1 had all the rest
    try:
        def factory(tag):
            return Ring(ctx.store, ctx.rank, ctx.world_size, timeout=5, job_id=f"{ctx.job}/{tag}",
                        max_rate=2e6 if ctx.rank == 0 else None)

        sync = RingSync(None, ring_factory=factory, retries=1)
        if agree:
            sync.agree_through(StoreOutcomes(lambda: ctx.store, SECRET, ctx.job, "launch/g0", node=ctx.rank,
                                             nodes=ctx.world_size, timeout_s=10))
        torch.manual_seed(0)
        model = nn.Linear(256, 256, bias=False)
        d = DiLoCo(model, None, sync, inner_steps=1, codec="none", check_replicas=False)
        d.reset_outer()
        with torch.no_grad():
            model.weight -= 0.01 * (ctx.rank + 1)
        try:
            d.step()
            outcome = "applied"
        except OuterSyncError:
            outcome = "gave up"
        return outcome, d.weights_hash()
    finally:
        faults.disarm()


@needs_ring
@pytest.mark.parametrize("agree", [False, True])
def test_a_rank_that_fails_after_its_peer_completed(ranks, agree):
    """Without the store's decision the peer applies the outer step and this rank gives up: the replicas differ
    (the limit of docs/ring-failures.md). With it, both give up (or both apply after a retry), and agree."""
    results = ranks.run(_rank_asymmetric_failure, agree, world_size=2, timeout=120)
    (o0, h0), (o1, h1) = results
    if agree:
        assert (o0, h0) == (o1, h1), results
    else:  # what the decision prevents (if the fault ever stops splitting them, this test no longer shows it)
        assert o0 != o1 and h0 != h1, results


def _rank_overlapped_retry(ctx, fault: bool):
    from torch import nn

    from prime import faults
    from prime.comm import Ring
    from prime.diloco import DiLoCo
    from prime.sync import RingSync

    n = 256 * 256
    try:
        def factory(tag):
            if fault and ctx.rank == 0 and tag == "start":  # the first ring: its first all-reduce, outer step 1
                faults.arm(f"ring.send@{n * 4 - 100}")
            else:
                faults.disarm()
            return Ring(ctx.store, ctx.rank, ctx.world_size, timeout=5, job_id=f"{ctx.job}/{tag}",
                        max_rate=2e6 if ctx.rank == 0 else None)

        sync = RingSync(None, ring_factory=factory, retries=1)
        sync.agree_through(StoreOutcomes(lambda: ctx.store, SECRET, ctx.job, "launch/g0", node=ctx.rank,
                                         nodes=ctx.world_size, timeout_s=10))
        torch.manual_seed(0)
        model = nn.Linear(256, 256, bias=False)
        d = DiLoCo(model, None, sync, inner_steps=1, codec="none", overlap=True, check_replicas=False)
        d.reset_outer()
        gen = torch.Generator().manual_seed(ctx.rank)
        attempts = []
        for _ in range(3):
            with torch.no_grad():
                model.weight -= 0.01 * torch.randn(model.weight.shape, generator=gen)
            r = d.step()
            attempts.append(getattr(r, "attempts", None))
        d.finish()
        return d.weights_hash(), attempts
    finally:
        faults.disarm()


@needs_ring
def test_an_overlapped_average_retried_after_another_node_failed_sends_its_own_input_again(ranks):
    """A one-process node's background average that worked while its peer's failed is retried on the store's
    decision: it must send its own pseudo-gradient again, not the average its buffer holds (RingSync.keeps_input),
    so that the run ends with the weights of a run without the failure."""
    clean = ranks.run(_rank_overlapped_retry, False, world_size=2, timeout=120)
    failed = ranks.run(_rank_overlapped_retry, True, world_size=2, timeout=120)
    assert clean[0][0] == clean[1][0] and failed[0][0] == failed[1][0], (clean, failed)
    assert failed[0][1][1] == 2, failed  # the first overlapped average was retried (it lands at step 2)
    assert failed[0][0] == clean[0][0], (clean, failed)
