"""The topk codec on the real ring (prime.comm.Ring.all_reduce(codec="topk")): the bits of the reference
arithmetic (prime.sparse.owner_average) on every rank, the residual the owners keep, the bytes on the wire,
and the failures every other codec reports."""

import random

import pytest
import torch

from conftest import MAX_RANKS, needs_ring
from prime import sparse

pytestmark = needs_ring

SEED = random.randrange(1 << 30)


def _contribution(seed: int, rank: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))


CASES = [  # n, chunk, k, op, k of the owners' averages (None: k)
    (5 * 256 + 77, 256, 8, "avg", None),
    (1 << 16, 4096, 64, "avg", None),
    (3 * 1024, 1024, 1024, "sum", None),  # everything kept
    (100, 16, 3, "avg", None),
    (1, 16, 1, "sum", None),  # fewer chunks than ranks: some own nothing
    (3 * 4096 + 999, 4096, 48, "avg", 96),  # the averages keep more than each contribution
    (7 * 256 + 5, 256, 16, "sum", 5),  # and fewer
]


def _rank_cases(ctx, seed, device="cpu"):
    out = []
    with ctx.ring(segment_bytes=1 << 14, quant_error=True) as ring:  # small segments: several per shard
        for i, (n, chunk, k, op, ka) in enumerate(CASES):
            t = _contribution(seed, ctx.rank, n).to(device)
            if device == "cuda":  # the codec runs on the GPU: the residual lives there too
                assert ring.reduces_on_device(t)
            # every other case the buffer is filled (dropped=, whatever it held) instead of added to
            kind = "dropped" if i % 2 else "residual"
            residual = torch.full((n,), float("nan"), device=device) if i % 2 else torch.zeros(n, device=device)
            work = ring.all_reduce(t, op=op, codec="topk", block_size=chunk, keep=k, keep_average=ka,
                                   **{kind: residual})
            work.wait()
            stats = work.stats()
            out.append((t.cpu(), residual.cpu(), stats.bytes_sent, stats.quant_err_sq, stats.quant_in_sq))
    return out


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", list(range(2, MAX_RANKS + 1)))
def test_topk_all_reduce_gives_the_reference_bits_and_residuals(ranks, world_size, device):
    results = ranks.run(_rank_cases, SEED, device, world_size=world_size)
    for i, (n, chunk, k, op, ka) in enumerate(CASES):
        note = f"[N={world_size} n={n} chunk={chunk} k={k} op={op} k_average={ka} seed={SEED}]"
        contributions = [_contribution(SEED, r, n) for r in range(world_size)]
        want = sparse.owner_average(contributions, chunk, k, op=op, k_average=ka)
        for r in range(world_size):
            got, residual, sent, err_sq, in_sq = results[r][i]
            assert torch.equal(got, want.average), f"rank {r} differs from the reference {note}"
            # the wire's residual is all this rank's contribution lost: its selections of the shards others own,
            # and what its selection of its own shard's average dropped
            lo, hi = sparse.shards(n, world_size, chunk)[r]
            assert torch.equal(residual, want.residuals[r]), f"rank {r}'s residual {note}"
            assert sent >= want.sent[r] and sent < want.sent[r] + 200 * (2 * world_size + n // (1 << 12) + 4), \
                f"rank {r} sent {sent} bytes for {want.sent[r]} of payloads {note}"
            # the error the ring reports: what this rank's selection of its shard's average dropped
            divisor = world_size if op == "avg" else 1
            dropped = want.residuals[r][lo:hi].double() / divisor
            before = want.average[lo:hi].double() + dropped
            assert err_sq == pytest.approx(float(dropped.pow(2).sum()), rel=1e-6, abs=1e-30), note
            assert in_sq == pytest.approx(float(before.pow(2).sum()), rel=1e-6, abs=1e-30), note


def _rank_nonfinite(ctx, seed, device="cpu"):
    from prime.comm import NonFiniteError

    with ctx.ring() as ring:
        n = 4096 * 3
        t = _contribution(seed, ctx.rank, n)
        if ctx.rank == 1:
            t[5] = float("nan")
        t = t.to(device)
        before, residual = t.clone(), torch.zeros(n, device=device)
        try:
            ring.all_reduce(t, codec="topk", keep=16, residual=residual).wait()
        except NonFiniteError as e:
            return (str(e), torch.equal(t, before) or (t.isnan() == before.isnan()).all().item(), bool(residual.any()))
        return ("no error", False, False)


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_on_one_rank_fails_the_topk_collective_everywhere_and_changes_nothing(ranks, device):
    out = ranks.run(_rank_nonfinite, SEED, device, world_size=3)
    for r, (msg, unchanged, residual_touched) in enumerate(out):
        assert "rank(s) [1]" in msg, (r, msg)
        assert unchanged and not residual_touched, r


def _rank_bad_args(ctx):
    with ctx.ring() as ring:
        errors = []
        for kwargs in ({"schedule": "ring"}, {"keep": 0}, {"block_size": 100}, {"residual": torch.zeros(3)},
                       {"residual": torch.zeros(4096, dtype=torch.float64)}, {"keep_average": 4097},
                       {"residual": torch.zeros(4096), "dropped": torch.zeros(4096)}, {"dropped": torch.zeros(5)}):
            try:
                ring.all_reduce(torch.zeros(4096), codec="topk", **kwargs)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        try:
            ring.all_reduce(torch.zeros(4096, dtype=torch.bfloat16), codec="topk")
        except TypeError as e:
            errors.append(str(e))
        for kwargs in ({"keep": 4}, {"keep_average": 4}):
            try:
                ring.all_reduce(torch.zeros(4096), codec="int8", **kwargs)
            except ValueError as e:
                errors.append(str(e))
        return errors


def test_bad_topk_arguments_are_refused_with_what_is_wrong(ranks):
    errors = ranks.run(_rank_bad_args, world_size=1)[0]
    assert "direct schedule" in errors[0]
    assert "k (values kept" in errors[1]
    assert "power of two" in errors[2]
    assert "residual must be" in errors[3] and "residual must be" in errors[4]
    assert errors[5].startswith("keep_average: ") and "k (values kept" in errors[5]
    assert "pass one" in errors[6] and errors[7].startswith("dropped must be")
    assert "float32" in errors[8]
    assert "settings of codec 'topk'" in errors[9] and "settings of codec 'topk'" in errors[10]


def _rank_other_average_k(ctx):
    from prime.comm import CommError

    with ctx.ring(timeout=10) as ring:
        t = torch.randn(4 * 4096)
        before = t.clone()
        try:  # rank 1's owners would send averages of another size: each rank refuses the other's frames
            ring.all_reduce(t, codec="topk", keep=32, keep_average=64 if ctx.rank == 0 else None).wait()
            return None, False
        except CommError as e:
            return str(e), torch.equal(t, before)


def test_ranks_whose_averages_keep_different_counts_refuse_each_other(ranks):
    for msg, unchanged in ranks.run(_rank_other_average_k, world_size=2):
        assert msg is not None and "other arguments" in msg, msg
        assert unchanged


def _rank_cuda(ctx, seed):
    import os

    from prime.comm.ring import ENV_CUDA_REDUCE

    with ctx.ring() as ring:
        n = 3 * 4096 + 100
        t = _contribution(seed, ctx.rank, n)
        gpu, scratch, staged = t.cuda(), t.cuda(), t.cuda()
        r_cpu, r_gpu, r_staged = torch.zeros(n), torch.zeros(n, device="cuda"), torch.zeros(n)
        ring.all_reduce(t, codec="topk", keep=32, keep_average=64, residual=r_cpu).wait()
        on_device = ring.reduces_on_device(gpu)
        ring.all_reduce(gpu, codec="topk", keep=32, keep_average=64, residual=r_gpu).wait()
        # dropped=: filled on the device as the collective runs (whatever the buffer held before)
        d_gpu = torch.full((n,), float("nan"), device="cuda")
        ring.all_reduce(scratch, codec="topk", keep=32, keep_average=64, dropped=d_gpu).wait()
        same_scratch = torch.equal(scratch.cpu(), t) and torch.equal(d_gpu.cpu(), r_cpu)
        os.environ[ENV_CUDA_REDUCE] = "cpu"  # through the host and the CPU kernels
        try:
            wrong = None
            try:
                ring.all_reduce(staged, codec="topk", keep=32, residual=torch.zeros(n, device="cuda"))
            except ValueError as e:
                wrong = str(e)
            ring.all_reduce(staged, codec="topk", keep=32, keep_average=64, residual=r_staged).wait()
        finally:
            del os.environ[ENV_CUDA_REDUCE]
        return (on_device, torch.equal(gpu.cpu(), t) and same_scratch, torch.equal(r_cpu, r_gpu.cpu()),
                torch.equal(staged.cpu(), t), torch.equal(r_cpu, r_staged), wrong)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_tensor_gets_the_bits_of_a_cpu_one(ranks):
    """The GPU kernels (the ring reduces on the device) and the host staging (PRIME_RING_CUDA_REDUCE=cpu) give the
    CPU ring's bits, result and residual (added to, or filled: dropped=); a residual on the wrong side is refused."""
    import prime._C as C

    for on_device, same, same_residual, same_staged, same_staged_residual, wrong in ranks.run(
            _rank_cuda, SEED, world_size=2):
        assert on_device == bool(C._ring_reduces_on_gpu)
        assert same and same_residual and same_staged and same_staged_residual
        assert wrong is not None and "on cpu" in wrong
