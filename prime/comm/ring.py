"""Ring: one rank's end of the int8 ring all-reduce over TCP (C++ core in csrc/ring/).

    store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0)
    with prime.comm.Ring(store, rank, world_size) as ring:
        work = ring.all_reduce(tensor, op="avg", codec="int8")   # in place, async
        ...                                                     # overlap other work
        work.wait()                                             # CommError on failure

See docs/ring.md for the guarantees, the failure behaviour and the wire format.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import warnings
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import List, Optional, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist

from prime import _extension, faults
from prime.comm import rendezvous
from prime.comm.errors import CommError, error_from_info
from prime.comm.links import LinkTable, choose_schedule
from prime.ops import CODECS, check_block_size, default_block_size, wire_bytes

__all__ = ["Ring", "Work", "WorkStats", "RING_TIMERS", "RingProtocol", "WorkProtocol", "DEFAULT_SEGMENT_BYTES", "DEFAULT_STREAMS", "segment_values",
           "device_buffer_bytes"]

logger = logging.getLogger("prime.comm")

# 1 MiB of fp32 values (262144 values, 256 KiB + scales as int8) per pipeline
# segment: small enough that quantizing one segment overlaps sending the previous,
# large enough that the 80 bytes of frame header and tag are noise (0.03%).
DEFAULT_SEGMENT_BYTES = 1 << 20
# 0: every link chooses its streams (and send buffers) from its round trip, as many as
# its bandwidth-delay product needs within the host's socket-buffer limits: one on
# loopback and short paths, more on long fat ones (csrc/ring/tcp/tuning.h, docs/ring.md).
DEFAULT_STREAMS = 0
_SEGMENT_ALIGN = 4096  # values: the largest codec block, so every block size divides a segment

ENV_STREAMS = "PRIME_RING_STREAMS"
# "auto" (default), "ring" or "direct": the schedule of every all_reduce (docs/ring.md, "Schedules").
ENV_SCHEDULE = "PRIME_RING_SCHEDULE"
SCHEDULES = ("auto", "ring", "direct")
ENV_MAX_RATE = "PRIME_RING_MAX_RATE"
ENV_JOB_ID = "PRIME_RING_JOB_ID"
ENV_SOCKET_BUFFER = "PRIME_RING_SOCKET_BUFFER"
ENV_ENCRYPT = "PRIME_RING_ENCRYPT"
# "0" turns off the int8 codec's own error measurement (WorkStats.quant_err_sq / quant_in_sq).
ENV_QUANT_ERROR = "PRIME_RING_QUANT_ERROR"
# "0" leaves the streams' congestion control alone: by default the ring restarts BBR on a
# stream before a collective that its minimum-RTT window would expire in (docs/ring.md, "Links").
ENV_RESTART_BBR = "PRIME_RING_RESTART_BBR"
# Where the ring reduces CUDA tensors: "auto" (default: on their GPU when prime._C was
# built with CUDA, else through pinned host memory on the CPU), "gpu" (refuse a build
# without CUDA), "cpu" (always through pinned host memory: the path before GPU reduction).
ENV_CUDA_REDUCE = "PRIME_RING_CUDA_REDUCE"
# How received payloads reach the GPU when the ring reduces there: "pinned" (default: the
# worker copies each into pinned memory, then one DMA) or "pageable" (cudaMemcpyAsync
# straight from the transport's buffer; the driver stages it). Read at every all_reduce.
ENV_CUDA_UPLOAD = "PRIME_RING_CUDA_UPLOAD"


def _ring_timers() -> tuple:
    """(name, description) of every timer of a ring's statistics, in order: prime._C's own list (csrc/ring/timers.h
    as compiled, so that WorkStats takes exactly the keys its stats() gives), or without the extension that header
    read from the source tree, so that stand-in rings (tests/fake_ring.py) still build a WorkStats."""
    if _extension.available():
        return tuple((str(name), str(description)) for name, description in _extension.require()._ring_timers())
    header = Path(__file__).resolve().parents[2] / "csrc" / "ring" / "timers.h"
    try:
        return tuple(re.findall(r'^\s*X\((\w+), "([^"]*)"\)', header.read_text(), flags=re.MULTILINE))
    except OSError as e:
        warnings.warn(f"prime: neither prime._C nor {header} ({e}): WorkStats has no timer fields", RuntimeWarning)
        return ()


RING_TIMERS = _ring_timers()
"""(name, description) of the timers of WorkStats, in seconds, in order. Defined once, in csrc/ring/timers.h: a timer
added there is a field here (default 0.0), a key of stats() and of the trainer's metrics (prime.sync.work_stats)."""


