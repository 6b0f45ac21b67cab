"""The int8 block codec: the Python face of the op API, the backend choice, and
the pure-torch reference that every backend must match bit for bit.

The format is specified in docs/wire-format.md. Four backends implement it:

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
    "NonFiniteError",
    "quantize_int8",
    "dequantize_int8",
    "dequantize_add_int8_",
    "quantize_int8_reference",
    "dequantize_int8_reference",
    "dequantize_add_int8_reference_",
    "available_backends",
    "wire_bytes",
]

DEFAULT_BLOCK_SIZE = 256
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
QMAX = 127
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("cpu", "cuda", "triton", "torch")


class NonFiniteError(ValueError):
    """The input of quantize_int8 holds NaN or infinity: it must not be sent."""


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


def wire_bytes(n: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of a quantized tensor of n elements: n int8 values plus one fp32 scale per block."""
    return n + 4 * num_blocks(n, block_size)


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_int8 expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"quantize_int8 expects a float32, bfloat16 or float16 tensor, got {x.dtype}; "
            "convert it first, e.g. x.float()"
        )


def _check_encoded(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    check_block_size(block_size)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
        raise TypeError(f"q must be an int8 tensor (from quantize_int8), got {getattr(q, 'dtype', type(q))}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(
            f"scales must be a float32 tensor (from quantize_int8), got {getattr(scales, 'dtype', type(scales))}"
        )
    if q.device != scales.device:
        raise ValueError(f"q is on {q.device} but scales is on {scales.device}; move both to one device")
    expected = num_blocks(q.numel(), block_size)
    if scales.numel() != expected:
        raise ValueError(
            f"q has {q.numel()} elements, which at block_size {block_size} needs {expected} scales, "
            f"but scales has {scales.numel()}; were they made with another block_size?"
        )


def _check_accumulator(acc: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32:
        raise TypeError(f"the accumulator must be float32, got {getattr(acc, 'dtype', type(acc))}")
    if acc.device != q.device:
        raise ValueError(f"the accumulator is on {acc.device} but q is on {q.device}; move them to one device")
    if acc.numel() != q.numel():
        raise ValueError(f"the accumulator has {acc.numel()} elements but q has {q.numel()}; they must match")
    if not acc.is_contiguous():
        raise ValueError("the accumulator must be contiguous (it is updated in place)")


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


def quantize_int8_reference(
    x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, seed: Optional[int] = None, *, first_index: int = 0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The codec in plain torch ops. Returns (q int8[n], scales float32[ceil(n/B)]).

    Blocks with non-finite input get a NaN scale and zero q (the flag). `first_index`
    is the flattened index of x's first element in a larger tensor: stochastic
    rounding keys its generator by (seed, first_index + i)."""
    _check_input(x)
    check_block_size(block_size)
    if not 0 <= first_index < 2**63:
        raise ValueError(f"first_index must be in [0, 2^63), got {first_index}")
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = num_blocks(n, block_size)
    blocks = torch.nn.functional.pad(flat, (0, nb * block_size - n)).view(nb, block_size)
    nonfinite = ~torch.isfinite(blocks).all(dim=1)
    a = torch.where(nonfinite, 0.0, blocks.abs().amax(dim=1))
    c127 = torch.full_like(a, float(QMAX))
    scale = a / c127  # tensor / tensor: one IEEE division per element
    inv = torch.where(a > 0, c127 / torch.where(a > 0, a, 1.0), 0.0)
    inv = torch.where(torch.isinf(inv), 0.0, inv)
    v = blocks * inv[:, None]
    if seed is None:
        r = torch.round(v)  # round half to even
    else:
        # the padding past n may run beyond 2^63 - 1 at the very top of the range: it is discarded
        index = first_index + torch.arange(nb * block_size, dtype=torch.int64, device=x.device).view(nb, block_size)
        u = stochastic_uniform_reference(seed, index)
        f = torch.floor(v)
        r = f + (u < (v - f)).to(torch.float32)
    q = r.clamp(-QMAX, QMAX).to(torch.int8)
    q = torch.where(nonfinite[:, None], torch.zeros_like(q), q)
    scale = torch.where(nonfinite, float("nan"), scale)
    return q.reshape(-1)[:n].contiguous(), scale.contiguous()


def _expand_scales(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)[: q.numel()]


def dequantize_int8_reference(
    q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    _check_encoded(q, scales, block_size)
    y = q.reshape(-1).to(torch.float32) * _expand_scales(q, scales, block_size)
    return y.to(dtype)


def dequantize_add_int8_reference_(
    acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
) -> torch.Tensor:
    _check_encoded(q, scales, block_size)
    _check_accumulator(acc, q)
    product = q.reshape(-1).to(torch.float32) * _expand_scales(q, scales, block_size)
    acc.view(-1).add_(product)  # a separate add: never fused with the multiply
    return acc


# ---------------------------------------------------------------------------
# backend choice


def _triton():
    from prime.kernels import codec  # imports triton: only when asked for

    return codec


def _triton_usable(device: torch.device) -> bool:
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
        if _triton_usable(device):
            out.append("triton")
    elif device.type == "cpu":
        if _extension.available():
            out.append("cpu")
        if _triton_usable(device):  # only under TRITON_INTERPRET=1; slow, for tests
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


def _raise_if_nonfinite(x: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    bad = torch.isnan(scales)
    if bool(bad.any()):  # a device sync on CUDA; pass check_finite=False to avoid it
        first = int(bad.nonzero()[0, 0]) * block_size
        raise NonFiniteError(
            f"quantize_int8: the input holds NaN or Inf in {int(bad.sum())} of {scales.numel()} blocks "
            f"(first bad block starts at element {first}); refusing to encode poisoned values"
        )


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
    """Encodes x (fp32, bf16 or fp16, any shape) into int8 values and one fp32 scale per block.

    Returns (q: int8[n], scales: float32[ceil(n / block_size)]) on x's device.
    `seed` turns on stochastic rounding. Non-finite input raises NonFiniteError
    when `check_finite` (a host sync on CUDA); otherwise its blocks carry a NaN scale.
    """
    _check_input(x)
    check_block_size(block_size)
    if seed is not None:
        # the generator keys on seed mod 2^32 (docs/wire-format.md); reducing here keeps
        # any Python int working on every backend (the torch ops take an int64)
        seed = int(seed) & _MASK32
    name = _pick_backend(backend, x.device)
    if name in ("cpu", "cuda"):
        q, scales = torch.ops.prime.quantize_int8(x, block_size, seed)
    elif name == "triton":
        q, scales = _triton().quantize_int8(x, block_size, seed)
    else:
        q, scales = quantize_int8_reference(x, block_size, seed)
    if check_finite:
        _raise_if_nonfinite(x, scales, block_size)
    return q, scales


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
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    name = _pick_backend(backend, q.device)
    if name in ("cpu", "cuda"):
        return torch.ops.prime.dequantize_int8(q, scales, block_size, dtype)
    if name == "triton":
        return _triton().dequantize_int8(q, scales, block_size, dtype)
    return dequantize_int8_reference(q, scales, block_size, dtype)


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
    name = _pick_backend(backend, q.device)
    if name in ("cpu", "cuda"):
        torch.ops.prime.dequantize_add_int8_(acc, q, scales, block_size)
    elif name == "triton":
        _triton().dequantize_add_int8_(acc, q, scales, block_size)
    else:
        dequantize_add_int8_reference_(acc, q, scales, block_size)
    return acc
