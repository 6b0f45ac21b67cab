"""Triton versions of the block codec ops (int8, fp4), bit-identical to the torch reference.

The same ops as `prime.ops` (whose `backend="triton"` lands here), with the same
arguments and the same bytes (docs/wire-format.md):

    quantize_int8(x, block_size, seed)                   -> (q int8[n], scales fp32[ceil(n/B)])
    dequantize_int8(q, scales, block_size, dtype)        -> y[n] of dtype
    dequantize_add_int8_(acc, q, scales, block_size)     -> acc, updated in place
    quantize_fp4(x, block_size, seed)                    -> (q uint8[ceil(n/2)], scales fp32[ceil(n/B)])
    dequantize_fp4(q, scales, numel, block_size, dtype)  -> y[numel] of dtype
    dequantize_add_fp4_(acc, q, scales, block_size)      -> acc, updated in place

CUDA tensors run compiled kernels. CPU tensors run the same kernels under
Triton's interpreter (numpy; slow, for tests), which needs TRITON_INTERPRET=1
in the environment before triton is first imported.

Every launch is asynchronous (no host sync) and passes `enable_fp_fusion=False`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Tuple

import torch
import triton
from triton.runtime import JITFunction

from prime.ops import (
    _check_accumulator,
    _check_dtype,
    _check_encoded,
    _check_encoded_fp4,
    _check_fp4_accumulation,
    _check_input,
    check_block_size,
)

from . import _codec_kernels as _kernels

__all__ = ["available", "quantize_int8", "dequantize_int8", "dequantize_add_int8_", "quantize_fp4", "dequantize_fp4",
           "dequantize_add_fp4_"]


# Launch shapes. Chosen by reasoning and by reading the code Triton 3.9 generates
# for sm_90 (PTX + ptxas register counts, no GPU run yet; benchmarks/ can sweep
# them through the keyword arguments of the launchers below):
#
# quantize: a program encodes max(B, 4096) elements as 4096 / B whole blocks, so
#   small blocks (B = 32) cost no more per byte than big ones. With 4 warps that
#   is 32 values a thread, read as 16-byte vectors and written as 16-byte int8
#   vectors, in one layout (no shared-memory shuffles besides the reduction);
#   16 KiB of fp32 in flight per program. The masked path of the last tile
#   (scalar loads: n is not specialized, to compile once per block size) would
#   raise the kernel to ~90 registers; capping at 64 costs no spill with
#   round-to-nearest (ptxas: 60-64 registers, no local memory) and lets 8
#   programs share an SM, 128 KiB in flight, ample for HBM3 latency. Stochastic
#   rounding needs ~96 (it spills at 64), so it keeps 5 programs an SM.
# dequantize(-add): a decoder needs no whole block, so a program takes 1024
#   elements and 8 warps: 4 values a thread, the one shape where the int8 loads
#   and the fp32 loads/stores share a layout (with more values a thread Triton
#   moves the tile through shared memory between them); ~22 registers, so the
#   SM is full (2048 threads, 8 programs, ~72 KiB in flight for dequantize-add).
# fp4 runs the same kernels (constexpr FP4). Its encoder reads full tiles as pairs of values
#   (one byte of codes each) where x is aligned to a pair, so the codes need no trip through
#   shared memory; with 4 warps that layout holds 2048 values in 56 registers (ptxas for sm_90,
#   B = 256) without spilling, where 4096 spill under the 64-register cap: tile 2048, 16 values
#   a thread, as the CUDA kernel. Its decoders take int8's shapes.
_QUANTIZE_TILE = 4096
_QUANTIZE_WARPS = 4
_QUANTIZE_MAX_REGISTERS = 64  # round-to-nearest only
_QUANTIZE_FP4_TILE = 2048
_DEQUANTIZE_TILE = 1024
_DEQUANTIZE_WARPS = 8

# Compiler options of every launch. No fused multiply-add: the format rounds
# every product before the add that follows it (docs/wire-format.md).
_COMPILE_OPTIONS = {"enable_fp_fusion": False}


# ---------------------------------------------------------------------------
# where the kernels run


def _is_interpreted() -> bool:
    # triton.jit chose between compiling and interpreting when it decorated the
    # kernels, from TRITON_INTERPRET at that moment (and the triton.language
    # helpers they call, such as tl.max, were decorated the same way when triton
    # was imported): the variable must be set before triton is first imported.
    return not isinstance(_kernels._quantize_kernel, JITFunction)


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and _is_interpreted()):
        return
    if device.type == "cpu":
        raise RuntimeError(
            "the Triton codec runs CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (it is slow; for tests), or use the C++ or torch backend"
        )
    raise ValueError(f"the Triton codec runs on cuda tensors, not on {device}")


@functools.lru_cache(maxsize=None)
def _gpu_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    if _is_interpreted():
        return True  # the interpreter copies cuda tensors to the host and back
    try:
        return triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception:  # triton found no GPU driver it can use: report unavailable, not crash
        return False


def available(device: torch.device | str) -> bool:
    """Whether prime.ops may pick the Triton codec for tensors on `device`.

    cuda: when a GPU is present that triton can drive. cpu: only when the kernels
    run under Triton's interpreter (TRITON_INTERPRET=1 set before triton was
    imported); that is orders of magnitude slower than the C++ codec, for tests.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _gpu_ready()
    if device.type == "cpu":
        return _is_interpreted()
    return False


