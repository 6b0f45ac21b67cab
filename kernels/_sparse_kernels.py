"""The Triton kernels of the sparse top-k format (docs/wire-format-sparse.md), bit for bit the
bytes and values of the CPU kernels (csrc/codec/sparse_cpu.cpp) and of the reference
(prime/sparse.py). The launchers are in kernels/sparse.py.

The encoder's programs take chunks in turn (each with a scratch row of its own); decode is one
program per chunk:

- Candidates. Magnitudes are the fp32 bits without the sign (non-negative floats order as their
  bits). The chunk, read in pieces, falls in R >= k groups of CHUNK / R values; the keep groups
  that hold values have keep distinct maxima, so the smallest of those, L, has at least keep
  magnitudes at or above it. The values above L, and of those equal to L the lowest positions,
  go to the scratch row in position order (one cumsum per piece): at most CAP of them (about 7%
  of a chunk at k / C = 1/64). When more than CAP exceed L, L becomes the k-th largest itself,
  searched over the whole chunk (rare).
- Selection, on the candidates only: the k-th largest, t, bit by bit from the top, stopping once
  a count equals keep; everything above t is kept, and of the values equal to t the lowest
  positions, as many as are still needed (an exclusive cumsum ranks them). A second cumsum
  gives each kept value its slot: slots follow positions, ascending.
- The two levels. The ceil(k / 2) largest of the kept (the same ranking, a second search over
  the kept only) split them; the means of each side and then of each level are float64 sums
  in ascending position order, as the format fixes: vector sums where every partial sum is
  provably exact, else a loop over the kept values in the scratch row, left to right (a tree
  reduction would round differently).
- Packing. The positions are Elias-Fano coded with b = lower_bits(keep, CHUNK), computed per
  record (the shorter last chunk keeps fewer values, so its b is larger). Upper bits: each kept
  value (slot i, position p) writes the chunk's index to the scratch row's bit slot
  (p >> b) + i, and byte q of the unary stream is the eight slots 8q .. 8q + 7 that hold this
  chunk's index (slots left from earlier chunks hold theirs: no clearing between chunks). Lower
  bits: each byte ORs the b-bit low parts of the (at most PER) positions that overlap its eight
  bits. Codes: each byte its four 2-bit codes.

Decode is one program per chunk over the bits of its unary stream: at a set bit s, an inclusive
cumsum gives j + 1, the kept value's index, and p = ((s - j) << b) | lower_j. A record is
malformed when the stream holds other than keep set bits, a position is at or past the chunk's
length, or two consecutive set bits (one bucket) have lower parts not ascending (the only place
positions can fail to ascend).

Nothing is converted by a cast that could round differently compiled and interpreted: the
fp32 -> bf16 rounding is integer arithmetic on the bits; the float64 means go to fp32 by one
conversion (round to nearest even on both).
"""

import triton
import triton.language as tl

_ABS = tl.constexpr(0x7FFFFFFF)
_INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _lower_bits(keep, BITS: tl.constexpr):
    """b of a record keeping `keep` values of a chunk of 2^BITS: the largest with keep << b <= 2^BITS."""
    b = tl.zeros_like(keep)
    for t in tl.static_range(1, BITS + 1):
        b += ((keep << t) <= (1 << BITS)).to(tl.int32)
    return b


@triton.jit
def _kth_largest(m, keep, lo, c_lo, hi):
    """A threshold t of the keep largest of the int32 magnitudes m (lanes outside hold -1): the keep-th largest, or
    one with exactly keep magnitudes >= t (the same selection, found earlier). lo is a bound known to hold at least
    keep magnitudes (c_lo of them are >= lo) and hi the largest magnitude: the bits those decide cost no count."""
    t = tl.where(c_lo == keep, lo, 0)
    done = (c_lo == keep).to(tl.int32)
    b = tl.full((), 30, dtype=tl.int32)
    while (b >= 0) & (done == 0):
        cand = t | (1 << b)
        if cand <= lo:
            t = cand
        elif cand <= hi:
            cnt = tl.sum((m >= cand).to(tl.int32), axis=0)
            if cnt >= keep:
                t = cand
                done = (cnt == keep).to(tl.int32)
        b -= 1
    return t


