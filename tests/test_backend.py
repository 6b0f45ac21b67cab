"""Tests of the torch.distributed backend "prime" (prime/comm/backend.py).

Ranks are processes of the session's pool (tests/conftest.py); each call forms a
fresh default process group with init_process_group("prime") on its own store prefix.
References:
  * a plain-torch data-parallel loop and torch's DDP over the backend against one
    process training the same model on the whole batch in float64,
  * all_reduce against the float64 sum (and gloo's rank-r-contributes-r check),
  * broadcast / all_gather bit for bit against the inputs, rebuilt from the seed,
  * the int8 option against prime.comm.Ring called directly on the same inputs.
Inputs are fresh random data each run; the seed is printed on failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from datetime import timedelta

import pytest
import torch

prime = pytest.importorskip("prime")
from prime import _extension  # noqa: E402
from prime.comm import backend  # noqa: E402

pytestmark = pytest.mark.skipif(not _extension.available(), reason="prime._C is not built")

SEED = random.SystemRandom().randrange(1 << 30)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
ANY_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool, torch.complex64)


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"test_backend SEED={SEED}")  # captured: pytest shows it when the test fails


def _note(**kw) -> str:
    return "[" + " ".join(f"{k}={v}" for k, v in kw.items()) + f"] (SEED={SEED})"


@contextlib.contextmanager
def _prime_world(ctx, **kwargs):
    """The default process group on the "prime" backend for this call's ranks."""
    import torch.distributed as dist

    store = dist.PrefixStore(ctx.job_id(), ctx.store)
    dist.init_process_group("prime", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=timedelta(seconds=30), **kwargs)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes(t)).hexdigest()


