"""DiLoCo's outer step against hand-computed references, with an in-process fake ring.

The nodes here are threads of the test process. `FakeThreadRing` is a test
double of prime.comm.Ring (same all_reduce/wait/close surface) that averages
in a fixed order in fp32, optionally through an int8 round trip re-derived in
float64 from docs/wire-format.md (independent of prime.ops), and can be told
to fail. The real ring is exercised by tests/test_train.py.
"""

import copy
import math
import threading

import pytest
import torch
from torch import nn

from prime import ops
from prime.diloco import DiLoCo, OuterSyncError, ReplicaMismatchError


class CommError(RuntimeError):
    """Named like prime.comm.CommError: DiLoCo treats an exception of this name as a failed collective."""


class FakeThreadGroup:
    """Shared state of N fake-ring members living in N threads of one process."""

    def __init__(self, n: int, fail_calls=()):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=60)
        self.inputs = [None] * n
        self.result = None
        self.calls = 0  # collective calls so far (all members together)
        self.fail_calls = set(fail_calls)
        self.rings_built = []


def int8_round_trip_f64(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Quantize then dequantize as docs/wire-format.md writes it, without prime.ops.

    Each fp32 operation of the format (a / 127.5, 1 / scale, x * inv, q * scale) is
    computed in float64 and rounded once to fp32, which gives the correctly
    rounded fp32 result for a division or a product of two fp32 values; the scale
    is a / 127.5 rounded up to the grid 2^e * fp32(2^(j / 18))."""
    def f32(t):
        return torch.as_tensor(t, dtype=torch.float64).to(torch.float32).to(torch.float64)

    def grid_up(t: float) -> float:
        if t == 0 or t < 2.0**-126:
            return 0.0 if t == 0 else 2.0**-126
        _, ex = math.frexp(t)
        for j in range(19):  # j = 18: the next octave's 2^ex
            g = math.ldexp(float(f32(2.0 ** (j / 18))), ex - 1)
            if g >= t:
                return g
        raise AssertionError(t)

    flat = x.detach().reshape(-1).to(torch.float64)
    out = torch.empty_like(flat)
    for s in range(0, flat.numel(), block_size):
        b = flat[s : s + block_size]
        a = float(b.abs().max())
        scale = torch.tensor(grid_up(float(f32(a / 127.5))), dtype=torch.float64)
        inv = f32(1 / float(scale)) if float(scale) > 0 else f32(0.0)
        if torch.isinf(inv):
            inv = f32(0.0)
        q = torch.round(f32(b * inv)).clamp(-127, 127)  # torch.round: half to even
        out[s : s + block_size] = f32(q * scale)
    return out.to(torch.float32).view_as(x)


class FakeWork:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def wait(self):
        return None

    def stats(self):
        from prime.comm import WorkStats

        n = self.nbytes
        return WorkStats(seq=0, numel=n, bytes_sent=n, bytes_received=n, frames_sent=1, frames_received=1,
                         quantize_s=0.0, reduce_s=0.0, wait_s=0.0, commit_s=0.0, queue_s=0.0, total_s=0.0)


class FakeThreadRing:
    """Test double of prime.comm.Ring for in-process nodes: a synchronous all-reduce through a barrier."""

    def __init__(self, group: FakeThreadGroup, rank: int, tag: str = "start"):
        self.group, self.rank, self.world_size, self.tag = group, rank, group.n, tag
        self.closed = False
        group.rings_built.append((rank, tag))

    def all_reduce(self, t, op="avg", codec="int8", block_size=256):
        g = self.group
        assert not self.closed
        g.inputs[self.rank] = t.detach().clone()
        g.barrier.wait()
        if self.rank == 0:
            if g.calls in g.fail_calls:
                g.result = None
            else:
                parts = g.inputs
                if codec == "int8":
                    parts = [int8_round_trip_f64(x, block_size) for x in parts]
                acc = parts[0].clone()
                for x in parts[1:]:
                    acc += x  # fixed order: every member gets the same bits
                g.result = acc / g.n if op == "avg" else acc
            g.calls += 1
        g.barrier.wait()
        result = g.result
        g.barrier.wait()  # nobody starts the next call before everyone has read this one
        if result is None:
            raise CommError(f"injected failure (rank {self.rank})")
        t.copy_(result.view_as(t))
        return FakeWork(t.numel())

    def close(self):
        self.closed = True


def run_nodes(n, fn):
    """Runs fn(rank) in n threads; returns the results, re-raising the first exception."""
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported to the test below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for e in errors:
        if e is not None:
            raise e
    return results


class TwoParams(nn.Module):
    def __init__(self, w_a, w_b):
        super().__init__()
        self.a = nn.Parameter(w_a.clone())
        self.b = nn.Parameter(w_b.clone())


@pytest.fixture(autouse=True)
def one_thread():
    # On a loaded 2-core machine torch's second OpenMP thread makes tiny ops ~30x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_outer_steps_match_hand_computed_nesterov(seed):
    """2 nodes, 2 outer steps: pseudo-gradient, Nesterov update and identical weights, vs float64 by hand."""
    gen = torch.Generator().manual_seed(seed)
    n, lr, mu = 2, 0.7, 0.9
    w_a, w_b = torch.randn(5, generator=gen), torch.randn(2, 3, generator=gen)
    deltas = [[(0.1 * torch.randn(5, generator=gen), 0.1 * torch.randn(2, 3, generator=gen)) for _ in range(n)]
              for _ in range(2)]  # deltas[outer step][node] = outer - local after the inner steps
    group = FakeThreadGroup(n)

    def node(r):
        model = TwoParams(w_a, w_b)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCo(model, opt, FakeThreadRing(group, r), inner_steps=1, outer_lr=lr, outer_momentum=mu,
                   codec="none", block_size=32)
        out = []
        for k in range(2):
            opt.step()  # no gradients: changes nothing, but the first one takes the outer weights
            with torch.no_grad():  # stand-in for the inner steps: move away from the outer weights by delta
                model.a -= deltas[k][r][0]
                model.b -= deltas[k][r][1]
            res = d.step()
            assert res.did_sync and res.outer_step == k + 1 and res.attempts == 1
            out.append((model.a.detach().clone(), model.b.detach().clone()))
        return out

    results = run_nodes(n, node)
    # the reference, in float64
    w = [w_a.double(), w_b.double()]
    m = [torch.zeros_like(w[0]), torch.zeros_like(w[1])]
    for k in range(2):
        for i in range(2):
            g = sum(deltas[k][r][i].double() for r in range(n)) / n
            m[i] = mu * m[i] + g
            w[i] = w[i] - lr * (g + mu * m[i])
        for r in range(n):
            for i in range(2):
                torch.testing.assert_close(results[r][k][i].double(), w[i], rtol=1e-5, atol=1e-6,
                                           msg=f"seed {seed} outer step {k + 1} node {r} param {i}")
    for k in range(2):
        for i in range(2):
            assert torch.equal(results[0][k][i], results[1][k][i]), f"nodes differ (seed {seed})"


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_update_matches_torch_sgd(seed, nesterov):
    """The hand-written update agrees with torch.optim.SGD fed the same pseudo-gradient (within fp32 rounding), one node."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(1000, generator=gen)
    ref = nn.Parameter(w0.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=nesterov)
    group = FakeThreadGroup(1)
    model = TwoParams(w0, torch.zeros(0))
    d = DiLoCo(model, None, FakeThreadRing(group, 0), inner_steps=1, codec="none", nesterov=nesterov,
               check_replicas=False)
    for _ in range(4):
        delta = 0.05 * torch.randn(1000, generator=gen)
        outer = model.a.detach().clone()  # after every outer step the local weights are the outer ones
        with torch.no_grad():
            model.a -= delta
        d.step()
        # SGD gets the pseudo-gradient DiLoCo computes, outer - (outer - delta) in fp32, not delta itself:
        # the two differ by a rounding of the subtraction, which the tolerance below is too tight to absorb.
        ref.grad = outer - (outer - delta)
        sgd.step()
        # atol: torch's SGD may fuse a multiply and an add (one rounding) where DiLoCo rounds twice; they
        # can differ by 1 ulp of the weight before the step (up to ~4 here: 4.8e-7), which a weight driven
        # to near 0 keeps (atol 1e-7 failed ~1e-4 of seeds)
        torch.testing.assert_close(model.a.detach(), ref.detach(), rtol=1e-6, atol=5e-7, msg=f"seed {seed}")


def test_sync_cadence_and_counters(seed):
    """An outer step every inner_steps calls, none in between; the local weights become the outer ones."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=3, codec="none")
    synced = []
    for _ in range(7):
        with torch.no_grad():
            model.weight.add_(torch.randn(3, 4))
        synced.append(d.step().did_sync)
    assert synced == [False, False, True, False, False, True, False]
    assert d.outer_step == 2 and d.inner_step == 7 and d.since_sync == 1


def test_int8_codec_and_compression_error(seed):
    """With int8, nodes agree bitwise, the result is the int8 average, and compression_error is the round-trip error."""
    gen = torch.Generator().manual_seed(seed)
    n, bs = 3, 64
    w0 = torch.randn(300, generator=gen)
    deltas = [0.01 * torch.randn(300, generator=gen) for _ in range(n)]
    group = FakeThreadGroup(n)

    def node(r):
        model = TwoParams(w0, torch.zeros(1))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, codec="int8", block_size=bs,
                   outer_momentum=0.0, nesterov=False, outer_lr=1.0)
        with torch.no_grad():
            model.a -= deltas[r]
        res = d.step()
        return model.a.detach().clone(), res

    out = run_nodes(n, node)
    assert all(torch.equal(out[0][0], o[0]) for o in out), f"seed {seed}"
    # lr 1, no momentum: new weights = w0 - avg(int8 round trip of each pseudo-gradient). The
    # pseudo-gradient is w0 - (w0 - delta) in fp32, not delta itself: quantizing delta instead
    # can land one int8 level away on a near-tie (seen once: 7e-5 off at one element).
    # The fake ring round-trips with int8_round_trip_f64; the expected weights come from prime.ops' reference
    # codec, the expected compression error (which DiLoCo computes with prime.ops) from int8_round_trip_f64.
    pgs = [w0 - (w0 - d) for d in deltas]
    rt = [ops.dequantize_int8_reference(*ops.quantize_int8_reference(x, bs), bs) for x in pgs]
    torch.testing.assert_close(out[0][0].double(), w0.double() - sum(x.double() for x in rt) / n, rtol=0, atol=1e-6)
    for r in range(n):
        ind = int8_round_trip_f64(pgs[r], bs)
        expected = float((ind.double() - pgs[r].double()).norm() / pgs[r].double().norm())
        got = out[r][1].compression_error
        assert got == pytest.approx(expected, rel=1e-3), f"seed {seed} node {r}"
        assert 0 < got < 0.02
        assert out[r][1].pseudo_grad_norm == pytest.approx(float(deltas[r].norm()), rel=1e-5)


def test_failed_allreduce_is_retried_on_a_new_ring(seed):
    """The first attempt fails on every node: a new ring per node, same result as without the failure."""
    gen = torch.Generator().manual_seed(seed)
    w0, deltas = torch.randn(50, generator=gen), [torch.randn(50, generator=gen) for _ in range(2)]

    def run(fail_calls):
        group = FakeThreadGroup(2, fail_calls=fail_calls)

        def node(r):
            model = TwoParams(w0, torch.zeros(1))
            d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, codec="none", retries=2,
                       ring_factory=lambda tag: FakeThreadRing(group, r, tag), check_replicas=False)
            with torch.no_grad():
                model.a -= deltas[r]
            res = d.step()
            return model.a.detach().clone(), res.attempts

        return run_nodes(2, node), group

    clean, _ = run(())
    retried, group = run({0})
    assert [a for _, a in retried] == [2, 2]
    assert torch.equal(clean[0][0], retried[0][0]) and torch.equal(retried[0][0], retried[1][0]), f"seed {seed}"
    assert sorted(group.rings_built) == [(0, "o0a1"), (0, "start"), (1, "o0a1"), (1, "start")]


def test_persistent_failure_stops_without_changing_weights(seed):
    """Every attempt fails: OuterSyncError on every node, outer and local weights as they were."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(40, generator=gen)
    group = FakeThreadGroup(2, fail_calls=range(100))

    def node(r):
        model = TwoParams(w0, torch.zeros(1))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, codec="none", retries=1,
                   ring_factory=lambda tag: FakeThreadRing(group, r, tag), check_replicas=False)
        with torch.no_grad():
            model.a -= 0.5
        local = model.a.detach().clone()
        with pytest.raises(OuterSyncError, match="failed 2 time"):
            d.step()
        assert torch.equal(model.a.detach(), local)
        assert torch.equal(d.state_dict()["fragments"][0]["outer"][:40], w0)
        assert d.outer_step == 0 and d.since_sync == 1
        return True

    assert run_nodes(2, node) == [True, True]


