"""The ring reduces CUDA tensors on their GPU (csrc/ring/wire_codec_cuda.cu), for the exact, int8 and fp4 codecs.

The bytes on the wire are docs/wire-format.md's whatever the device, so a ring whose
ranks mix CPU and CUDA tensors must give every rank the bits an all-CPU ring gives for
the same inputs. Ranks are threads of this process (one Ring each, a HashStore between
them), all on the first GPU or spread over the GPUs there are. Needs a GPU and a CUDA
build of prime._C: skipped otherwise. Fresh random inputs each run; the seed is printed.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

prime = pytest.importorskip("prime")
from prime import _extension  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        not (_extension.available() and getattr(_extension.require(), "_ring_reduces_on_gpu", False)),
        reason="prime._C is not built with CUDA",
    ),
]

SEED = random.SystemRandom().randrange(1 << 30)
SEGMENT_BYTES = 1 << 16  # 16 Ki values: several segments per chunk, so the pipeline is exercised


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"test_ring_cuda SEED={SEED}")


def make_input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1013 + rank)
    scale = torch.rand(1, generator=g).item() * 4 + 0.1
    return (torch.randn(n, generator=g) * scale).to(dtype)


def _device(i: int) -> torch.device:
    return torch.device("cuda", i % torch.cuda.device_count())


_jobs = iter(range(1 << 30))


def _run_ranks(rank_main, world: int) -> None:
    """rank_main(r) for every rank r on a thread of its own; raises the first rank's error, fails on a hang."""
    errors = [None] * world

    def main(r: int) -> None:
        try:
            rank_main(r)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors[r] = e

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), f"a rank hung (SEED={SEED})"
    for e in errors:
        if e is not None:
            raise e


def run_ring(inputs, devices, op, codec, *, reduce_mode=None, monkeypatch=None, layout=None, block_size=None,
             schedule=None):
    """One all_reduce with rank r's input on devices[r] ("cpu" or "cuda"); returns per rank
    (result on the CPU, stats or the exception, the tensor after the call). block_size None:
    the codec's default (int8 64: 1-byte scales on the wire, packed and unpacked by the GPU codec)."""
    import torch.distributed as dist

    from prime.comm import Ring

    world = len(inputs)
    store = dist.HashStore()
    job = f"cuda-test-{next(_jobs)}"
    results = [None] * world

    def rank_main(r: int) -> None:
        x = inputs[r].clone()
        if devices[r] == "cuda":
            x = x.to(_device(r))
        if layout == "strided":  # every other element of a twice-as-long tensor
            wide = torch.zeros(2 * x.numel(), dtype=x.dtype, device=x.device)
            wide[::2] = x
            x = wide[::2]
        with Ring(store, r, world, timeout=60, job_id=job, segment_bytes=SEGMENT_BYTES, quant_error=True) as ring:
            work = ring.all_reduce(x, op=op, codec=codec, block_size=block_size, schedule=schedule)
            try:
                work.wait()
                outcome = work.stats()
            except Exception as e:  # noqa: BLE001 - returned to the test
                outcome = e
        results[r] = (x.cpu(), outcome)

    _run_ranks(rank_main, world)
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


CASES = [
    # world, devices, n, dtype
    (2, ("cuda", "cpu"), 100003, torch.float32),
    (2, ("cuda", "cuda"), 1 << 18, torch.float32),
    (3, ("cpu", "cuda", "cuda"), 100003, torch.float32),
    (3, ("cuda", "cpu", "cuda"), 77777, torch.bfloat16),
    (3, ("cuda", "cuda", "cpu"), 50001, torch.float16),
    (3, ("cuda", "cuda", "cuda"), 7, torch.float32),  # chunks smaller than a block, some empty
    (4, ("cuda", "cpu", "cuda", "cuda"), 100003, torch.bfloat16),  # the direct owner adds 3 contributions
]