@triton.jit
def _at_or_above(m, keep, t):
    """The keep values of m ranked highest by (magnitude desc, position asc), as a mask, t from _kth_largest."""
    above = tl.sum((m > t).to(tl.int32), axis=0)
    eq = (m == t).to(tl.int32)
    rank = tl.cumsum(eq, axis=0) - eq
    return (m > t) | ((eq == 1) & (rank < keep - above))


@triton.jit
def _rank2d(a):
    """Exclusive prefix sums of an int32 [R, W] block in row-major (position) order, and its total."""
    row = tl.sum(a, axis=1)
    before = tl.cumsum(row, axis=0) - row
    return tl.cumsum(a, axis=1) - a + before[:, None], tl.sum(row, axis=0)


@triton.jit
def _bf16_bits(f):
    """fp32 -> bf16 bits, round to nearest even (non-negative finite f)."""
    b = f.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@triton.jit
def _ordered_sums(mag_row, up_row, keep, mid, BY_MID: tl.constexpr, K: tl.constexpr):
    """(sum of one side, sum of the other) of the kept magnitudes in a chunk's scratch row, float64, left to
    right: the upper half and the rest (BY_MID false), or those >= mid and the rest."""
    a = tl.zeros((), dtype=tl.float64)
    b = tl.zeros((), dtype=tl.float64)
    for j in range(0, K):
        ok = j < keep
        v = tl.load(mag_row + j, mask=ok, other=0).to(tl.float32, bitcast=True).to(tl.float64)
        if BY_MID:
            side = v >= mid
        else:
            side = tl.load(up_row + j, mask=ok, other=0) != 0
        a += tl.where(ok & side, v, 0.0)
        b += tl.where(ok & ~side, v, 0.0)
    return a, b


