"""The block codecs (int8 and fp4): the Python face of the op API, the backend
choice, and the pure-torch references that every backend must match bit for bit.

The formats are specified in docs/wire-format.md. Four backends implement them:

  "cpu"     C++ in csrc/codec/codec_cpu.cpp (multithreaded), torch op prime::*
  "cuda"    CUDA C++ in csrc/codec/codec_cuda.cu, the same torch ops
  "triton"  kernels/codec.py
  "torch"   the reference below: the test oracle and the fallback when the
            extension is not built

`backend=None` picks the fastest one available for the tensor's device.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from prime import _extension

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_FP4_BLOCK_SIZE",
    "NonFiniteError",
    "quantize_int8",
    "dequantize_int8",
    "dequantize_add_int8_",
    "quantize_int8_reference",
    "dequantize_int8_reference",
    "dequantize_add_int8_reference_",
    "quantize_fp4",
    "dequantize_fp4",
    "dequantize_add_fp4_",
    "quantize_fp4_reference",
    "dequantize_fp4_reference",
    "dequantize_add_fp4_reference_",
    "available_backends",
    "wire_bytes",
    "CODECS",
]

# int8: block 64 with scales on a grid of 18 steps an octave (1 byte on the wire): 65 bytes per
# 64 values, and a ring average of 16 ranks still errs below 0.9% on Gaussian data
# (benchmarks/RESULTS.md, "int8: one-byte scales and block 64"). fp4 keeps block 256 and fp32
# scales (docs/wire-format.md, "Block size 256").
DEFAULT_BLOCK_SIZE = 64
DEFAULT_FP4_BLOCK_SIZE = 256
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
QMAX = 127
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("cpu", "cuda", "triton", "torch")


# The codecs a ring may send a tensor with: exact values, or one of the block codecs.
CODECS = ("int8", "fp4", "none")

# fp4: the 16 values of an E2M1 code (docs/wire-format.md), code = sign << 3 | magnitude
# index. Code 8 (-0) is never written; it decodes as -0.0 times the scale.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
# Round to nearest: the magnitude index of t = |v| counts the midpoints below t; a value
# on a midpoint goes to the even index (strict > where the even neighbour is below).
_FP4_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class NonFiniteError(ValueError):
    """The input of quantize_int8 / quantize_fp4 holds NaN or infinity: it must not be sent."""


# ---------------------------------------------------------------------------
# argument checks, shared by every backend so the messages are the same


def check_block_size(block_size: int, name: str = "block_size") -> None:
    """The one Python statement of the block-size rule (C++: csrc/codec/checks.h).

    Raises TypeError for a non-int and ValueError for an int that is not a power of two
    from 32 to 4096; `name` is what the message calls the value (a config field, say)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"{name} must be an int, got {type(block_size).__name__}")
    if block_size < MIN_BLOCK_SIZE or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"{name} must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, got {block_size}")


def num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def fp4_bytes(n: int) -> int:
    """Bytes of n packed fp4 codes: two per byte."""
    return (n + 1) // 2


# Bytes of one block's scale in a ring payload: int8 sends one byte (its step on the scale grid
# below the payload's largest scale, which a 2-byte header carries), fp4 the whole fp32 scale
# (docs/wire-format.md, "On the wire").
SCALE_BYTES = {"int8": 1, "fp4": 4}
INT8_HEADER_BYTES = 2

# The int8 scale grid (docs/wire-format.md, "Encoding one block"): the fp32 values
# 2^e * G[j], G[j] = 2^(j / 18) rounded to fp32, whose mantissa bits these are. A step is
# 2^(1/18) = 1.0393: coarse enough for 14 octaves in the byte a ring payload gives a scale,
# fine enough that a round trip of the codec stays a fixed point of it.
SCALE_GRID_STEPS = 18
SCALE_GRID_MANTISSAS = (
    0x000000, 0x050672, 0x0A3F66, 0x0FACD6, 0x1550D3, 0x1B2D80, 0x214518, 0x2799EA, 0x2E2E5E,
    0x3504F3, 0x3C2043, 0x4382FF, 0x4B2FF5, 0x532A10, 0x5B7457, 0x6411F0, 0x6D0620, 0x76544D,
)