@pytest.mark.parametrize("schedule", ["ring", "direct"])
@pytest.mark.parametrize("codec", ["int8", "fp4", "none"])
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("world,devices,n,dtype", CASES)
def test_mixed_ring_gives_the_all_cpu_bits(world, devices, n, dtype, op, codec, schedule):
    """Both schedules: the GPU ranks reduce on their GPU (the direct schedule's owner adds every
    contribution there) and end with the all-CPU ring's bits."""
    inputs = [make_input(SEED, r, n, dtype) for r in range(world)]
    reference = run_ring(inputs, ["cpu"] * world, op, codec, schedule=schedule)
    mixed = run_ring(inputs, list(devices), op, codec, schedule=schedule)
    for r in range(world):
        ref_y, ref_stats = reference[r]
        y, stats = mixed[r]
        assert not isinstance(stats, Exception), f"rank {r}: {stats} (SEED={SEED})"
        assert y.dtype == dtype
        assert torch.equal(_bits(y), _bits(ref_y)), (
            f"rank {r} ({devices[r]}) differs from the all-CPU ring in "
            f"{int((_bits(y) != _bits(ref_y)).sum())} of {n} values (SEED={SEED})"
        )
        assert torch.equal(_bits(y), _bits(reference[0][0]))  # and every rank agrees
        assert stats.bytes_sent == ref_stats.bytes_sent  # the same frames on the wire
        assert stats.gpu == (devices[r] == "cuda")
        assert stats.schedule == schedule
        if devices[r] == "cuda" and n >= 1000:
            assert stats.gpu_codec_s > 0 and stats.h2d_s > 0 and stats.d2h_s > 0, stats


@pytest.mark.parametrize("schedule", ["ring", "direct"])
@pytest.mark.parametrize("codec", ["int8", "fp4"])
@pytest.mark.parametrize("block_size", [32, 256, 1024, 2048, 4096])
@pytest.mark.parametrize("world,devices", [(2, ("cuda", "cpu")), (3, ("cuda", "cpu", "cuda"))])
def test_block_sizes_give_the_all_cpu_bits(world, devices, block_size, codec, schedule):
    # One warp per block in the fused reduce-quantize up to 1024, the unfused kernels above;
    # the direct schedule's owner of 3 ranks sums in fp32 on the device whatever the block.
    n = 70001
    inputs = [make_input(SEED + block_size, r, n, torch.float32) for r in range(world)]
    reference = run_ring(inputs, ["cpu"] * world, "avg", codec, block_size=block_size, schedule=schedule)
    mixed = run_ring(inputs, list(devices), "avg", codec, block_size=block_size, schedule=schedule)
    for r in range(world):
        y, stats = mixed[r]
        assert not isinstance(stats, Exception), f"rank {r}: {stats} (SEED={SEED})"
        assert torch.equal(_bits(y), _bits(reference[r][0])), (
            f"block {block_size}: rank {r} ({devices[r]}) differs from the all-CPU ring in "
            f"{int((_bits(y) != _bits(reference[r][0])).sum())} of {n} values (SEED={SEED})"
        )