def test_replica_check_catches_different_weights(seed):
    """Nodes that start from different weights are refused before any outer step."""
    gen = torch.Generator().manual_seed(seed)
    inits = [torch.randn(64, generator=gen), torch.randn(64, generator=gen)]
    group = FakeThreadGroup(2)

    def node(r):
        model = TwoParams(inits[r], torch.zeros(1))
        d = DiLoCo(model, None, FakeThreadRing(group, r), inner_steps=1, codec="none")
        with pytest.raises(ReplicaMismatchError, match="outer weights differ"):
            d.check_replicas()
        return True

    run_nodes(2, node)
    # and the same weights pass
    group = FakeThreadGroup(2)
    run_nodes(2, lambda r: DiLoCo(TwoParams(inits[0], torch.zeros(1)), None, FakeThreadRing(group, r),
                                  codec="none").check_replicas())


def test_replica_check_catches_different_settings():
    group = FakeThreadGroup(2)
    w = torch.randn(10)

    def node(r):
        d = DiLoCo(TwoParams(w, torch.zeros(1)), None, FakeThreadRing(group, r), inner_steps=10 + r)
        with pytest.raises(ReplicaMismatchError, match="settings"):
            d.check_replicas()

    run_nodes(2, node)


def _sgd_steps(model, opt, xs, after_step=None):
    """Real inner steps: MSE of model(x) against 0, SGD."""
    out = []
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            out.append(after_step())
    return out