def random_tensor(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bits of any dtype (NaN payloads, -0, Inf, denormals included for floats)."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    t = raw.view(dtype).clone()
    if dtype.is_floating_point and n >= 4:
        t[:4] = torch.tensor([float("nan"), -0.0, float("-inf"), torch.finfo(dtype).tiny / 4], dtype=dtype)
    return t


# ---------------------------------------------------------------------------
# the byte carrier (no processes)


def test_byte_carrier_round_trips_and_stays_below_2_pow_24():
    rng = random.Random(SEED)
    for n in [0, 1, 2, 3, 4, 5, 6, 7, 100, 65537, 100001]:
        data = torch.tensor([rng.randrange(256) for _ in range(n)], dtype=torch.uint8)
        carrier = backend.bytes_to_carrier(data)
        assert carrier.dtype == torch.float32 and carrier.numel() == backend.carrier_len(n) == -(-n // 3)
        assert bool((carrier >= 0).all()) and bool((carrier < 2**24).all()) and bool((carrier == carrier.round()).all())
        # What the exact all-reduce does to a broadcast's carrier: add zeros, in float32.
        summed = carrier + torch.zeros_like(carrier) + torch.zeros_like(carrier)
        assert torch.equal(backend.carrier_to_bytes(summed, n), data), _note(n=n)
    want = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert backend.bytes_to_carrier(want).tolist() == [1 + 2 * 256 + 3 * 65536, 4]


def test_options_name_the_bad_field(monkeypatch):
    with pytest.raises(ValueError, match="codec"):
        backend.PrimeOptions(codec="fp8")
    monkeypatch.setenv(backend.ENV_CODEC, "int4")
    with pytest.raises(ValueError, match=backend.ENV_CODEC):
        backend.PrimeOptions()
    monkeypatch.setenv(backend.ENV_CODEC, "int8")
    assert backend.PrimeOptions().codec == "int8"


# ---------------------------------------------------------------------------
# an unmodified plain-torch data-parallel loop, and DDP


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_shard(seed: int, rank: int, step: int, batch: int = 16):
    g = torch.Generator().manual_seed(seed * 1000003 + step * 101 + rank)
    x = torch.randn(batch, 8, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(batch, 1, generator=g)


def train_data_parallel(model, batches, lr):
    """Plain torch data parallelism, as written for any backend."""
    import torch.distributed as dist

    world = dist.get_world_size()
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        opt.step()
    return model


def train_ddp(model, batches, lr):
    """The same with torch's DistributedDataParallel."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return model


STEPS, LR = 12, 0.05


def _rank_train(ctx, seed, how):
    with _prime_world(ctx):
        model = make_model(seed + ctx.rank)  # different on every rank until rank 0's weights are broadcast
        batches = [make_shard(seed, ctx.rank, s) for s in range(STEPS)]
        fn = train_data_parallel if how == "plain" else train_ddp
        fn(model, batches, LR)
        return [p.detach().clone() for p in model.parameters()]


def reference_train(seed: int, world: int):
    """One process, float64, the whole batch (the ranks' shards together) per step."""
    model = make_model(seed).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for s in range(STEPS):
        shards = [make_shard(seed, r, s) for r in range(world)]
        x = torch.cat([a for a, _ in shards]).double()
        y = torch.cat([b for _, b in shards]).double()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("how", ["plain", "ddp"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_data_parallel_training_matches_float64_reference(ranks, world_size, how):
    results = ranks.run(_rank_train, SEED, how, world_size=world_size)
    ref = reference_train(SEED, world_size)
    for r in range(1, world_size):
        for a, b in zip(results[0], results[r]):
            assert torch.equal(a, b), f"rank {r}'s weights differ from rank 0's {_note(how=how, N=world_size)}"
    start = [p.detach().double() for p in make_model(SEED).parameters()]
    # The model as a whole must move far beyond the tolerance, or the comparison could not fail. One small
    # parameter (a bias of one value) can move less than 1e-3 under some seeds; that is not a vacuous test.
    moved = max((want - p0).abs().max().item() for want, p0 in zip(ref, start))
    assert moved > 1e-2, f"the reference moved only {moved}: the test could not fail {_note(N=world_size)}"
    for got, want in zip(results[0], ref):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 + 1e-4 * want.abs().max().item(), f"off the float64 reference by {err} {_note(how=how)}"


# ---------------------------------------------------------------------------
# each collective on fresh random data


SIZES = (0, 1, 5, 1000, 100003)


def _rank_collectives(ctx, seed):
    import torch.distributed as dist

    out = {"all_reduce": [], "broadcast": [], "all_gather": [], "all_gather_into_tensor": []}
    world, rank = ctx.world_size, ctx.rank
    with _prime_world(ctx):
        for i, n in enumerate(SIZES):
            for j, dtype in enumerate(FLOATS):
                for op in ("sum", "avg"):
                    x = torch.randn(n, generator=torch.Generator().manual_seed(seed + 31 * i + 7 * j + rank)).to(dtype)
                    dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG)
                    out["all_reduce"].append((n, dtype, op, x if rank == 0 else _digest(x)))
            rank_r = torch.full((n,), float(rank))
            dist.all_reduce(rank_r)  # gloo's check: the sum is N(N-1)/2
            out["rank_sum_ok"] = out.get("rank_sum_ok", True) and bool((rank_r == world * (world - 1) / 2).all())
        for i, dtype in enumerate(ANY_DTYPES):
            for n in (0, 1, 5, 10007):
                root = (i + n) % world
                x = random_tensor(seed + i + n, rank, n, dtype)
                dist.broadcast(x, src=root)
                out["broadcast"].append((dtype, n, root, _bytes(x)))
                mine = random_tensor(seed + 100 + i + n, rank, n, dtype)
                got = [torch.empty(n, dtype=dtype) for _ in range(world)]
                dist.all_gather(got, mine)
                out["all_gather"].append((dtype, n, [_bytes(t) for t in got]))
                flat = torch.empty(world * n, dtype=dtype)
                dist.all_gather_into_tensor(flat, mine)
                out["all_gather_into_tensor"].append((dtype, n, _bytes(flat)))
        scalar = torch.tensor(float(rank) + 0.25, dtype=torch.float64)  # 0-dim
        dist.broadcast(scalar, src=world - 1)
        out["scalar"] = scalar.item()
        strided = torch.arange(12, dtype=torch.int64).view(3, 4).t() * (rank + 1)  # non-contiguous
        dist.broadcast(strided, src=1)
        out["strided"] = strided.clone()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_collective_against_independent_references(ranks, world_size):
    results = ranks.run(_rank_collectives, SEED, world_size=world_size)
    world = world_size
    for r in range(world):
        assert results[r]["rank_sum_ok"], f"rank {r}: rank r contributes r, sum != N(N-1)/2 {_note(N=world)}"
    # all_reduce: every rank the same bytes; rank 0's within the fp32 error of the float64 sum.
    k = 0
    for i, n in enumerate(SIZES):
        for j, dtype in enumerate(FLOATS):
            for op in ("sum", "avg"):
                _, _, _, y = results[0]["all_reduce"][k]
                for r in range(1, world):
                    assert results[r]["all_reduce"][k][3] == _digest(y), \
                        f"ranks differ {_note(n=n, dtype=dtype, op=op)}"
                xs = torch.stack([torch.randn(n, generator=torch.Generator().manual_seed(SEED + 31 * i + 7 * j + r))
                                  .to(dtype).double() for r in range(world)])
                ref = xs.sum(0) / (world if op == "avg" else 1)
                scale = 1.0 / world if op == "avg" else 1.0
                bound = world * 2.0**-24 * xs.abs().sum(0) * scale + torch.finfo(dtype).eps * ref.abs() \
                    + torch.finfo(dtype).tiny
                assert bool(((y.double() - ref).abs() <= bound).all()), f"off float64 {_note(n=n, dtype=dtype, op=op)}"
                k += 1
    # broadcast / all_gather: bit for bit.
    k = 0
    for i, dtype in enumerate(ANY_DTYPES):
        for n in (0, 1, 5, 10007):
            root = (i + n) % world
            want = _bytes(random_tensor(SEED + i + n, root, n, dtype))
            inputs = [_bytes(random_tensor(SEED + 100 + i + n, r, n, dtype)) for r in range(world)]
            for r in range(world):
                note = _note(rank=r, dtype=dtype, n=n, root=root)
                assert results[r]["broadcast"][k][3] == want, f"broadcast {note}"
                assert results[r]["all_gather"][k][2] == inputs, f"all_gather {note}"
                assert results[r]["all_gather_into_tensor"][k][2] == b"".join(inputs), f"all_gather_into_tensor {note}"
            k += 1
    for r in range(world):
        assert results[r]["scalar"] == world - 1 + 0.25
        assert torch.equal(results[r]["strided"], torch.arange(12).view(3, 4).t() * 2)


def _rank_barrier_and_async(ctx, seed):
    import torch.distributed as dist

    last = ctx.world_size - 1
    with _prime_world(ctx):
        # barrier: the last rank arrives late, after leaving a mark in the store.
        if ctx.rank == last:
            time.sleep(0.5)
            ctx.store.set(f"{ctx.job}/late", "here")
            ctx.store.check([f"{ctx.job}/late"])  # on the server before the barrier: a set is not answered
        dist.barrier()
        seen = ctx.store.check([f"{ctx.job}/late"])
        # async_op: three in flight, waited in reverse order, through Work and Future.
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(seed + n + ctx.rank)) for n in (3, 70001, 10)]
        works = [dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True) for x in xs]
        futs = [w.get_future() for w in works]
        assert futs[1].wait()[0] is xs[1]
        works[2].wait()
        works[0].wait()
        done = [w.is_completed() and w.is_success() and w.exception() is None for w in works]
        got = works[0].result()
        return {"seen": seen, "xs": [_digest(x) for x in xs], "x0": xs, "done": done,
                "result_is_tensor": got[0] is xs[0]}


def test_barrier_waits_for_the_last_rank_and_async_ops_complete(ranks):
    world = 3
    results = ranks.run(_rank_barrier_and_async, SEED, world_size=world)
    for r in range(world):
        assert results[r]["seen"], f"rank {r} left the barrier before the last rank arrived {_note()}"
        assert all(results[r]["done"]) and results[r]["result_is_tensor"]
        assert results[r]["xs"] == results[0]["xs"], f"rank {r}'s async results differ {_note()}"
    for i, n in enumerate((3, 70001, 10)):
        xs = torch.stack([torch.randn(n, generator=torch.Generator().manual_seed(SEED + n + r)).double()
                          for r in range(world)])
        err = (results[0]["x0"][i].double() - xs.mean(0)).abs().max().item() if n else 0.0
        assert err <= 1e-6 * (1 + xs.abs().max().item()), _note(n=n)


# ---------------------------------------------------------------------------
# what it refuses, and how it fails


def _rank_unsupported(ctx):
    import torch.distributed as dist

    t = torch.ones(4)
    calls = {
        "reduce": lambda: dist.reduce(t, dst=0),
        "scatter": lambda: dist.scatter(t, [torch.ones(4)] * ctx.world_size if ctx.rank == 0 else None, src=0),
        "gather": lambda: dist.gather(t, [torch.ones(4)] * ctx.world_size if ctx.rank == 0 else None, dst=0),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * ctx.world_size)),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty(4 * ctx.world_size), torch.ones(4 * ctx.world_size)),
        "send": lambda: dist.send(t, dst=(ctx.rank + 1) % ctx.world_size),
        "MAX": lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX),
        "PRODUCT": lambda: dist.all_reduce(t, op=dist.ReduceOp.PRODUCT),
    }
    out = {}
    with _prime_world(ctx):
        for name, call in calls.items():
            try:
                call()
                out[name] = "no error"
            except NotImplementedError as e:
                out[name] = ("NotImplementedError", str(e))
            except Exception as e:  # reported to the test process, which fails on it
                out[name] = (type(e).__name__, str(e))
        try:
            dist.all_reduce(torch.ones(3, dtype=torch.int64))
            out["int64"] = "no error"
        except TypeError as e:
            out["int64"] = ("TypeError", str(e))
        # Nothing above reached the ring: it is still in step.
        x = torch.full((5,), float(ctx.rank))
        dist.all_reduce(x)
        out["after"] = x.tolist()
    return out


