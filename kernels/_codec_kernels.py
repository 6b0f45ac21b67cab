"""The Triton kernels of the block codecs (docs/wire-format.md), bit for bit: int8, and
fp4 where the constexpr FP4 is set (the same loads, scale and masks; other codes).

Only kernels live here; the typed launchers are in kernels/codec.py. The same
source runs compiled on CUDA and, under TRITON_INTERPRET=1, interpreted on CPU
(that is how CI tests it), so nothing here may depend on either.

Both kernels view their data as 2-D tiles of ROWS rows, a row lying in one block
(the encoder's rows are whole blocks, so a block's reduction is one
`tl.max(axis=1)`), and each scale is one broadcast along its row. A program
handles one tile of consecutive elements; full tiles take an unmasked path
(vector loads whatever n is), the last tile a masked one.

Bit-exactness, point by point (each was a trap):
- Divisions use `tl.math.div_rn` (IEEE `div.rn.f32`): `/` on fp32 lowers to an
  approximate division on NVIDIA GPUs.
- No operation here may be contracted into an FMA (`x * inv` followed by the
  rounding add, `q * s` followed by the accumulate): the launchers pass
  `enable_fp_fusion=False`, and tests/test_triton.py checks the PTX.
- Round-half-to-even is `(v + 1.5 * 2^23) - 1.5 * 2^23`, exact for |v| < 2^22
  (here |v| <= 127 * (1 + 2^-23)): in [2^23, 2^24) the fp32 spacing is 1, so the
  add itself rounds to the nearest integer, ties to even. Plain IEEE adds behave
  the same compiled and interpreted, unlike library rint. floor is derived from
  it too: tl.floor goes through libdevice, whose NVIDIA build flushes subnormals.
- bf16 is widened and narrowed with integer bit operations, not casts: exact on
  every backend (Triton's interpreter truncates fp32 -> bf16 and mangles bf16
  subnormals), and it is the same round-to-nearest-even as torch's conversion.
- The NaN flag is written as the integer 0x7FC00000 into an int32 view of the
  scales, so no arithmetic NaN (whose bits differ between CPU and GPU) is stored.
- fp4 rounds to nearest by one IEEE add of a power of two that leaves fp32 the E2M1
  grid's spacing (_fp4_nearest_magnitude; the same bits as the format's comparisons,
  which stochastic rounding still counts), and decodes by building the E2M1 value's
  fp32 bits with integer operations: no table lookup, no conversion that could round.
- fp4 packs value 2j into the low nibble of byte j: full tiles read x as pairs of
  values (one 64- or 32-bit word each) and make one byte of each; the last tile
  reshapes a row of codes to pairs and splits them (tl.split); decoding joins them
  back (tl.join) in the same order.
"""

import triton
import triton.language as tl

# 1.5 * 2^23: adding it to |v| < 2^22 rounds v to an integer, ties to even.
_ROUND_MAGIC = tl.constexpr(12582912.0)
_QMAX = tl.constexpr(127.0)
# The canonical quiet NaN of fp32 (the non-finite flag of a block's scale).
_NAN_BITS = tl.constexpr(0x7FC00000)
# fp4: the largest E2M1 magnitude (a block's max |x| maps to it).
_FP4_MAX = tl.constexpr(6.0)
# 2^-126: moves fp32's exponent bias (127) to E2M1's (1); an E2M1 magnitude times it keeps its index in bits 22..24.
_FP4_INDEX_SCALE = tl.constexpr(1.1754943508222875e-38)
_FP4_VALUE_SCALE = tl.constexpr(8.507059173023462e37)  # 2^126, the way back