def test_no_ring_means_plain_training(seed):
    """Without a ring the weights follow exactly the plain-torch loop, in the hook form and the explicit one."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(8, 3, generator=gen) for _ in range(5)]
    w = torch.randn(3, 3, generator=gen)

    def fresh():
        m = nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            m.weight.copy_(w)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    ref, ref_opt = fresh()
    _sgd_steps(ref, ref_opt, xs)
    model, opt = fresh()
    d = DiLoCo(model, opt, None, inner_steps=1)
    synced = _sgd_steps(model, opt, xs, after_step=lambda: d.step().did_sync)
    assert synced == [False] * 5 and d.inner_step == 5 and d.outer_step == 0
    assert torch.equal(model.weight.detach(), ref.weight.detach()), f"seed {seed}"
    assert not torch.equal(model.weight.detach(), w)  # training moved it
    assert d.state_dict().get("outer") is None
    model2, opt2 = fresh()
    with DiLoCo(model2, opt2, None, inner_steps=1) as d2:
        _sgd_steps(model2, opt2, xs)
    assert d2.inner_step == 5 and torch.equal(model2.weight.detach(), ref.weight.detach())


def test_optimizer_of_other_parameters_is_refused():
    model, other = nn.Linear(3, 3), nn.Linear(3, 3)
    with pytest.raises(ValueError, match="after fully_shard"):
        DiLoCo(model, torch.optim.SGD(other.parameters(), lr=0.1), None)


@pytest.mark.parametrize("kwargs,match", [
    ({"inner_steps": 0}, "inner_steps must be >= 1, got 0"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"codec": "fp8"}, "codec"),
    ({"block_size": 100}, "block_size"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCo(nn.Linear(2, 2), None, None, **kwargs)


def test_state_dict_round_trip(seed):
    """A DiLoCo restored from state_dict continues exactly like the original."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(100, generator=gen)
    deltas = [0.1 * torch.randn(100, generator=gen) for _ in range(3)]

    def make():
        model = TwoParams(w0, torch.zeros(1))
        return model, DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=1, codec="none")

    m1, d1 = make()
    for k in range(2):
        with torch.no_grad():
            m1.a -= deltas[k]
        d1.step()
    m2, d2 = make()
    with torch.no_grad():
        m2.a.copy_(m1.a)
    d2.load_state_dict(copy.deepcopy(d1.state_dict()))
    for m, d in ((m1, d1), (m2, d2)):
        with torch.no_grad():
            m.a -= deltas[2]
        d.step()
    assert torch.equal(m1.a, m2.a) and d2.outer_step == 3, f"seed {seed}"