def test_unsupported_collectives_raise_not_implemented_naming_the_op(ranks):
    world = 2
    results = ranks.run(_rank_unsupported, world_size=world)
    for r in range(world):
        res = results[r]
        for name in ("reduce", "scatter", "gather", "reduce_scatter", "all_to_all", "send", "MAX", "PRODUCT"):
            kind, msg = res[name] if isinstance(res[name], tuple) else (res[name], "")
            assert kind == "NotImplementedError", f"rank {r} {name}: got {res[name]}"
            assert name in msg and "prime" in msg, f"rank {r}: the message does not name {name}: {msg}"
        assert res["int64"][0] == "TypeError" and "int64" in res["int64"][1]
        assert res["after"] == [1.0] * 5


def _rank_failure(ctx, seed):
    import torch.distributed as dist

    from prime.comm import CommError, NonFiniteError

    with _prime_world(ctx):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed + ctx.rank))
        if ctx.rank == 1:
            x[17] = float("nan")
        before = x.clone()
        out = {}
        try:
            dist.all_reduce(x)
            out["sync"] = "no error"
        except NonFiniteError as e:
            out["sync"] = ("NonFiniteError", list(e.nonfinite_ranks))
        work = dist.all_reduce(x, async_op=True)
        try:
            work.wait()
        except CommError:
            pass
        out["async_exception"] = type(work.exception()).__name__
        try:
            work.get_future().wait()
            out["future"] = "no error"
        except Exception as e:  # torch wraps a future's error in its own type
            out["future"] = "NonFiniteError" in str(e) or "non-finite" in str(e).lower() or "NaN" in str(e)
        out["unchanged"] = _bytes(x) == _bytes(before)
    return out


