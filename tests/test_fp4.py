"""The fp4 block codec's C++ backends (CPU, every instruction set; CUDA when present)
against the pure-torch reference, bit for bit, on fresh random data; and its
properties stated without the reference (the nearest-even rule on midpoints, the
error bound, unbiased stochastic rounding). tests/test_ops.py runs its random-data
round trips (every block size, dtype and length, large tensors, seeds) for both codecs
and lends its helpers here; Triton has its own file (tests/test_triton.py).

The run's seed is printed at import (test_ops) and in every failure message; rerun with
PRIME_TEST_SEED=<seed> to replay it.
"""

from __future__ import annotations

import math

import pytest
import torch

from prime import _extension, ops
from test_ops import (  # noqa: F401  (tests/ is on sys.path under pytest)
    BACKENDS,
    DTYPES,
    KINDS,
    SEED,
    assert_same_encoding,
    assert_same_floats,
    both,
    check_roundtrip,
    ctx,
    gen_for,
    impls,
    make,
    needs_cuda,
    needs_ext,
    relative_l2,
)

P = torch.ops.prime if _extension.available() else None


IMPLS = impls("fp4")


def codes_of(q: torch.Tensor, n: int) -> torch.Tensor:
    """The n codes (int64, 0..15) packed in q: value 2j in the low nibble of byte j."""
    b = q.cpu().to(torch.int64)
    return torch.stack([b & 15, b >> 4], 1).reshape(-1)[:n]


# ---------------------------------------------------------------------------
# bit-exactness on random data


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_misaligned(impl):
    g = gen_for("fp4 strided", impl.name)
    base = torch.randn(301, 517, generator=g).to(impl.device)
    for name, v in {"transposed": base.t(), "every_third": base.reshape(-1)[::3],
                    "bf16_transposed": base.to(torch.bfloat16).t()}.items():
        for seed in (None, 99):
            want = ops.quantize_fp4_reference(v.cpu(), 64, seed)
            assert_same_encoding(impl.quantize(v, 64, seed), want, ctx(impl=impl, view=name, seed=seed))
    flat = base.reshape(-1)
    for off in (1, 3):  # inputs at odd offsets (misaligned for vector loads)
        check_roundtrip(impl, flat[off : off + 10_000], 256, None, ctx(impl=impl, offset=off), codec="fp4")
    n = 20_001
    q, s = ops.quantize_fp4_reference(flat.cpu()[:n], 32)
    qv = torch.cat([q[:1], q])[1:].to(impl.device)  # codes at an odd byte address
    accv = torch.randn(n + 1, generator=g)[1:].to(impl.device)
    want = ops.dequantize_add_fp4_reference_(accv.cpu().clone(), q, s, 32)
    impl.dequantize_add_(accv, qv, s.to(impl.device), 32)
    assert_same_floats(accv, want, ctx(impl=impl, what="dequantize_add at odd offsets"))