@pytest.mark.parametrize("overlap", [False, True])
def test_a_checkpoint_of_the_older_one_fragment_layout_loads(seed, overlap):
    """One-fragment runs once wrote the fragment's part at the top level of DiLoCo.state_dict() (counters beside
    "outer", "momentum", "start"): such a checkpoint still restores the run exactly."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(100, generator=gen)
    deltas = [0.1 * torch.randn(100, generator=gen) for _ in range(4)]

    def make():
        model = TwoParams(w0, torch.zeros(1))
        ring = FakeThreadRing(FakeThreadGroup(1), 0)
        return model, DiLoCo(model, None, ring, inner_steps=1, codec="none", overlap=overlap)

    m1, d1 = make()
    for k in range(3):
        with torch.no_grad():
            m1.a -= deltas[k]
        d1.step()
    sd = d1.state_dict()
    part = dict(sd["fragments"][0])
    assert part["momentum"].abs().sum() > 0 and ("start" in part) == overlap
    del part["outer_step"], part["since_sync"]
    flat = {"inner_step": sd["inner_step"], "outer_step": sd["outer_step"], "since_sync": sd["since_sync"], **part}
    m2, d2 = make()
    with torch.no_grad():
        m2.a.copy_(m1.a)
    d2.load_state_dict(copy.deepcopy(flat))
    assert d2.state_dict()["fragments"][0].keys() == sd["fragments"][0].keys()
    for m, d in ((m1, d1), (m2, d2)):
        with torch.no_grad():
            m.a -= deltas[3]
        d.step()
        d.finish()
    assert torch.equal(m1.a, m2.a) and torch.equal(d1.outer_weights(), d2.outer_weights()), f"seed {seed}"
    assert d2.outer_step == d1.outer_step == 4

# -- the API: hook form, outer weights taken late, local group, close, outer optimizer ---------------


def _linear(w):
    m = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        m.weight.copy_(w)
    return m


def test_hook_form_runs_outer_steps_without_step_calls(seed):
    """Inside `with diloco:` the optimizer's step runs the outer steps: the same weights as calling step()."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 4, generator=gen)
    xs = [torch.randn(6, 4, generator=gen) for _ in range(7)]

    explicit = _linear(w)
    opt = torch.optim.SGD(explicit.parameters(), lr=0.1)
    d = DiLoCo(explicit, opt, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=3, codec="none")
    synced = _sgd_steps(explicit, opt, xs, after_step=lambda: d.step().did_sync)
    assert synced == [False, False, True, False, False, True, False]

    hooked = _linear(w)
    opt2 = torch.optim.SGD(hooked.parameters(), lr=0.1)
    seen = []
    with DiLoCo(hooked, opt2, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=3, codec="none") as d2:
        _sgd_steps(hooked, opt2, xs, after_step=lambda: seen.append(d2.result.did_sync))
        with pytest.raises(RuntimeError, match="count every inner step twice"):
            d2.step()
    assert seen == synced and d2.outer_step == 2 and d2.inner_step == 7
    assert torch.equal(hooked.weight, explicit.weight), f"seed {seed}"
    # after the with block the hook is gone: more optimizer steps do not count
    _sgd_steps(hooked, opt2, xs[:1])
    assert d2.inner_step == 7