def _with_timers(after: str):
    """Class decorator for WorkStats, before @dataclass reads its fields: adds a float field (default 0.0, its
    description in the field's metadata) per RING_TIMERS entry, after the field `after`."""

    def add(cls):
        annotations = {}
        for name, kind in cls.__annotations__.items():
            annotations[name] = kind
            if name == after:
                for timer, description in RING_TIMERS:
                    annotations[timer] = "float"
                    setattr(cls, timer, field(default=0.0, metadata={"description": description}))
        assert after in annotations, f"WorkStats has no field {after}"
        cls.__annotations__ = annotations
        return cls

    return add


@dataclass(frozen=True)
@_with_timers(after="frames_received")
class WorkStats:
    """What one all-reduce cost, measured by this rank. After frames_received: one float field per timer of
    RING_TIMERS, in seconds (quantize_s, reduce_s, wait_s, ..., total_s, gpu_codec_s, ...; the field's
    metadata["description"] says what it counts); a ring that does not measure one reports 0.0."""

    seq: int
    numel: int
    bytes_sent: int  # on the wire to the right neighbour, frame headers included
    bytes_received: int  # on the wire from the left neighbour
    frames_sent: int
    frames_received: int
    schedule: str = "ring"  # "ring" or "direct" (two hops): what ran
    gpu: bool = False  # a CUDA tensor reduced on its GPU: the GPU timers count (docs/ring.md, "CUDA tensors")
    # The int8 error this rank made while encoding (prime.sync.QUANT_ERROR_FIELDS): over every
    # block it quantized, the float64 sums of ||dequantize(quantize(x)) - x||^2 and of ||x||^2.
    # None when nothing was measured: codec "none", or a ring of one rank (it quantizes nothing).
    quant_err_sq: Optional[float] = None
    quant_in_sq: Optional[float] = None