def default_block_size(codec: str) -> int:
    """The block size a codec uses when none is given: 64 for int8, 256 for fp4, 4096 values a chunk for topk
    (prime.sparse)."""
    return {"fp4": DEFAULT_FP4_BLOCK_SIZE, "topk": 4096}.get(codec, DEFAULT_BLOCK_SIZE)


def wire_bytes(n: int, block_size: Optional[int] = None, codec: str = "int8") -> int:
    """Bytes of a tensor of n elements encoded with `codec` in a ring payload ("int8": n int8 values
    plus a 1-byte scale per block and a 2-byte header; "fp4": ceil(n/2) bytes of codes plus a 4-byte
    scale per block;
    "none": 4n, fp32). `block_size` None: the codec's default."""
    if codec == "none":
        return 4 * n
    if codec not in ("int8", "fp4"):
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    if block_size is None:
        block_size = default_block_size(codec)
    if codec == "int8":
        return n + num_blocks(n, block_size) + (INT8_HEADER_BYTES if n else 0)
    return fp4_bytes(n) + SCALE_BYTES[codec] * num_blocks(n, block_size)


def _check_input(x: torch.Tensor, op: str = "quantize_int8") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op} expects a float32, bfloat16 or float16 tensor, got {x.dtype}; convert it first, e.g. x.float()"
        )


def _check_scales(scales: torch.Tensor, q: torch.Tensor, n: int, block_size: int, source: str) -> None:
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(
            f"scales must be a float32 tensor (from {source}), got {getattr(scales, 'dtype', type(scales))}"
        )
    if q.device != scales.device:
        raise ValueError(f"q is on {q.device} but scales is on {scales.device}; move both to one device")
    expected = num_blocks(n, block_size)
    if scales.numel() != expected:
        what = "q has" if source == "quantize_int8" else "the tensor has"
        raise ValueError(
            f"{what} {n} elements, which at block_size {block_size} needs {expected} scales, "
            f"but scales has {scales.numel()}; were they made with another block_size?"
        )


