"""DiLoCo's outer step against a fake prime.sync.Sync: what DiLoCo does with what the sync returns.

The fake plays the other nodes (their pseudo-gradients are given), averages
over the contributors in float64 and can fail attempts. The references are
float64 by hand. ElasticSync's own arithmetic is tested in test_elastic.py
(nodes as threads) and RingSync's with a fake ring in test_diloco.py.
"""


import pytest
import torch
from torch import nn

from prime.diloco import DiLoCo, OuterSyncError
from prime.sync import RingSync, Sync, SyncResult, node_local_group


class FakeSync:
    """A Sync for one node whose peers' pseudo-gradients are given: the average is over the contributors.

    others:         pseudo-gradients of the other contributing nodes (flat, padded like the outer state)
    silent:         members that take part without contributing (joiners)
    me_contributes: False: this node is the joiner (its pseudo-gradient is left out)
    fail_attempts:  attempts that fail first (each leaves grad scrambled, then recompute() restores it)
    give_up:        every attempt fails: OuterSyncError after scrambling grad
    peer_ok:        what the other processes of this node answer in agree()
    """

    def __init__(self, others=(), *, silent=0, me_contributes=True, fail_attempts=0, give_up=False, peer_ok=True,
                 job_step=None):
        self.others, self.silent, self.me_contributes = [o.double() for o in others], silent, me_contributes
        self.fail_attempts, self.give_up, self.peer_ok, self.job_step = fail_attempts, give_up, peer_ok, job_step
        self.state = self.settings = None
        self.calls, self.verified, self.committed_outer = [], [], []
        self.recomputed_equal = []

    def bind(self, state, settings):
        self.state, self.settings = state, settings

    def agree(self, ok):
        return ok and self.peer_ok

    def verify(self, fingerprint, *, outer_step):
        self.verified.append((fingerprint, outer_step))

    def average(self, grad, *, outer_step, inner_step, recompute):
        self.calls.append((outer_step, inner_step, grad.clone()))
        mine = grad.clone()
        for _ in range(self.fail_attempts):
            grad.mul_(-3.0).add_(1.0)  # a failed ring leaves a partial result behind
            recompute(grad)
            self.recomputed_equal.append(torch.equal(grad, mine))
        if self.give_up:
            grad.mul_(-3.0)
            raise OuterSyncError("injected: every attempt failed")
        parts = ([mine.double()] if self.me_contributes else []) + self.others
        grad.copy_((sum(parts) / len(parts)).float())
        n = len(parts) + self.silent + (0 if self.me_contributes else 1)
        return SyncResult(members=list(range(n)), contributors=len(parts), attempts=self.fail_attempts + 1,
                          contributed=self.me_contributes, outer_step=outer_step,
                          inner_step=self.job_step, details={"fake": True})

    def committed(self, result):
        self.committed_outer.append(self.state.outer.clone())

    def close(self):
        raise AssertionError("DiLoCo must not close a sync it was given")


class TwoParams(nn.Module):
    def __init__(self, w_a, w_b):
        super().__init__()
        self.a = nn.Parameter(w_a.clone())
        self.b = nn.Parameter(w_b.clone())


def _flat(state, a, b):
    """a and b laid out like the outer state's flat buffer (each parameter padded to whole blocks)."""
    out = torch.zeros(state.numel, dtype=a.dtype)
    for t, off in zip((a, b), state.offsets):
        out[off : off + t.numel()] = t.reshape(-1)
    return out


def _nesterov64(w, m, g, lr=0.7, mu=0.9):
    m = mu * m + g
    return w - lr * (g + mu * m), m


def test_fake_sync_is_a_sync():
    assert isinstance(FakeSync(), Sync)
    assert not isinstance(object(), Sync)