@runtime_checkable
class WorkProtocol(Protocol):
    """What callers of a ring rely on from the handle all_reduce returns (Work implements it)."""

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Blocks until done: True, or raises CommError (NonFiniteError) and the tensor is unchanged."""
        ...

    def is_completed(self) -> bool: ...

    def stats(self) -> WorkStats:
        """Bytes on the wire and where the time went."""
        ...


@runtime_checkable
class RingProtocol(Protocol):
    """The ring as the rest of prime sees it: Ring implements it; tests and benchmarks may pass
    stand-ins (tests/fake_ring.py). Every rank calls all_reduce in the same order with the same
    size, dtype, op, codec and block size."""

    rank: int
    world_size: int

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "avg", codec: str = "int8", block_size: Optional[int] = None
    ) -> WorkProtocol:
        """Sums or averages `tensor` in place across the ring, asynchronously."""
        ...

    def close(self) -> None: ...


class Work:
    """Handle of one in-flight all-reduce (returned by Ring.all_reduce)."""

    def __init__(self, handle, ring: "Ring", tensor: torch.Tensor, *keep_alive: Optional[torch.Tensor]):
        self._handle = handle
        self._ring = ring  # keeps the ring open while this work may run
        self._tensor = tensor
        self._keep_alive = keep_alive  # tensors the collective writes besides `tensor`

    @property
    def seq(self) -> int:
        """The collective's sequence number on this ring (0, 1, 2, ...)."""
        return self._handle.seq

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._handle.is_completed()

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Blocks until the all-reduce finished and returns True; the tensor then holds
        the result. Raises CommError (NonFiniteError for NaN/Inf) if it failed, in
        which case the tensor is unchanged. With `timeout` (seconds or timedelta),
        raises CommError(kind="timeout") if the work is still running by then; the
        work itself goes on (its own deadlines are the ring's timeout)."""
        limit = None if timeout is None else _seconds(timeout)
        start = time.monotonic()
        # Short waits (GIL released inside) so Ctrl-C is seen promptly.
        while not self._handle.wait(0.2 if limit is None else max(0.0, min(0.2, limit - (time.monotonic() - start)))):
            if limit is not None and time.monotonic() - start >= limit:
                raise CommError(
                    f"rank {self._ring.rank}: all_reduce #{self.seq} did not complete within {limit:g} s "
                    "(Work.wait timeout); it is still running",
                    kind="timeout",
                    rank=self._ring.rank,
                    origin=self._ring.rank,
                    seq=self.seq,
                )
        info = self._handle.error()
        if info is not None:
            raise error_from_info(info)
        return True

    def exception(self) -> Optional[CommError]:
        """The failure of a completed work, or None."""
        info = self._handle.error()
        return None if info is None else error_from_info(info)

    def stats(self) -> WorkStats:
        """Bytes on the wire and where the time went (complete once the work is)."""
        return WorkStats(**self._handle.stats())


def _env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off; unset or anything else: default."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return default


def _env_number(name: str, default: Union[int, float], kind: type = int) -> Union[int, float]:
    """A numeric environment variable (int or float), finite and >= 0; unset or empty: default. A bad value is a
    ValueError naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < 0:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{name} must be {what} >= 0, got {raw!r}")
    return value


def _corrupt_offset() -> int:
    """The byte offset of fault point ring.send in this process (-1: none armed)."""
    f = faults.standing("ring.send", "corrupt")
    return -1 if f is None or f.at is None else int(f.at)


def _seconds(t: Union[float, int, timedelta]) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


@dataclass(frozen=True)
class _RingArguments:
    """Ring()'s settings, checked, with their defaults and environment variables resolved."""

    timeout_s: float
    streams: int
    schedule: str
    order: Union[str, List[int]]
    max_rate: float
    segment_elems: int
    encrypt: bool
    quant_error: bool


def _ring_arguments(rank, world_size, timeout, streams, schedule, order, max_rate, segment_bytes, encrypt,
                    quant_error) -> _RingArguments:
    """Checks Ring()'s arguments (ValueError naming the first bad one) and resolves what is unset from the
    environment or the defaults."""
    if not isinstance(world_size, int) or not 1 <= world_size <= 64:
        raise ValueError(f"world_size must be an int from 1 to 64, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    timeout_s = _seconds(timeout)
    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    streams = _env_number(ENV_STREAMS, DEFAULT_STREAMS) if streams is None else streams
    if not isinstance(streams, int) or not 0 <= streams <= 64:
        raise ValueError(f"streams must be an int from 0 (chosen per link) to 64, got {streams!r}")
    schedule = (os.environ.get(ENV_SCHEDULE) or "auto") if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    order = "auto" if order is None else order
    if isinstance(order, str):
        if order not in ("auto", "rank"):
            raise ValueError(f"order must be 'auto', 'rank' or a permutation of the ranks, got {order!r}")
    elif sorted(order) != list(range(world_size)):
        raise ValueError(f"order must be a permutation of range({world_size}), got {order!r}")
    if max_rate is None:
        max_rate = _env_number(ENV_MAX_RATE, 0.0, float)
    if not isinstance(max_rate, (int, float)) or not math.isfinite(max_rate) or max_rate < 0:
        raise ValueError(f"max_rate must be >= 0 bytes/s (0: unlimited), got {max_rate}")
    segment_bytes = DEFAULT_SEGMENT_BYTES if segment_bytes is None else segment_bytes
    if not isinstance(segment_bytes, int) or not 4 * _SEGMENT_ALIGN <= segment_bytes <= 1 << 30:
        raise ValueError(f"segment_bytes must be an int from {4 * _SEGMENT_ALIGN} to 2^30, got {segment_bytes!r}")
    if encrypt is None:
        encrypt = _env_flag(ENV_ENCRYPT, False)
    if quant_error is None:
        quant_error = _env_flag(ENV_QUANT_ERROR, False)
    return _RingArguments(timeout_s, streams, schedule, order, float(max_rate), segment_values(segment_bytes),
                          bool(encrypt), bool(quant_error))


def segment_values(segment_bytes: Optional[int] = None) -> int:
    """Values of one pipeline segment of a ring of `segment_bytes` (None: DEFAULT_SEGMENT_BYTES): its fp32 values
    rounded down to whole segments of the largest codec block (4096 values), at least one."""
    segment_bytes = DEFAULT_SEGMENT_BYTES if segment_bytes is None else segment_bytes
    return max(_SEGMENT_ALIGN, segment_bytes // 4 // _SEGMENT_ALIGN * _SEGMENT_ALIGN)


def _cuda_reduce_mode() -> str:
    mode = os.environ.get(ENV_CUDA_REDUCE, "auto").strip().lower() or "auto"
    if mode not in ("auto", "gpu", "cpu"):
        raise ValueError(f"{ENV_CUDA_REDUCE} must be 'auto', 'gpu' or 'cpu', got {mode!r}")
    return mode


_RINGS: "weakref.WeakSet[Ring]" = weakref.WeakSet()
"""The rings of this process not yet garbage (device_buffer_bytes walks their GPU contexts)."""


def device_buffer_bytes(device: Optional[int] = None) -> int:
    """Bytes of GPU memory the open rings of this process hold for their collectives on CUDA tensors (on GPU
    `device`, an index; None: every GPU): staging the ring allocates itself, with cudaMalloc, which
    torch.cuda's memory statistics do not count. Grow-only while a ring is open, freed when it closes."""
    total = 0
    for ring in list(_RINGS):
        for index, context in list(ring._cuda_contexts.items()):
            if device is None or index == device:
                total += int(context.device_bytes)
    return total


def reduces_on_gpu() -> bool:
    """True when rings reduce CUDA tensors on their GPU (a CUDA build of prime._C, and
    $PRIME_RING_CUDA_REDUCE not "cpu"), as Ring.reduces_on_device says of one tensor."""
    return _cuda_reduce_mode() != "cpu" and bool(_extension.require()._ring_reduces_on_gpu)


class Ring:
    """One rank's end of a ring all-reduce over raw TCP.

    Args:
      store: any torch.distributed.Store all ranks share (TCPStore, PrefixStore, ...),
        used only to exchange addresses (and a secret if none is given).
      rank, world_size: this rank and the number of ranks (1 to 64).
      timeout: how long any wait may last without progress (seconds or timedelta),
        also the limit for forming the ring. A dead, stalled or hostile peer makes every
        survivor's Work.wait() raise CommError within about this long.
      streams: TCP streams per link (default $PRIME_RING_STREAMS, else 0: each link chooses
        its streams and send buffers from its round trip and max_rate, enough to fill its
        bandwidth-delay product within the host's socket-buffer limits, and grows its
        buffers as collectives measure it; see links()).
      secret: shared secret (bytes/str) authenticating every stream; default
        $PRIME_RING_SECRET, else (only when the store and every address are on loopback)
        rank 0 draws one and shares it through the store; a ring across hosts without a
        secret raises ValueError. The ring's store records are signed with it.
      max_rate: cap on this rank's sending rate in bytes/s (default $PRIME_RING_MAX_RATE
        or unlimited): emulates a slow uplink.
      bind_addr, advertise_addr: where to listen and what address to publish
        (see rendezvous.resolve_addresses; default: only the address others reach us on).
      job_id: names this ring in the store; a new ring on the same store (say after a
        failure) needs a new one. Default $PRIME_RING_JOB_ID or "prime".
      checksum: ignored, kept for old callers: every frame, header and payload, carries an
        AES-256-GCM tag under the stream's session key, which subsumes the CRC32C it switched.
      encrypt: also encrypt payloads (AES-256-GCM; default $PRIME_RING_ENCRYPT, else off:
        authenticated only). Every rank must pass the same value.
      segment_bytes: pipeline segment size in fp32 bytes (default 1 MiB).
      schedule: "auto" (default, or $PRIME_RING_SCHEDULE), "ring" or "direct": the
        schedule of every all_reduce (all_reduce may override it per call). "direct" sends
        each rank's values straight to the owner of their chunk, encoded once, and the
        owner's result straight back: two one-way delays instead of 2(N-1), and one
        quantization per contribution. "auto" picks, per collective, the one with the
        smaller predicted time from the agreed link table and the size (links.choose_schedule;
        the ring where delays hide behind long chunks or it avoids a slow link), and the
        direct one when every rank is on this host.
      order: the ring schedule's order: "auto" (default: planned from the links, its
        slowest link as fast as possible, then the least delay; links.plan_order), "rank"
        (0, 1, ..., N-1) or a permutation of the ranks. Rank 0's setting decides.
      link_history: what an earlier ring measured (Ring.link_history() of it), so that this
        one plans with link rates from the start: {peer host: {"rate": bytes/s, "rtt_s": s}}.
      quant_error: the int8 codec measures the error of every quantize it makes and reports
        it in WorkStats (quant_err_sq, quant_in_sq; DiLoCo's compression_error); the topk codec
        what each owner's selection of its shard's average dropped. Default
        $PRIME_RING_QUANT_ERROR, else off (DiLoCo's rings turn it on when
        diloco.compression_error is set). One float64 pass over each segment just quantized:
        nearly free on the GPU (inside the fused kernel), about 2x the quantize time on the
        CPU (benchmarks/RESULTS.md). Off: the fields are None. Local to this rank (nothing
        on the wire changes).

    Fault point ring.send (prime/faults.py, tests only): `ring.send@N` armed in this
    process flips one bit of the payload byte at offset N of everything the ring sends
    (after the frame was sealed), so that the receiver must reject it.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: Union[float, timedelta] = timedelta(seconds=60),
        streams: Optional[int] = None,
        secret: Optional[Union[bytes, str]] = None,
        max_rate: Optional[float] = None,
        bind_addr: Optional[str] = None,
        advertise_addr: Optional[str] = None,
        job_id: Optional[str] = None,
        checksum: bool = True,
        segment_bytes: Optional[int] = None,
        encrypt: Optional[bool] = None,
        quant_error: Optional[bool] = None,
        schedule: Optional[str] = None,
        order: Union[str, List[int], None] = None,
        link_history: Optional[dict] = None,
    ):
        C = _extension.require()
        a = _ring_arguments(rank, world_size, timeout, streams, schedule, order, max_rate, segment_bytes, encrypt,
                            quant_error)
        self.quant_error = a.quant_error
        self._segment_elems = a.segment_elems

        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id or os.environ.get(ENV_JOB_ID, "prime")
        self.timeout = a.timeout_s
        self.streams = a.streams
        self.schedule = a.schedule
        self.address: Optional[str] = None
        self.order: List[int] = list(range(world_size))  # the ring schedule's order (agreed while forming)
        self.link_table: Optional[LinkTable] = None  # what the ranks agreed about their links
        self._peer_hosts: List[str] = []
        self._host_local = False  # every rank's address is on loopback
        self._history = dict(link_history or {})
        # Connections dropped during the rendezvous (bad secret, garbage, ...), also logged.
        self.rejected_connections: list = []
        self._ring = None
        self._cuda_contexts: dict = {}  # device index -> prime._C._CudaRingContext
        _RINGS.add(self)
        common = dict(
            rank=rank,
            world_size=world_size,
            job_id=self.job_id,
            timeout_s=a.timeout_s,
            streams=a.streams,
            max_rate=a.max_rate,
            encrypt=a.encrypt,
            segment_elems=a.segment_elems,
            socket_buffer_bytes=_env_number(ENV_SOCKET_BUFFER, 0),
            corrupt_after_bytes=_corrupt_offset(),
            measure_quant_error=self.quant_error,
            restart_bbr=_env_flag(ENV_RESTART_BBR, True),
        )
        if world_size == 1:
            self._ring = C._Ring(secret=b"", rendezvous_timeout_s=a.timeout_s, bind_addr="", **common)
            self._ring.connect([("", 0)])
            return
        self._form(C, store, common, secret, bind_addr, advertise_addr, a.order, a.max_rate)

    def _form(self, C, store: dist.Store, common: dict, secret, bind_addr: Optional[str],
              advertise_addr: Optional[str], order, max_rate: float) -> None:
        """The rendezvous of a ring of several ranks, within the timeout: claims the job's name, agrees on the
        job's secret, listens, publishes this rank's address (authenticated) and finds the others', connects,
        measures the links and agrees on the order, then a barrier. A failure is reported to the others through
        the store and raised, the ring closed."""
        rank, world_size, timeout_s = self.rank, self.world_size, self.timeout
        deadline = time.monotonic() + timeout_s
        timeout_ms = int(timeout_s * 1000)
        ns = rendezvous.namespace(self.job_id)
        rendezvous.claim_job(store, ns, rank, world_size, self.job_id)
        key = b""
        try:
            bind, advertise = rendezvous.resolve_addresses(store, bind_addr, advertise_addr)
            key = rendezvous.shared_secret(store, ns, rank, secret, deadline, timeout_ms, advertise)
            left_s = max(0.001, deadline - time.monotonic())
            self._ring = C._Ring(secret=key, rendezvous_timeout_s=left_s, bind_addr=bind, **common)
            self.address = rendezvous.format_address(advertise, self._ring.port)
            addresses = rendezvous.publish_and_find_all(
                store, ns, rank, world_size, self.address, deadline, timeout_ms, secret=key
            )
            self._peer_hosts = [host for host, _ in addresses]
            self._host_local = all(rendezvous.is_loopback(h) for h in self._peer_hosts)
            try:
                self._ring.connect(addresses)
            finally:
                self.rejected_connections = list(self._ring.rejected_connections())
                for line in self.rejected_connections:
                    logger.warning("prime ring rank %d: %s", rank, line)
            rtt_row, rate_row = self._measured_row(max_rate)
            self.order, self.link_table = rendezvous.agree_links(
                store, ns, rank, world_size, rtt_row, rate_row, order, deadline, timeout_ms, secret=key
            )
            self._ring.set_order(self.order)
            self._log_links()
            rendezvous.barrier(store, ns, rank, world_size, deadline, timeout_ms, secret=key)
        except BaseException as e:
            rendezvous.report_failure(store, ns, rank, str(e), secret=key)
            self.close()
            raise

    # -- collectives ---------------------------------------------------------

    @property
    def reports_quant_error(self) -> bool:
        """True when an int8 all_reduce's stats() carry quant_err_sq and quant_in_sq (prime.sync.QUANT_ERROR_FIELDS,
        measured by the codec as it encodes, on the CPU or the GPU): DiLoCo then skips its own round-trip pass. A ring
        of one rank quantizes nothing and reports nothing; quant_error=False turns the measurement off."""
        return self.world_size > 1 and self.quant_error

    def all_reduce(self, tensor: torch.Tensor, op: str = "avg", codec: str = "int8", block_size: Optional[int] = None,
                   schedule: Optional[str] = None, keep: Optional[int] = None,
                   residual: Optional[torch.Tensor] = None, keep_average: Optional[int] = None,
                   dropped: Optional[torch.Tensor] = None) -> Work:
        """Sums (op="sum") or averages (op="avg") `tensor` across the ring, in place and
        asynchronously; returns a Work. codec="int8" sends int8 values plus one 1-byte
        scale per `block_size` values (default 64: 0.254x the bytes of fp32); codec="fp4"
        4-bit E2M1 codes plus one fp32 scale per block (default 256: 0.129x); codec="none"
        sends exact values (docs/wire-format.md). block_size None: the codec's default. schedule: "auto", "ring" or "direct" (default: the
        ring's setting). Every rank must call all_reduce in the same order with tensors of
        the same size and dtype and the same op, codec, block_size and schedule. The tensor
        holds the result once wait() returned; on failure it is left unchanged.

        codec="topk" (docs/wire-format-sparse.md; float32 only, always the direct schedule):
        per chunk of `block_size` values (default 4096) the `keep` largest magnitudes (default
        64) at 2 bits each with their positions, 0.005x the bytes of fp32 at the defaults.
        Each rank's contribution is selected once by its sender and each chunk's sum once by
        its owner, who adds its own values of its chunk unselected and keeps `keep_average`
        values of every chunk of the sum (default: keep); with `residual` (a contiguous
        float32 tensor of the same size, on the tensor's GPU where the ring reduces it there,
        see reduces_on_device, else on the CPU) the ring adds to it all that this rank's
        contribution lost, only once the collective succeeded: what its selections of its
        values of the other chunks left out, and what its selection of its chunk's average
        left out (in the units of the contributions). Error feedback sends it again
        (prime.sparse.owner_average computes the same bits in one process). `dropped` (the same
        kind of tensor, instead of `residual`) is filled with those values instead of added to:
        the ring may write into it while the collective runs, so that on the GPU it keeps no
        copy of its own (n fp32 values less), and after a failure its contents are undefined."""
        if self._ring is None:
            raise CommError("all_reduce on a closed ring", kind="closed", rank=self.rank)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"all_reduce expects a float32, bfloat16 or float16 tensor, got {tensor.dtype}; convert it first"
            )
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        schedule = self.schedule if schedule is None else schedule
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if codec == "topk":
            return self._all_reduce_topk(tensor, op, block_size, schedule, keep, residual, keep_average, dropped)
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS + ('topk',)}, got {codec!r}")
        if keep is not None or residual is not None or keep_average is not None or dropped is not None:
            raise ValueError(f"keep, keep_average, residual and dropped are settings of codec 'topk', not of {codec!r}")
        if block_size is None:
            block_size = default_block_size(codec)
        check_block_size(block_size)
        chosen = self._choose(schedule, tensor.numel(), codec, block_size, tensor.element_size())
        context = self._cuda_context(tensor)
        return Work(self._ring.all_reduce(tensor, op, codec, block_size, context, chosen), self, tensor)

    def _all_reduce_topk(self, tensor, op, chunk, schedule, keep, residual, keep_average, dropped) -> Work:
        from prime import sparse

        chunk = sparse.CHUNK if chunk is None else chunk
        keep = 64 if keep is None else keep
        keep_average = keep if keep_average is None else keep_average
        sparse.check_settings(chunk, keep)
        try:
            sparse.check_settings(chunk, keep_average)
        except ValueError as e:
            raise ValueError(f"keep_average: {e}") from None
        if tensor.dtype != torch.float32:
            raise TypeError(f"codec 'topk' takes float32 tensors, got {tensor.dtype}")
        if schedule == "ring":
            raise ValueError("codec 'topk' runs only in the direct schedule (a ring would select every partial sum "
                             "again); use schedule='direct' or 'auto'")
        context = self._cuda_context(tensor)
        if residual is not None and dropped is not None:
            raise ValueError("residual and dropped are two ways to get what the selections drop: pass one")
        scratch = dropped is not None
        residual = dropped if scratch else residual
        name = "dropped" if scratch else "residual"
        if residual is not None:
            home = tensor.device if context is not None else torch.device("cpu")
            if (not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or residual.device != home
                    or not residual.is_contiguous() or residual.numel() != tensor.numel()):
                raise ValueError(f"{name} must be a contiguous float32 tensor of {tensor.numel()} values on {home}")
            if scratch and context is None:
                residual.zero_()  # (the CPU codec adds to it once the collective succeeded)
        handle = self._ring.all_reduce(tensor, op, "topk", chunk, context, "direct", keep, residual, keep_average,
                                       scratch and context is not None)
        return Work(handle, self, tensor, residual)

    def _choose(self, schedule: str, n: int, codec: str, block_size: int, esize: int) -> str:
        """The schedule a collective runs: the setting, or for "auto" the one links.choose_schedule
        predicts faster from the agreed link table (the same choice on every rank)."""
        if schedule != "auto":
            return schedule
        if self.world_size <= 2 or self.link_table is None or self._host_local:
            # Two ranks: the same two hops either way. Every rank on this host: no link is the
            # bottleneck (the CPUs are), and the direct schedule was not slower there
            # (benchmarks/RESULTS.md) while it quantizes each contribution once.
            return "direct"
        per_value = wire_bytes(n, block_size, codec) / max(n, 1) if n else 4.0
        return choose_schedule(self.link_table, self.order, per_value * n, per_value * self._segment_elems)

    # -- links ----------------------------------------------------------------

    def _measured_row(self, max_rate: float) -> tuple:
        """This rank's row of the link table: the round trip to every peer measured while
        the links formed, and a rate per peer from link_history (by the peer's host), else
        max_rate when set, else 0 (unknown)."""
        rtt = [0.0] * self.world_size
        rate = [0.0] * self.world_size
        for link in self._ring.links():
            p = link["peer"]
            rtt[p] = link["handshake_rtt_s"]
            seen = self._history.get(self._peer_hosts[p], {})
            rate[p] = float(seen.get("rate") or max_rate or 0.0)
        return rtt, rate

    def links(self) -> List[dict]:
        """What this rank knows of its link to each peer: streams, send buffer (as granted),
        the round trip measured while forming and by TCP since, the rate the last collective
        that carried enough on it measured, the share of time it waited on buffers, and the
        bytes in flight it needs. Empty for a ring of one rank or a closed ring."""
        if self._ring is None:
            return []
        out = self._ring.links()
        for link in out:
            link["host"] = self._peer_hosts[link["peer"]]
        return out

    def link_history(self) -> dict:
        """What this ring knows of its peers' links, by peer host, for the next ring's
        link_history: {host: {"rate": bytes/s, "rtt_s": seconds}} (measured values win over
        the history this ring was given). Also after close()."""
        for link in self.links():
            seen = self._history.setdefault(link["host"], {})
            if link["rate"] > 0:
                seen["rate"] = link["rate"]
            rtt = link["rtt_s"] if link["rtt_s"] > 0 else link["handshake_rtt_s"]
            if rtt > 0:
                seen["rtt_s"] = rtt
        return {host: dict(v) for host, v in self._history.items()}

    def _log_links(self) -> None:
        for link in self.links():
            logger.info(
                "prime ring rank %d: link to rank %d (%s): round trip %.2f ms, %d stream(s), send buffer %s",
                self.rank, link["peer"], link["host"], 1e3 * link["handshake_rtt_s"], link["streams"],
                f"{link['sndbuf'] / (1 << 20):.1f} MiB" if link["sndbuf"] else "autotuned",
            )
        if self.rank == 0 and self.world_size > 2:
            logger.info("prime ring: order %s (schedule %s)", self.order, self.schedule)

    def reduces_on_device(self, tensor: torch.Tensor) -> bool:
        """True when an all-reduce of `tensor` runs its codec on the tensor's GPU (a CUDA build, and
        $PRIME_RING_CUDA_REDUCE not "cpu"); False: a CUDA tensor is staged through pinned host memory."""
        return self._ring is not None and self._cuda_context(tensor) is not None

    def _cuda_context(self, tensor: torch.Tensor):
        """The ring's stream and staging on tensor's GPU when the ring reduces it there
        ($PRIME_RING_CUDA_REDUCE), else None: staged through pinned host memory."""
        if not tensor.is_cuda or self.world_size == 1:
            return None  # (one rank: nothing to reduce, only a finiteness check on the host)
        mode = _cuda_reduce_mode()
        upload = os.environ.get(ENV_CUDA_UPLOAD, "pinned").strip().lower() or "pinned"
        if upload not in ("pinned", "pageable"):
            raise ValueError(f"{ENV_CUDA_UPLOAD} must be 'pinned' or 'pageable', got {upload!r}")
        C = _extension.require()
        if mode == "cpu" or (mode == "auto" and not C._ring_reduces_on_gpu):
            return None
        if not C._ring_reduces_on_gpu:
            raise RuntimeError(
                f"{ENV_CUDA_REDUCE}=gpu but prime._C was built without the CUDA kernels "
                "(build/prime-cuda.txt says why); rebuild with a CUDA toolkit or unset it"
            )
        device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        context = self._cuda_contexts.get(device)
        if context is None:
            context = self._cuda_contexts[device] = C._CudaRingContext(device)
        context.pageable_upload = upload == "pageable"  # (copied into the job at submit)
        return context

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Stops the ring: joins its threads and closes its sockets. Collectives still
        queued fail with CommError(kind="closed"). Idempotent."""
        if self._ring is not None and self.world_size > 1:
            self.link_history()  # keep what the links showed, for link_history() after close
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
        self._cuda_contexts = {}  # (queued collectives hold their own reference)

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    def __repr__(self) -> str:
        state = "closed" if self._ring is None else "open"
        return f"Ring(rank={self.rank}, world_size={self.world_size}, job_id={self.job_id!r}, {state})"
