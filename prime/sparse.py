"""The sparse top-k format: per chunk, the largest-magnitude values at 2 bits each with their positions.

The sparse codec's format (docs/wire-format-sparse.md): `encode` / `decode` run the compiled CPU kernels
(csrc/codec/sparse_cpu.cpp) and `encode_reference` / `decode_reference` are their pure-torch reference, the
same bytes and values. The ring carries it as codec "topk" (prime.comm.Ring.all_reduce), the outer step as
`diloco.codec = "topk"` with `diloco.density`.

A flat fp32 tensor of n values is cut into chunks of C values (C a power of two from 16 to 4096; the last
chunk may be shorter). Chunk j of L values keeps its k_j = ceil(L k / C) largest magnitudes (k per full
chunk; ties go to the lower index). Each kept value becomes 2 bits: its sign and one of two magnitudes of the
chunk, `lo` and `hi` (bf16), from one step of 2-means: a kept value is `hi` when its magnitude is at least the
midpoint of the means of the larger and the smaller half of the kept magnitudes, and `hi` and `lo` are the means
of the magnitudes coded each way (so a round trip is a fixed point: error feedback's residual is then exactly
what the payload dropped). Every chunk is one record:

    lo: bf16, hi: bf16                     4 bytes
    positions, upper bits (unary)          ceil((k_j + C / 2^b) / 8) bytes: bit (p_i >> b) + i set for each i
    positions, lower b bits                ceil(k_j b / 8) bytes: p_i mod 2^b, packed LSB first
    codes: k_j x 2 bits                    ceil(k_j / 4) bytes, LSB first; bit 0: hi, bit 1: negative

The positions p_0 < p_1 < ... are Elias-Fano coded: b is the largest with k_j 2^b <= C, so a position costs
about 2 + log2(C / k_j) bits instead of log2(C). With C = 4096 and k = 64 (density 1.56%) a value of the tensor
costs (4 + 16 + 48 + 16) / 4096 = 0.0205 bytes: 1/50 of int8's 1.016. What the format drops is the residual that
error feedback keeps (prime/feedback.py).

`owner_average` is the arithmetic of the collective that will carry it, every rank in one process: each shard's
owner sums the ranks' payloads of it, selects again from the sum and sends that to every rank (bytes per rank
flat in N, one selection of the sum whatever N; docs/wire-format-sparse.md "The collective").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Callable, Optional

import torch

from prime import _extension

__all__ = ["CHUNK", "BACKENDS", "chunk_keep", "payload_bytes", "encode", "decode", "decode_add_", "encode_reference", "decode_reference", "density", "bytes_per_value", "keep_for_density", "lower_bits",
           "shards", "sparse_pays", "OwnerAverage", "owner_average"]

CHUNK = 4096
"""Values per chunk by default."""


def _check(n: int, chunk: int, k: int) -> int:
    if chunk < 16 or chunk > 4096 or chunk & (chunk - 1):
        raise ValueError(f"sparse chunk must be a power of two from 16 to 4096, got {chunk}")
    if not 1 <= k <= chunk:
        raise ValueError(f"sparse k (values kept per chunk of {chunk}) must be in [1, {chunk}], got {k}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return chunk.bit_length() - 1


def check_settings(chunk: int, k: int) -> None:
    """Raises ValueError naming what is wrong with a chunk size or a k (values kept per chunk)."""
    _check(0, chunk, k)


def chunk_keep(length: int, chunk: int, k: int) -> int:
    """Values kept of a chunk of `length` values: k for a full chunk, ceil(length k / chunk) for the last."""
    return (length * k + chunk - 1) // chunk


def lower_bits(keep: int, chunk: int) -> int:
    """b, the lower bits of a position kept directly: the largest with keep 2^b <= chunk."""
    if not 1 <= keep <= chunk:
        raise ValueError(f"sparse: values kept per chunk must be in [1, chunk={chunk}], got {keep}")
    b = 0
    while keep << (b + 1) <= chunk:
        b += 1
    return b


def _areas(keep: int, chunk: int) -> tuple:
    """(upper bytes, lower bytes, code bytes) of a record keeping `keep` values of a chunk of `chunk`."""
    b = lower_bits(keep, chunk)
    return (keep + (chunk >> b) + 7) // 8, (keep * b + 7) // 8, (keep + 3) // 4


def _record_bytes(keep: int, chunk: int) -> int:
    return 4 + sum(_areas(keep, chunk))


def payload_bytes(n: int, chunk: int = CHUNK, k: int = 64) -> int:
    """Bytes of the sparse payload of n values."""
    _check(n, chunk, k)
    full, rest = divmod(n, chunk)
    size = full * _record_bytes(k, chunk)
    return size + (_record_bytes(chunk_keep(rest, chunk, k), chunk) if rest else 0)


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs non-negative ints of `bits` bits each into bytes, LSB first."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8)
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((values.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)]).reshape(-1, 8)
    return (stream << torch.arange(8, dtype=torch.int64)).sum(1).to(torch.uint8)


def _unpack(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    stream = ((data.to(torch.int64)[:, None] >> torch.arange(8, dtype=torch.int64)) & 1).reshape(-1)
    stream = stream[: count * bits].reshape(count, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(1)


def _bf16_bytes(x: float) -> torch.Tensor:
    """The format's rounding of a float64 mean: to fp32, then to bf16, each to nearest even."""
    return torch.tensor([x], dtype=torch.float64).to(torch.float32).to(torch.bfloat16).view(torch.uint8)