def test_a_failed_collective_raises_everywhere_and_leaves_the_tensor(ranks):
    world = 3
    results = ranks.run(_rank_failure, SEED, world_size=world)
    for r in range(world):
        res = results[r]
        assert res["sync"] == ("NonFiniteError", [1]), f"rank {r}: {res['sync']}"
        assert res["async_exception"] == "NonFiniteError" and res["future"] is True, f"rank {r}: {res}"
        assert res["unchanged"], f"rank {r}: a failed all_reduce changed the tensor {_note()}"


def _rank_interrupted_wait(ctx, seed):
    import signal

    import torch.distributed as dist

    with _prime_world(ctx):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed + ctx.rank))
        out = {}
        if ctx.rank == 1:  # enters the all-reduce late, so that rank 0's wait is interrupted while it runs
            time.sleep(1.0)
            dist.all_reduce(x)
            return {"x": x}
        work = dist.all_reduce(x, async_op=True)

        def interrupt(*_):
            raise KeyboardInterrupt("interrupted wait")

        old = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            work.wait()
            out["first"] = "returned"
        except BaseException as e:  # the interrupt itself, not a stand-in for it
            out["first"] = type(e).__name__
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        out["running_after_interrupt"] = not work.is_completed() and work.exception() is None
        out["second"] = work.wait()  # the collective still completes, and its future with it
        out["future"] = work.get_future().wait()[0] is x
        out["x"] = x
    return out