@pytest.mark.parametrize("codec", ["int8", "fp4"])
@pytest.mark.parametrize("world,devices,n,dtype,block_size", [
    (2, ("cuda", "cuda"), 100003, torch.float32, 256),  # fused reduce-quantize
    (3, ("cuda", "cpu", "cuda"), 100003, torch.float32, 64),  # int8's default
    (3, ("cuda", "cpu", "cuda"), 77777, torch.bfloat16, 256),
    (3, ("cuda", "cuda", "cuda"), 50001, torch.float16, 32),
    (2, ("cuda", "cuda"), 70001, torch.float32, 2048),  # unfused: quantize, then the error kernel
    (3, ("cuda", "cuda", "cuda"), 7, torch.float32, 256),  # chunks shorter than a block, some empty
])
def test_gpu_ranks_report_the_cpu_rings_quant_error(world, devices, n, dtype, block_size, codec):
    # The bytes are the all-CPU ring's, so the error each rank measured while encoding
    # (WorkStats.quant_err_sq / quant_in_sq) is too, up to the order of the float64 additions.
    # (The CPU ring's sums are checked against the torch model in tests/test_ring.py.)
    inputs = [make_input(SEED, r, n, dtype) for r in range(world)]
    reference = run_ring(inputs, ["cpu"] * world, "avg", codec, block_size=block_size)
    mixed = run_ring(inputs, list(devices), "avg", codec, block_size=block_size)
    for r in range(world):
        ref_stats, stats = reference[r][1], mixed[r][1]
        assert not isinstance(stats, Exception), f"rank {r}: {stats} (SEED={SEED})"
        assert torch.equal(_bits(mixed[r][0]), _bits(reference[r][0])), f"rank {r} (SEED={SEED})"
        assert stats.quant_err_sq is not None and stats.quant_in_sq is not None, stats
        note = f"rank {r} ({devices[r]}) n={n} {dtype} block {block_size} (SEED={SEED})"
        assert stats.quant_in_sq == pytest.approx(ref_stats.quant_in_sq, rel=1e-9, abs=1e-300), note
        assert stats.quant_err_sq == pytest.approx(ref_stats.quant_err_sq, rel=1e-9, abs=1e-300), note
        if n > 1000:  # squared relative error: int8 ~1e-4, fp4 ~1e-2
            assert 0 < stats.quant_err_sq < (1e-3 if codec == "int8" else 0.1) * stats.quant_in_sq, note
    exact = run_ring(inputs, list(devices), "avg", "none", block_size=block_size)
    assert all(s.quant_err_sq is None and s.quant_in_sq is None for _, s in exact)  # nothing quantized