def _seqsum(values) -> float:
    """float64 sum, left to right (the format's order: ascending position). Not sum(): from Python 3.12 it
    compensates, and every implementation must add alike."""
    total = 0.0
    for v in values:
        total += v
    return total


def _bf16(x: float) -> float:
    return float(_bf16_bytes(x).view(torch.bfloat16).float())


def _levels(mags: list, upper: set) -> tuple:
    """(codes' level bits, lo, hi) of the kept magnitudes `mags` (ascending position order); `upper`: the
    indices into mags of the ceil(k/2) largest. One 2-means step: split at the midpoint of the halves' means,
    then each level is the mean of its members, rounded to bf16."""
    keep = len(mags)
    c_hi = _seqsum(m for i, m in enumerate(mags) if i in upper) / len(upper)
    c_lo = _seqsum(m for i, m in enumerate(mags) if i not in upper) / (keep - len(upper)) if keep > len(upper) else c_hi
    mid = (c_lo + c_hi) / 2
    level = [int(m >= mid) for m in mags]
    n_hi = sum(level)
    hi = _bf16(_seqsum(m for m, h in zip(mags, level) if h) / n_hi)
    lo = _bf16(_seqsum(m for m, h in zip(mags, level) if not h) / (keep - n_hi)) if keep > n_hi else hi
    return level, lo, hi


