"""Triton versions of the sparse top-k ops (docs/wire-format-sparse.md), the bytes and values of
prime.sparse's CPU kernels and reference bit for bit (prime.sparse's backend="triton" lands here):

    encode(x, chunk, k)              -> payload uint8[payload_bytes(n)] on x's device
    decode(payload, n, chunk, k)     -> y fp32[n] on the payload's device
    decode_add_(acc, payload, chunk, k) -> acc, the kept values added in place

CUDA tensors run compiled kernels; CPU tensors run them under Triton's interpreter (TRITON_INTERPRET=1
before triton is first imported; slow, for tests), as kernels/codec.py. Each call checks what the kernels
report (a non-finite input, a malformed payload) with one host sync, and raises ValueError naming it;
decode_add_ checks the payload before it touches the accumulator.
"""

from __future__ import annotations

import torch
import triton

from . import _sparse_kernels as _k
from .codec import _COMPILE_OPTIONS, _check_device, _is_interpreted, _on_device

__all__ = ["encode", "decode", "decode_add_"]

ENCODE_WARPS = 1  # H200, 256 MiB, k = 64 (bench_sparse_speed.py --sweep): 1 warp and 16 programs per SM fastest
ENCODE_PROGRAMS_PER_SM = 16  # encode's programs each take chunks in turn, with a scratch row of their own
CANDIDATES_PER_KEPT = 8  # the selection runs on at most this many values per value kept (a power of two)
ENCODE_PIECE = 512  # values of a chunk read at a time


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 3  # the interpreter: a few programs, so that each takes several chunks
    return torch.cuda.get_device_properties(device).multi_processor_count * ENCODE_PROGRAMS_PER_SM


def _shape(chunk: int, k: int) -> dict:
    """The launch constants both kernels take: BITS = log2(chunk) (each record's lower bits b follow from its keep
    at run time), RECORD a full chunk's record, UB the unary stream's bytes of the widest record, a power of two
    (keep + chunk / 2^b grows with keep, so a full chunk's)."""
    from prime.sparse import _areas, _check, _record_bytes

    bits = _check(0, chunk, k)
    return {"CHUNK": chunk, "K": k, "BITS": bits, "RECORD": _record_bytes(k, chunk),
            "UB": triton.next_power_of_2(_areas(k, chunk)[0])}


