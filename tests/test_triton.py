"""The Triton codec (kernels/codec.py, int8 and fp4) against the torch reference, bit for bit.

Every comparison is exact: q bytes, scale bits (through an int32 view, so the NaN
flag must be exactly 0x7FC00000) and decoded bits (NaN-aware: a decoder must give
NaN where the reference does, but NaN payloads differ between CPU and GPU).
Each test draws fresh data from a printed seed; PRIME_TEST_SEED=<n> replays one.

Two ways the kernels run:
- cuda: compiled kernels on a GPU (skipped without one).
- cpu: the same kernels under Triton's interpreter. It needs TRITON_INTERPRET=1
  in the environment before triton is first imported, and in a pytest session
  another test file may import triton first; so when this process's kernels
  are compiled ones, `test_interpreter_in_subprocess` runs this file's cpu tests
  in a fresh python with the variable set (a few seconds of start-up, and it
  works whatever the import order); the cpu cases are then not collected in
  this process. Run with TRITON_INTERPRET=1 in the environment, they run
  in-process instead (and the subprocess test skips).

The interpreter runs a program of 4096 elements in a few ms, so cpu sizes are
chosen to cover every path with few programs: per block size n = 1, B-1, B, B+1
(one masked tile), 3 full tiles (unmasked path only), 3 tiles + B + 5 (both paths),
and 123457 (31 tiles; on the interpreter for B >= 1024 only, where 3 tiles hold few blocks) with a
value pattern drawn per block; one test at 2^20 + 7.
On CUDA the same tests run, plus 2^24 + 7 for every block size and n > 2^32.

Without a GPU, the GPU-only traps (approximate division, FMA contraction,
flush-to-zero) are still checked: Triton compiles the kernels for sm_90 on any
machine, and the PTX must contain none of them.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
# The interpreter evaluates IEEE edge cases (127 / tiny -> inf, inf * 0) in numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

from prime import ops  # noqa: E402
from prime.kernels import codec  # noqa: E402
from test_sparse import selection_corner_chunks  # noqa: E402  (tests/ is on sys.path under pytest)

INTERPRETED = codec.available("cpu")  # the kernels were built under TRITON_INTERPRET=1
COMPILED_GPU = torch.cuda.is_available() and not INTERPRETED and codec.available("cuda")

# "cpu" cases exist only where the kernels are interpreted (elsewhere the subprocess runs them).
DEVICES = (["cpu"] if INTERPRETED else []) + [
    pytest.param("cuda", marks=pytest.mark.skipif(not COMPILED_GPU, reason="needs a GPU and compiled kernels")),
]
BLOCK_SIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TILE = codec._QUANTIZE_TILE  # elements per quantize program (a multiple of the decoder's); sizes straddle it
FLT_MAX = torch.finfo(torch.float32).max
NAN_BITS = 0x7FC00000


@pytest.fixture
def rng():
    """A torch.Generator with a fresh seed, printed (shown by pytest on failure)."""
    seed = int(os.environ.get("PRIME_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"PRIME_TEST_SEED={seed}")
    gen = torch.Generator().manual_seed(seed)
    return gen


def sizes_for(block: int) -> list[int]:
    return sorted({1, block - 1, block, block + 1, 3 * TILE, 3 * TILE + block + 5})


# ---------------------------------------------------------------------------
# input data: fp32 values in every pattern the format has a rule for


def _blocks_of(kind: str, nb: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """nb blocks of `kind`, as an fp32 [nb, block] tensor (each block with its own scale)."""

    def uniform(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen)

    if kind == "normal":
        return torch.randn(nb, block, generator=gen) * torch.pow(10.0, uniform(-4, 4, nb, 1))
    if kind == "heavy":  # Student-t with 3 degrees of freedom
        chi2 = (torch.randn(3, nb, block, generator=gen) ** 2).sum(0)
        return torch.randn(nb, block, generator=gen) / torch.sqrt(chi2 / 3)
    if kind == "outlier":
        x = torch.randn(nb, block, generator=gen)
        where = torch.randint(block, (nb, 2), generator=gen)
        return x.scatter_(1, where, x.gather(1, where) * 1e4)
    if kind == "zero":
        return torch.zeros(nb, block)
    if kind == "tiny":  # around 127 / FLT_MAX, where 127 / a overflows; subnormals included
        return uniform(-1, 1, nb, block) * torch.pow(10.0, uniform(-45, -35, nb, 1))
    if kind == "huge":
        return uniform(-1, 1, nb, block) * FLT_MAX
    if kind == "ties":  # a = 127 * 2^k, so inv = 2^-k exactly and every v is a half-integer
        x = torch.randint(-254, 255, (nb, block), generator=gen).float() / 2
        x[torch.rand(nb, block, generator=gen) < 0.05] = -0.0
        # the maximum 1-4 times per block, with either sign (repeated maxima)
        reps = torch.randint(1, 5, (nb, 1), generator=gen)
        sign = torch.where(torch.rand(nb, 4, generator=gen) < 0.5, -1.0, 1.0)
        where = torch.randint(block, (nb, 4), generator=gen)
        for j in range(4):
            keep = (reps[:, 0] > j).float()
            cur = x.gather(1, where[:, j : j + 1])
            x.scatter_(1, where[:, j : j + 1], keep[:, None] * 127.0 * sign[:, j : j + 1] + (1 - keep[:, None]) * cur)
        return x * torch.pow(2.0, torch.randint(-8, 9, (nb, 1), generator=gen).float())
    if kind == "near_ties":  # any a: x = fp32((k + 0.5) * scale), the block's own scale, lands on or beside a tie
        a = torch.pow(10.0, uniform(-3, 3, nb, 1))
        step = ops.grid_scale_reference(a / torch.full_like(a, 127.5))
        x = (torch.randint(-123, 123, (nb, block), generator=gen).float() + 0.5) * step  # |k + 0.5| <= 122.5
        return x.scatter_(1, torch.randint(block, (nb, 1), generator=gen), a)
    if kind == "equal":  # every value the same: v = +-127 everywhere; or +-c with signed zeros
        c = torch.randn(nb, 1, generator=gen) * torch.pow(10.0, uniform(-3, 3, nb, 1))
        x = c.expand(nb, block).clone()
        mixed = torch.rand(nb, 1, generator=gen) < 0.5
        pattern = torch.tensor([1.0, -1.0, 0.0, -0.0])[torch.randint(4, (nb, block), generator=gen)]
        return torch.where(mixed, c * pattern, x)
    if kind == "nonfinite":
        x = torch.randn(nb, block, generator=gen)
        bad = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.randint(3, (nb, 2), generator=gen)]
        return x.scatter_(1, torch.randint(block, (nb, 2), generator=gen), bad)
    raise AssertionError(kind)


SPECIAL_KINDS = ["normal", "heavy", "outlier", "zero", "tiny", "huge", "ties", "near_ties", "equal", "nonfinite"]
TIE_KINDS = ["ties", "near_ties", "equal", "zero"]  # where the last bit of v decides the rounding


def make_input(kind: str, n: int, block: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """n values of `dtype`; kinds "special" and "tie_heavy" draw a pattern per block (from
    SPECIAL_KINDS, TIE_KINDS), the others fill every block."""
    nb = max(1, -(-n // block))
    if kind not in ("special", "tie_heavy"):
        return _blocks_of(kind, nb, block, gen).reshape(-1)[:n].to(dtype)
    kinds = SPECIAL_KINDS if kind == "special" else TIE_KINDS
    pick = torch.randint(len(kinds), (nb,), generator=gen)
    x = torch.empty(nb, block)
    for k, name in enumerate(kinds):
        chosen = pick == k
        if chosen.any():
            x[chosen] = _blocks_of(name, int(chosen.sum()), block, gen)
    return x.reshape(-1)[:n].to(dtype)


# ---------------------------------------------------------------------------
# comparisons


def assert_same_encoding(x, got, want, context):
    q, scales = got
    rq, rscales = want
    assert q.dtype == rq.dtype and q.shape == rq.shape, f"{context}: q {q.dtype} {tuple(q.shape)}"
    assert scales.dtype == torch.float32 and scales.shape == rscales.shape, f"{context}: scales {tuple(scales.shape)}"
    q, scales = q.cpu(), scales.cpu()
    bits, rbits = scales.view(torch.int32), rscales.view(torch.int32)
    if not torch.equal(bits, rbits):
        k = int((bits != rbits).nonzero()[0, 0])
        raise AssertionError(
            f"{context}: {int((bits != rbits).sum())} scales differ; first block {k}: "
            f"got {scales[k].item()!r} ({int(bits[k]) & 0xFFFFFFFF:#010x}), "
            f"want {rscales[k].item()!r} ({int(rbits[k]) & 0xFFFFFFFF:#010x})"
        )
    if not torch.equal(q, rq):
        i = int((q != rq).nonzero()[0, 0])
        j = 2 * i if q.dtype == torch.uint8 else i  # fp4: byte i holds values 2i and 2i + 1
        raise AssertionError(
            f"{context}: {int((q != rq).sum())} of {q.numel()} q differ; first at {i}: "
            f"x={x.reshape(-1)[j : j + 2].tolist()!r} got {int(q[i])} want {int(rq[i])}"
        )


def assert_same_floats(got, want, context):
    """Bit equality, except that NaN only has to be NaN (its payload is the hardware's)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{context}: {got.dtype} {tuple(got.shape)}"
    got = got.cpu()
    nan, rnan = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan, rnan):
        i = int((nan != rnan).nonzero()[0, 0])
        raise AssertionError(f"{context}: NaN at different places; first {i}: got {got[i]!r} want {want[i]!r}")
    int_type = torch.int32 if got.dtype == torch.float32 else torch.int16
    bits, rbits = got.view(int_type)[~rnan], want.view(int_type)[~rnan]
    if not torch.equal(bits, rbits):
        i = int((bits != rbits).nonzero()[0, 0])
        raise AssertionError(
            f"{context}: {int((bits != rbits).sum())} values differ; first (non-NaN #{i}): "
            f"got {got[~rnan][i].item()!r} want {want[~rnan][i].item()!r}"
        )


