"""Golden vectors of the block codecs (int8 and fp4), derived from docs/wire-format.md alone.

    python tools/golden_vectors.py > /tmp/golden.py   # the GOLDEN literal of tests/test_golden.py

This is a second, independent reading of the wire format: plain Python integers and
floats, no torch, no numpy, nothing from prime. fp32 arithmetic is done in double
precision and rounded to fp32 once (`f32`): a product of two fp32 values is exact in
double, and a double-precision quotient or sum rounded to fp32 is the correctly
rounded fp32 result (53 >= 2 * 24 + 2 bits, so the double rounding is harmless).
Python's round() is round-half-to-even, math.floor is exact.

tests/test_golden.py holds the printed literal (committed hex) and checks every
backend against it, and checks that this script still prints the same vectors.
Hex conventions: an fp32 value is the 8 hex digits of its bit pattern (as an
integer, so 1.0 is 3f800000); bf16 / fp16 values 4 hex digits; q is one string of
two hex digits per element (two's complement: -1 is ff); fp4 q is the packed bytes,
two hex digits per byte (value 2j in the low nibble: codes 3 then 9 are the byte 93).
"""

from __future__ import annotations

import math
import struct
import sys

B = 32  # the smallest block size: short vectors, every rule still exercised
MASK32 = 0xFFFFFFFF
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


# ---------------------------------------------------------------------------
# fp32 / bf16 / fp16 from Python floats


def f32(x: float) -> float:
    """x rounded to the nearest fp32 (ties to even), overflowing to +-inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def bf16_bits(x: float) -> int:
    """fp32 x rounded to bf16 (nearest even); NaN as 0x7fc0."""
    u = bits32(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    lower = u & 0xFFFF
    upper = u >> 16
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper


def fp16_bits(x: float) -> int:
    """fp32 x rounded to fp16 (nearest even), overflowing to +-inf; NaN as 0x7e00."""
    if math.isnan(x):
        return 0x7E00
    try:
        return struct.unpack("<H", struct.pack("<e", x))[0]
    except OverflowError:
        return 0xFC00 if x < 0 else 0x7C00


def widen16(h: int, kind: str) -> float:
    if kind == "bfloat16":
        return from_bits32(h << 16)
    return struct.unpack("<e", struct.pack("<H", h))[0]


# ---------------------------------------------------------------------------
# the format, rule by rule


def fmix32(h: int) -> int:
    """MurmurHash3's finalizer on uint32."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def stochastic_h(seed: int, i: int) -> int:
    """h of the generator keyed by (seed, i): u = (h >> 8) * 2^-24."""
    lo, hi = i & MASK32, i >> 32
    k = fmix32(seed ^ fmix32(hi ^ 0x9E3779B9))
    return fmix32((fmix32(lo ^ k) + k) & MASK32)


# The int8 scale grid: 2^e * G[j], G[j] = 2^(j / 18) rounded to fp32 (j = 0..17), for every
# fp32 exponent e of a normal number; and 0.
GRID = [f32(2.0 ** (j / 18)) for j in range(18)]


def grid_round_up(t: float) -> float:
    """The smallest grid value >= t (t >= 0, finite fp32): 0 for 0, 2^-126 below 2^-126."""
    if t == 0:
        return 0.0
    if t < 2.0**-126:
        return 2.0**-126
    m, ex = math.frexp(t)  # t = m * 2^ex, m in [0.5, 1): t's octave is [2^(ex - 1), 2^ex)
    for g in GRID:
        if math.ldexp(g, ex - 1) >= t:
            return math.ldexp(g, ex - 1)
    return math.ldexp(1.0, ex)


def encode_block(xs: list[float], seed: int | None, first: int) -> tuple[int, list[int]]:
    """(scale bits, q) of one block whose first element has flattened index `first`."""
    if any(math.isnan(x) or math.isinf(x) for x in xs):
        return 0x7FC00000, [0] * len(xs)  # the non-finite flag: canonical quiet NaN, zero q
    a = max(abs(x) for x in xs)
    # to nearest: the smallest grid scale s with a / s <= 127.5; stochastic: a / s <= 127
    scale = grid_round_up(f32(a / (127.5 if seed is None else 127.0)))
    inv = 0.0 if scale == 0 else f32(1.0 / scale)
    if math.isinf(inv):
        inv = 0.0  # tiny (subnormal) scales: 1 / scale overflows
    q = []
    for j, x in enumerate(xs):
        v = f32(x * inv)
        if seed is None:
            r = round(v)  # half to even
        else:
            f = math.floor(v)
            frac = v - f
            u = (stochastic_h(seed, first + j) >> 8) * 2.0**-24
            r = f + (1 if u < frac else 0)
        q.append(max(-127, min(127, int(r))))
    return bits32(scale), q