def test_a_forgotten_step_is_an_error_at_the_next_inner_step(seed):
    gen = torch.Generator().manual_seed(seed)
    model = _linear(torch.randn(2, 2, generator=gen))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    DiLoCo(model, opt, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=2, codec="none")
    x = torch.randn(4, 2, generator=gen)
    _sgd_steps(model, opt, [x])
    after_first = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="without DiLoCo.step\\(\\) in between"):
        _sgd_steps(model, opt, [x])
    assert torch.equal(model.weight.detach(), after_first)  # refused before the optimizer touched anything


def test_weights_loaded_after_construction_are_kept(seed):
    """DiLoCo built on fresh weights, then a checkpoint is loaded: the outer step starts from the loaded ones."""
    gen = torch.Generator().manual_seed(seed)
    w0, loaded = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    xs = [torch.randn(6, 4, generator=gen) for _ in range(2)]
    model = _linear(w0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, opt, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=2, codec="none", outer_lr=0.5,
               outer_momentum=0.0, nesterov=False)
    model.load_state_dict({"weight": loaded})
    _sgd_steps(model, opt, xs, after_step=d.step)
    ref = _linear(loaded)  # the same inner steps in plain torch
    _sgd_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), xs)
    local = ref.weight.detach().double()
    want = loaded.double() - 0.5 * (loaded.double() - local)  # outer - lr * (outer - local), outer = loaded
    got = model.weight.detach().double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"seed {seed}")
    stale = w0.double() - 0.5 * (w0.double() - local)
    assert (got - stale).abs().max() > 0.1, "the outer weights were taken at construction"