@triton.jit
def _piece(x_ptr, start, length, s, SUB: tl.constexpr, W: tl.constexpr):
    """Piece s of a chunk as [SUB / W groups, W]: its offsets, fp32 bits and magnitudes (-1 outside the chunk)."""
    offs = s * SUB + tl.arange(0, SUB // W)[:, None] * W + tl.arange(0, W)[None, :]
    valid = offs < length
    xb = tl.load(x_ptr + start + offs, mask=valid, other=0.0).to(tl.int32, bitcast=True)
    return offs, xb, tl.where(valid, xb & _ABS, -1)


@triton.jit
def _compact(x_ptr, start, length, low, room, cx_row, cpos_row, CHUNK: tl.constexpr, SUB: tl.constexpr,
             W: tl.constexpr, CAP: tl.constexpr):
    """Writes to the scratch rows, in position order, the chunk's values above low and its first `room` values
    equal to low, those that fall in the first CAP slots; returns how many are above low and how many equal."""
    gt_off = tl.zeros((), dtype=tl.int32)
    eq_off = tl.zeros((), dtype=tl.int32)
    for s in range(0, CHUNK // SUB):
        offs, xb, m = _piece(x_ptr, start, length, s, SUB, W)
        packed = (m > low).to(tl.int32) | ((m == low).to(tl.int32) << 16)
        before, total = _rank2d(packed)
        gt = (before & 0xFFFF) + gt_off
        eq = (before >> 16) + eq_off
        slot = gt + tl.minimum(eq, room)
        cand = ((m > low) | ((m == low) & (eq < room))) & (slot < CAP)
        tl.store(cx_row + slot, xb, mask=cand)
        tl.store(cpos_row + slot, offs, mask=cand)
        gt_off += total & 0xFFFF
        eq_off += total >> 16
    return gt_off, eq_off


@triton.jit
def _kth_largest_in_chunk(x_ptr, start, length, keep, lo, c_lo, hi, CHUNK: tl.constexpr, SUB: tl.constexpr,
                          W: tl.constexpr):
    """_kth_largest over a whole chunk, piece by piece (the rare case of _candidates)."""
    t = tl.where(c_lo == keep, lo, 0)
    done = (c_lo == keep).to(tl.int32)
    b = tl.full((), 30, dtype=tl.int32)
    while (b >= 0) & (done == 0):
        cand = t | (1 << b)
        if cand <= lo:
            t = cand
        elif cand <= hi:
            cnt = tl.zeros((), dtype=tl.int32)
            for s in range(0, CHUNK // SUB):
                offs, xb, m = _piece(x_ptr, start, length, s, SUB, W)
                cnt += tl.sum(tl.sum((m >= cand).to(tl.int32), axis=1), axis=0)
            if cnt >= keep:
                t = cand
                done = (cnt == keep).to(tl.int32)
        b -= 1
    return t


@triton.jit
def _candidates(x_ptr, start, length, keep, cx_row, cpos_row, CHUNK: tl.constexpr, R: tl.constexpr,
                SUB: tl.constexpr, CAP: tl.constexpr):
    """Writes to the scratch rows, in position order, at most CAP values of the chunk that hold all it keeps, and
    returns (how many, a bound L that keep of them reach, the largest magnitude). The chunk is read in pieces of
    SUB values, as groups of W = CHUNK / R (R >= k): the keep groups that hold values have keep maxima, so the
    smallest of those is L. Of the values equal to L, the lowest positions are kept, as many as fit; when more
    than CAP values exceed L, L becomes the keep-th largest itself (a count per bit over the chunk; rare)."""
    W: tl.constexpr = CHUNK // R
    hi = tl.full((), -1, dtype=tl.int32)
    low = tl.full((), 0x7FFFFFFF, dtype=tl.int32)
    for s in range(0, CHUNK // SUB):
        offs, xb, m = _piece(x_ptr, start, length, s, SUB, W)
        group = tl.max(m, axis=1)
        hi = tl.maximum(hi, tl.max(group, axis=0))
        low = tl.minimum(low, tl.min(tl.where(group >= 0, group, _ABS), axis=0))
    gt, eq = _compact(x_ptr, start, length, low, CAP, cx_row, cpos_row, CHUNK, SUB, W, CAP)
    if gt > CAP:
        low = _kth_largest_in_chunk(x_ptr, start, length, keep, low, gt + eq, hi, CHUNK, SUB, W)
        gt, eq = _compact(x_ptr, start, length, low, CAP, cx_row, cpos_row, CHUNK, SUB, W, CAP)
    if gt + eq > CAP:  # too many ties at L for every one to have a slot: the first ones take what is left
        _compact(x_ptr, start, length, low, CAP - gt, cx_row, cpos_row, CHUNK, SUB, W, CAP)
    return gt + tl.minimum(eq, CAP - gt), low, hi


@triton.jit
def _scratch_row(scratch_ptr, row, K: tl.constexpr, UB: tl.constexpr, CAP: tl.constexpr):
    """Scratch row `row` (one per program), its bit slots set to -1. The row holds the candidates (fp32 bits,
    positions), then by slot: positions, magnitudes, upper-half flags, codes; then the unary stream's bit
    slots, each holding the index of the chunk that last set it."""
    cx_row = scratch_ptr + row * (2 * CAP + 4 * K + 8 * UB)
    bit_row = cx_row + 2 * CAP + 4 * K
    tl.store(bit_row + tl.arange(0, 8 * UB), tl.full((8 * UB,), -1, dtype=tl.int32))
    return cx_row


@triton.jit
def _encode_chunk(x_ptr, out_ptr, status_ptr, n, c32, cx_row,
                  CHUNK: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, RECORD: tl.constexpr,
                  UB: tl.constexpr, LB: tl.constexpr, PER: tl.constexpr, CBYTES: tl.constexpr,
                  LOGK: tl.constexpr, R: tl.constexpr, SUB: tl.constexpr, CAP: tl.constexpr):
    """Chunk c32 into its record and its status, with a program's scratch row (_scratch_row)."""
    cpos_row = cx_row + CAP
    pos_row = cpos_row + CAP
    mag_row = pos_row + K
    up_row = mag_row + K
    code_row = up_row + K
    bit_row = code_row + K
    j = tl.arange(0, CAP)
    tl.debug_barrier()  # the previous chunk's reads of the scratch are done
    c = tl.cast(c32, tl.int64)
    start = c * CHUNK
    length = tl.minimum(n - start, CHUNK).to(tl.int32)
    keep = (length * K + CHUNK - 1) // CHUNK
    lb = _lower_bits(keep, BITS)
    count, low, hi = _candidates(x_ptr, start, length, keep, cx_row, cpos_row, CHUNK, R, SUB, CAP)
    status = tl.where(hi >= _INF_BITS, 2, 0)  # EncodeStatus: 2 not finite, 1 overflow
    tl.debug_barrier()
    inside = j < count
    xb = tl.load(cx_row + j, mask=inside, other=0)
    offs = tl.load(cpos_row + j, mask=inside, other=0)
    m = tl.where(inside, xb & _ABS, -1)

    sel = _at_or_above(m, keep, _kth_largest(m, keep, low, count, hi))
    slot = tl.cumsum(sel.to(tl.int32), axis=0) - sel.to(tl.int32)
    upper = (keep + 1) // 2
    m_sel = tl.where(sel, m, -1)
    t_sel = tl.min(tl.where(sel, m, _ABS), axis=0)
    up = _at_or_above(m_sel, upper, _kth_largest(m_sel, upper, t_sel, keep, hi))
    mk = tl.where(sel, m, 0)
    v = mk.to(tl.float32, bitcast=True).to(tl.float64)
    # The format's sums are float64 in ascending position order. When every kept magnitude is a multiple of
    # the smallest nonzero one's ulp and k of the largest stay below 2^53 of those ulps, every partial sum is
    # exact and any order gives the same bits: a vector sum. Otherwise (kept magnitudes spanning more than
    # 2^(29 - log2 K), rare) a loop over the kept values, left to right.
    top = tl.max(mk, axis=0)
    small = tl.min(tl.where(sel & (m > 0), m, _INF_BITS), axis=0)
    exact = (top == 0) | ((top >> 23) - tl.maximum(small >> 23, 1) <= 29 - LOGK)
    tl.store(pos_row + slot, offs, mask=sel)
    tl.store(mag_row + slot, m, mask=sel)
    tl.store(up_row + slot, up.to(tl.int32), mask=sel)
    tl.store(bit_row + (offs >> lb) + slot, tl.zeros_like(slot) + c32, mask=sel)  # distinct slots
    tl.debug_barrier()
    if exact:
        s_hi = tl.sum(tl.where(up, v, 0.0), axis=0)
        s_lo = tl.sum(tl.where(sel & ~up, v, 0.0), axis=0)
    else:
        s_hi, s_lo = _ordered_sums(mag_row, up_row, keep, 0.0, False, K)
    c_hi = s_hi / upper.to(tl.float64)
    c_lo = tl.where(keep > upper, s_lo / tl.maximum(keep - upper, 1).to(tl.float64), c_hi)
    mid = (c_lo + c_hi) / 2.0
    h = sel & (v >= mid)
    n_hi = tl.sum(h.to(tl.int32), axis=0)
    if exact:
        sum_hi = tl.sum(tl.where(h, v, 0.0), axis=0)
        sum_lo = tl.sum(tl.where(sel & ~h, v, 0.0), axis=0)
    else:
        sum_hi, sum_lo = _ordered_sums(mag_row, up_row, keep, mid, True, K)
    hi_bits = _bf16_bits((sum_hi / n_hi.to(tl.float64)).to(tl.float32))
    lo_bits = tl.where(keep > n_hi,
                       _bf16_bits((sum_lo / tl.maximum(keep - n_hi, 1).to(tl.float64)).to(tl.float32)), hi_bits)
    status = tl.where((status == 0) & ((hi_bits & 0x7FFF) >= 0x7F80), 1, status)
    tl.store(status_ptr + c, status)
    negative = xb.to(tl.float32, bitcast=True) < 0.0  # -0 codes as positive
    code = h.to(tl.int32) | (negative.to(tl.int32) << 1)  # bit 0: hi, bit 1: negative
    tl.store(code_row + slot, code, mask=sel)
    tl.debug_barrier()

    rec = out_ptr + c * RECORD
    head = tl.arange(0, 4)
    word = tl.where(head < 2, lo_bits, hi_bits)
    tl.store(rec + head, ((word >> ((head % 2) * 8)) & 0xFF).to(tl.uint8))
    # upper bits: bit s of the unary stream is set where slot s holds this chunk's index
    ubytes = (keep + (CHUNK >> lb) + 7) // 8
    s = tl.arange(0, UB)[:, None] * 8 + tl.arange(0, 8)[None, :]
    ones = (tl.load(bit_row + s, mask=s < ubytes * 8, other=-1) == c32).to(tl.int32)
    q = tl.arange(0, UB)
    tl.store(rec + 4 + q, tl.sum(ones << (s % 8), axis=1).to(tl.uint8), mask=q < ubytes)
    # lower bits: byte q holds bits [8q, 8q + 8) of the stream of the positions' lb-bit low parts
    lbytes = (keep * lb + 7) // 8
    q = tl.arange(0, LB)
    acc = tl.zeros((LB,), dtype=tl.int32)
    for t in tl.static_range(PER):
        i = (q * 8) // tl.maximum(lb, 1) + t
        ok = (q < lbytes) & (i < keep) & (i * lb < q * 8 + 8)
        p = tl.load(pos_row + i, mask=ok, other=0) & ((1 << lb) - 1)
        shift = i * lb - q * 8
        part = tl.where(shift >= 0, p << tl.maximum(shift, 0), p >> tl.maximum(-shift, 0))
        acc = acc | tl.where(ok, part & 0xFF, 0)
    tl.store(rec + 4 + ubytes + q, acc.to(tl.uint8), mask=q < lbytes)
    # codes: byte q holds the codes of kept values 4q .. 4q + 3
    cbytes = (keep + 3) // 4
    q = tl.arange(0, CBYTES)
    packed = tl.zeros((CBYTES,), dtype=tl.int32)
    for t in tl.static_range(4):
        i = q * 4 + t
        ok = (q < cbytes) & (i < keep)
        packed = packed | (tl.load(code_row + i, mask=ok, other=0) << (2 * t))
    tl.store(rec + 4 + ubytes + lbytes + q, packed.to(tl.uint8), mask=q < cbytes)


@triton.jit
def _sparse_encode_kernel(x_ptr, out_ptr, scratch_ptr, status_ptr, n, chunks,
                          CHUNK: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, RECORD: tl.constexpr,
                          UB: tl.constexpr, LB: tl.constexpr, PER: tl.constexpr, CBYTES: tl.constexpr,
                          LOGK: tl.constexpr, R: tl.constexpr, SUB: tl.constexpr, CAP: tl.constexpr):
    """The encoder: each program takes chunks pid, pid + programs, ... with a scratch row of its own."""
    pid = tl.program_id(0)
    cx_row = _scratch_row(scratch_ptr, pid.to(tl.int64), K, UB, CAP)
    for c32 in range(pid, chunks, tl.num_programs(0)):
        _encode_chunk(x_ptr, out_ptr, status_ptr, n, c32, cx_row,
                      CHUNK, K, BITS, RECORD, UB, LB, PER, CBYTES, LOGK, R, SUB, CAP)


@triton.jit
def _sparse_encode_interpreted(x_ptr, out_ptr, scratch_ptr, status_ptr, n,
                               CHUNKS: tl.constexpr, PROGRAMS: tl.constexpr,
                               CHUNK: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, RECORD: tl.constexpr,
                               UB: tl.constexpr, LB: tl.constexpr, PER: tl.constexpr, CBYTES: tl.constexpr,
                               LOGK: tl.constexpr, R: tl.constexpr, SUB: tl.constexpr, CAP: tl.constexpr):
    """_sparse_encode_kernel under Triton's interpreter, launched as one program that runs PROGRAMS programs in
    turn, so that every loop bound is a Python int: the interpreter turns a tensor bound (a program id) into one
    with int(), which NumPy 2 refuses for the one-element arrays of Triton 3.6's interpreter."""
    for p in range(0, PROGRAMS):
        cx_row = _scratch_row(scratch_ptr, p, K, UB, CAP)
        for c32 in range(p, CHUNKS, PROGRAMS):
            _encode_chunk(x_ptr, out_ptr, status_ptr, n, c32, cx_row,
                          CHUNK, K, BITS, RECORD, UB, LB, PER, CBYTES, LOGK, R, SUB, CAP)


@triton.jit
def _lower(area, j, ok, lbytes, lb):
    """The lb-bit low parts of kept values j (where ok) of a record's lower-bit area (lbytes bytes)."""
    bit = tl.maximum(j, 0) * lb
    byte = bit // 8
    word = tl.zeros(j.shape, dtype=tl.int32)
    for t in tl.static_range(3):  # lb <= 12 bits from bit (bit % 8) of a byte: within three bytes
        inside = ok & (byte + t < lbytes)
        word = word | (tl.load(area + byte + t, mask=inside, other=0).to(tl.int32) << (8 * t))
    return (word >> (bit % 8)) & ((1 << lb) - 1)


@triton.jit
def _sparse_decode_kernel(payload_ptr, y_ptr, bad_ptr, n, CHUNK: tl.constexpr, K: tl.constexpr,
                          BITS: tl.constexpr, RECORD: tl.constexpr, UB: tl.constexpr, ACCUMULATE: tl.constexpr,
                          CHECK_ONLY: tl.constexpr):
    c = tl.program_id(0)
    start = c.to(tl.int64) * CHUNK
    length = tl.minimum(n - start, CHUNK).to(tl.int32)
    keep = (length * K + CHUNK - 1) // CHUNK
    rec = payload_ptr + c.to(tl.int64) * RECORD
    lo_bits = tl.load(rec).to(tl.int32) | (tl.load(rec + 1).to(tl.int32) << 8)
    hi_bits = tl.load(rec + 2).to(tl.int32) | (tl.load(rec + 3).to(tl.int32) << 8)
    lo = (lo_bits << 16).to(tl.float32, bitcast=True)
    hi = (hi_bits << 16).to(tl.float32, bitcast=True)
    lb = _lower_bits(keep, BITS)
    ubytes = (keep + (CHUNK >> lb) + 7) // 8
    lbytes = (keep * lb + 7) // 8
    lower_area = rec + 4 + ubytes
    # one lane per bit s of the unary stream: at a set bit, j = the set bits up to s, less one
    s = tl.arange(0, 8 * UB)
    one = (tl.load(rec + 4 + s // 8, mask=s < ubytes * 8, other=0).to(tl.int32) >> (s % 8)) & 1
    j = tl.cumsum(one, axis=0) - 1
    ok = (one != 0) & (j < keep)
    low = _lower(lower_area, j, ok, lbytes, lb)
    pos = ((s - j) << lb) | low
    if CHECK_ONLY or not ACCUMULATE:
        # a record is not a payload of this format when its stream holds other than keep set bits, or its positions
        # are not ascending inside the chunk: they can descend only within a bucket (set bits s - 1 and s), where
        # the lower parts must ascend. One flag for the payload, set by the malformed records only (an atomic from
        # every program would serialize at one address: 0.1 ms on 2^14 chunks)
        prev_set = ok & (s > 0)
        prev_s = tl.maximum(s - 1, 0)
        prev_set = prev_set & (((tl.load(rec + 4 + prev_s // 8, mask=prev_set, other=0).to(tl.int32) >> (prev_s % 8))
                                & 1) != 0)
        prev = _lower(lower_area, j - 1, prev_set, lbytes, lb)
        wrong = ok & ((pos >= length) | (prev_set & (low <= prev)))
        bad = (tl.sum(one, axis=0) != keep) | (tl.sum(wrong.to(tl.int32), axis=0) > 0)
        tl.atomic_max(bad_ptr, 1, mask=bad)
    if CHECK_ONLY:
        return
    jj = tl.maximum(j, 0)
    codes = (tl.load(lower_area + lbytes + jj // 4, mask=ok, other=0).to(tl.int32) >> ((jj % 4) * 2)) & 3
    mag = tl.where((codes & 1) != 0, hi, lo)
    val = tl.where((codes & 2) != 0, -mag, mag)
    if ACCUMULATE:  # after a CHECK_ONLY pass: nothing is written when it found the payload malformed
        ok = ok & (tl.load(bad_ptr + tl.zeros_like(j)) == 0)
    if not ACCUMULATE:
        offs = tl.arange(0, CHUNK)
        tl.store(y_ptr + start + offs, tl.zeros((CHUNK,), dtype=tl.float32), mask=offs < length)
        tl.debug_barrier()
        tl.store(y_ptr + start + pos, val, mask=ok & (pos < length))
    else:
        a = tl.load(y_ptr + start + pos, mask=ok & (pos < length), other=0.0)
        tl.store(y_ptr + start + pos, a + val, mask=ok & (pos < length))