@triton.jit
def _fmix32(h):
    """MurmurHash3's finalizer on uint32 (multiplications wrap modulo 2^32)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _round_half_even(v):
    return (v + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _fp4_magnitude_bits(m):
    """The fp32 bits of E2M1 magnitude m (int32, 0..7): 0, 0.5, then 2^((m >> 1) - 1) * (1 + (m & 1) / 2)."""
    normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
    return tl.where(m < 2, m * 0x3F000000, normal)


@triton.jit
def _fp4_values(codes):
    """The fp32 value (+-M[m], before the scale) of fp4 codes (int32, 0..15); code 8 is -0.0. The E2M1
    bits m at fp32 bits 22..24 are the value times 2^-126 (exponent bias 1 for 127; 0.5 the subnormal
    2^-127): times 2^126, exact, it is the value."""
    return (((codes & 7) << 22) | ((codes & 8) << 28)).to(tl.float32, bitcast=True) * _FP4_VALUE_SCALE


@triton.jit
def _fp4_nearest_magnitude(v):
    """The index (int32) of the E2M1 magnitude nearest to |v| (|v| < 7), a midpoint to the even index:
    |v| + 2^(22 + max(e, 0)) for |v| in [2^e, 2^(e+1)) rounds |v| to the E2M1 grid (csrc/codec/formats_cuda.cuh
    says why), and the grid value times 2^-126 holds the index in its bits 22..24."""
    bits = v.to(tl.int32, bitcast=True)
    magic = (tl.maximum(bits & 0x7F800000, 0x3F800000) + (22 << 23)).to(tl.float32, bitcast=True)
    r = (tl.abs(v) + magic) - magic
    return (r * _FP4_INDEX_SCALE).to(tl.int32, bitcast=True) >> 22


@triton.jit
def _fp4_codes(v, u, STOCHASTIC: tl.constexpr):
    """The fp4 code (int32) of each v = x * inv: the nearest magnitude (a midpoint goes to the even
    index), or stochastically the one just below t = |v| plus one when u < (t - M[l]) / gap."""
    t = tl.abs(v)
    if STOCHASTIC:
        m = ((t >= 0.5).to(tl.int32) + (t >= 1.0).to(tl.int32) + (t >= 1.5).to(tl.int32) + (t >= 2.0).to(tl.int32)
             + (t >= 3.0).to(tl.int32) + (t >= 4.0).to(tl.int32) + (t >= 6.0).to(tl.int32))
        low = _fp4_magnitude_bits(m).to(tl.float32, bitcast=True)
        inv_gap = tl.where(m < 4, 2.0, tl.where(m < 6, 1.0, tl.where(m < 7, 0.5, 0.0)))  # 7: stays
        m += (u < (t - low) * inv_gap).to(tl.int32)  # exact: Sterbenz, and a power-of-two gap
    else:
        m = _fp4_nearest_magnitude(v)
    # v's sign bit as bit 3, kept only for m > 0 (m + 7 has bit 3 set exactly for m = 1..7): a zero
    # magnitude is code 0 whatever the sign
    return m | ((v.to(tl.int32, bitcast=True) >> 28) & (m + 7) & 8)


@triton.jit
def _grid_round_up(t):
    """The bits (int32) of the smallest int8 scale-grid value >= t (fp32 >= 0, finite; docs/wire-format.md):
    2^e * G[j], G[j] = 2^(j / 18) in fp32, whose mantissa bits are below; 0 stays 0, t below 2^-126 gives
    2^-126. The first G[j] >= t's mantissa, else 2^23: a carry into the next octave."""
    bits = t.to(tl.int32, bitcast=True)
    m = bits & 0x7FFFFF
    up = tl.where(m <= 0x76544D, 0x76544D, 0x800000)
    up = tl.where(m <= 0x6D0620, 0x6D0620, up)
    up = tl.where(m <= 0x6411F0, 0x6411F0, up)
    up = tl.where(m <= 0x5B7457, 0x5B7457, up)
    up = tl.where(m <= 0x532A10, 0x532A10, up)
    up = tl.where(m <= 0x4B2FF5, 0x4B2FF5, up)
    up = tl.where(m <= 0x4382FF, 0x4382FF, up)
    up = tl.where(m <= 0x3C2043, 0x3C2043, up)
    up = tl.where(m <= 0x3504F3, 0x3504F3, up)
    up = tl.where(m <= 0x2E2E5E, 0x2E2E5E, up)
    up = tl.where(m <= 0x2799EA, 0x2799EA, up)
    up = tl.where(m <= 0x214518, 0x214518, up)
    up = tl.where(m <= 0x1B2D80, 0x1B2D80, up)
    up = tl.where(m <= 0x1550D3, 0x1550D3, up)
    up = tl.where(m <= 0x0FACD6, 0x0FACD6, up)
    up = tl.where(m <= 0x0A3F66, 0x0A3F66, up)
    up = tl.where(m <= 0x050672, 0x050672, up)
    up = tl.where(m == 0, 0, up)
    up = (bits & 0x7F800000) + up
    return tl.where(bits < 0x800000, tl.where(bits == 0, 0, 0x800000), up)