def encode(xs: list[float], seed: int | None = None, first_index: int = 0) -> tuple[list[int], list[int]]:
    scales, q = [], []
    for start in range(0, len(xs), B):
        s, qb = encode_block(xs[start : start + B], seed, first_index + start)
        scales.append(s)
        q.extend(qb)
    return scales, q


def decode(q: list[int], scales: list[int]) -> list[float]:
    """y_i = float(q_i) * scale (one fp32 multiply)."""
    return [f32(float(v) * from_bits32(scales[i // B])) for i, v in enumerate(q)]


# ---------------------------------------------------------------------------
# fp4: E2M1 codes, one fp32 scale per block (a / 6)

FP4_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def fp4_nearest(t: float) -> int:
    """The magnitude index nearest to t >= 0; of two equally near, the even index."""
    best = min(range(8), key=lambda k: (abs(t - FP4_MAGNITUDES[k]), k % 2))
    return best


def fp4_encode_block(xs: list[float], seed: int | None, first: int) -> tuple[int, list[int]]:
    """(scale bits, codes) of one block whose first element has flattened index `first`."""
    if any(math.isnan(x) or math.isinf(x) for x in xs):
        return 0x7FC00000, [0] * len(xs)
    a = max(abs(x) for x in xs)
    scale = f32(a / 6.0)
    inv = 0.0 if a == 0 else f32(6.0 / a)
    if math.isinf(inv):
        inv = 0.0
    codes = []
    for j, x in enumerate(xs):
        v = f32(x * inv)
        t = abs(v)
        if seed is None:
            m = fp4_nearest(t)
        else:
            low = max(k for k in range(8) if FP4_MAGNITUDES[k] <= t)
            if low == 7:
                m = 7
            else:
                frac = (t - FP4_MAGNITUDES[low]) / (FP4_MAGNITUDES[low + 1] - FP4_MAGNITUDES[low])
                u = (stochastic_h(seed, first + j) >> 8) * 2.0**-24
                m = low + (1 if u < frac else 0)
        codes.append(0 if m == 0 else m | (8 if v < 0 else 0))
    return bits32(scale), codes


def fp4_encode(xs: list[float], seed: int | None = None, first_index: int = 0) -> tuple[list[int], list[int]]:
    scales, codes = [], []
    for start in range(0, len(xs), B):
        s, c = fp4_encode_block(xs[start : start + B], seed, first_index + start)
        scales.append(s)
        codes.extend(c)
    return scales, codes


def fp4_pack(codes: list[int]) -> list[int]:
    """Two codes a byte, the first in the low nibble; an odd count leaves the last high nibble 0."""
    padded = codes + [0] * (len(codes) % 2)
    return [padded[i] | padded[i + 1] << 4 for i in range(0, len(padded), 2)]


def fp4_decode(packed: list[int], n: int, scales: list[int]) -> list[float]:
    """y_i = (+-M[code & 7]) * scale, the sign from bit 3 (code 8 is -0.0): one fp32 multiply."""
    out = []
    for i in range(n):
        code = (packed[i // 2] >> (4 * (i % 2))) & 15
        value = math.copysign(FP4_MAGNITUDES[code & 7], -1.0 if code & 8 else 1.0)
        out.append(f32(value * from_bits32(scales[i // B])))
    return out


# ---------------------------------------------------------------------------
# inputs: every rule of the format in a few blocks


class Lcg:
    """A fixed 64-bit linear congruential generator: the same inputs on every machine."""

    def __init__(self, state: int):
        self.state = state

    def next(self) -> int:
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        return self.state >> 33  # 31 bits

    def uniform(self) -> float:  # in (-1, 1), an fp32 value
        return f32(self.next() / 2**30 - 1.0)

    def int(self, lo: int, hi: int) -> int:  # in [lo, hi]
        return lo + self.next() % (hi - lo + 1)


def common_blocks(rng: Lcg) -> list[list[float]]:
    """Blocks 1-7 of both codecs' fp32 input (qmax: 127 for int8, 6 for fp4)."""
    blocks = []
    # 1: ordinary values, largest |x| = 1 twice (scale 1/qmax; for int8 rounded up to the grid)
    b = [rng.uniform() for _ in range(B)]
    b[5], b[17] = 1.0, -1.0
    blocks.append(b)
    # 2: all equal
    blocks.append([f32(-3.7)] * B)
    # 3: zeros of both signs: scale 0, inv 0
    blocks.append([0.0 if j % 3 else -0.0 for j in range(B)])
    # 4: subnormals: scale = a / qmax (fp4: a subnormal or 0; int8: a / 127.5 rounds to 0 here,
    # so the scale is 0; a larger subnormal a would give 2^-126, the smallest grid value)
    blocks.append([rng.int(-60, 60) * 2.0**-149 for _ in range(B)])
    # 5: a ~ 1e-36: inv finite; int8's a / 127.5 is subnormal, so its scale is 2^-126; fp4's is
    # normal (1e-36 / 6 > 2^-126)
    blocks.append([f32(rng.uniform() * 1e-36) for _ in range(B - 1)] + [f32(1e-36)])
    # 6: huge: a = FLT_MAX
    blocks.append([f32(rng.uniform() * 3e38) for _ in range(B - 1)] + [-FLT_MAX])
    # 7: a NaN in a block: the flag
    b = [rng.uniform() for _ in range(B)]
    b[11] = math.nan
    blocks.append(b)
    return blocks


def fp32_input(rng: Lcg) -> list[float]:
    blocks = []
    # 0: ties. a = 127 * 2^-3, so scale = 2^-3 and inv = 8 exactly; x = (k + 0.5) * 2^-3
    # lands on v = k + 0.5. Repeated maxima of both signs; signed zeros.
    ks = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, 125.5, -126.5, 126.5, -125.5, 63.5, -64.5, 0.0, -0.0]
    ks += [rng.int(-127, 126) + 0.5 for _ in range(B - len(ks) - 3)]
    blocks.append([127.0 * 0.125, -127.0 * 0.125, 127.0 * 0.125] + [k * 0.125 for k in ks])
    blocks += common_blocks(rng)
    # 8: a short last block (7 values) with an infinity: the flag
    blocks.append([rng.uniform() for _ in range(6)] + [math.inf])
    return [x for blk in blocks for x in blk]


def half_input(rng: Lcg, kind: str) -> list[int]:
    """Bits of a bf16 / fp16 input: a tie block (a = 127 * 4), a random block, a short block."""
    to_bits = bf16_bits if kind == "bfloat16" else fp16_bits
    ties = [127.0 * 4, -127.0 * 4] + [(rng.int(-127, 126) + 0.5) * 4 for _ in range(B - 2)]
    rand = [f32(rng.uniform() * 3.0) for _ in range(B)]
    short = [f32(rng.uniform() * 0.01) for _ in range(5)]
    return [to_bits(x) for x in ties + rand + short]


def fp4_input(rng: Lcg) -> list[float]:
    blocks = []
    # 0: midpoints. a = 6 * 2^-2, so scale = 2^-2 and inv = 4 exactly; x = t / 4 lands on v = t:
    # the seven midpoints of both signs go to the even index, values an ulp beside them to the
    # nearer one; small negatives that round to 0 give code 0 (no -0); signed zeros.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    ts = mids + [-t for t in mids]
    ts += [from_bits32(bits32(t) + d) for t in mids for d in (-1, 1)]
    ts += [-0.1, -0.0, 0.0]
    blocks.append([1.5, -1.5] + [f32(t * 0.25) for t in ts][: B - 2])
    blocks += common_blocks(rng)  # (block 2: every code is -6, f)
    # 8: a short last block of 7 values (an odd count: the last byte's high nibble is 0)
    blocks.append([rng.uniform() for _ in range(7)])
    return [x for blk in blocks for x in blk]


def fp4_decode_input() -> tuple[list[int], list[float]]:
    """Every byte value (so every code in both nibbles, code 8 included) under scales that
    decode to zero, subnormals, huge values (inf in fp16, and past FLT_MAX in fp32) and NaN."""
    packed = list(range(256))
    scales = [1.0, 0.25, f32(1 / 3), 0.0, -2.0, 3e-45, f32(1.2e-38), 1e4, f32(3e38), math.nan, 7.5, 2.0**-24,
              f32(1e-8), 65504 / 6, 1e-3, 5.0]
    return packed, scales


SR_SEEDS = [0, 0x9E3779B9, 0xFFFFFFFF]
# Flattened index of the first element: 0; two blocks below 2^32 (the high half changes
# inside the vector); 2^40 + 2^32 - 32; the top of the int64 range.
SR_OFFSETS = [0, 2**32 - 2 * B, 2**40 + 2**32 - B, 2**63 - 4 * B]
HASH_PAIRS = [(0, 0), (0, 1), (1, 0), (0x9E3779B9, 12345), (0xFFFFFFFF, 2**32 - 1), (0xFFFFFFFF, 2**32),
              (7, 2**32 + 5), (7, 2**33 + 5), (123456789, 2**40 + 77), (0x80000000, 2**62 + 3),
              (42, 2**63 - 1), (0, 0xDEADBEEF_CAFEF00D & (2**63 - 1))]


def hex_q(q: list[int]) -> str:
    return "".join(f"{v & 0xFF:02x}" for v in q)


def hex32(values: list[float]) -> str:
    return " ".join(f"{bits32(v):08x}" for v in values)


def hex16(bits: list[int]) -> str:
    return " ".join(f"{b:04x}" for b in bits)


def codec_vectors(rng: Lcg, x: list[float], encode_q, decode_q) -> dict:
    """One codec's vectors: encode, decode, decode-add of x, half inputs, stochastic rounding.

    encode_q(xs, seed, first) -> (scale bits, q bytes: int8 values or packed fp4 codes);
    decode_q(q, n, scale bits) -> the n decoded fp32 values."""
    scales, q = encode_q(x, None, 0)
    y = decode_q(q, len(x), scales)
    acc = [f32(rng.uniform() * 4.0) for _ in x]
    out = {
        "fp32": {
            "x": hex32(x),
            "scales": " ".join(f"{s:08x}" for s in scales),
            "q": hex_q(q),
            "decoded_fp32": hex32(y),
            "decoded_bf16": hex16([bf16_bits(v) for v in y]),
            "decoded_fp16": hex16([fp16_bits(v) for v in y]),
            "acc": hex32(acc),
            "acc_plus_decoded": hex32([f32(a + v) for a, v in zip(acc, y)]),  # one multiply, then one add
        },
    }
    for kind in ("bfloat16", "float16"):
        bits = half_input(rng, kind)
        s, qh = encode_q([widen16(h, kind) for h in bits], None, 0)
        out[kind] = {"x": hex16(bits), "scales": " ".join(f"{v:08x}" for v in s), "q": hex_q(qh)}
    # stochastic rounding: the first three blocks of x and a fresh one
    xs = x[: 3 * B] + [f32(rng.uniform() * 2.0) for _ in range(B)]
    # (the scales of stochastic rounding, the same for every seed: int8 rounds a / 127 up to the grid)
    sr = {"x": hex32(xs), "scales": " ".join(f"{s:08x}" for s in encode_q(xs, SR_SEEDS[0], 0)[0]), "q": {}}
    for seed in SR_SEEDS:
        for first in SR_OFFSETS:
            sr["q"][f"{seed}@{first}"] = hex_q(encode_q(xs, seed, first)[1])
    out["stochastic"] = sr
    return out


def build() -> dict:
    """Every golden vector, as hex strings."""
    rng = Lcg(20261126)
    int8 = codec_vectors(rng, fp32_input(rng), encode, lambda q, n, scales: decode(q, scales))
    out = {"block_size": B, **int8}
    out["hash"] = {f"{seed}@{i}": f"{stochastic_h(seed, i):08x}" for seed, i in HASH_PAIRS}
    out["fp4"] = build_fp4(Lcg(20261127))
    return out


def build_fp4(rng: Lcg) -> dict:
    """The fp4 vectors: codec_vectors', and every byte value decoded."""

    def encode_q(xs, seed, first):
        scales, codes = fp4_encode(xs, seed, first)
        return scales, fp4_pack(codes)

    out = codec_vectors(rng, fp4_input(rng), encode_q, fp4_decode)
    dq, dscales = fp4_decode_input()
    dy = fp4_decode(dq, 2 * len(dq), [bits32(v) for v in dscales])
    out["all_codes"] = {
        "q": hex_q(dq),
        "scales": hex32(dscales),
        "decoded_fp32": hex32(dy),
        "decoded_bf16": hex16([bf16_bits(v) for v in dy]),
        "decoded_fp16": hex16([fp16_bits(v) for v in dy]),
    }
    return out


def _format(obj, indent: int = 0) -> str:
    """A Python literal with long hex strings wrapped (implicit concatenation)."""
    pad = " " * indent
    if isinstance(obj, dict):
        inner = "".join(f"{pad}    {k!r}: {_format(v, indent + 4)},\n" for k, v in obj.items())
        return "{\n" + inner + pad + "}"
    width = 90 if isinstance(obj, str) and " " in obj else 96  # whole words / whole bytes per line
    if isinstance(obj, str) and len(obj) > width:
        parts = [obj[i : i + width] for i in range(0, len(obj), width)]
        return "(\n" + "".join(f"{pad}    {p!r}\n" for p in parts) + pad + ")"
    return repr(obj)


def main() -> int:
    sys.stdout.write("GOLDEN = " + _format(build()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