def wide_range_input(seed: int, rank: int, n: int) -> torch.Tensor:
    """Gaussian values whose blocks of 64 alternate between scale 1 and scale 1e-6 (2^-20, below the 2^-14
    that one byte reaches under a payload's largest scale): int8 payloads send every other block as zeros."""
    g = torch.Generator().manual_seed(seed * 1019 + rank)
    x = torch.randn(n, generator=g)
    return x * torch.tensor([1.0, 1e-6]).repeat_interleave(64).repeat(-(-n // 128))[:n]


@pytest.mark.parametrize("schedule", ["ring", "direct"])
@pytest.mark.parametrize("world,devices", [(2, ("cuda", "cpu")), (3, ("cuda", "cpu", "cuda"))])
def test_blocks_far_below_the_largest_travel_as_zeros_on_every_device(world, devices, schedule):
    # The GPU codec packs the scales on the device and zeroes its own copy of a block it sends as zeros;
    # the result and the measured quantization error are the all-CPU ring's.
    n = 70001
    inputs = [wide_range_input(SEED, r, n) for r in range(world)]
    reference = run_ring(inputs, ["cpu"] * world, "avg", "int8", schedule=schedule)
    mixed = run_ring(inputs, list(devices), "avg", "int8", schedule=schedule)
    tiny = torch.tensor([False, True]).repeat_interleave(64).repeat(-(-n // 128))[:n]
    for r in range(world):
        y, stats = mixed[r]
        assert not isinstance(stats, Exception), f"rank {r}: {stats} (SEED={SEED})"
        assert torch.equal(_bits(y), _bits(reference[r][0])), f"rank {r} ({devices[r]}) (SEED={SEED})"
        assert not y[tiny].any(), f"rank {r}: the small blocks decode as zeros (SEED={SEED})"
        assert bool((y[~tiny] != 0).float().mean() > 0.9), f"rank {r}: the large blocks went through"
        assert stats.quant_err_sq == pytest.approx(reference[r][1].quant_err_sq, rel=1e-9), f"rank {r} (SEED={SEED})"


def test_result_against_float64_sum():
    # Independent of the CPU ring: the exact codec's sum is within the fp32 bound of docs/ring.md.
    world, n = 3, 100003
    inputs = [make_input(SEED, r, n, torch.float32) for r in range(world)]
    results = run_ring(inputs, ["cuda"] * world, "sum", "none")
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    bound = world * 2.0**-24 * torch.stack([x.double().abs() for x in inputs]).sum(0)
    for y, _ in results:
        assert ((y.double() - exact).abs() <= bound).all(), f"SEED={SEED}"


@pytest.mark.parametrize("codec", ["int8", "fp4", "none"])
def test_strided_cuda_tensor(codec):
    world, n = 2, 40000
    inputs = [make_input(SEED, r, n, torch.float32) for r in range(world)]
    reference = run_ring(inputs, ["cpu"] * world, "avg", codec)
    strided = run_ring(inputs, ["cuda", "cuda"], "avg", codec, layout="strided")
    for r in range(world):
        assert torch.equal(_bits(strided[r][0]), _bits(reference[r][0])), f"SEED={SEED}"


@pytest.mark.parametrize("codec", ["int8", "fp4", "none"])
def test_nonfinite_input_on_a_gpu_rank(codec):
    from prime.comm import NonFiniteError

    world, n = 3, 60000
    inputs = [make_input(SEED, r, n, torch.float32) for r in range(world)]
    inputs[1][12345] = float("nan")
    results = run_ring(inputs, ["cpu", "cuda", "cuda"], "avg", codec)
    for r, (y, outcome) in enumerate(results):
        assert isinstance(outcome, NonFiniteError), f"rank {r}: {outcome!r}"
        assert list(outcome.nonfinite_ranks) == [1]
        assert torch.equal(_bits(y), _bits(inputs[r]))  # untouched (compared as bits: NaN included)


@pytest.mark.parametrize("codec", ["none", "int8", "fp4"])
def test_overflow_on_gpu_owner(codec):
    from prime.comm import NonFiniteError

    world, n = 2, 5000
    inputs = [torch.full((n,), 60000.0, dtype=torch.float16) for _ in range(world)]
    results = run_ring(inputs, ["cuda", "cuda"], "sum", codec)
    for r, (y, outcome) in enumerate(results):
        assert isinstance(outcome, NonFiniteError) and outcome.overflow, f"rank {r}: {outcome!r}"
        assert torch.equal(_bits(y), _bits(inputs[r]))


def test_host_staging_path_still_selectable(monkeypatch):
    monkeypatch.setenv("PRIME_RING_CUDA_REDUCE", "cpu")
    world, n = 2, 30000
    inputs = [make_input(SEED, r, n, torch.float32) for r in range(world)]
    staged = run_ring(inputs, ["cuda", "cuda"], "avg", "int8")
    monkeypatch.setenv("PRIME_RING_CUDA_REDUCE", "gpu")
    on_gpu = run_ring(inputs, ["cuda", "cuda"], "avg", "int8")
    for r in range(world):
        assert not staged[r][1].gpu and staged[r][1].stage_s > 0 and staged[r][1].copy_back_s > 0
        assert on_gpu[r][1].gpu
        assert torch.equal(_bits(staged[r][0]), _bits(on_gpu[r][0])), f"SEED={SEED}"


@pytest.mark.parametrize("codec", ["int8", "fp4", "none"])
@pytest.mark.parametrize("world,devices,dtype", [(2, ("cuda", "cuda"), torch.float32),
                                                 (3, ("cuda", "cpu", "cuda"), torch.bfloat16)])
def test_pageable_upload_gives_the_all_cpu_bits(monkeypatch, world, devices, dtype, codec):
    # PRIME_RING_CUDA_UPLOAD=pageable: received payloads go to the GPU straight from the
    # transport's buffers (no pinned upload slot); the bits must not change.
    n = 300007  # several segments per chunk
    inputs = [make_input(SEED, r, n, dtype) for r in range(world)]
    reference = run_ring(inputs, ["cpu"] * world, "avg", codec)
    monkeypatch.setenv("PRIME_RING_CUDA_UPLOAD", "pageable")
    pageable = run_ring(inputs, list(devices), "avg", codec)
    for r in range(world):
        y, stats = pageable[r]
        assert not isinstance(stats, Exception), f"rank {r}: {stats} (SEED={SEED})"
        assert torch.equal(_bits(y), _bits(reference[r][0])), f"rank {r} ({devices[r]}), SEED={SEED}"
        if devices[r] == "cuda":
            assert stats.gpu and stats.h2d_s > 0, stats


def test_bad_upload_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("PRIME_RING_CUDA_UPLOAD", "mapped")
    inputs = [make_input(SEED, r, 1000, torch.float32) for r in range(2)]
    with pytest.raises(ValueError, match="PRIME_RING_CUDA_UPLOAD must be 'pinned' or 'pageable'"):
        run_ring(inputs, ["cuda", "cuda"], "avg", "int8")


def test_back_to_back_collectives_on_one_ring():
    # Collectives queue on one ring and reuse its stream and staging; the caller's
    # stream writes the next input while the ring still works on the previous one.
    import torch.distributed as dist

    from prime.comm import Ring

    world, n, rounds = 2, 50000, 4
    store = dist.HashStore()
    inputs = [[make_input(SEED + k, r, n, torch.float32) for r in range(world)] for k in range(rounds)]
    out = [[None] * rounds for _ in range(world)]

    def rank_main(r):
        with Ring(store, r, world, timeout=60, job_id="cuda-b2b", segment_bytes=SEGMENT_BYTES) as ring:
            xs = [inputs[k][r].to(_device(r)) * 1.0 for k in range(rounds)]  # made on the current stream
            works = [ring.all_reduce(x, op="avg", codec="int8" if k % 2 else "none") for k, x in enumerate(xs)]
            for k, w in enumerate(works):
                w.wait()
                out[r][k] = xs[k].cpu()

    _run_ranks(rank_main, world)
    for k in range(rounds):
        ref = run_ring(inputs[k], ["cpu"] * world, "avg", "int8" if k % 2 else "none")
        for r in range(world):
            assert torch.equal(_bits(out[r][k]), _bits(ref[r][0])), f"round {k} rank {r} (SEED={SEED})"


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_the_rings_device_buffers_are_counted_while_it_is_open(codec):
    # cudaMalloc'd by the ring, out of torch.cuda's statistics: prime.comm.ring.device_buffer_bytes reports them
    # (the memory line adds them to the GPU peak) until it closes, and the memory plan counts them: at most what
    # it plans for them, and not much less (a change of the buffers the plan does not follow fails here).
    import torch.distributed as dist

    from prime.comm import Ring
    from prime.comm.ring import device_buffer_bytes
    from prime.comm.ring import segment_values
    from prime.memory import _dense_ring_gpu, _topk_ring_gpu

    world, n = 2, 1 << 20
    store = dist.HashStore()
    seen = [None] * world
    opened, closing = threading.Barrier(world, timeout=60), threading.Barrier(world, timeout=60)

    def rank_main(r):
        x = make_input(SEED, r, n, torch.float32).to(_device(r))
        with Ring(store, r, world, timeout=60, job_id=f"cuda-bytes-{codec}", segment_bytes=SEGMENT_BYTES) as ring:
            if codec == "topk":
                residual = torch.zeros_like(x)
                ring.all_reduce(x, op="avg", codec="topk", block_size=4096, keep=48, keep_average=96,
                                residual=residual).wait()
            else:
                ring.all_reduce(x, op="avg", codec="int8").wait()
            torch.cuda.synchronize(x.device)
            opened.wait()
            own = ring._cuda_contexts[x.device.index].device_bytes
            seen[r] = (own, device_buffer_bytes(x.device.index), device_buffer_bytes())
            closing.wait()

    _run_ranks(rank_main, world)
    owns = [s[0] for s in seen]
    print(f"ring device buffers of {n} values, {codec}: {owns} bytes (rank 0, 1)")
    segment = segment_values(SEGMENT_BYTES)
    if codec == "int8":  # the result's image (codes and scales) and a segment's buffers
        plan = _dense_ring_gpu(n, 64, "int8", segment=segment, ranks=world)
    else:  # the dropped part (with `residual`, the ring's own), the final records and a segment's buffers
        plan = _topk_ring_gpu(n, 4096, 48, 96, segment=segment, own_dropped=True)
    dropped = 4 * n if codec == "topk" else 0  # (exactly that: the rest is held to 5% of the rest of the plan)
    for r, (own, here, everywhere) in enumerate(seen):
        assert dropped + 0.95 * (plan - dropped) <= own <= plan, (r, own, plan)
        assert here >= own and everywhere == sum(owns), (r, here, everywhere, owns)
    assert device_buffer_bytes() == 0