@triton.jit
def _scale_bits_and_inverse(a, QMAX: tl.constexpr, ROWS: tl.constexpr, FP4: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Per block, from a = max |x| (inf where the block holds NaN or Inf): the scale's bits (or the NaN flag)
    and the inverse the values are multiplied by. fp4: scale = a / QMAX, inv = QMAX / a. int8: a / 127.5
    (stochastic rounding: a / 127) rounded up to the scale grid; inv = 1 / scale. inv is 0 when its divisor
    is 0, when the quotient overflows (fp4's tiny subnormal blocks) and for non-finite blocks (num / inf
    == 0)."""
    if FP4:
        qmax = tl.full([ROWS], QMAX, tl.float32)
        scale = tl.math.div_rn(a, qmax)
        num = qmax
        den = a
    else:
        if STOCHASTIC:
            divisor = tl.full([ROWS], QMAX, tl.float32)
        else:
            divisor = tl.full([ROWS], QMAX + 0.5, tl.float32)
        t = tl.math.div_rn(a, divisor)
        # a non-finite block's t is inf: its scale is replaced by the flag below, its inv made 0 here
        finite = t != float("inf")
        scale = _grid_round_up(tl.where(finite, t, 0.0)).to(tl.float32, bitcast=True)
        num = tl.full([ROWS], 1.0, tl.float32)
        den = tl.where(finite, scale, float("inf"))
    positive = den > 0.0
    inv = tl.math.div_rn(num, tl.where(positive, den, 1.0))
    inv = tl.where(positive & (inv != float("inf")), inv, 0.0)
    return tl.where(a == float("inf"), _NAN_BITS, scale.to(tl.int32, bitcast=True)), inv


@triton.jit
def _uniform(seed, start, local):
    """The stochastic-rounding uniform in [0, 1) of element start + local: a counter-based hash keyed by
    (seed, flattened index i). A tile is a power of two <= 2^32 elements starting at a multiple of its
    size, so i >> 32 is the same for the whole tile and i mod 2^32 never carries."""
    hi = (start >> 32).to(tl.uint32)
    key = _fmix32(seed.to(tl.uint32, bitcast=True) ^ _fmix32(hi ^ 0x9E3779B9))
    lo = start.to(tl.uint32) + local.to(tl.uint32)
    h = _fmix32(_fmix32(lo ^ key) + key)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24: exact


@triton.jit
def _quantize_tile(
    x_ptr, q_ptr, scale_bits_ptr, start, n, seed,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, X_IS_BF16_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr, MASKED: tl.constexpr, FP4: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # int32, < TILE
    x_ptrs = (x_ptr + start) + local
    if MASKED:
        in_range = local < n - start
        raw = tl.load(x_ptrs, mask=in_range, other=0)  # zero padding never raises |x|'s max
    else:
        raw = tl.load(x_ptrs)
    if X_IS_BF16_BITS:
        # bf16 arrives as its int16 bits: its fp32 value is those bits in the top half.
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)

    ax = tl.abs(x)
    # A NaN would vanish in max (max.f32 drops NaN operands): count it as +inf, which
    # no finite input reaches, so `a == inf` flags every non-finite block.
    ax = tl.where(ax == ax, ax, float("inf"))
    a = tl.max(ax, axis=1)
    nonfinite = a == float("inf")

    scale_bits, inv = _scale_bits_and_inverse(a, _FP4_MAX if FP4 else _QMAX, ROWS, FP4, STOCHASTIC)

    v = x * inv[:, None]
    u = 0.0
    if STOCHASTIC:
        u = _uniform(seed, start, local)
    if FP4:
        code = tl.where(nonfinite[:, None], 0, _fp4_codes(v, u, STOCHASTIC))
        # pairs (value 2j, 2j + 1) -> one byte, the first in the low nibble
        lo_code, hi_code = tl.split(tl.reshape(code, [ROWS, BLOCK // 2, 2]))
        q = (lo_code | (hi_code << 4)).to(tl.uint8)
        q_local = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        q_ptrs = (q_ptr + start // 2) + q_local
        q_in_range = q_local < (n - start + 1) // 2
    else:
        if STOCHASTIC:
            # floor(v) from the nearest integer: tl.floor lowers to libdevice's
            # flush-to-zero cvt.rmi.ftz on NVIDIA, which the format never allows.
            nearest = _round_half_even(v)
            f = nearest - tl.where(nearest > v, 1.0, 0.0)
            r = f + tl.where(u < v - f, 1.0, 0.0)
        else:
            r = _round_half_even(v)
        r = tl.where(nonfinite[:, None], 0.0, r)  # before the clamp: v may be NaN there
        q = tl.minimum(tl.maximum(r, -_QMAX), _QMAX).to(tl.int8)
        q_ptrs = (q_ptr + start) + local
        if MASKED:
            q_in_range = in_range

    scale_ptrs = (scale_bits_ptr + start // BLOCK) + rows
    if MASKED:
        tl.store(q_ptrs, q, mask=q_in_range)
        tl.store(scale_ptrs, scale_bits, mask=rows * BLOCK < n - start)
    else:
        tl.store(q_ptrs, q)
        tl.store(scale_ptrs, scale_bits)


@triton.jit
def _quantize_fp4_pairs_tile(
    x_ptr, q_ptr, scale_bits_ptr, start, seed,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, X_IS_BF16_BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    """A full fp4 tile read as pairs of values (one 64-bit word of fp32, one 32-bit word of bf16 or fp16):
    the pair (2j, 2j + 1) becomes byte j of the codes in the thread that loaded it. Loads and stores then
    share one layout, where _quantize_tile's codes go through shared memory between the two (tl.split
    leaves each thread 2 bytes, the store wants 16). x must be aligned to a pair."""
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]  # pair index in the tile, < TILE / 2
    if X_IS_BF16_BITS:  # bf16 bits: a value's fp32 bits are its 16 bits on top
        w = tl.load((x_ptr.to(tl.pointer_type(tl.int32)) + start // 2) + local)
        x_lo = (w << 16).to(tl.float32, bitcast=True)
        x_hi = (w & -65536).to(tl.float32, bitcast=True)
    elif x_ptr.dtype.element_ty == tl.float16:
        w = tl.load((x_ptr.to(tl.pointer_type(tl.int32)) + start // 2) + local)
        x_lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x_hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # little endian: value 2j in the low half of word j
        w = tl.load((x_ptr.to(tl.pointer_type(tl.int64)) + start // 2) + local)
        x_lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        x_hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)

    ax_lo = tl.abs(x_lo)
    ax_hi = tl.abs(x_hi)
    # NaN counts as +inf, as in _quantize_tile
    ax = tl.maximum(tl.where(ax_lo == ax_lo, ax_lo, float("inf")), tl.where(ax_hi == ax_hi, ax_hi, float("inf")))
    a = tl.max(ax, axis=1)
    scale_bits, inv = _scale_bits_and_inverse(a, _FP4_MAX, ROWS, True, STOCHASTIC)

    v_lo = x_lo * inv[:, None]
    v_hi = x_hi * inv[:, None]
    u_lo = 0.0
    u_hi = 0.0
    if STOCHASTIC:
        u_lo = _uniform(seed, start, 2 * local)
        u_hi = _uniform(seed, start, 2 * local + 1)
    q = _fp4_codes(v_lo, u_lo, STOCHASTIC) | (_fp4_codes(v_hi, u_hi, STOCHASTIC) << 4)
    q = tl.where((a == float("inf"))[:, None], 0, q)
    tl.store((q_ptr + start // 2) + local, q.to(tl.uint8))
    tl.store((scale_bits_ptr + start // BLOCK) + rows, scale_bits)


# n is not specialized (on n % 16 or n == 1): full tiles take the unmasked path
# whatever n is, so a specialization would only multiply compilations.
@triton.jit(do_not_specialize=["n", "seed"])
def _quantize_kernel(
    x_ptr, q_ptr, scale_bits_ptr, n, seed,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, X_IS_BF16_BITS: tl.constexpr, STOCHASTIC: tl.constexpr,
    FP4: tl.constexpr, FP4_PAIRS: tl.constexpr,
):
    """One program encodes ROWS blocks of BLOCK elements: x -> (q int8 or packed fp4 codes, scale bits int32).
    FP4_PAIRS: fp4 with x aligned to a pair of values; full tiles then read pairs (_quantize_fp4_pairs_tile)."""
    start = tl.program_id(0).to(tl.int64) * (ROWS * BLOCK)
    if FP4 and FP4_PAIRS and start + ROWS * BLOCK <= n:
        _quantize_fp4_pairs_tile(x_ptr, q_ptr, scale_bits_ptr, start, seed, BLOCK, ROWS, X_IS_BF16_BITS, STOCHASTIC)
    elif start + ROWS * BLOCK <= n:
        _quantize_tile(x_ptr, q_ptr, scale_bits_ptr, start, n, seed,
                       BLOCK, ROWS, X_IS_BF16_BITS, STOCHASTIC, False, FP4)
    else:
        _quantize_tile(x_ptr, q_ptr, scale_bits_ptr, start, n, seed,
                       BLOCK, ROWS, X_IS_BF16_BITS, STOCHASTIC, True, FP4)


@triton.jit
def _to_bf16_bits(y):
    """fp32 -> bf16 bits (int16), round to nearest even; any NaN -> 0x7FC0."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(y == y, rounded, 0x7FC0)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _dequantize_tile(
    q_ptr, scale_ptr, out_ptr, start, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, ACCUMULATE: tl.constexpr,
    OUT_IS_BF16_BITS: tl.constexpr, MASKED: tl.constexpr, FP4: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    local = rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
    out_ptrs = (out_ptr + start) + local
    # A row lies inside one block: either ROWS > 1 and COLS == BLOCK (start is a
    # multiple of BLOCK), or ROWS == 1; so this is (start + row * COLS) // BLOCK.
    scale_ptrs = (scale_ptr + start // BLOCK) + (rows * COLS) // BLOCK
    if MASKED:
        in_range = local < n - start
        scale = tl.load(scale_ptrs, mask=rows * COLS < n - start, other=0.0)
    else:
        scale = tl.load(scale_ptrs)
    if FP4:
        # COLS / 2 bytes a row, each two codes: value 2j in the low nibble of byte j
        q_local = rows[:, None] * (COLS // 2) + tl.arange(0, COLS // 2)[None, :]
        q_ptrs = (q_ptr + start // 2) + q_local
        if MASKED:
            packed = tl.load(q_ptrs, mask=q_local < (n - start + 1) // 2, other=0).to(tl.int32)
        else:
            packed = tl.load(q_ptrs).to(tl.int32)
        pairs = tl.join(_fp4_values(packed & 15), _fp4_values(packed >> 4))
        values = tl.reshape(pairs, [ROWS, COLS])
    else:
        q_ptrs = (q_ptr + start) + local
        if MASKED:
            values = tl.load(q_ptrs, mask=in_range, other=0).to(tl.float32)
        else:
            values = tl.load(q_ptrs).to(tl.float32)
    y = values * scale[:, None]
    if ACCUMULATE:
        if MASKED:
            acc = tl.load(out_ptrs, mask=in_range, other=0.0)
        else:
            acc = tl.load(out_ptrs)
        y = acc + y  # a separate add: the launch forbids fusing it with the multiply
    if OUT_IS_BF16_BITS:
        y = _to_bf16_bits(y)
    else:
        y = y.to(out_ptr.dtype.element_ty)  # fp32, or fp16 (round to nearest even)
    if MASKED:
        tl.store(out_ptrs, y, mask=in_range)
    else:
        tl.store(out_ptrs, y)


@triton.jit(do_not_specialize=["n"])
def _dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, n,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, ACCUMULATE: tl.constexpr,
    OUT_IS_BF16_BITS: tl.constexpr, FP4: tl.constexpr,
):
    """out = value(q) * scale (ACCUMULATE: out = out + value(q) * scale) on ROWS x COLS elements;
    value(q) = float(q) for int8, the E2M1 value of the code for fp4 (FP4).

    COLS = min(BLOCK, tile): unlike the encoder, a decoder needs no whole block per
    program, so its tile can be sized for the memory system alone."""
    start = tl.program_id(0).to(tl.int64) * (ROWS * COLS)
    if start + ROWS * COLS <= n:
        _dequantize_tile(q_ptr, scale_ptr, out_ptr, start, n, BLOCK, ROWS, COLS, ACCUMULATE, OUT_IS_BF16_BITS,
                         False, FP4)
    else:
        _dequantize_tile(q_ptr, scale_ptr, out_ptr, start, n, BLOCK, ROWS, COLS, ACCUMULATE, OUT_IS_BF16_BITS,
                         True, FP4)