def check_quantize(x, block, seed, device, context, fp4=False):
    if fp4:
        got, want = codec.quantize_fp4(x.to(device), block, seed), ops.quantize_fp4_reference(x, block, seed)
    else:
        got, want = codec.quantize_int8(x.to(device), block, seed), ops.quantize_int8_reference(x, block, seed)
    assert_same_encoding(x, got, want, context)
    return got


# ---------------------------------------------------------------------------
# quantize


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_quantize_matches_reference(device, block, dtype, rng):
    # 123457 (31 tiles) adds no kernel path to 3 tiles + B + 5, only more blocks of drawn patterns: the
    # interpreter (about 0.6 s for it) runs it where 3 tiles + B + 5 holds few blocks (B >= 1024: 16 or
    # fewer); 3 tiles of B <= 512 already hold 48 to 384 blocks, each with its own pattern
    big = [123457] if device == "cuda" or block >= 1024 else []
    for n in sizes_for(block) + big:
        # every block of a "special" input draws its own pattern, so big inputs need no other kind
        for kind in ("normal", "heavy", "outlier", "special") if n <= block + 1 else ("special",):
            x = make_input(kind, n, block, dtype, rng)
            check_quantize(x, block, None, device, f"seed {rng.initial_seed()} B={block} {dtype} n={n} {kind}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_quantize_stochastic_matches_reference(device, block, dtype, rng):
    seeds = [int(torch.randint(2**32, (), generator=rng, dtype=torch.int64)), 0, 0xFFFFFFFF]
    for n, seed in zip([block + 1, 3 * TILE + block + 5, 5 * TILE + 3], seeds):
        x = make_input("special", n, block, dtype, rng)
        check_quantize(x, block, seed, device, f"seed {rng.initial_seed()} B={block} {dtype} n={n} sr-seed {seed}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_quantize_tie_heavy_matches_reference(device, block, dtype, rng):
    """Every block on or beside rounding ties, with repeated maxima, all-equal values or signed zeros."""
    seed = int(torch.randint(2**32, (), generator=rng, dtype=torch.int64))
    for n, sr in [(block, None), (3 * TILE + block + 5, None), (3 * TILE + block + 5, seed)]:
        x = make_input("tie_heavy", n, block, dtype, rng)
        got = check_quantize(x, block, sr, device, f"seed {rng.initial_seed()} B={block} {dtype} n={n} sr {sr}")
        assert int(got[0].min()) >= -127


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_million(device, rng):
    n = 2**20 + 7
    x = make_input("special", n, 256, torch.float32, rng)
    check_quantize(x, 256, None, device, f"seed {rng.initial_seed()} n={n}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_layouts(device, dtype, rng):
    """Non-contiguous views and any shape are read in row-major order."""
    base = make_input("special", 96 * 130, 32, dtype, rng).view(96, 130)
    views = {
        "transposed": lambda t: t.t(),
        "strided": lambda t: t[:, ::3],
        "sliced": lambda t: t[5:70, 7:100],
        "3d": lambda t: t.reshape(12, 8, 130)[:, ::2, :],
        "scalar": lambda t: t[3, 4],
    }
    for name, view in views.items():
        x = view(base)
        for block in (32, 256):
            got = codec.quantize_int8(view(base.to(device)), block, None)
            want = ops.quantize_int8_reference(x, block, None)
            assert_same_encoding(x, got, want, f"seed {rng.initial_seed()} {name} {dtype} B={block}")


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_empty(device):
    q, scales = codec.quantize_int8(torch.empty(0, device=device), 256, None)
    assert q.shape == (0,) and q.dtype == torch.int8 and scales.shape == (0,) and scales.dtype == torch.float32
    y = codec.dequantize_int8(q, scales, 256, torch.bfloat16)
    assert y.shape == (0,) and y.dtype == torch.bfloat16
    acc = torch.empty(0, device=device)
    assert codec.dequantize_add_int8_(acc, q, scales, 256) is acc


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_blocks_flagged(device, rng):
    """Stated directly, not through the reference: NaN scale bits 0x7FC00000 and zero q."""
    block, nb = 64, 40
    x = torch.randn(nb * block, generator=rng)
    bad_blocks = torch.randperm(nb, generator=rng)[:10]
    for j, k in enumerate(bad_blocks.tolist()):
        x[k * block + int(torch.randint(block, (), generator=rng))] = [float("nan"), float("inf"), float("-inf")][j % 3]
    q, scales = codec.quantize_int8(x.to(device), block, None)
    q, bits = q.cpu().view(nb, block), scales.cpu().view(torch.int32)
    bad = torch.zeros(nb, dtype=torch.bool)
    bad[bad_blocks] = True
    assert (bits[bad] == NAN_BITS).all(), f"seed {rng.initial_seed()}: flag bits {bits[bad].tolist()}"
    assert (q[bad] == 0).all()
    assert torch.isfinite(scales.cpu()[~bad]).all() and (q[~bad] != 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_error_bound(device, rng):
    """Independent of the reference: |q * scale - x| <= scale / 2 (+ the rounding of x * inv), in float64."""
    block = 128
    for kind in ("normal", "heavy", "outlier"):
        x = make_input(kind, 50 * block + 17, block, torch.float32, rng)
        q, scales = codec.quantize_int8(x.to(device), block, None)
        q, scales = q.cpu().double(), scales.cpu().double()
        s = scales.repeat_interleave(block)[: x.numel()]
        err = (q * s - x.double()).abs()
        assert (err <= s * 0.50005).all(), f"seed {rng.initial_seed()} {kind}: max err/scale {(err / s).max().item()}"
        assert q.abs().max() == 127 and q.min() >= -127


# ---------------------------------------------------------------------------
# decode


def make_encoded(n: int, block: int, gen: torch.Generator):
    """Random (q, scales) as a decoder may meet them, not only as the encoder makes them.

    Scales take random fp32 bit patterns (every exponent: subnormal and overflowing
    products), bf16 / fp16 rounding ties (low mantissa bits 0x8000 / 0x1000 with q a
    power of two keeps them), zeros and the NaN flag."""
    nb = -(-n // block)
    q = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
    powers = torch.tensor([1, 2, 4, 8, 16, 32, 64], dtype=torch.int8)
    pick = torch.rand(n, generator=gen) < 0.3
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, 1, -1).to(torch.int8)
    q[pick] = (powers[torch.randint(7, (n,), generator=gen)] * sign)[pick]
    bits = torch.randint(0, 0x7F800000, (nb,), generator=gen, dtype=torch.int64)
    low = torch.tensor([0x8000, 0x1000, 0x7FFF, 0x18000, 0x0])[torch.randint(5, (nb,), generator=gen)]
    tie = torch.rand(nb, generator=gen) < 0.4
    bits[tie] = (bits[tie] & ~0x1FFFF) | low[tie]
    typical = torch.rand(nb, generator=gen) < 0.3
    bits[typical] = (torch.rand(int(typical.sum()), generator=gen) * 0.05).view(torch.int32).long()
    bits[torch.rand(nb, generator=gen) < 0.05] = 0
    bits[torch.rand(nb, generator=gen) < 0.05] = NAN_BITS
    bits |= torch.where(torch.rand(nb, generator=gen) < 0.5, 0, 1 << 31)
    scales = bits.to(torch.int32).view(torch.float32)  # the int64 -> int32 cast wraps the sign bit in
    return q, scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_dequantize_matches_reference(device, block, dtype, rng):
    for n in [1, block + 1, 3 * TILE + block + 5]:
        q, scales = make_encoded(n, block, rng)
        got = codec.dequantize_int8(q.to(device), scales.to(device), block, dtype)
        want = ops.dequantize_int8_reference(q, scales, block, dtype)
        assert_same_floats(got, want, f"seed {rng.initial_seed()} B={block} {dtype} n={n}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_matches_reference(device, dtype, rng):
    """Encoder output through the decoder, including the blocks the encoder flagged."""
    x = make_input("special", 3 * TILE + 77, 256, dtype, rng)
    q, scales = codec.quantize_int8(x.to(device), 256, None)
    got = codec.dequantize_int8(q, scales, 256, dtype)
    want = ops.dequantize_int8_reference(*ops.quantize_int8_reference(x, 256, None), 256, dtype)
    assert_same_floats(got, want, f"seed {rng.initial_seed()} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_dequantize_add_matches_reference(device, block, rng):
    for n in [1, block + 1, 3 * TILE + block + 5]:
        q, scales = make_encoded(n, block, rng)
        # accumulators of every magnitude, so q * scale and acc often nearly cancel:
        # that is where a fused multiply-add would differ
        acc = torch.randn(n, generator=rng) * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=rng))
        acc[torch.rand(n, generator=rng) < 0.1] = 0.0
        want = ops.dequantize_add_int8_reference_(acc.clone(), q, scales, block)
        acc_dev = acc.to(device)
        out = codec.dequantize_add_int8_(acc_dev, q.to(device), scales.to(device), block)
        assert out is acc_dev
        assert_same_floats(acc_dev, want, f"seed {rng.initial_seed()} B={block} n={n}")


# ---------------------------------------------------------------------------
# fp4 (the same kernels with FP4 set: their own codes, packing and decode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [32, 64, 256, 4096])
def test_fp4_quantize_matches_reference(device, block, dtype, rng):
    """Every special pattern per block (fp4 ties sit elsewhere than int8's: "ties" blocks still
    land many values on midpoints, as v = k / 2 * 6 / 127 * 2^j rarely but x = a * t / 6 often
    does), odd lengths (a last half byte), both roundings."""
    seed = int(torch.randint(2**32, (), generator=rng, dtype=torch.int64))
    for i, n in enumerate([1, block - 1, block + 1, 3 * TILE + block + 5]):
        x = make_input("special", n, block, dtype, rng)
        for sr in (None, seed) if i % 2 else (None,):
            check_quantize(x, block, sr, device, f"seed {rng.initial_seed()} fp4 B={block} {dtype} n={n} sr {sr}",
                           fp4=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_midpoints_round_to_even(device, rng):
    """a = 6 * 2^k: inv = 2^-k exactly, so x = t * 2^k lands on v = t for every midpoint t, and
    one ulp either side; checked against the nearest-even rule spelled out here, not the reference."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    t = torch.cat([mids, -mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0))])
    want_m = torch.tensor([0, 2, 2, 4, 4, 6, 6] * 2 + [0, 1, 2, 3, 4, 5, 6] + [1, 2, 3, 4, 5, 6, 7])
    want = torch.where((want_m > 0) & (t < 0), want_m + 8, want_m)
    k = int(torch.randint(-10, 10, (), generator=rng))
    x = torch.cat([torch.tensor([6.0]), t, torch.zeros(3)]) * 2.0**k  # one block of 32
    q, s = codec.quantize_fp4(x.to(device), 32, None)
    q = q.cpu().to(torch.int64)
    codes = torch.stack([q & 15, q >> 4], 1).reshape(-1)
    assert s.item() == 2.0**k and codes[0] == 7
    assert torch.equal(codes[1:29], want), f"k={k}: {codes[1:29].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [32, 256])
def test_fp4_nearest_near_every_level(device, block):
    """The kernels round with one IEEE add of a power of two (_fp4_nearest_magnitude): every fp32 within
    4096 ulps of each E2M1 midpoint and level, both signs, in blocks whose a = 6 makes v = x exactly,
    against the reference's count of midpoints; full tiles (pairs of values) and the masked last one."""
    points = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    near = (points.view(torch.int32)[:, None] + torch.arange(-4096, 4096, dtype=torch.int32)).reshape(-1)
    t = near.view(torch.float32)
    t = torch.cat([t[t <= 6.0], -t[t <= 6.0]])
    t = t[: t.numel() // (block - 1) * (block - 1)].view(-1, block - 1)
    x = torch.cat([torch.full((t.shape[0], 1), 6.0), t], 1).reshape(-1)
    x = x[: x.numel() - block // 2]  # a last, partial tile
    check_quantize(x, block, None, device, f"fp4 near every level, B={block}", fp4=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_nonfinite_blocks_flagged(device, rng):
    block, nb = 64, 20
    x = torch.randn(nb * block, generator=rng)
    bad_blocks = torch.randperm(nb, generator=rng)[:6]
    for j, k in enumerate(bad_blocks.tolist()):
        x[k * block + int(torch.randint(block, (), generator=rng))] = [float("nan"), float("inf"), float("-inf")][j % 3]
    q, scales = codec.quantize_fp4(x.to(device), block, None)
    q, bits = q.cpu().view(nb, block // 2), scales.cpu().view(torch.int32)
    bad = torch.zeros(nb, dtype=torch.bool)
    bad[bad_blocks] = True
    assert (bits[bad] == NAN_BITS).all() and (q[bad] == 0).all(), f"seed {rng.initial_seed()}"
    assert torch.isfinite(scales.cpu()[~bad]).all() and (q[~bad] != 0).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_fp4_decode_matches_reference(device, block, dtype, rng):
    """Every byte value (code 8, -0, included) under the scales make_encoded draws; decode and decode-add."""
    for n in [1, block + 1, 3 * TILE + block + 5]:
        _, scales = make_encoded(n, block, rng)
        q = torch.randint(0, 256, ((n + 1) // 2,), generator=rng, dtype=torch.uint8)
        got = codec.dequantize_fp4(q.to(device), scales.to(device), n, block, dtype)
        want = ops.dequantize_fp4_reference(q, scales, n, block, dtype)
        assert_same_floats(got, want, f"seed {rng.initial_seed()} fp4 B={block} {dtype} n={n}")
        if dtype == torch.float32:
            acc = torch.randn(n, generator=rng) * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=rng))
            want_acc = ops.dequantize_add_fp4_reference_(acc.clone(), q, scales, block)
            acc_dev = acc.to(device)
            assert codec.dequantize_add_fp4_(acc_dev, q.to(device), scales.to(device), block) is acc_dev
            assert_same_floats(acc_dev, want_acc, f"seed {rng.initial_seed()} fp4 add B={block} n={n}")


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_empty(device):
    q, scales = codec.quantize_fp4(torch.empty(0, device=device), 256, None)
    assert q.shape == (0,) and q.dtype == torch.uint8 and scales.shape == (0,)
    assert codec.dequantize_fp4(q, scales, 0, 256, torch.float16).shape == (0,)


def test_fp4_bad_arguments_raise_clear_errors():
    x = torch.randn(100)
    q, scales = torch.zeros(50, dtype=torch.uint8), torch.ones(4)
    with pytest.raises(ValueError, match="power of two"):
        codec.quantize_fp4(x, 48)
    with pytest.raises(TypeError, match="quantize_fp4 expects a float32"):
        codec.quantize_fp4(x.double(), 256)
    with pytest.raises(ValueError, match="q has 50 bytes, but 101 fp4 values take 51"):
        codec.dequantize_fp4(q, scales, 101, 32)
    with pytest.raises(TypeError, match="uint8"):
        codec.dequantize_fp4(q.to(torch.int8), scales, 100, 32)
    with pytest.raises(ValueError, match="needs 1 scales"):
        codec.dequantize_fp4(q, scales, 100, 256)
    with pytest.raises(ValueError, match="whose fp4 codes take 51 bytes, but q has 50"):
        codec.dequantize_add_fp4_(torch.zeros(101), q, scales, 32)


# ---------------------------------------------------------------------------
# arguments and availability (no kernel runs)


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(100)
    q, scales = torch.zeros(100, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="power of two"):
        codec.quantize_int8(x, 48)
    with pytest.raises(ValueError, match="power of two"):
        codec.quantize_int8(x, 8192)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        codec.quantize_int8(x.double(), 256)
    with pytest.raises(TypeError, match="seed"):
        codec.quantize_int8(x, 32, seed=1.5)
    with pytest.raises(ValueError, match="needs 1 scales"):
        codec.dequantize_int8(q, scales, 256)
    with pytest.raises(TypeError, match="int8"):
        codec.dequantize_int8(q.float(), torch.ones(1), 256)
    with pytest.raises(TypeError, match="dtype"):
        codec.dequantize_int8(q, scales, 32, torch.float64)
    with pytest.raises(TypeError, match="float32"):
        codec.dequantize_add_int8_(torch.zeros(100, dtype=torch.bfloat16), q, scales, 32)
    with pytest.raises(ValueError, match="contiguous"):
        codec.dequantize_add_int8_(torch.zeros(200)[::2], q, scales, 32)
    with pytest.raises(ValueError, match="elements"):
        codec.dequantize_add_int8_(torch.zeros(99), q, scales, 32)


# ---------------------------------------------------------------------------
# the sparse top-k format (kernels/sparse.py) against prime.sparse's reference, bytes and values


def _sparse_input(n: int, rng) -> torch.Tensor:
    """Random values with the format's corner cases: zeros, a negative zero, runs of equal magnitudes (ties),
    subnormals, and a spike that makes a chunk's kept magnitudes span more than float64 sums exactly (the
    kernel's ordered path)."""
    x = torch.randn(n, generator=rng) * torch.exp(2 * torch.randn(n, generator=rng))
    x[::7] = 0.0
    x[min(5, n - 1)] = -0.0
    x[10:20] = 1.5
    x[21:24] = -1.5
    x[30:33] = 1e-40
    x[40:41] = 1e30
    return x


# (n, chunk, k): a partial chunk of 4-bit positions, chunks of 4096 with a short last one, every value kept
SPARSE_CPU_SHAPES = [(100, 16, 3), (8269, 4096, 64), (300, 32, 32)]
SPARSE_GPU_SHAPES = SPARSE_CPU_SHAPES + [((1 << 20) + 7, 4096, 64), (1 << 18, 4096, 256), (123457, 256, 5),
                                         (99999, 1024, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_matches_reference(device, rng):
    from prime import sparse
    from prime.kernels import sparse as triton_sparse

    for n, chunk, k in SPARSE_CPU_SHAPES if device == "cpu" else SPARSE_GPU_SHAPES:
        x = _sparse_input(n, rng)
        ref = sparse.encode(x, chunk, k) if n > 10000 else sparse.encode_reference(x, chunk, k)
        got = triton_sparse.encode(x.to(device), chunk, k)
        assert torch.equal(got.cpu(), ref), (n, chunk, k)
        want = sparse.decode(ref, n, chunk, k)
        assert torch.equal(triton_sparse.decode(got, n, chunk, k).cpu(), want), (n, chunk, k)
        acc = torch.randn(n, generator=rng)
        want_acc = sparse.decode_add_(acc.clone(), ref, chunk, k, backend="torch")
        out = triton_sparse.decode_add_(acc.clone().to(device), got, chunk, k).cpu()
        assert torch.equal(out, want_acc), (n, chunk, k)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_selection_corner_cases(device, rng):
    from prime import sparse
    from prime.kernels import sparse as triton_sparse

    x = selection_corner_chunks(rng)
    ref = sparse.encode_reference(x, 4096, 64)
    assert torch.equal(triton_sparse.encode(x.to(device), 4096, 64).cpu(), ref)
    kept = sparse.decode(ref, x.numel(), 4096, 64)
    assert torch.equal(kept[2 * 4096:3 * 4096].nonzero()[:, 0], torch.arange(0, 64 * 7, 7))  # the first ties win


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_refuses_bad_input_and_leaves_the_accumulator(device):
    from prime.kernels import sparse as triton_sparse

    x = torch.ones(64, device=device)
    x[3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        triton_sparse.encode(x, 32, 4)
    with pytest.raises(ValueError, match="overflows bf16"):
        triton_sparse.encode(torch.full((32,), 3.4e38, device=device), 32, 4)
    both = torch.cat([torch.full((32,), 3.4e38), torch.randn(32)]).to(device)
    both[40] = float("nan")  # NaN in one chunk, an overflow in another: not finite
    with pytest.raises(ValueError, match="NaN or Inf"):
        triton_sparse.encode(both, 32, 4)
    payload = triton_sparse.encode(torch.arange(64.0, device=device), 32, 4)
    bad = payload.clone()
    bad[4] = 0xFF  # the first position becomes 15 and the second 15 or more: not ascending
    acc = torch.arange(64.0, device=device)
    with pytest.raises(ValueError, match="not ascending"):
        triton_sparse.decode_add_(acc, bad, 32, 4)
    assert torch.equal(acc.cpu(), torch.arange(64.0))
    with pytest.raises(ValueError, match="expected"):
        triton_sparse.decode(payload[:-1], 64, 32, 4)


def test_cpu_only_under_the_interpreter():
    if INTERPRETED:
        assert codec.available("cpu")
        return
    assert not codec.available("cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        codec.quantize_int8(torch.ones(64), 32)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter tests already run in this process")
def test_interpreter_in_subprocess():
    """Runs this file's cpu tests in a python started with TRITON_INTERPRET=1 (see the module docstring)."""
    import prime

    root = os.path.dirname(os.path.dirname(os.path.abspath(prime.__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH")] if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__), "-k", "cpu"]
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"interpreted tests failed ({' '.join(cmd)}):\n{out[-8000:]}"
    # pytest's closing line (a plugin may print warnings after it)
    summary = re.findall(r"^.*\d+ (?:passed|failed|errors?)\b.*$", out, re.M)[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
    print(summary)


# ---------------------------------------------------------------------------
# the machine code, compiled for an H100 (sm_90) without a GPU

# PTX that would break bit-exactness: fused multiply-add, approximate division or
# reciprocal, flush-to-zero (libdevice's default on NVIDIA).
_FORBIDDEN_PTX = re.compile(r"\bfma\.|\bmad\.[^ \t]*f32|div\.(full|approx)|rcp\.approx|\.ftz")

_QUANTIZE_SIGNATURE = {"x_ptr": "*fp32", "q_ptr": "*i8", "scale_bits_ptr": "*i32", "n": "i32", "seed": "i32"}
SM90_CASES = {
    "quantize": ("_quantize_kernel", _QUANTIZE_SIGNATURE,
                 {"BLOCK": 256, "ROWS": 16, "X_IS_BF16_BITS": False, "STOCHASTIC": False, "FP4": False,
                  "FP4_PAIRS": False}),
    "quantize-bf16-stochastic": ("_quantize_kernel", dict(_QUANTIZE_SIGNATURE, x_ptr="*i16"),
                                 {"BLOCK": 32, "ROWS": 128, "X_IS_BF16_BITS": True, "STOCHASTIC": True, "FP4": False,
                                  "FP4_PAIRS": False}),
    "dequantize-bf16": ("_dequantize_kernel", {"q_ptr": "*i8", "scale_ptr": "*fp32", "out_ptr": "*i16", "n": "i32"},
                        {"BLOCK": 4096, "ROWS": 1, "COLS": 1024, "ACCUMULATE": False, "OUT_IS_BF16_BITS": True,
                         "FP4": False}),
    "dequantize-add": ("_dequantize_kernel", {"q_ptr": "*i8", "scale_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                       {"BLOCK": 256, "ROWS": 4, "COLS": 256, "ACCUMULATE": True, "OUT_IS_BF16_BITS": False,
                        "FP4": False}),
    "quantize-fp4": ("_quantize_kernel", dict(_QUANTIZE_SIGNATURE, q_ptr="*u8"),
                     {"BLOCK": 256, "ROWS": 16, "X_IS_BF16_BITS": False, "STOCHASTIC": False, "FP4": True,
                      "FP4_PAIRS": False}),
    "quantize-fp4-bf16-stochastic": ("_quantize_kernel", dict(_QUANTIZE_SIGNATURE, x_ptr="*i16", q_ptr="*u8"),
                                     {"BLOCK": 32, "ROWS": 128, "X_IS_BF16_BITS": True, "STOCHASTIC": True,
                                      "FP4": True, "FP4_PAIRS": False}),
    # full tiles read as pairs of values (64-bit words of fp32, 32-bit words of fp16)
    "quantize-fp4-pairs": ("_quantize_kernel", dict(_QUANTIZE_SIGNATURE, q_ptr="*u8"),
                           {"BLOCK": 256, "ROWS": 8, "X_IS_BF16_BITS": False, "STOCHASTIC": False, "FP4": True,
                            "FP4_PAIRS": True}),
    "quantize-fp4-pairs-fp16-stochastic": ("_quantize_kernel", dict(_QUANTIZE_SIGNATURE, x_ptr="*fp16", q_ptr="*u8"),
                                           {"BLOCK": 64, "ROWS": 32, "X_IS_BF16_BITS": False, "STOCHASTIC": True,
                                            "FP4": True, "FP4_PAIRS": True}),
    "dequantize-fp4-bf16": ("_dequantize_kernel", {"q_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*i16",
                            "n": "i32"}, {"BLOCK": 4096, "ROWS": 1, "COLS": 1024, "ACCUMULATE": False,
                                          "OUT_IS_BF16_BITS": True, "FP4": True}),
    "dequantize-add-fp4": ("_dequantize_kernel", {"q_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*fp32",
                           "n": "i32"}, {"BLOCK": 256, "ROWS": 4, "COLS": 256, "ACCUMULATE": True,
                                         "OUT_IS_BF16_BITS": False, "FP4": True}),
}


def _compile_for_sm90(name, fusion=False):
    try:  # Triton's ahead-of-time entry points (as in triton/tools/compile.py), stable since 3.3
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")

    kernel_name, signature, constants = SM90_CASES[name]
    kernel = getattr(codec._kernels, kernel_name)
    signature = dict(signature, **{k: "constexpr" for k in constants})
    options = dict(codec._COMPILE_OPTIONS, enable_fp_fusion=fusion) if fusion else dict(codec._COMPILE_OPTIONS)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernel objects, not interpreted ones")
@pytest.mark.parametrize("name", list(SM90_CASES))
def test_sm90_code_has_true_divisions_and_no_fma(name):
    """Triton compiles for sm_90 on any machine: the launch options must keep the PTX exact."""
    ptx = _compile_for_sm90(name)
    bad = [line.strip() for line in ptx.splitlines() if _FORBIDDEN_PTX.search(line)]
    assert not bad, f"{name}: {bad[:5]}"
    if name.startswith("quantize"):
        assert "div.rn.f32" in ptx, f"{name}: no IEEE division (div.rn.f32) in the PTX"


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernel objects, not interpreted ones")
def test_sm90_check_sees_fused_multiply_add():
    """The check above can fail: with fusion allowed, dequantize-add gets an fma."""
    assert any(_FORBIDDEN_PTX.search(line) for line in _compile_for_sm90("dequantize-add", fusion=True).splitlines())


# ---------------------------------------------------------------------------
# GPU only


@pytest.mark.skipif(not COMPILED_GPU, reason="needs a GPU and compiled kernels")
def test_ptx_has_true_divisions_and_no_fma():
    """The compiled code itself: IEEE div.rn, no approximate division, no FMA, no flush-to-zero."""
    x = torch.randn(5000, device="cuda")
    q = torch.empty(5000, dtype=torch.int8, device="cuda")
    scales = torch.empty(-(-5000 // 256), device="cuda")
    acc = torch.zeros(5000, device="cuda")
    q4 = torch.empty(2500, dtype=torch.uint8, device="cuda")
    kernels = {
        "quantize": codec._launch_quantize(x, q, scales, 256, None),
        "quantize stochastic": codec._launch_quantize(x, q, scales, 256, 3),
        "dequantize bf16": codec._launch_dequantize(q, scales, torch.empty_like(x, dtype=torch.bfloat16), 256, False),
        "dequantize-add": codec._launch_dequantize(q, scales, acc, 256, True),
        "quantize fp4": codec._launch_quantize(x, q4, scales, 256, None, fp4=True),
        "quantize fp4 stochastic": codec._launch_quantize(x, q4, scales, 256, 3, fp4=True),
        "dequantize-add fp4": codec._launch_dequantize(q4, scales, acc, 256, True, fp4=True),
    }
    for name, kernel in kernels.items():
        ptx = kernel.asm["ptx"]
        bad = [line.strip() for line in ptx.splitlines() if _FORBIDDEN_PTX.search(line)]
        assert not bad, f"{name}: {bad[:5]}"
        if name.startswith("quantize"):
            assert "div.rn.f32" in ptx, f"{name}: no div.rn.f32 in the PTX"


LARGE_CASES = [(block, torch.float32) for block in BLOCK_SIZES] + [
    (block, dtype) for dtype in (torch.bfloat16, torch.float16) for block in (32, 256, 4096)
]


@pytest.mark.skipif(not COMPILED_GPU, reason="needs a GPU and compiled kernels")
@pytest.mark.parametrize("block,dtype", LARGE_CASES, ids=str)
def test_cuda_large_matches_reference(block, dtype, rng):
    n = 2**24 + 7
    x = make_input("special", n, block, dtype, rng)
    check_quantize(x, block, None, "cuda", f"seed {rng.initial_seed()} B={block} {dtype} n={n}")
    check_quantize(x, block, None, "cuda", f"seed {rng.initial_seed()} fp4 B={block} {dtype} n={n}", fp4=True)


@pytest.mark.skipif(not COMPILED_GPU, reason="needs a GPU and compiled kernels")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_large_stochastic_matches_reference(dtype, rng):
    n = 2**22 + 7  # the reference's integer hash is slow on the CPU
    x = make_input("special", n, 256, dtype, rng)
    seed = int(torch.randint(2**32, (), generator=rng, dtype=torch.int64))
    check_quantize(x, 256, seed, "cuda", f"seed {rng.initial_seed()} {dtype} n={n} sr-seed {seed}")


@pytest.mark.skipif(not COMPILED_GPU, reason="needs a GPU and compiled kernels")
@pytest.mark.parametrize("seed", [None, 12345])
def test_cuda_beyond_32_bit_indices(seed, rng):
    """n > 2^32: 64-bit offsets, and the high half of the index in the stochastic key."""
    n = 2**32 + 3 * TILE + 5
    need = n * (2 + 1) + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    block = 256
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    x.normal_(generator=torch.Generator("cuda").manual_seed(rng.initial_seed()))
    q, scales = codec.quantize_int8(x, block, seed)
    for start in [0, 2**31 - 2 * TILE, 2**32 - 2 * TILE, n - 3 * TILE - 5]:  # block-aligned windows
        stop = min(n, start + 4 * TILE)
        xs = x[start:stop].cpu()
        # the reference keyed by the global element index
        want_q, want_scales = ops.quantize_int8_reference(xs, block, seed, first_index=start)
        got = (q[start:stop], scales[start // block : -(-stop // block)])
        assert_same_encoding(xs, got, (want_q, want_scales), f"seed {rng.initial_seed()} window at {start}")