# ---------------------------------------------------------------------------
# the format's rules, stated without the reference


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_special_blocks(impl, dtype):
    """Zero blocks, subnormal blocks (6/a overflows), tiny normals, all-equal blocks, NaN/Inf flags."""
    B = 64
    g = gen_for("fp4 special", impl.name, dtype)
    tiny = torch.finfo(dtype).tiny
    blocks = [
        torch.zeros(B), -torch.zeros(B), torch.randn(B, generator=g) * 1e-3,
        torch.randint(-5, 6, (B,), generator=g).float() * tiny / 64,  # subnormals of the dtype
        torch.randn(B, generator=g) * tiny * 40, torch.full((B,), -7.25), torch.randn(B, generator=g) * 100,
    ]
    x = torch.cat(blocks)
    x[B * 2 + 3] = float("nan")
    x = torch.cat([x, torch.randn(B, generator=g)])
    x[-5] = float("inf")
    x = torch.cat([x, torch.randn(B // 2 + 3, generator=g)])
    x[-1] = float("-inf")  # in the short last block (an odd count)
    x = x.to(dtype)
    for seed in (None, 5):
        what = ctx(impl=impl, dtype=dtype, seed=seed)
        check_roundtrip(impl, x.to(impl.device), B, seed, what, codec="fp4")
        q, s = impl.quantize(x.to(impl.device), B, seed)
        codes, s = codes_of(q, x.numel()), s.cpu()
        bad_blocks = [2, 7, 8]
        assert torch.isnan(s).nonzero().view(-1).tolist() == bad_blocks, what
        assert torch.all(s[bad_blocks].view(torch.int32) == 0x7FC00000), what
        for k in bad_blocks:
            assert not codes[k * B : (k + 1) * B].any(), what
        assert not (codes == 8).any(), what  # -0 is never written
        assert (codes[5 * B : 6 * B] == 15).all(), what  # all equal (-7.25): -6 everywhere


@pytest.mark.parametrize("impl", IMPLS)
def test_midpoints_round_to_the_even_index(impl):
    """a = 6 * 2^k makes inv = 2^-k exact, so x = t * 2^k lands on v = t: the seven midpoints go to the
    even magnitude index, one ulp either side to the nearer neighbour (the rule as docs/wire-format.md
    states it, spelled out here)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    t = torch.cat([mids, -mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0)),
                   torch.tensor([-0.1, -0.0, 0.0])])
    m = torch.tensor([0, 2, 2, 4, 4, 6, 6] * 2 + [0, 1, 2, 3, 4, 5, 6] + [1, 2, 3, 4, 5, 6, 7] + [0, 0, 0])
    want = torch.where((m > 0) & (t < 0), m + 8, m)
    for k in (-20, -3, 0, 7):
        x = torch.cat([torch.tensor([-6.0]), t]) * 2.0**k  # one block of 32
        for dtype in DTYPES:
            if not torch.equal(x.to(dtype).float(), x):
                continue  # not exact in this dtype (the ulp neighbours)
            q, s = impl.quantize(x.to(dtype).to(impl.device), 32)
            codes = codes_of(q, 32)
            assert s.item() == 2.0**k and codes[0] == 15, ctx(impl=impl, k=k, dtype=dtype)
            assert torch.equal(codes[1:], want), ctx(impl=impl, k=k, dtype=dtype, codes=codes[1:].tolist())


def near_every_level(block=32):
    """Blocks of `block` values: 6 (so a = 6 and inv = 1: v = x exactly), then every fp32 within 4096
    ulps of each E2M1 midpoint and level up to 6, positive and negative."""
    points = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]
    bits = torch.tensor(points).view(torch.int32).to(torch.int64)
    near = (bits[:, None] + torch.arange(-4096, 4096)).reshape(-1).to(torch.int32).view(torch.float32)
    t = near[near <= 6.0]
    t = torch.cat([t, -t])
    t = t[: t.numel() // (block - 1) * (block - 1)].view(-1, block - 1)
    return torch.cat([torch.full((t.shape[0], 1), 6.0), t], 1).reshape(-1).contiguous()


@needs_ext
@pytest.mark.parametrize("block", [32, 64, 256])
def test_nearest_near_every_level_matches_the_definition(block):
    """The SIMD kernels let the FPU round (adding 1.5 * 2^(22 + e), e by a table on the integer
    part of v) rather than counting midpoints: every fp32 within 4096 ulps of each midpoint and
    level (the integers among them bound the table's classes), both signs, against the
    reference's count (a = 6: inv = 1, v = x exactly). Blocks of 32 and of 64 and up are packed
    by different code (AVX2: 32 values or 64 at a time)."""
    x = near_every_level(block)
    want, _ = ops.quantize_fp4_reference(x, block)
    for isa in P._cpu_codec_isas():
        q, s = P._quantize_fp4_isa(x, block, None, isa)
        assert bool((s == 1.0).all())
        assert torch.equal(q, want), ctx(isa=isa, bad=int((q != want).sum()))


@needs_cuda
@pytest.mark.parametrize("block", [32, 256])
def test_cuda_nearest_near_every_level_matches_the_definition(block):
    """The CUDA kernels round with one IEEE add of a power of two (formats_cuda.cuh): the same values
    as above against the reference's count."""
    x = near_every_level(block)
    want, _ = ops.quantize_fp4_reference(x, block)
    q, s = ops.quantize_fp4(x.cuda(), block, backend="cuda")
    assert bool((s == 1.0).all())
    assert torch.equal(q.cpu(), want), ctx(block=block, bad=int((q.cpu() != want).sum()))


@needs_ext
def test_nearest_in_every_binade_matches_the_definition():
    """Values of every fp32 binade below 6, subnormals included, with random mantissas, both
    signs, beside 6 (a = 6: v = x): the tiny ones round to code 0 on every instruction set
    whatever their exponent bits (the kernels' tables are indexed by the value, not by its
    exponent), against the reference."""
    g = torch.Generator().manual_seed(SEED)
    exponents = torch.arange(-149, 3).repeat_interleave(16)
    mantissas = torch.randint(0, 1 << 23, (exponents.numel(),), generator=g)
    normal = torch.ldexp(1.0 + mantissas.double() / 2.0**23, exponents.double())
    subnormal = mantissas.double() * 2.0**-149
    t = torch.where(exponents > -127, normal, subnormal).float()
    t = torch.cat([t[t <= 6.0], torch.tensor([0.0, 6.0])])
    t = t[: t.numel() // 31 * 31].view(-1, 31)
    for sign in (1.0, -1.0):
        x = torch.cat([torch.full((t.shape[0], 1), 6.0), sign * t], 1).reshape(-1).contiguous()
        want, _ = ops.quantize_fp4_reference(x, 32)
        for isa in P._cpu_codec_isas():
            q, s = P._quantize_fp4_isa(x, 32, None, isa)
            assert bool((s == 1.0).all())
            assert torch.equal(q, want), ctx(isa=isa, sign=sign, bad=int((q != want).sum()))


@needs_ext
def test_blocks_near_the_top_of_the_range_match_the_definition():
    """Blocks whose maximum lies from 2^124 up to the largest fp32, random mantissas, both signs:
    the scale passes 2^125, where the AVX2 kernel's halved inverse scale would be subnormal and it
    takes its other path; every instruction set against the reference, stochastic rounding too."""
    g = torch.Generator().manual_seed(SEED + 11)
    rows = []
    for e in range(124, 128):
        for top in (1.0 + torch.rand(1, generator=g).item(), 1.9999998807907104):  # the last: FLT_MAX at e = 127
            body = torch.randn(63, generator=g).clamp(-3.5, 3.5) / 3.5 * top * 2.0**e
            rows.append(torch.cat([torch.tensor([top * 2.0**e * (1 if e % 2 else -1)]), body]))
    # and values within 12 ulps of every midpoint times scales just above 2^125 (inverse scales with
    # odd last bits, which halving would drop): the rounding of x * inv decides these codes
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    for a in torch.empty(6).uniform_(6 * 2.0**125 * 1.01, 3.4e38, generator=g).float().tolist():
        t = (mids * (a / 6)).float().view(torch.int32).to(torch.int64)
        near = (t[:, None] + torch.arange(-12, 13)).reshape(-1).to(torch.int32).view(torch.float32)
        for part in near.split(63):
            rows.append(torch.cat([torch.tensor([a]), part, -part[: 63 - part.numel()] if part.numel() < 63 else part[:0]]))
    x = torch.cat(rows).float()
    assert torch.isfinite(x).all() and x.numel() % 64 == 0
    for seed in (None, 9):
        want, want_s = ops.quantize_fp4_reference(x, 64, seed)
        assert (want_s > 2.0**125).any() and (want_s < 2.0**125).any()  # both paths are taken
        for isa in P._cpu_codec_isas():
            q, s = P._quantize_fp4_isa(x, 64, seed, isa)
            assert torch.equal(s, want_s), ctx(isa=isa, seed=seed)
            assert torch.equal(q, want), ctx(isa=isa, seed=seed, bad=int((q != want).sum()))


def test_decode_table():
    """Each code decodes to +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times the scale (code 8: -0.0)."""
    q = torch.arange(256, dtype=torch.uint8)
    scales = torch.tensor([1.0] * 8 + [0.375] * 8)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = magnitudes + [-v for v in magnitudes]
    want = torch.tensor([table[(b >> (4 * k)) & 15] for b in range(256) for k in (0, 1)]) * scales.repeat_interleave(32)
    impls = [("torch", lambda *a: ops.dequantize_fp4_reference(*a))]
    if _extension.available():
        impls += [(isa, lambda *a, isa=isa: P._dequantize_fp4_isa(*a, isa)) for isa in P._cpu_codec_isas()]
    if "cuda" in ops.available_backends("cuda"):
        impls += [("cuda", lambda q, s, *a: ops.dequantize_fp4(q.cuda(), s.cuda(), *a, backend="cuda").cpu())]
    for name, decode in impls:
        got = decode(q, scales, 512, 32, torch.float32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name  # -0.0 included


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantization_error(backend):
    """|decoded - x| <= scale * gap / 2 per element (gap 2 at most: <= scale), and the relative L2 error
    of docs/wire-format.md's table at n = 2^20, B = 256, against the int8 codec on the same data."""
    dev = "cuda" if backend == "cuda" else "cpu"
    n, B = 1 << 20, 256
    for kind, bound in [("normal", 0.115), ("student_t", 0.2)]:  # measured (100 seeds): 11.1%, 16.5-18.3%
        x = KINDS[kind](n, gen_for("fp4 error", kind)).to(dev)
        q, s = ops.quantize_fp4(x, B, backend=backend)
        y = ops.dequantize_fp4(q, s, n, B, backend=backend)
        step = s.double().repeat_interleave(B)
        assert ((y.double() - x.double()).abs() <= step * (1 + 1e-6)).all(), ctx(kind=kind)
        ours = relative_l2(y, x)
        int8 = relative_l2(ops.dequantize_int8(*ops.quantize_int8(x, B, backend=backend), B, backend=backend), x)
        print(f"{kind}: fp4 {ours:.4f}, int8 {int8:.4f}")
        assert 5 * int8 < ours < bound, ctx(kind=kind, fp4=ours, int8=int8, bound=bound)  # fp4/int8: 16x, 9-10x


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_unbiased(backend):
    dev = "cuda" if backend == "cuda" else "cpu"
    B, S = 256, 400
    x = (torch.randn(4 * B, generator=gen_for("fp4 unbiased", backend)) * 0.3).to(dev)
    _, scales = ops.quantize_fp4(x, B, backend=backend)
    mean = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(S):
        q, s = ops.quantize_fp4(x, B, seed=SEED * 1000 + seed, backend=backend)
        assert torch.equal(s, scales)  # the scale does not depend on the rounding
        mean += ops.dequantize_fp4(q, s, x.numel(), B, backend=backend).double()
    mean /= S
    step = 2 * scales.double().repeat_interleave(B)  # the widest gap (4 to 6) in x's units
    err = (mean - x.double()) / step
    # per element a Bernoulli mean over S draws: std <= 0.5 / sqrt(S) gaps; allow 6 sigma (as for int8)
    assert err.abs().max() < 6 * 0.5 / math.sqrt(S), ctx(backend=backend, worst=float(err.abs().max()))
    assert abs(float(err.mean())) < 5 * 0.5 / math.sqrt(S * x.numel()), ctx(backend=backend, bias=float(err.mean()))


# ---------------------------------------------------------------------------
# torch.library conformance and arguments


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    dev = "cuda" if backend == "cuda" else "cpu"
    g = gen_for("fp4 opcheck", backend)
    x = torch.randn(1001, generator=g).to(dev)
    q, s = P.quantize_fp4(x, 64, None)
    acc = torch.randn(1001, generator=g).to(dev)
    cases = [
        (P.quantize_fp4.default, (x, 64, None)),
        (P.quantize_fp4.default, (x.to(torch.bfloat16)[:1000].view(10, 100), 128, 7)),
        (P.dequantize_fp4.default, (q, s, 1001, 64, torch.float32)),
        (P.dequantize_fp4.default, (q, s, 1001, 64, torch.float16)),
        (P.dequantize_add_fp4_.default, (acc, q, s, 64)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments(backend):
    dev = "cuda" if backend == "cuda" else "cpu"
    x = torch.randn(1001, device=dev)
    q, s = ops.quantize_fp4(x, 64, backend=backend)
    acc = torch.zeros(1001, device=dev)

    both(lambda: ops.quantize_fp4(x.int(), backend=backend), lambda: P.quantize_fp4(x.int(), 256, None),
         TypeError, "quantize_fp4 expects a float32, bfloat16 or float16 tensor, got")
    both(lambda: ops.quantize_fp4(x, 100, backend=backend), lambda: P.quantize_fp4(x, 100, None),
         ValueError, "block_size must be a power of two from 32 to 4096, got 100")
    both(lambda: ops.dequantize_fp4(q, s, 1003, 64, backend=backend),
         lambda: P.dequantize_fp4(q, s, 1003, 64, torch.float32), ValueError,
         "q has 501 bytes, but 1003 fp4 values take 502")
    both(lambda: ops.dequantize_fp4(q, s[:-1], 1001, 64, backend=backend),
         lambda: P.dequantize_fp4(q, s[:-1], 1001, 64, torch.float32), ValueError,
         "the tensor has 1001 elements, which at block_size 64 needs 16 scales, but scales has 15")
    both(lambda: ops.dequantize_fp4(q.to(torch.int8), s, 1001, 64, backend=backend),
         lambda: P.dequantize_fp4(q.to(torch.int8), s, 1001, 64, torch.float32), TypeError,
         "q must be a uint8 tensor")
    both(lambda: ops.dequantize_fp4(q, s, 1001, 64, torch.int32, backend=backend),
         lambda: P.dequantize_fp4(q, s, 1001, 64, torch.int32), TypeError, "dtype must be float32")
    both(lambda: ops.dequantize_fp4(q, s, -1, 64, backend=backend),
         lambda: P.dequantize_fp4(q, s, -1, 64, torch.float32), ValueError, "numel must be a non-negative int")
    both(lambda: ops.dequantize_add_fp4_(acc[:999], q, s, 64, backend=backend),
         lambda: P.dequantize_add_fp4_(acc[:999], q, s, 64), ValueError,
         "the accumulator has 999 elements, whose fp4 codes take 500 bytes, but q has 501")
    both(lambda: ops.dequantize_add_fp4_(acc.double(), q, s, 64, backend=backend),
         lambda: P.dequantize_add_fp4_(acc.double(), q, s, 64), TypeError, "the accumulator must be float32")
    strided = torch.zeros(2002, device=dev)[::2]
    both(lambda: ops.dequantize_add_fp4_(strided, q, s, 64, backend=backend),
         lambda: P.dequantize_add_fp4_(strided, q, s, 64), ValueError, "must be contiguous")
    assert not acc.any()  # nothing was written by the failed calls
    y = x.clone()
    y[70] = float("nan")
    with pytest.raises(ops.NonFiniteError, match="quantize_fp4: .*first bad block starts at element 64"):
        ops.quantize_fp4(y, 64, backend=backend)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [32, 256, 4096])
def test_quantize_error_sums_match_float64(dtype, block_size):
    """codec.h quantize_error_sq_fp4 (the ring's quant_err_sq / quant_in_sq for fp4), every instruction
    set, against float64 sums in torch over the blocks with a finite scale."""
    g = gen_for("fp4 qerr", dtype, block_size)
    n = 5 * block_size + 37
    x = (torch.randn(n, generator=g) * torch.rand(1, generator=g) * 10).to(dtype)
    x[2 * block_size + 3] = float("nan")
    x[3 * block_size] = float("inf")
    x[4 * block_size : 5 * block_size] = 0
    q, scales = ops.quantize_fp4_reference(x, block_size)
    ok = torch.isfinite(scales).repeat_interleave(block_size)[:n]
    xd = x.double()[ok]
    d = ops.dequantize_fp4_reference(q, scales, n, block_size).double()[ok] - xd
    want = [float((d * d).sum()), float((xd * xd).sum())]
    for isa in P._cpu_codec_isas():
        got = P._quantize_error_sq_fp4_isa(x, q, scales, block_size, isa)
        assert got[0] == pytest.approx(want[0], rel=1e-12), ctx(isa=isa, dtype=dtype, B=block_size)
        assert got[1] == pytest.approx(want[1], rel=1e-12), ctx(isa=isa, dtype=dtype, B=block_size)