def test_an_interrupted_wait_propagates_and_the_collective_still_completes(ranks):
    """A KeyboardInterrupt (or a stop) raised in the thread that waits is not the collective's outcome: it reaches
    the caller as itself, the work stays running, and a later wait() and the future complete with the result."""
    results = ranks.run(_rank_interrupted_wait, SEED, world_size=2)
    res = results[0]
    assert res["first"] == "KeyboardInterrupt", res["first"]
    assert res["running_after_interrupt"], "an interrupted wait completed the work with the interrupt as its error"
    assert res["second"] is True and res["future"] is True
    assert torch.equal(res["x"], results[1]["x"]), _note()
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(SEED + r)).double() for r in range(2)]
    assert (res["x"].double() - (xs[0] + xs[1])).abs().max().item() <= 1e-5, _note()


# ---------------------------------------------------------------------------
# the int8 option


def _rank_int8(ctx, seed):
    import torch.distributed as dist

    n = 50003
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed + ctx.rank))
    out = {}
    with _prime_world(ctx):
        exact = x.clone()
        dist.all_reduce(exact, op=dist.ReduceOp.AVG)  # the default group: exact
        group = dist.new_group(backend="prime", pg_options=backend.PrimeOptions(codec="int8"))
        via_option = x.clone()
        dist.all_reduce(via_option, op=dist.ReduceOp.AVG, group=group)
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        os.environ[backend.ENV_CODEC] = "int8"
        try:
            env_group = dist.new_group(backend="prime")
        finally:
            del os.environ[backend.ENV_CODEC]
        via_env = x.clone()
        dist.all_reduce(via_env, op=dist.ReduceOp.AVG, group=env_group)
        out.update(exact=exact, option=via_option, env=via_env, option_sum=summed)
        out["codecs"] = (group.options.codec, env_group.options.codec)
    with ctx.ring() as ring:  # the int8 ring called directly, same inputs
        direct = x.clone()
        ring.all_reduce(direct, op="avg", codec="int8").wait()
        direct_sum = x.clone()
        ring.all_reduce(direct_sum, op="sum", codec="int8").wait()
    out.update(direct=direct, direct_sum=direct_sum)
    return out


def test_int8_option_gives_the_int8_rings_bits(ranks):
    world = 3
    results = ranks.run(_rank_int8, SEED, world_size=world)
    for r in range(world):
        res = results[r]
        assert res["codecs"] == ("int8", "int8")
        assert torch.equal(res["option"].view(torch.int32), res["direct"].view(torch.int32)), f"rank {r} {_note()}"
        assert torch.equal(res["env"].view(torch.int32), res["direct"].view(torch.int32)), f"rank {r} {_note()}"
        assert torch.equal(res["option_sum"].view(torch.int32), res["direct_sum"].view(torch.int32)), _note()
        # The option did something: int8 is not the exact result, and is close to it.
        assert not torch.equal(res["option"], res["exact"])
        rel = ((res["option"] - res["exact"]).norm() / res["exact"].norm()).item()
        assert rel < 0.03, f"int8 relative error {rel} {_note()}"