def test_a_checkpoint_initializing_the_optimizer_is_not_an_inner_step(seed):
    """torch.distributed.checkpoint steps the optimizer at lr 0 to create its state (before loading into it):
    that neither counts, nor takes the outer weights, nor trips the forgotten-step check."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    gen = torch.Generator().manual_seed(seed)
    w0, loaded = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    for hook_form in (False, True):
        model = _linear(w0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        d = DiLoCo(model, opt, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=2, codec="none")
        if hook_form:
            d.__enter__()
        get_optimizer_state_dict(model, opt)  # the lr-0 step
        model.load_state_dict({"weight": loaded})
        assert d.inner_step == 0
        _sgd_steps(model, opt, [torch.randn(6, 4, generator=gen)], after_step=None if hook_form else d.step)
        assert d.inner_step == 1 and torch.equal(d.state_dict()["fragments"][0]["outer"][:12], loaded.reshape(-1))
        d.close()


def test_reset_outer_takes_the_weights_without_an_optimizer(seed):
    gen = torch.Generator().manual_seed(seed)
    w0, loaded, delta = (torch.randn(20, generator=gen) for _ in range(3))
    model = TwoParams(w0, torch.zeros(1))
    d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=1, codec="none", outer_lr=1.0,
               outer_momentum=0.0, nesterov=False)
    assert torch.equal(d.state_dict()["fragments"][0]["outer"][:20], w0)  # no optimizer: taken at construction
    with torch.no_grad():
        model.a.copy_(loaded)
    d.reset_outer()
    assert torch.equal(d.state_dict()["fragments"][0]["outer"][:20], loaded)
    with torch.no_grad():
        model.a -= delta
    d.step()  # lr 1, no momentum: the outer weights become the local ones
    torch.testing.assert_close(model.a.detach().double(), (loaded - delta).double(), rtol=0, atol=1e-6)


def _rank_local_group_checks(ctx):
    """Rank function (tests/conftest.py pool): DiLoCo's node-local group under different torchrun worlds."""
    import os

    import torch.distributed as dist

    from prime.diloco import DiLoCo

    dist.init_process_group("gloo", store=dist.PrefixStore(f"{ctx.job}/pg", ctx.store), rank=ctx.rank,
                            world_size=ctx.world_size)
    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    out = {}
    try:
        for name, local, explicit in (("one process per node", "1", False), ("no LOCAL_WORLD_SIZE", None, False),
                                      ("WORLD given, one per node", "1", True), ("both on one node", "2", False)):
            if local is None:
                os.environ.pop("LOCAL_WORLD_SIZE", None)
            else:
                os.environ["LOCAL_WORLD_SIZE"] = local
            try:
                DiLoCo(nn.Linear(2, 2), None, FakeThreadRing(FakeThreadGroup(1), 0), check_replicas=False,
                       local_group=dist.group.WORLD if explicit else None).close()
                out[name] = "accepted"
            except ValueError as e:
                out[name] = str(e)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
        dist.destroy_process_group()
    return out