def _lower_shape(chunk: int, k: int) -> dict:
    """The encoder's constants for the lower bits: LB, the lower-bit bytes of the widest record keeping at most k
    values, a power of two (keep * b grows with keep while b stays, so the widest keeps k or a power of two; the
    short last chunk's may be wider than a full one's), and PER, the most positions that overlap one of its bytes
    (at a full chunk's b, the narrowest: the last chunk keeps fewer, so its b is no smaller)."""
    from prime.sparse import _areas, lower_bits

    keeps = {k} | {1 << e for e in range(k.bit_length()) if 1 << e <= k}
    width = max(1, lower_bits(k, chunk))
    return {"LB": triton.next_power_of_2(max(_areas(keep, chunk)[1] for keep in keeps)),
            "PER": min(8, -(-8 // width) + 1)}


def encode(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    from prime.sparse import payload_bytes

    _check_device(x.device)
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"sparse encode takes a flat float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    x = x.contiguous()
    n = x.numel()
    shape = _shape(chunk, k)
    out = torch.empty(payload_bytes(n, chunk, k), dtype=torch.uint8, device=x.device)
    chunks = triton.cdiv(n, chunk)
    if chunks == 0:
        return out
    cap = min(chunk, triton.next_power_of_2(CANDIDATES_PER_KEPT * k))
    programs = min(chunks, _programs(x.device))
    group = chunk // min(chunk, triton.next_power_of_2(k))
    row = 2 * cap + 4 * k + 8 * shape["UB"]  # per program: candidates, the kept values, the unary stream's bits
    scratch = torch.empty(programs, row, dtype=torch.int32, device=x.device)
    status = torch.empty(chunks, dtype=torch.int32, device=x.device)
    cbytes = triton.next_power_of_2((k + 3) // 4)
    consts = dict(CBYTES=cbytes, LOGK=(k - 1).bit_length(), R=chunk // group, SUB=min(chunk, max(group, ENCODE_PIECE)),
                  CAP=cap, **shape, **_lower_shape(chunk, k))
    with _on_device(x.device):
        if not _is_interpreted():
            _k._sparse_encode_kernel[(programs,)](x, out, scratch, status, n, chunks, num_warps=ENCODE_WARPS, **consts,
                                                  **_COMPILE_OPTIONS)
        else:  # the interpreter: its programs in turn, in one launch (_k._sparse_encode_interpreted says why)
            _k._sparse_encode_interpreted[(1,)](x, out, scratch, status, n, CHUNKS=chunks, PROGRAMS=programs, **consts)
    worst = int(status.max())
    if worst == 2:  # not finite: reported before an overflow elsewhere (csrc/codec/sparse.h's EncodeStatus)
        raise ValueError("sparse encode: the input holds NaN or Inf")
    if worst == 1:
        raise ValueError("sparse encode: a chunk's magnitude overflows bf16")
    return out


def _decode(payload: torch.Tensor, y: torch.Tensor, chunk: int, k: int, accumulate: bool,
            bad: torch.Tensor, check_only: bool = False) -> None:
    n = y.numel()
    chunks = triton.cdiv(n, chunk)
    if chunks == 0:
        return
    shape = _shape(chunk, k)
    lanes = 8 * shape["UB"]  # a lane per bit of the unary stream: about 2 to 3 per value kept
    warps = max(1, min(4, lanes // 64)) if lanes <= 2048 else 8  # 8: no spill at k = 2048 of 4096 (ptxas, sm_90)
    with _on_device(y.device):
        _k._sparse_decode_kernel[(chunks,)](payload, y, bad, n, ACCUMULATE=accumulate, CHECK_ONLY=check_only,
                                            num_warps=warps, **shape, **_COMPILE_OPTIONS)


def _check_payload(payload: torch.Tensor, n: int, chunk: int, k: int) -> None:
    from prime.sparse import payload_bytes

    _check_device(payload.device)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != payload_bytes(n, chunk, k):
        raise ValueError(f"sparse decode: expected {payload_bytes(n, chunk, k)} bytes (uint8) for {n} values, "
                         f"got {payload.numel()} ({payload.dtype})")


_MALFORMED = "sparse decode: a record's positions are not ascending inside its chunk"


def decode(payload: torch.Tensor, n: int, chunk: int, k: int) -> torch.Tensor:
    _check_payload(payload, n, chunk, k)
    y = torch.empty(n, dtype=torch.float32, device=payload.device)
    bad = torch.zeros(1, dtype=torch.int32, device=payload.device)
    _decode(payload.contiguous(), y, chunk, k, accumulate=False, bad=bad)
    if int(bad):
        raise ValueError(_MALFORMED)
    return y


def decode_add_(acc: torch.Tensor, payload: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    if acc.dtype != torch.float32 or acc.dim() != 1 or not acc.is_contiguous():
        raise ValueError(f"sparse decode_add_ takes a flat contiguous float32 accumulator, got {acc.dtype} of "
                         f"shape {tuple(acc.shape)}")
    _check_payload(payload, acc.numel(), chunk, k)
    if payload.device != acc.device:
        raise ValueError(f"the payload ({payload.device}) and the accumulator ({acc.device}) are on different devices")
    payload = payload.contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=acc.device)
    _decode(payload, acc, chunk, k, accumulate=True, bad=bad, check_only=True)
    _decode(payload, acc, chunk, k, accumulate=True, bad=bad)  # writes nothing when the check found a fault
    if int(bad):
        raise ValueError(_MALFORMED)
    return acc