@pytest.mark.parametrize("me_contributes", [True, False])
def test_the_update_uses_the_average_over_contributors_only(seed, me_contributes):
    """Two other contributors and a silent member: the outer step moves by the contributors' average.
    As a joiner, this node's own pseudo-gradient is left out and its norm is not reported."""
    gen = torch.Generator().manual_seed(seed)
    w_a, w_b = torch.randn(70, generator=gen), torch.randn(3, 5, generator=gen)
    model = TwoParams(w_a, w_b)
    probe = DiLoCo(TwoParams(w_a, w_b), None, FakeSync(), block_size=32)  # only for the layout
    others = [_flat(probe.state, 0.1 * torch.randn(70, generator=gen), 0.1 * torch.randn(3, 5, generator=gen))
              for _ in range(2)]
    sync = FakeSync(others, silent=1, me_contributes=me_contributes)
    d = DiLoCo(model, None, sync, inner_steps=2, codec="none", block_size=32)
    delta_a, delta_b = 0.1 * torch.randn(70, generator=gen), 0.1 * torch.randn(3, 5, generator=gen)
    with torch.no_grad():
        model.a -= delta_a
        model.b -= delta_b
    assert not d.step().did_sync
    r = d.step()
    assert r.did_sync and r.outer_step == 1 and r.inner_step == 2
    mine = _flat(d.state, w_a - (w_a - delta_a), w_b - (w_b - delta_b)).double()  # fp32 subtraction, as DiLoCo
    parts = ([mine] if me_contributes else []) + [o.double() for o in others]
    avg = sum(parts) / len(parts)
    want, _ = _nesterov64(_flat(d.state, w_a, w_b).double(), torch.zeros_like(avg), avg)
    torch.testing.assert_close(d.state.outer.double(), want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
    assert torch.equal(_flat(d.state, model.a.detach(), model.b.detach()), d.state.outer)
    assert r.contributors == len(parts) and len(r.members) == 4 and r.details == {"fake": True}
    if me_contributes:
        assert r.pseudo_grad_norm == pytest.approx(float(mine.norm()), rel=1e-6)
    else:
        assert r.pseudo_grad_norm == 0.0 and r.compression_error is None
    # committed() saw the new outer weights; the sync was asked for outer step 1 at inner step 2
    assert len(sync.committed_outer) == 1 and torch.equal(sync.committed_outer[0], d.state.outer)
    assert [(k, i) for k, i, _ in sync.calls] == [(1, 2)]


def test_a_failed_attempt_is_recomputed_and_changes_nothing(seed):
    """Attempts that scramble the buffer are followed by recompute(): the input is restored bit for bit and
    the outer step ends exactly as without the failures."""
    gen = torch.Generator().manual_seed(seed)
    w_a, w_b = torch.randn(40, generator=gen), torch.randn(7, generator=gen)
    delta = 0.2 * torch.randn(40, generator=gen)
    other = 0.2 * torch.randn(40, generator=gen)

    def run(fail):
        model = TwoParams(w_a, w_b)
        layout = DiLoCo(TwoParams(w_a, w_b), None, FakeSync(), block_size=32).state
        sync = FakeSync([_flat(layout, other, torch.zeros(7))], fail_attempts=fail)
        d = DiLoCo(model, None, sync, inner_steps=1, codec="none", block_size=32)
        with torch.no_grad():
            model.a -= delta
        r = d.step()
        return model.a.detach().clone(), d.state.momentum.clone(), r, sync

    a0, m0, r0, _ = run(0)
    a2, m2, r2, sync = run(2)
    assert sync.recomputed_equal == [True, True], f"seed {seed}"
    assert torch.equal(a0, a2) and torch.equal(m0, m2), f"seed {seed}"
    assert (r0.attempts, r2.attempts) == (1, 3)


def test_giving_up_leaves_weights_and_counters_and_the_next_step_works(seed):
    """OuterSyncError from the sync: local weights, outer weights, momentum and counters as they were;
    a later outer step computes the same as if the failure never happened."""
    gen = torch.Generator().manual_seed(seed)
    w_a = torch.randn(50, generator=gen)
    delta = 0.3 * torch.randn(50, generator=gen)
    model = TwoParams(w_a, torch.zeros(1))
    sync = FakeSync(give_up=True)
    d = DiLoCo(model, None, sync, inner_steps=1, codec="none", block_size=32)
    with torch.no_grad():
        model.a -= delta
    local, outer, mom = model.a.detach().clone(), d.state.outer.clone(), d.state.momentum.clone()
    with pytest.raises(OuterSyncError, match="injected"):
        d.step()
    assert torch.equal(model.a.detach(), local) and torch.equal(d.state.outer, outer)
    assert torch.equal(d.state.momentum, mom)
    assert (d.outer_step, d.inner_step, d.since_sync) == (0, 1, 1) and sync.committed_outer == []
    sync.give_up = False
    r = d.sync()  # what a trainer does after a restart: the outer step that failed
    ref_model = TwoParams(w_a, torch.zeros(1))
    ref = DiLoCo(ref_model, None, FakeSync(), inner_steps=1, codec="none", block_size=32)
    with torch.no_grad():
        ref_model.a -= delta
    ref.step()
    assert r.outer_step == 1 and torch.equal(model.a.detach(), ref_model.a.detach()), f"seed {seed}"


def test_a_non_finite_pseudo_gradient_stops_before_the_average():
    """NaN here, or a peer process of this node reporting one: OuterSyncError, the sync is not asked."""
    model = TwoParams(torch.ones(10), torch.zeros(1))
    sync = FakeSync()
    d = DiLoCo(model, None, sync, inner_steps=1, codec="none")
    with torch.no_grad():
        model.a[3] = float("nan")
    with pytest.raises(OuterSyncError, match="not finite \\(here\\)"):
        d.step()
    model2 = TwoParams(torch.ones(10), torch.zeros(1))
    sync2 = FakeSync(peer_ok=False)
    d2 = DiLoCo(model2, None, sync2, inner_steps=1, codec="none")
    with pytest.raises(OuterSyncError, match="on another process of this node"):
        d2.step()
    assert sync.calls == [] and sync2.calls == []


def test_the_sync_sets_the_jobs_position_and_replicas_are_verified_once():
    """A sync may move this node to the job's inner step (an elastic join); verify() runs before the first
    outer step and again after load_state_dict, with the fingerprint of the outer weights."""
    model = TwoParams(torch.ones(10), torch.zeros(1))
    sync = FakeSync(job_step=50)
    d = DiLoCo(model, None, sync, inner_steps=1, codec="none")
    r = d.step()
    assert r.inner_step == 50 and d.inner_step == 50 and d.outer_step == 1
    d.step()
    assert [k for _, k in sync.verified] == [1]
    d.load_state_dict(d.state_dict())
    d.step()
    assert [k for _, k in sync.verified] == [1, 3]
    fp = sync.verified[1][0]
    assert fp[2] == d.state.numel


def test_a_sync_given_keeps_its_own_ring_settings():
    with pytest.raises(ValueError, match="give them to the Sync"):
        DiLoCo(nn.Linear(2, 2), None, FakeSync(), ring_factory=lambda tag: None)


def test_ring_sync_needs_a_ring():
    with pytest.raises(ValueError, match="needs a ring or a ring_factory"):
        RingSync()


def test_no_local_group_without_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    assert node_local_group() is None
    with pytest.raises(ValueError, match="not initialized"):
        node_local_group(object())