def test_a_local_group_spanning_nodes_is_refused(ranks):
    """2 processes in torch.distributed's default group: refused as the node-local group when torchrun says
    each node runs 1 (or does not say), accepted when both are on one node."""
    for out in ranks.run(_rank_local_group_checks, world_size=2):
        assert "spans nodes" in out["one process per node"], out
        assert "spans nodes" in out["WORLD given, one per node"], out
        assert "LOCAL_WORLD_SIZE is not set" in out["no LOCAL_WORLD_SIZE"], out
        assert out["both on one node"] == "accepted", out


def test_close_leaves_the_callers_ring_open(seed):
    """close() (and leaving `with`) closes only the rings DiLoCo built: the caller's stays open, also after a
    failure made DiLoCo move to a ring of its own."""
    ring = FakeThreadRing(FakeThreadGroup(1), 0)
    model = TwoParams(torch.randn(10), torch.zeros(1))
    with DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), ring, codec="none"):
        pass
    assert not ring.closed
    group = FakeThreadGroup(1, fail_calls={0})
    theirs, built = FakeThreadRing(group, 0), []

    def factory(tag):
        built.append(FakeThreadRing(group, 0, tag))
        return built[-1]

    model = TwoParams(torch.randn(10), torch.zeros(1))
    d = DiLoCo(model, None, theirs, inner_steps=1, codec="none", ring_factory=factory, check_replicas=False)
    assert d.step().attempts == 2 and [r.tag for r in built] == ["o0a1"]
    d.close()
    assert not theirs.closed and built[0].closed
    d2 = DiLoCo(TwoParams(torch.randn(10), torch.zeros(1)), None, None, ring_factory=factory, check_replicas=False)
    d2.close()
    assert built[-1].tag == "start" and built[-1].closed  # built by DiLoCo: closed


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.95), eps=1e-6),
    lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.5, weight_decay=0.01),
], ids=["adam", "sgd-wd"])
def test_a_custom_outer_optimizer_matches_plain_torch(seed, make):
    """outer_optimizer=factory: the outer weights follow the same torch optimizer run on plain parameters fed
    the pseudo-gradient; its state survives state_dict()."""
    gen = torch.Generator().manual_seed(seed)
    w_a, w_b = torch.randn(300, generator=gen), torch.randn(4, 5, generator=gen)
    ref = [nn.Parameter(w_a.clone()), nn.Parameter(w_b.clone())]
    ref_opt = make(ref)
    model = TwoParams(w_a, w_b)
    d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=1, codec="none", outer_optimizer=make)
    for k in range(4):
        if k == 2:  # a restart in the middle: a new DiLoCo from state_dict continues the same
            sd = copy.deepcopy(d.state_dict())
            d = DiLoCo(model, None, FakeThreadRing(FakeThreadGroup(1), 0), inner_steps=1, codec="none",
                       outer_optimizer=make)
            d.load_state_dict(sd)
        outer = [model.a.detach().clone(), model.b.detach().clone()]
        deltas = [0.05 * torch.randn(300, generator=gen), 0.05 * torch.randn(4, 5, generator=gen)]
        with torch.no_grad():
            model.a -= deltas[0]
            model.b -= deltas[1]
        d.step()
        for p, o, dl in zip(ref, outer, deltas):
            p.grad = o - (o - dl)  # the pseudo-gradient as DiLoCo computes it in fp32
        ref_opt.step()
        for got, want in ((model.a, ref[0]), (model.b, ref[1])):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7, msg=f"seed {seed} k {k}")
    part = d.state_dict()["fragments"][0]
    assert "momentum" not in part and "outer_optimizer" in part


def test_a_custom_outer_optimizer_must_be_a_torch_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DiLoCo(nn.Linear(2, 2), None, FakeThreadRing(FakeThreadGroup(1), 0), outer_optimizer=lambda ps: object())
