"""The TCP ring as a torch.distributed backend named "prime".

    import prime                                    # registers the backend
    dist.init_process_group("prime", ...)           # or: dist.new_group(backend="prime")
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)     # runs on prime.comm.Ring

    group = dist.new_group(backend="prime", pg_options=PrimeOptions(codec="int8"))

What runs on the ring (docs/backend.md has the details and costs):

  all_reduce   SUM and AVG of float32 / bfloat16 / float16 tensors, in place: one Ring
               all_reduce, exact (codec "none") unless the group's codec is "int8".
  broadcast    any dtype, bit-exact: the root's bytes, 3 to a float32 value (integers
               below 2^24), summed with the other ranks' zeros by an exact all_reduce.
  all_gather   any dtype, bit-exact: each rank's bytes in its own slot of one such
               buffer; all_gather_into_tensor too.
  barrier      an exact all_reduce of one value.

Every other collective raises NotImplementedError naming it. Collectives return a
PrimeWork (a torch.distributed Work): wait(), is_completed(), exception(), result(),
get_future(); a background thread completes them in order, so futures complete without
anyone calling wait() (DDP and torchft's Manager rely on that).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, List, Optional, Union

import torch
import torch.distributed as dist

from prime.comm.errors import CommError
from prime.comm.ring import Ring

__all__ = ["BACKEND_NAME", "ENV_CODEC", "PrimeOptions", "PrimeProcessGroup", "PrimeWork", "register"]

BACKEND_NAME = "prime"
ENV_CODEC = "PRIME_BACKEND_CODEC"
_CODECS = ("none", "int8")
_REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)
# torch.distributed's default for non-NCCL groups; used when torch passes no timeout.
_DEFAULT_TIMEOUT = timedelta(minutes=30)
# Bytes per carrier value: 3 bytes make an integer below 2^24, which float32 holds
# exactly, and x + 0 + ... + 0 == x for it in any order (no NaN, Inf, -0 or denormal).
_CARRIER_BYTES = 3

assert sys.byteorder == "little", "the byte carrier assumes a little-endian host"


@dataclass(frozen=True)
class PrimeOptions:
    """Options of a "prime" process group: `pg_options=` of init_process_group / new_group.

    The fields after `block_size` are passed to prime.comm.Ring (docs/ring.md).
    """

    codec: str = field(default_factory=lambda: os.environ.get(ENV_CODEC, "none"))
    """all_reduce codec: "none" (exact, the default) or "int8" (0.254x the bytes;
    docs/ring.md gives its error). Default $PRIME_BACKEND_CODEC, else "none".
    broadcast, all_gather and barrier are always exact."""
    block_size: Optional[int] = None
    """values per scale of the int8 codec (None: the codec's default, 64)."""
    timeout: Optional[Union[float, timedelta]] = None
    """Ring timeout (forming the ring; any wait without progress). Default: the group's
    timeout as torch passes it (init_process_group / new_group `timeout=`)."""
    streams: Optional[int] = None
    secret: Optional[Union[bytes, str]] = field(default=None, repr=False)
    """Default $PRIME_RING_SECRET, else rank 0 draws one and shares it through the
    group's store (see docs/ring.md, Security)."""
    max_rate: Optional[float] = None
    bind_addr: Optional[str] = None
    advertise_addr: Optional[str] = None
    job_id: Optional[str] = None
    """Default "pg-<torch group name>": every group gets its own ring."""
    checksum: bool = True
    segment_bytes: Optional[int] = None

    def __post_init__(self):
        if self.codec not in _CODECS:
            where = f" (from ${ENV_CODEC})" if os.environ.get(ENV_CODEC) == self.codec else ""
            raise ValueError(f"PrimeOptions.codec must be one of {_CODECS}, got {self.codec!r}{where}")


class PrimeWork(dist._Work):
    """One collective of a PrimeProcessGroup, completed by the group's completion thread
    (or, for all_reduce and barrier, by the first wait())."""

    def __init__(self, op: str, rank: int, ring_work, finish: Callable[[], Any], in_place: bool):
        super().__init__()
        self._op = op
        self._rank = rank
        self._ring_work = ring_work  # the prime.comm.Work behind this collective
        self._finish_fn = finish  # writes the outputs (broadcast, all_gather) and returns them
        # all_reduce and barrier write nothing after the ring: wait() may complete them itself
        # instead of waking up behind the completion thread (one thread hop less per call).
        self._in_place = in_place
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._result: Any = None
        self._future: torch.futures.Future = torch.futures.Future()

    def _complete(self) -> None:
        """Waits for the ring, writes the outputs, completes the work and its future. Run
        by the completion thread (in order), and by wait() for in-place collectives."""
        # Outside the lock: both threads may wait here, and the ring wakes each directly
        # (a waiter behind the lock would wake only after the other thread got a CPU).
        try:
            self._ring_work.wait()
            ring_error = None
        except Exception as e:  # the collective's outcome: handed to the waiter, never swallowed
            ring_error = e
        # A KeyboardInterrupt or a stop (SystemExit) raised while this thread waited is not the collective's
        # outcome: it propagates, and the work stays running (the completion thread completes it later).
        with self._lock:
            if self._done.is_set():
                return
            result, error = None, ring_error
            if ring_error is None:
                try:
                    result = self._finish_fn()
                except Exception as e:
                    error = e
            self._result, self._error = result, error
            self._done.set()  # before the future: its callbacks (DDP, torchft) run in this thread
        if error is None:
            self._future.set_result(result)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Blocks until the collective finished; returns True, or raises its error
        (CommError; the tensors are then as they were). timeout (timedelta; torch's
        0 means none): raise CommError(kind="timeout") if still running by then."""
        limit = None if timeout is None else timeout.total_seconds()
        if self._in_place and not limit:
            self._complete()
        if not self._done.wait(limit if limit else None):
            raise CommError(
                f"rank {self._rank}: {self._op} did not complete within {limit:g} s (Work.wait timeout); "
                "it is still running",
                kind="timeout",
                rank=self._rank,
                origin=self._rank,
            )
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        """Same as wait() (the ring works on the host; there is no stream to order)."""
        self.wait()

    def is_completed(self) -> bool:
        """True once the collective finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True once the collective finished successfully."""
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        """The error of a failed collective, else None."""
        return self._error

    def result(self) -> Any:
        """The output tensors (blocks until done)."""
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output tensors (or the error)."""
        return self._future

    def stats(self):
        """The ring's WorkStats of the all-reduce behind this collective (bytes on the
        wire, time split; see docs/ring.md); complete once the work is."""
        return self._ring_work.stats()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self._done.is_set() else "running"
        return f"PrimeWork({self._op}, {state})"


def _complete_in_order(jobs: "queue.SimpleQueue") -> None:
    # The ring runs collectives one after another in submission order, so completing
    # them in that order never waits behind a later one.
    while True:
        work = jobs.get()
        if work is None:
            return
        work._complete()


# ---------------------------------------------------------------------------
# bytes through an exact all-reduce (broadcast, all_gather)


def carrier_len(nbytes: int) -> int:
    """float32 values that carry `nbytes` bytes."""
    return -(-nbytes // _CARRIER_BYTES)


def bytes_to_carrier(data: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """uint8 bytes -> float32 values, 3 bytes each as the integer b0 + 256 b1 + 65536 b2
    (exact in float32). Writes into `out` (carrier_len values) when given."""
    assert data.dtype == torch.uint8 and data.dim() == 1
    m = carrier_len(data.numel())
    words = torch.zeros(m, 4, dtype=torch.uint8)
    flat = torch.zeros(m * _CARRIER_BYTES, dtype=torch.uint8)
    flat[: data.numel()] = data
    words[:, :_CARRIER_BYTES] = flat.view(m, _CARRIER_BYTES)
    ints = words.view(torch.int32).view(m)  # little-endian: top byte 0, so 0 <= v < 2^24
    if out is None:
        return ints.to(torch.float32)
    out.copy_(ints)
    return out


def carrier_to_bytes(carrier: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The inverse of bytes_to_carrier: the first `nbytes` bytes."""
    m = carrier.numel()
    ints = carrier.to(torch.int32)
    return ints.view(torch.uint8).view(m, 4)[:, :_CARRIER_BYTES].reshape(-1)[:nbytes]


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as host bytes (a view when it is a contiguous CPU tensor)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _copy_bytes_into(dst: torch.Tensor, data: torch.Tensor) -> None:
    if dst.numel() == 0:
        return
    dtype = torch.uint8 if dst.dtype == torch.bool else dst.dtype
    values = data.view(dtype)
    if dst.dtype == torch.bool:
        values = values.view(torch.bool)
    with torch.no_grad():
        dst.copy_(values.view(dst.shape))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------
# the process group


def _reduce_op_name(opts: Any) -> str:
    """'sum' / 'avg' from AllreduceOptions, ReduceOp or RedOpType; NotImplementedError else."""
    op = getattr(opts, "reduceOp", opts)
    if op is None or op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    name = getattr(getattr(op, "op", op), "name", str(op))  # ReduceOp -> RedOpType -> "MAX"
    raise NotImplementedError(
        f"the prime backend's all_reduce supports ReduceOp.SUM and ReduceOp.AVG, not ReduceOp.{name}; "
        f"use a gloo group for {name}"
    )


# The torch.distributed call behind each ProcessGroup method whose name differs from it
# (torch versions route the same call to different methods: 2.11 sends all_to_all_single to alltoall_base).
_PUBLIC_NAMES = {
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather_coalesced": "all_gather_coalesced",
}


def _unsupported(op: str) -> Callable:
    name = f"{_PUBLIC_NAMES[op]} ({op})" if op in _PUBLIC_NAMES else op

    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"the prime backend does not implement {name}; it runs all_reduce (SUM, AVG), broadcast, all_gather "
            f"and barrier on the TCP ring. Use a gloo group (dist.new_group(backend='gloo')) for {name}."
        )

    method.__name__ = op
    method.__doc__ = "Not supported by the prime backend: raises NotImplementedError."
    return method


class PrimeProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on a prime.comm.Ring.

    Usually made by torch (init_process_group("prime") / new_group(backend="prime")),
    which passes the group's store, rank, size, timeout and name; constructing one
    directly (e.g. inside torchft's ProcessGroupWrapper) takes the same arguments.
    Forming it forms the ring (all ranks must construct it).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: Optional[timedelta] = None,
        options: Optional[PrimeOptions] = None,
        group_name: Optional[str] = None,
    ):
        super().__init__(rank, world_size)
        if options is None:
            options = PrimeOptions()
        if not isinstance(options, PrimeOptions):
            raise TypeError(
                f"pg_options of a prime group must be prime.comm.backend.PrimeOptions, got {type(options).__name__}"
            )
        if options.job_id is None and group_name:
            options = replace(options, job_id=f"pg-{group_name}")
        self.options = options
        self._rank = rank
        self._world_size = world_size
        ring_timeout = options.timeout if options.timeout is not None else (timeout or _DEFAULT_TIMEOUT)
        self.ring = Ring(
            store,
            rank,
            world_size,
            timeout=ring_timeout,
            streams=options.streams,
            secret=options.secret,
            max_rate=options.max_rate,
            bind_addr=options.bind_addr,
            advertise_addr=options.advertise_addr,
            job_id=options.job_id,
            checksum=options.checksum,
            segment_bytes=options.segment_bytes,
        )
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Holds the queue, not self, so that dropping the group stops the thread.
        self._completer = threading.Thread(
            target=_complete_in_order, args=(self._jobs,), name=f"prime-pg-r{rank}", daemon=True
        )
        self._completer.start()
        self._submit_lock = threading.Lock()  # ring order == completion order
        self._stop = weakref.finalize(self, _stop_completer, self._jobs, self._completer, self.ring)

    # -- plumbing ----------------------------------------------------------------

    def _submit(self, op: str, start: Callable[[], Any], finish: Callable[[], Any], in_place: bool = False):
        with self._submit_lock:
            ring_work = start()  # raises at once on bad arguments or a closed ring
            work = PrimeWork(op, self._rank, ring_work, finish, in_place)
            self._jobs.put(work)
        return work

    def _single(self, tensors: List[torch.Tensor], op: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"prime backend {op}: expected one tensor per call, got {len(tensors)}")
        return tensors[0]

    def _exact_all_reduce(self, carrier: torch.Tensor):
        return self.ring.all_reduce(carrier, op="sum", codec="none")

    # -- collectives on the ring -----------------------------------------------

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> PrimeWork:
        """dist.all_reduce: SUM or AVG of a float32/bfloat16/float16 tensor, in place."""
        tensor = self._single(tensors, "all_reduce")
        op = _reduce_op_name(opts)
        if tensor.dtype not in _REDUCIBLE:
            raise TypeError(
                f"the prime backend's all_reduce takes float32, bfloat16 or float16 tensors, got {tensor.dtype}; "
                "convert it, or use a gloo group for it"
            )
        codec, block = self.options.codec, self.options.block_size
        return self._submit(
            "all_reduce",
            lambda: self.ring.all_reduce(tensor, op=op, codec=codec, block_size=block),
            lambda: [tensor],
            in_place=True,
        )

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> PrimeWork:
        """dist.broadcast: the root's tensor, bit for bit, on every rank (any dtype)."""
        tensor = self._single(tensors, "broadcast")
        root = 0 if opts is None else int(opts.rootRank)
        if not 0 <= root < self._world_size:
            raise ValueError(f"prime backend broadcast: root rank {root} is not in [0, {self._world_size})")
        nbytes = _nbytes(tensor)
        if self._rank == root:
            carrier = bytes_to_carrier(_tensor_bytes(tensor))
        else:
            carrier = torch.zeros(carrier_len(nbytes), dtype=torch.float32)

        def finish():
            if self._rank != root:
                _copy_bytes_into(tensor, carrier_to_bytes(carrier, nbytes))
            return [tensor]

        return self._submit("broadcast", lambda: self._exact_all_reduce(carrier), finish)

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None):
        """dist.all_gather: output_tensors[0][r] = rank r's input, bit for bit (any dtype)."""
        tensor = self._single(input_tensors, "all_gather")
        if len(output_tensors) != 1:
            raise ValueError(f"prime backend all_gather: expected one output list, got {len(output_tensors)}")
        outputs = output_tensors[0]
        if len(outputs) != self._world_size:
            raise ValueError(
                f"prime backend all_gather: expected {self._world_size} output tensors, got {len(outputs)}"
            )
        for r, out in enumerate(outputs):
            if out.numel() != tensor.numel() or out.dtype != tensor.dtype:
                raise ValueError(
                    f"prime backend all_gather: output {r} is {out.dtype} x {out.numel()}, the input "
                    f"{tensor.dtype} x {tensor.numel()}; they must match"
                )
        carrier, nbytes, span = self._gather_carrier(tensor)

        def finish():
            for r, out in enumerate(outputs):
                _copy_bytes_into(out, carrier_to_bytes(carrier[r * span : (r + 1) * span], nbytes))
            return outputs

        return self._submit("all_gather", lambda: self._exact_all_reduce(carrier), finish)

    def _gather_carrier(self, tensor: torch.Tensor):
        nbytes = _nbytes(tensor)
        span = carrier_len(nbytes)
        carrier = torch.zeros(self._world_size * span, dtype=torch.float32)
        bytes_to_carrier(_tensor_bytes(tensor), out=carrier[self._rank * span : (self._rank + 1) * span])
        return carrier, nbytes, span

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrimeWork:
        """dist.all_gather_into_tensor: output = the ranks' inputs, concatenated along dim 0."""
        if output.numel() != self._world_size * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"prime backend all_gather_into_tensor: output is {output.dtype} x {output.numel()}, expected "
                f"{input.dtype} x {self._world_size} * {input.numel()}"
            )
        carrier, nbytes, span = self._gather_carrier(input)

        def finish():
            parts = [carrier_to_bytes(carrier[r * span : (r + 1) * span], nbytes) for r in range(self._world_size)]
            data = torch.cat(parts)
            _copy_bytes_into(output, data)
            return [output]

        return self._submit("all_gather_into_tensor", lambda: self._exact_all_reduce(carrier), finish)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrimeWork:
        """The older name of all_gather_single."""
        return self.all_gather_single(output, input, opts)

    def barrier(self, opts: Any = None) -> PrimeWork:
        """dist.barrier: an exact all_reduce of one value (so a dead peer fails it too)."""
        token = torch.zeros(1, dtype=torch.float32)
        return self._submit("barrier", lambda: self._exact_all_reduce(token), lambda: [], in_place=True)

    # -- identity and lifetime ---------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def shutdown(self) -> None:
        """Closes the ring (collectives still queued fail with CommError) and stops the
        completion thread. Idempotent; also run by dist.destroy_process_group()."""
        self._stop()

    def abort(self) -> None:
        """Same as shutdown()."""
        self._stop()

    def __repr__(self) -> str:
        return (
            f"PrimeProcessGroup(rank={self._rank}, world_size={self._world_size}, codec={self.options.codec!r}, "
            f"{self.ring!r})"
        )


def _stop_completer(jobs: "queue.SimpleQueue", thread: threading.Thread, ring: Ring) -> None:
    ring.close()  # fails what is still queued, so the thread gets past every wait
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=10)


# Collectives the ring does not run: each raises NotImplementedError naming itself (the
# base class would fail with an unrelated message about missing device backends).
for _op in (
    "allreduce_coalesced",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "scatter",
    "gather",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "send",
    "recv",
    "recv_anysource",
    "monitored_barrier",
):
    setattr(PrimeProcessGroup, _op, _unsupported(_op))
del _op


# ---------------------------------------------------------------------------
# registration


def _create(backend_opts, pg_options) -> PrimeProcessGroup:
    # torch's extended creator API: backend_opts carries the group's (prefixed) store,
    # rank, size, timeout and name; pg_options is what the user passed as pg_options.
    return PrimeProcessGroup(
        backend_opts.store,
        backend_opts.group_rank,
        backend_opts.group_size,
        timeout=backend_opts.timeout,
        options=pg_options,
        group_name=str(backend_opts.group_id),
    )


def register() -> None:
    """Registers the "prime" backend with torch.distributed (done by `import prime`). Idempotent."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


register()