def _encode_chunk(x: torch.Tensor, keep: int, chunk: int) -> torch.Tensor:
    mag = x.abs()
    order = torch.sort(mag, descending=True, stable=True).indices[:keep]  # ties: the lower index first
    positions = torch.sort(order).values
    rank_of = {p: r for r, p in enumerate(order.tolist())}
    upper = {i for i, p in enumerate(positions.tolist()) if rank_of[p] < (keep + 1) // 2}
    v = x[positions]
    level, lo, hi = _levels(v.abs().tolist(), upper)
    if not math.isfinite(hi):
        raise ValueError("sparse encode: a chunk's magnitude overflows bf16")
    codes = torch.tensor(level, dtype=torch.int64) | ((v < 0).to(torch.int64) << 1)
    b = lower_bits(keep, chunk)
    upper = torch.zeros(_areas(keep, chunk)[0] * 8, dtype=torch.int64)
    upper[(positions >> b) + torch.arange(keep)] = 1
    lower = _pack(positions & ((1 << b) - 1), b) if b else torch.zeros(0, dtype=torch.uint8)
    return torch.cat([_bf16_bytes(lo), _bf16_bytes(hi), _pack(upper, 1), lower, _pack(codes, 2)])


def encode_reference(x: torch.Tensor, chunk: int = CHUNK, k: int = 64) -> torch.Tensor:
    """The sparse payload (uint8) of a flat fp32 tensor: one record per chunk. Non-finite values are refused."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"sparse encode takes a flat float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    _check(x.numel(), chunk, k)
    x = x.detach().cpu()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("sparse encode: the tensor holds non-finite values")
    records = [_encode_chunk(x[s : s + chunk], chunk_keep(min(chunk, x.numel() - s), chunk, k), chunk)
               for s in range(0, x.numel(), chunk)]
    return torch.cat(records) if records else torch.zeros(0, dtype=torch.uint8)


def _records(payload: torch.Tensor, n: int, chunk: int, k: int):
    """(first value, positions, values) of every record of a payload, checked (ValueError)."""
    _check(n, chunk, k)
    if payload.dtype != torch.uint8 or payload.numel() != payload_bytes(n, chunk, k):
        raise ValueError(f"sparse decode: expected {payload_bytes(n, chunk, k)} bytes (uint8) for {n} values, "
                         f"got {payload.numel()} ({payload.dtype})")
    payload = payload.cpu()
    out, at = [], 0
    for s in range(0, n, chunk):
        length = min(chunk, n - s)
        keep = chunk_keep(length, chunk, k)
        ubytes, lbytes, cbytes = _areas(keep, chunk)
        b = lower_bits(keep, chunk)
        lo, hi = payload[at : at + 4].clone().view(torch.bfloat16).float().tolist()  # (a record may start at an odd byte)
        areas = payload[at + 4 : at + 4 + ubytes + lbytes + cbytes]
        ones = _unpack(areas[:ubytes], ubytes * 8, 1).nonzero().flatten()
        lower = _unpack(areas[ubytes : ubytes + lbytes], keep, b) if b else torch.zeros(keep, dtype=torch.int64)
        codes = _unpack(areas[ubytes + lbytes :], keep, 2)
        positions = (ones[:keep] - torch.arange(ones[:keep].numel())) << b | lower[: ones[:keep].numel()]
        if ones.numel() != keep or bool((positions >= length).any()) or bool((positions[1:] <= positions[:-1]).any()):
            raise ValueError(f"sparse decode: the positions of the chunk at value {s} are not ascending in "
                             f"[0, {length})")
        mag = torch.where(codes & 1 == 1, torch.tensor(hi), torch.tensor(lo))
        out.append((s, positions, torch.where(codes & 2 == 2, -mag, mag)))
        at += 4 + ubytes + lbytes + cbytes
    return out


def decode_reference(payload: torch.Tensor, n: int, chunk: int = CHUNK, k: int = 64) -> torch.Tensor:
    """The dense fp32 tensor of n values a payload stands for (zero where nothing was kept)."""
    out = torch.zeros(n, dtype=torch.float32)
    for s, positions, values in _records(payload, n, chunk, k):
        out[s + positions] = values
    return out


BACKENDS = ("cpu", "cuda", "triton", "torch")
"""cpu: the compiled kernels (prime._C, csrc/codec/sparse_cpu.cpp); cuda: the compiled CUDA kernels
(csrc/codec/sparse_cuda.cu, CUDA tensors, in CUDA builds); triton: kernels/sparse.py (CUDA tensors; CPU tensors
only under TRITON_INTERPRET=1, for tests); torch: the reference here. All give the same bytes and values.
Default: for a CUDA tensor cuda where the build has it, else triton where triton runs, else cpu (the tensor then
goes through the host); for a CPU tensor cpu, else torch."""


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that run on tensors of this device, the default first."""
    from prime.ops import triton_usable

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    usable = {"cuda": on_gpu and _extension.has_cuda_kernels(), "triton": triton_usable(device),
              "cpu": _extension.available()}
    # (triton on CPU tensors is the interpreter, for tests: after the CPU kernels)
    return [b for b in (("cuda", "triton", "cpu") if on_gpu else ("cpu", "triton")) if usable[b]] + ["torch"]


def _backend(backend: Optional[str], device: torch.device = torch.device("cpu")) -> str:
    if backend in (None, "cuda") and device.type == "cuda" and _extension.has_cuda_kernels():
        return "cuda"  # (the common case on GPUs, without asking triton)
    available = available_backends(device)
    if backend is None:
        return available[0]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend not in available:
        hint = {"cpu": _extension.build_hint(), "triton": "triton cannot run on this device",
                "cuda": "it takes a CUDA tensor and a CUDA build of prime._C"}.get(backend, "")
        raise RuntimeError(f"sparse backend {backend!r} is not available: {hint}".strip())
    return backend


_BAD_INPUT = ("sparse ", "numel must", "the accumulator")  # how the ops' own argument errors begin (checks.h)


def _op(op, *args):
    """A prime::sparse_* op; its errors about the input (bad settings, a non-finite value, a malformed payload) as
    ValueError; anything else (a device fault, out of memory) as it came."""
    try:
        return op(*args)
    except RuntimeError as e:
        line = str(e).split("\n")[0]
        if line.startswith(_BAD_INPUT):
            raise ValueError(line) from None
        raise


def _kernels():
    from prime.kernels import sparse as kernels  # imports triton: only when asked for

    return kernels


def encode(x: torch.Tensor, chunk: int = CHUNK, k: int = 64, backend: Optional[str] = None) -> torch.Tensor:
    """The sparse payload (uint8) of a flat fp32 tensor: on x's device with the cuda and triton backends, else on
    the CPU. Non-finite values are refused (ValueError)."""
    chosen = _backend(backend, x.device)
    if chosen == "torch":
        return encode_reference(x, chunk, k)
    if chosen == "triton":
        return _kernels().encode(x, chunk, k)
    _check(x.numel(), chunk, k)
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"sparse encode takes a flat float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    return _op(torch.ops.prime.sparse_encode, x.detach() if chosen == "cuda" else x.detach().cpu(), chunk, k)


def decode(payload: torch.Tensor, n: int, chunk: int = CHUNK, k: int = 64, backend: Optional[str] = None) -> torch.Tensor:
    """The dense fp32 tensor of n values a payload stands for (zero where nothing was kept), on the payload's
    device with the cuda and triton backends, else on the CPU. A payload of another size or with positions not
    ascending in a chunk raises ValueError."""
    chosen = _backend(backend, payload.device)
    if chosen == "torch":
        return decode_reference(payload, n, chunk, k)
    if chosen == "triton":
        return _kernels().decode(payload, n, chunk, k)
    _check(n, chunk, k)
    if payload.dtype != torch.uint8 or payload.numel() != payload_bytes(n, chunk, k):
        raise ValueError(f"sparse decode: expected {payload_bytes(n, chunk, k)} bytes (uint8) for {n} values, "
                         f"got {payload.numel()} ({payload.dtype})")
    return _op(torch.ops.prime.sparse_decode, payload.contiguous() if chosen == "cuda" else payload.cpu().contiguous(),
               n, chunk, k)


def decode_add_(acc: torch.Tensor, payload: torch.Tensor, chunk: int = CHUNK, k: int = 64,
                backend: Optional[str] = None) -> torch.Tensor:
    """acc += the values a payload stands for, at the kept positions only (a flat fp32 accumulator on the
    payload's device; the same fp32 add as decode() then add). A malformed payload raises ValueError and leaves
    acc as it was."""
    chosen = _backend(backend, acc.device)
    if chosen == "triton":
        return _kernels().decode_add_(acc, payload, chunk, k)
    if chosen in ("cpu", "cuda") and acc.device.type == chosen and acc.dtype == torch.float32 \
            and acc.is_contiguous():
        _check(acc.numel(), chunk, k)  # (the op checks the payload, ascending positions included, before it adds)
        _op(torch.ops.prime.sparse_decode_add_, acc, payload.to(acc.device).contiguous(), chunk, k)
        return acc
    records = _records(payload, acc.numel(), chunk, k)  # checked first: acc is untouched on error
    flat = acc.view(-1)
    for s, positions, values in records:
        at = (s + positions).to(acc.device)
        flat[at] = flat[at] + values.to(acc.device)
    return acc


def density(chunk: int = CHUNK, k: int = 64) -> float:
    """Share of the values kept: k / chunk."""
    return k / chunk


def bytes_per_value(chunk: int = CHUNK, k: int = 64) -> float:
    """Payload bytes per value of a long tensor."""
    _check(chunk, chunk, k)
    return _record_bytes(k, chunk) / chunk


def keep_for_density(d: float, chunk: int = CHUNK) -> int:
    """k for a density d (the share of values kept), at least 1."""
    if not 0 < d <= 1 or not math.isfinite(d):
        raise ValueError(f"sparse density must be in (0, 1], got {d}")
    return max(1, round(d * chunk))


# -- the collective (reference: every rank in one process) ---------------------------------------------------


def shards(n: int, world: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """[start, end) of the shard each rank owns: whole chunks, as even in count as they go (the last shard
    holds the short chunk); a rank may own nothing when there are fewer chunks than ranks."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    chunks = (n + chunk - 1) // chunk
    bounds = [min(n, (r * chunks // world) * chunk) for r in range(world + 1)]
    return [(bounds[r], bounds[r + 1]) for r in range(world)]


def sparse_pays(n: int, chunk: int = CHUNK, k: int = 64) -> bool:
    """Whether a collective of n values takes the sparse format rather than int8: when it holds at least one full
    chunk. Bytes never decide it: a record costs at most 4 bits a value and 4 bytes (everything kept: 2 bits of
    unary upper part and 2 of code), under int8's 8.125 at every chunk size and density. A tensor under a chunk
    would keep ceil(n k / C) values of it (one or two of a small one at DiLoCo's densities) for a few bytes of
    int8's: such tensors go dense. The rule reads only n and the settings, so every rank decides the same."""
    return n >= chunk


@dataclass
class OwnerAverage:
    average: torch.Tensor
    """What every rank applies: each shard's owner's payload of the shard's average, decoded (fp32, the same
    bits everywhere)."""
    residuals: list
    """Per rank, what the round left out of its contribution (fp32): its selection of its payloads of the other
    ranks' shards, and for the shard it owns what the selection of the average dropped, times the world size
    (its own values of that shard enter the sum unselected). Error feedback adds it to the rank's next
    contribution; the ring hands back the same bits (Ring.all_reduce(residual=))."""
    sent: list
    """Per rank, payload bytes it sends: its payload of every other rank's shard, then its shard's average to
    each."""


def _coded(x: torch.Tensor, chunk: int, k: int) -> tuple:
    payload = encode(x, chunk, k)
    return decode(payload, x.numel(), chunk, k), payload.numel()


def owner_average(contributions: list, chunk: int = CHUNK, k: int = 64, op: str = "avg",
                  k_average: Optional[int] = None, coding: Callable = _coded) -> OwnerAverage:
    """The topk all-reduce over len(contributions) ranks, computed in one process: the arithmetic the wire
    carries bit for bit (prime.comm.Ring.all_reduce(codec="topk"), the direct schedule; docs/wire-format-sparse.md,
    "The collective").

    1. Each rank encodes its values of every other rank's shard and sends the payload to the shard's owner.
    2. The owner adds to its own values (exact) the decoded payloads of ranks o+1, o+2, ... in that order (fp32),
       divides by the world size (op "avg"), encodes the result (k_average values a chunk; None: k) and keeps
       what that encoding dropped (times the world size for "avg") as its own residual.
    3. It sends that payload to every rank; each decodes it.
    Bytes per rank: (N - 1) / N of a payload of n values at k and as much at k_average, as int8's ring and direct
    schedules, so flat in N;
    each shard's sum is selected once, by its owner, whatever N.
    `coding(x, chunk, k)` -> (what arrives of x, its payload's bytes): the format's encode and decode; a study
    may put another coding of the same selection in its place (benchmarks/bench_lowrank.py: exact values)."""
    world = len(contributions)
    n = contributions[0].numel()
    ka = k if k_average is None else k_average
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    for c in contributions:
        if c.dtype != torch.float32 or c.dim() != 1 or c.numel() != n:
            raise ValueError("owner_average: every contribution must be a flat float32 tensor of the same size")
    device = contributions[0].device  # (encode and decode run there: the GPU kernels for CUDA tensors)
    if any(c.device != device for c in contributions):
        raise ValueError("owner_average: every contribution must be on the same device")
    average = torch.zeros(n, dtype=torch.float32, device=device)
    residuals = [torch.zeros(n, dtype=torch.float32, device=device) for _ in range(world)]
    sent = [0] * world
    for owner, (lo, hi) in enumerate(shards(n, world, chunk)):
        if hi == lo:
            continue
        acc = contributions[owner][lo:hi].clone()
        for j in range(1, world):
            r = (owner + j) % world
            part = contributions[r][lo:hi]
            got, sent_bytes = coding(part, chunk, k)
            sent[r] += sent_bytes
            residuals[r][lo:hi] += part - got
            acc += got
        divisor = float(world) if op == "avg" else 1.0
        if op == "avg":
            acc = acc / divisor
        got, sent_bytes = coding(acc, chunk, ka)
        sent[owner] += (world - 1) * sent_bytes
        residuals[owner][lo:hi] += (acc - got) * divisor
        average[lo:hi] = got
    return OwnerAverage(average, residuals, sent)