def _on_device(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ---------------------------------------------------------------------------
# typed launchers: flat contiguous tensors in, no checks, no host syncs


def _check_tile(tile: int) -> None:
    assert tile > 0 and tile & (tile - 1) == 0, f"tile must be a power of two, got {tile}"


def _launch_quantize(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    seed: Optional[int],
    *,
    fp4: bool = False,
    tile: Optional[int] = None,
    num_warps: int = _QUANTIZE_WARPS,
    max_registers: Optional[int] = _QUANTIZE_MAX_REGISTERS,
    fp4_pairs: Optional[bool] = None,
):
    """q[:] , scales[:] = quantize(x) for flat contiguous x (fp32/bf16/fp16), q (int8; fp4: uint8,
    ceil(n/2) bytes), scales (fp32). tile: elements a program encodes (default _QUANTIZE_TILE,
    fp4 _QUANTIZE_FP4_TILE); fp4_pairs: fp4 full tiles read as pairs of values (default: where x
    is aligned to a pair; False forces the element-wise tile, for comparisons).

    Returns the launched kernel handle (its .asm holds the PTX on CUDA)."""
    if tile is None:
        tile = _QUANTIZE_FP4_TILE if fp4 else _QUANTIZE_TILE
    _check_tile(tile)
    pair_aligned = x.data_ptr() % (2 * x.element_size()) == 0
    if fp4_pairs is None:
        fp4_pairs = pair_aligned
    assert not fp4_pairs or pair_aligned, "fp4_pairs needs x aligned to a pair of values"
    n = x.numel()
    rows = max(1, tile // block_size)  # whole blocks per program
    x_is_bf16 = x.dtype == torch.bfloat16
    seed_bits = 0 if seed is None else seed & 0xFFFFFFFF
    seed_i32 = seed_bits - (1 << 32) if seed_bits >= (1 << 31) else seed_bits  # an i32 argument, always
    grid = (triton.cdiv(n, rows * block_size),)
    options = {"maxnreg": max_registers} if max_registers and seed is None else {}
    with _on_device(x.device):
        return _kernels._quantize_kernel[grid](
            x.view(torch.int16) if x_is_bf16 else x,
            q,
            scales.view(torch.int32),  # the NaN flag is stored as exact bits
            n,
            seed_i32,
            BLOCK=block_size,
            ROWS=rows,
            X_IS_BF16_BITS=x_is_bf16,
            STOCHASTIC=seed is not None,
            FP4=fp4,
            FP4_PAIRS=fp4 and fp4_pairs,
            num_warps=num_warps,
            **_COMPILE_OPTIONS,
            **options,
        )


def _launch_dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    accumulate: bool,
    *,
    fp4: bool = False,
    tile: int = _DEQUANTIZE_TILE,
    num_warps: int = _DEQUANTIZE_WARPS,
):
    """out[:] = value(q) * scale, or out[:] += value(q) * scale (accumulate; out fp32).

    Flat contiguous q (int8; fp4: uint8 codes of out.numel() values), scales (fp32), out
    (fp32/bf16/fp16). Returns the kernel handle."""
    _check_tile(tile)
    n = out.numel()
    cols = min(block_size, tile)  # a row lies in one block
    rows = tile // cols
    out_is_bf16 = out.dtype == torch.bfloat16
    assert not (accumulate and out.dtype != torch.float32), "the accumulator is fp32"
    grid = (triton.cdiv(n, rows * cols),)
    with _on_device(q.device):
        return _kernels._dequantize_kernel[grid](
            q,
            scales,
            out.view(torch.int16) if out_is_bf16 else out,
            n,
            BLOCK=block_size,
            ROWS=rows,
            COLS=cols,
            ACCUMULATE=accumulate,
            OUT_IS_BF16_BITS=out_is_bf16,
            FP4=fp4,
            num_warps=num_warps,
            **_COMPILE_OPTIONS,
        )


# ---------------------------------------------------------------------------
# the ops (the argument checks are prime.ops's own, so every backend words its errors alike)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous()  # a copy only when t is not contiguous


def _quantize(op: str, x: torch.Tensor, block_size: int, seed: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_input(x, op)
    check_block_size(block_size)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be None or an int, got {type(seed).__name__}")
    _check_device(x.device)
    x = _flat(x)
    n = x.numel()
    fp4 = op == "quantize_fp4"
    q = torch.empty((n + 1) // 2 if fp4 else n, dtype=torch.uint8 if fp4 else torch.int8, device=x.device)
    scales = torch.empty(triton.cdiv(n, block_size), dtype=torch.float32, device=x.device)
    if n > 0:
        _launch_quantize(x, q, scales, block_size, seed, fp4=fp4)
    return q, scales


def quantize_int8(
    x: torch.Tensor, block_size: int = 64, seed: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encodes x (fp32, bf16 or fp16, any shape) as (q int8[n], scales fp32[ceil(n/B)]).

    Bit-identical to prime.ops.quantize_int8_reference: round half to even, or
    stochastic rounding keyed by (seed, element index) when `seed` is an int.
    Blocks holding NaN or Inf get the NaN scale (bits 0x7FC00000) and zero q;
    raising on them is prime.ops' job. A non-contiguous x is copied first.
    """
    return _quantize("quantize_int8", x, block_size, seed)


def dequantize_int8(
    q: torch.Tensor, scales: torch.Tensor, block_size: int = 64, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decodes (q, scales) into a 1-D tensor of `dtype` (fp32, bf16 or fp16).

    y = float(q) * scale in fp32, then rounded to nearest even into `dtype`.
    """
    _check_encoded(q, scales, block_size)
    _check_dtype(dtype)
    _check_device(q.device)
    q = _flat(q)
    out = torch.empty(q.numel(), dtype=dtype, device=q.device)
    if q.numel() > 0:
        _launch_dequantize(q, _flat(scales), out, block_size, accumulate=False)
    return out


def dequantize_add_int8_(
    acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int = 64
) -> torch.Tensor:
    """acc += dequantize(q, scales) in place: one fp32 multiply, then one fp32 add. Returns acc."""
    _check_encoded(q, scales, block_size)
    _check_accumulator(acc, q)
    _check_device(q.device)
    if q.numel() > 0:
        _launch_dequantize(_flat(q), _flat(scales), acc.view(-1), block_size, accumulate=True)
    return acc


def quantize_fp4(
    x: torch.Tensor, block_size: int = 256, seed: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encodes x (fp32, bf16 or fp16, any shape) as (q uint8[ceil(n/2)], scales fp32[ceil(n/B)]):
    E2M1 codes, value 2j in the low nibble of byte j. Bit-identical to
    prime.ops.quantize_fp4_reference; otherwise as quantize_int8."""
    return _quantize("quantize_fp4", x, block_size, seed)


def dequantize_fp4(
    q: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int = 256, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decodes the numel values of (q, scales) into a 1-D tensor of `dtype` (fp32, bf16 or fp16)."""
    _check_encoded_fp4(q, scales, numel, block_size)
    _check_dtype(dtype)
    _check_device(q.device)
    out = torch.empty(numel, dtype=dtype, device=q.device)
    if numel > 0:
        _launch_dequantize(_flat(q), _flat(scales), out, block_size, accumulate=False, fp4=True)
    return out


def dequantize_add_fp4_(acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """acc += dequantize_fp4(q, scales, acc.numel()) in place: one fp32 multiply, then one fp32 add. Returns acc."""
    _check_fp4_accumulation(acc, q, scales, block_size)
    _check_device(q.device)
    if acc.numel() > 0:
        _launch_dequantize(_flat(q), _flat(scales), acc.view(-1), block_size, accumulate=True, fp4=True)
    return acc