def _check_encoded(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    check_block_size(block_size)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise TypeError(f"q must be an int8 tensor (from quantize_int8), got {getattr(q, 'dtype', type(q))}")
    _check_scales(scales, q, q.numel(), block_size, "quantize_int8")


def _check_fp4_codes(q: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8:
        raise TypeError(f"q must be a uint8 tensor (from quantize_fp4), got {getattr(q, 'dtype', type(q))}")


def _check_encoded_fp4(q: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int) -> None:
    """q: the packed codes of `numel` values (uint8, two per byte), scales: one per block."""
    check_block_size(block_size)
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    _check_fp4_codes(q)
    if q.numel() != fp4_bytes(numel):
        raise ValueError(
            f"q has {q.numel()} bytes, but {numel} fp4 values take {fp4_bytes(numel)} (two per byte); "
            "is numel the length of the tensor that was quantized?"
        )
    _check_scales(scales, q, numel, block_size, "quantize_fp4")


def _check_accumulator(acc: torch.Tensor, q: torch.Tensor, codec: str = "int8") -> None:
    """acc: fp32, contiguous, on q's device, as long as q encodes (int8: one byte a value; fp4: two values a byte)."""
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32:
        raise TypeError(f"the accumulator must be float32, got {getattr(acc, 'dtype', type(acc))}")
    if acc.device != q.device:
        raise ValueError(f"the accumulator is on {acc.device} but q is on {q.device}; move them to one device")
    if codec == "int8" and acc.numel() != q.numel():
        raise ValueError(f"the accumulator has {acc.numel()} elements but q has {q.numel()}; they must match")
    if codec == "fp4" and fp4_bytes(acc.numel()) != q.numel():
        raise ValueError(
            f"the accumulator has {acc.numel()} elements, whose fp4 codes take {fp4_bytes(acc.numel())} bytes, "
            f"but q has {q.numel()}; they must match"
        )
    if not acc.is_contiguous():
        raise ValueError("the accumulator must be contiguous (it is updated in place)")


def _check_fp4_accumulation(acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    """The argument checks of dequantize_add_fp4_ (the accumulator gives the number of values)."""
    check_block_size(block_size)
    _check_fp4_codes(q)
    _check_accumulator(acc, q, "fp4")
    _check_encoded_fp4(q, scales, acc.numel(), block_size)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")


# ---------------------------------------------------------------------------
# the reference: plain torch ops, evaluated in fp32 exactly as the wire format says

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = (x * (c & 0xFFFF)) & _MASK32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def stochastic_uniform_reference(seed: int, index: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) for each element index (int64), as in docs/wire-format.md."""
    seed &= _MASK32
    lo = index & _MASK32
    hi = index >> 32
    k = _fmix32(seed ^ _fmix32(hi ^ 0x9E3779B9))
    h = _fmix32((_fmix32(lo ^ k) + k) & _MASK32)
    return (h >> 8).to(torch.float32) * (2.0**-24)


def grid_scale_reference(t: torch.Tensor) -> torch.Tensor:
    """Non-negative finite fp32 values t rounded up to the int8 scale grid (SCALE_GRID_MANTISSAS):
    the smallest 2^e * G[j] >= t. 0 stays 0; t below 2^-126 (the subnormals) gives 2^-126."""
    bits = t.view(torch.int32).to(torch.int64)
    mant = bits & 0x7FFFFF
    grid = torch.tensor(SCALE_GRID_MANTISSAS, dtype=torch.int64, device=t.device)
    j = torch.searchsorted(grid, mant)  # how many grid mantissas lie below mant; 18: the next octave's 2^(e + 1)
    up = (bits & 0x7F800000) + torch.cat([grid, grid.new_tensor([0x800000])])[j]
    up = torch.where(bits < 0x800000, 0x800000, up)
    return torch.where(bits == 0, 0, up).to(torch.int32).view(torch.float32)


def _scaled_blocks(x: torch.Tensor, block_size: int, qmax: float, first_index: int, grid_scale: bool = False):
    """The steps every block codec shares (docs/wire-format.md): blocks of B values, zero-padded;
    a = max |x| per block; scale = a / qmax (one IEEE division). fp4: inv = qmax / a; int8
    (grid_scale; qmax 127.5, or 127 for stochastic codes): scale rounded up to the scale grid,
    inv = 1 / scale.
    inv is 0 when the divisor is 0 or the quotient overflows; v = x * inv.
    Returns (n, blocks, nonfinite, scale, v)."""
    if not 0 <= first_index < 2**63:
        raise ValueError(f"first_index must be in [0, 2^63), got {first_index}")
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = num_blocks(n, block_size)
    blocks = torch.nn.functional.pad(flat, (0, nb * block_size - n)).view(nb, block_size)
    nonfinite = ~torch.isfinite(blocks).all(dim=1)
    a = torch.where(nonfinite, 0.0, blocks.abs().amax(dim=1))
    c = torch.full_like(a, float(qmax))
    scale = a / c  # tensor / tensor: one IEEE division per element
    if grid_scale:
        scale = grid_scale_reference(scale)
        num, den = torch.ones_like(a), scale
    else:
        num, den = c, a
    inv = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
    inv = torch.where(torch.isinf(inv), 0.0, inv)
    scale = torch.where(nonfinite, float("nan"), scale)
    return n, blocks, nonfinite, scale.contiguous(), blocks * inv[:, None]


def _block_uniforms(seed: int, first_index: int, v: torch.Tensor) -> torch.Tensor:
    """u of the stochastic-rounding generator for every element of the padded blocks v."""
    # the padding past n may run beyond 2^63 - 1 at the very top of the range: it is discarded
    index = first_index + torch.arange(v.numel(), dtype=torch.int64, device=v.device).view(v.shape)
    return stochastic_uniform_reference(seed, index)


def quantize_int8_reference(
    x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, seed: Optional[int] = None, *, first_index: int = 0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The codec in plain torch ops. Returns (q int8[n], scales float32[ceil(n/B)]).

    Blocks with non-finite input get a NaN scale and zero q (the flag). `first_index`
    is the flattened index of x's first element in a larger tensor: stochastic
    rounding keys its generator by (seed, first_index + i)."""
    _check_input(x)
    check_block_size(block_size)
    # the scale: max |x| / 127.5 rounded up to the grid for round-to-nearest codes (|v| <= 127.5,
    # the largest codes as 123..127), max |x| / 127 for stochastic ones (|v| <= 127: no value's
    # rounding is cut by the clamp)
    n, _, nonfinite, scale, v = _scaled_blocks(x, block_size, QMAX + 0.5 if seed is None else QMAX, first_index,
                                               grid_scale=True)
    if seed is None:
        r = torch.round(v)  # round half to even
    else:
        u = _block_uniforms(seed, first_index, v)
        f = torch.floor(v)
        r = f + (u < (v - f)).to(torch.float32)
    q = r.clamp(-QMAX, QMAX).to(torch.int8)
    q = torch.where(nonfinite[:, None], torch.zeros_like(q), q)
    return q.reshape(-1)[:n].contiguous(), scale


def _expand_scales(n: int, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)[:n]


def dequantize_int8_reference(
    q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    _check_encoded(q, scales, block_size)
    y = q.reshape(-1).to(torch.float32) * _expand_scales(q.numel(), scales, block_size)
    return y.to(dtype)


def dequantize_add_int8_reference_(
    acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
) -> torch.Tensor:
    _check_encoded(q, scales, block_size)
    _check_accumulator(acc, q)
    product = q.reshape(-1).to(torch.float32) * _expand_scales(q.numel(), scales, block_size)
    acc.view(-1).add_(product)  # a separate add: never fused with the multiply
    return acc


def _fp4_magnitude_index(t: torch.Tensor, seed: Optional[int], u: Optional[torch.Tensor]) -> torch.Tensor:
    """The magnitude index (0..7) of t = |v| <= 6 (a little above 6 by rounding: index 7)."""
    if seed is None:  # nearest; on a midpoint, the even index
        m = torch.zeros(t.shape, dtype=torch.int64, device=t.device)
        for mid, inclusive in _FP4_MIDPOINTS:
            m += (t >= mid) if inclusive else (t > mid)
        return m
    # stochastic: the magnitude l just below t, then one up with probability (t - M[l]) / gap,
    # exact in fp32 (t - M[l] by Sterbenz's lemma, the gap a power of two)
    mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32, device=t.device)
    low = torch.zeros(t.shape, dtype=torch.int64, device=t.device)
    for level in FP4_MAGNITUDES[1:]:
        low += t >= level
    top = low == 7
    gap = torch.where(top, 1.0, mags[(low + 1).clamp(max=7)] - mags[low])
    frac = (t - mags[low]) / gap
    return low + ((u < frac) & ~top).to(torch.int64)


def quantize_fp4_reference(
    x: torch.Tensor, block_size: int = DEFAULT_FP4_BLOCK_SIZE, seed: Optional[int] = None, *, first_index: int = 0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fp4 codec in plain torch ops. Returns (q uint8[ceil(n/2)], scales float32[ceil(n/B)]).

    Value 2j of x is the low nibble of q[j], value 2j + 1 the high one (0 past the end).
    Like quantize_int8_reference otherwise: NaN scale and zero codes for non-finite blocks;
    `first_index` keys stochastic rounding."""
    _check_input(x, "quantize_fp4")
    check_block_size(block_size)
    n, _, nonfinite, scale, v = _scaled_blocks(x, block_size, FP4_MAX, first_index)
    u = None if seed is None else _block_uniforms(seed, first_index, v)
    m = _fp4_magnitude_index(v.abs(), seed, u)
    code = torch.where((m > 0) & (v < 0), m + 8, m)  # a zero magnitude is code 0, whatever the sign
    code = torch.where(nonfinite[:, None], torch.zeros_like(code), code).reshape(-1)  # (even length: B is)
    packed = (code[0::2] | (code[1::2] << 4)).to(torch.uint8)
    return packed[: fp4_bytes(n)].contiguous(), scale


def fp4_values_reference(q: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 value (+-M[m], before the scale) of each of the numel codes packed in q."""
    table = torch.tensor(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES), dtype=torch.float32, device=q.device)
    b = q.reshape(-1).to(torch.int64)
    codes = torch.stack([b & 15, b >> 4], dim=1).reshape(-1)[:numel]
    return table[codes]


def dequantize_fp4_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    block_size: int = DEFAULT_FP4_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    _check_encoded_fp4(q, scales, numel, block_size)
    y = fp4_values_reference(q, numel) * _expand_scales(numel, scales, block_size)
    return y.to(dtype)


def dequantize_add_fp4_reference_(
    acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_FP4_BLOCK_SIZE
) -> torch.Tensor:
    _check_fp4_accumulation(acc, q, scales, block_size)
    n = acc.numel()
    acc.view(-1).add_(fp4_values_reference(q, n) * _expand_scales(n, scales, block_size))  # multiply, then add
    return acc


# ---------------------------------------------------------------------------
# backend choice


def _triton():
    from prime.kernels import codec  # imports triton: only when asked for

    return codec


def triton_usable(device: torch.device) -> bool:
    """True when the Triton kernels run on `device` (triton installed and working there; on CPU tensors only under
    TRITON_INTERPRET=1)."""
    try:
        return _triton().available(device)
    except ImportError:
        return False


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on `device`, fastest first."""
    device = torch.device(device)
    out = []
    if device.type == "cuda":
        if _extension.has_cuda_kernels():
            out.append("cuda")
        if triton_usable(device):
            out.append("triton")
    elif device.type == "cpu":
        if _extension.available():
            out.append("cpu")
        if triton_usable(device):  # only under TRITON_INTERPRET=1; slow, for tests
            out.append("triton")
    out.append("torch")
    return out


def _pick_backend(backend: Optional[str], device: torch.device) -> str:
    if backend is None:
        return available_backends(device)[0]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend not in available_backends(device):
        hint = _extension.build_hint() if backend in ("cpu", "cuda") else ""
        raise RuntimeError(f"codec backend {backend!r} is not available for {device} tensors. {hint}".strip())
    return backend


def _raise_if_nonfinite(op: str, scales: torch.Tensor, block_size: int) -> None:
    bad = torch.isnan(scales)
    if bool(bad.any()):  # a device sync on CUDA; pass check_finite=False to avoid it
        first = int(bad.nonzero()[0, 0]) * block_size
        raise NonFiniteError(
            f"{op}: the input holds NaN or Inf in {int(bad.sum())} of {scales.numel()} blocks "
            f"(first bad block starts at element {first}); refusing to encode poisoned values"
        )


# Each op by name: the torch op prime::<name> (cpu, cuda), the Triton function of the same
# name and arguments, and the reference here.
_REFERENCES = {
    "quantize_int8": quantize_int8_reference,
    "dequantize_int8": dequantize_int8_reference,
    "dequantize_add_int8_": dequantize_add_int8_reference_,
    "quantize_fp4": quantize_fp4_reference,
    "dequantize_fp4": dequantize_fp4_reference,
    "dequantize_add_fp4_": dequantize_add_fp4_reference_,
}


def _run(op: str, backend: Optional[str], device: torch.device, *args):
    name = _pick_backend(backend, device)
    if name in ("cpu", "cuda"):
        return getattr(torch.ops.prime, op)(*args)
    if name == "triton":
        return getattr(_triton(), op)(*args)
    return _REFERENCES[op](*args)


def _quantize(op: str, x, block_size, seed, backend, check_finite):
    _check_input(x, op)
    check_block_size(block_size)
    if seed is not None:
        # the generator keys on seed mod 2^32 (docs/wire-format.md); reducing here keeps
        # any Python int working on every backend (the torch ops take an int64)
        seed = int(seed) & _MASK32
    q, scales = _run(op, backend, x.device, x, block_size, seed)
    if check_finite:
        _raise_if_nonfinite(op, scales, block_size)
    return q, scales


# ---------------------------------------------------------------------------
# the public API


def quantize_int8(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: Optional[int] = None,
    backend: Optional[str] = None,
    check_finite: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encodes x (fp32, bf16 or fp16, any shape) into int8 values and one scale per block.

    Returns (q: int8[n], scales: float32[ceil(n / block_size)]) on x's device. Each scale is
    max|x| / 127.5 (max|x| / 127 with stochastic rounding) rounded up to the scale grid, 2^(k/18)
    for an integer k (a ring sends 1 byte of it; docs/wire-format.md); block 64 by default.
    `seed` turns on stochastic rounding. Non-finite input raises NonFiniteError
    when `check_finite` (a host sync on CUDA); otherwise its blocks carry a NaN scale.
    """
    return _quantize("quantize_int8", x, block_size, seed, backend, check_finite)


def dequantize_int8(
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decodes (q, scales) into a 1-D tensor of `dtype` (fp32, bf16 or fp16)."""
    _check_encoded(q, scales, block_size)
    _check_dtype(dtype)
    return _run("dequantize_int8", backend, q.device, q, scales, block_size, dtype)


def dequantize_add_int8_(
    acc: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """acc += dequantize(q, scales), in place (fp32 multiply then fp32 add). Returns acc."""
    _check_encoded(q, scales, block_size)
    _check_accumulator(acc, q)
    _run("dequantize_add_int8_", backend, q.device, acc, q, scales, block_size)
    return acc


def quantize_fp4(
    x: torch.Tensor,
    block_size: int = DEFAULT_FP4_BLOCK_SIZE,
    *,
    seed: Optional[int] = None,
    backend: Optional[str] = None,
    check_finite: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encodes x (fp32, bf16 or fp16, any shape) into 4-bit E2M1 codes and one fp32 scale per block.

    Returns (q: uint8[ceil(n / 2)], two codes a byte, value 2j in the low nibble of q[j];
    scales: float32[ceil(n / block_size)]) on x's device. About 7.8x fewer bytes than fp32
    at block_size 256 (docs/wire-format.md). `seed` and `check_finite` as in quantize_int8.
    """
    return _quantize("quantize_fp4", x, block_size, seed, backend, check_finite)


def dequantize_fp4(
    q: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    block_size: int = DEFAULT_FP4_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Decodes the `numel` values of (q, scales) into a 1-D tensor of `dtype` (fp32, bf16 or fp16).

    numel is the length of the tensor that was quantized (q holds ceil(numel / 2) bytes)."""
    _check_encoded_fp4(q, scales, numel, block_size)
    _check_dtype(dtype)
    return _run("dequantize_fp4", backend, q.device, q, scales, numel, block_size, dtype)


def dequantize_add_fp4_(
    acc: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = DEFAULT_FP4_BLOCK_SIZE,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """acc += dequantize_fp4(q, scales, acc.numel()), in place (fp32 multiply, then fp32 add). Returns acc."""
    _check_fp4_accumulation(acc, q, scales, block_size)
    _run("dequantize_add_fp4_", backend, q.device, acc, q, scales, block_size)
    return acc
