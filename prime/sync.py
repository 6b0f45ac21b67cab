"""Sync: how the outer step averages a pseudo-gradient across nodes.

DiLoCo (prime/diloco.py) computes the pseudo-gradient and applies the outer
update; everything about who takes part, retries and failures lives behind
this interface, so the outer step has one form:

    sync.bind(states, settings)             # once, by DiLoCo (prime.outer.OuterStates: every fragment)
    ok = sync.agree(finite)                 # every process of this node agrees
    r = sync.average(g, outer_step=k, inner_step=i, recompute=state.pseudo_gradient)
    sync.applying(r)                        # the outer state is about to change
    state.update(g); state.load_into_model()
    sync.committed(r)                       # ... and holds the outer step's result

A sync declares what it can do (SyncExtras: class attributes with defaults), so
the outer step never asks which class it holds:

    pipelined   average_pieces() exists: a large synchronous step goes in pieces
    background  average() may run on a thread of its own once use_from_background()
                was called (overlap)
    must_join   this node must join the running job before its first average

A node that fell out of the job (an elastic eviction seen by an average in the
background) is reported by LeftBehind; the outer step then calls rejoin() on its
main thread, which brings the node back with the job's state (SyncResult.joined).

Two implementations: RingSync (here; a fixed set of nodes on prime.comm.Ring,
rebuilt from a ring factory after a failure, every process of the node
agreeing) and prime.elastic.ElasticSync (nodes come and go; the average is
over the nodes that contributed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

from prime.codecs import wire_codec
from prime.comm.ring import RING_TIMERS

__all__ = ["Sync", "SyncExtras", "complete", "SyncResult", "RingSync", "OuterSyncError", "ReplicaMismatchError", "LeftBehind", "work_stats",
           "is_comm_error", "node_local_group", "all_local", "QUANT_ERROR_FIELDS", "start_all_reduce"]


class OuterSyncError(RuntimeError):
    """The pseudo-gradient all-reduce failed on every attempt; the outer weights were not changed."""


class ReplicaMismatchError(RuntimeError):
    """Nodes hold different outer weights or settings: they did not start from the same seed or checkpoint."""


FINGERPRINT_PARTS = ("outer weights", "settings (inner_steps, outer lr/momentum, codec, shapes, outer step)",
                     "shard sizes")
"""What each part of a replica check's fingerprint (weights hash, settings hash, element count) is, as
ReplicaMismatchError names it (the fixed rings' check here, the elastic one in prime.elastic.agreement)."""

SAME_START = ("start from the same seed (or resume from the same checkpoint step) with the same model, [diloco] "
              "settings and processes per node")
"""What ReplicaMismatchError asks of the nodes."""


def checks_differ(off: list, on: list) -> str:
    """The ReplicaMismatchError line when some nodes check replicas and others do not (fixed and elastic)."""
    return f"diloco.check_replicas is false on node(s) {sorted(off)} and true on node(s) {sorted(on)}: set it alike " \
           "on every node"


class LeftBehind(Exception):
    """This node is not part of the outer step being decided (an elastic eviction seen by an average running in
    the background): the outer step calls Sync.rejoin() on its main thread, which brings the job's state."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class SyncResult:
    """What one average across nodes did."""

    members: list
    """Nodes that took part (ring order)."""
    contributors: int
    """Nodes whose pseudo-gradient is in the average (a joining node takes part without contributing)."""
    attempts: int = 1
    """All-reduce attempts (1 when the first worked)."""
    allreduce_s: float = 0.0
    """Wall time of the all-reduce, all attempts."""
    stats: dict = field(default_factory=dict)
    """work_stats() of the all-reduce that worked (empty: nothing reported)."""
    contributed: bool = True
    """False when this process's pseudo-gradient is not in the average (it was joining)."""
    outer_step: Optional[int] = None
    """The outer step this average completes (None: the one DiLoCo asked for)."""
    inner_step: Optional[int] = None
    """The job's inner step at that outer step (None: this process's own count)."""
    details: Any = None
    """What the sync reports beyond this (ElasticSync: an ElasticReport)."""
    joined: bool = False
    """True when this node (re)joined the job at this outer step: the sync downloaded the job's state into
    every fragment's outer state, applied this outer step's average and loaded the model (OuterStates.admit);
    the outer step only takes the job's counters (inner_step, outer_step)."""
    counts: Optional[list] = None
    """An average asked for with `trained` (token weights): the inner steps each contributor trained, in member
    order, the same list on every node (None: not asked)."""
    weights: Any = None
    """The weights the outer step made of `counts` (prime.weights.StepWeights; None: equal weights)."""


@runtime_checkable
class Sync(Protocol):
    """Averages pseudo-gradients across nodes for DiLoCo."""

    def bind(self, states, settings: dict) -> None:
        """Called once by DiLoCo: the outer states it averages for (prime.outer_states.OuterStates: every
        fragment's; with one fragment it also answers as that fragment's OuterState) and the settings every
        node must share (inner_steps, codec, block_size, outer update, shapes, numel)."""

    def agree(self, ok: bool) -> bool:
        """True when `ok` holds on every process of this node (the same answer on all of them)."""

    def verify(self, fingerprint: tuple, *, outer_step: int) -> None:
        """Before outer step `outer_step`: raises ReplicaMismatchError on every node when any node's
        (weights hash, settings hash, numel) differs. A sync that checks replicas another way does nothing."""

    def average(self, grad: torch.Tensor, *, outer_step: int, inner_step: int,
                recompute: Callable[[torch.Tensor], None], trained: Optional[int] = None) -> SyncResult:
        """Replaces `grad` (this process's pseudo-gradient for outer step `outer_step`) by its average over
        the contributing nodes, bit-identical on every node. A failed attempt may leave `grad` changed:
        `recompute(grad)` restores it before the next one. Raises OuterSyncError when no attempt works;
        the outer state is then untouched. `trained` (only to a sync that declares `weighs`): this node's
        inner steps for the average; the result's `counts` then holds every contributor's."""

    def committed(self, result: SyncResult) -> None:
        """Called after the outer update of `result` was applied (the bound states hold the new weights)."""

    def close(self) -> None:
        """Releases what this sync created."""


class SyncExtras:
    """What a sync may declare beyond the six methods of Sync, with the defaults a sync that declares nothing
    gets (prime.sync.complete). RingSync and prime.elastic.ElasticSync declare all of it."""

    pipelined = False
    """True when average_pieces() exists (a pipelined synchronous outer step)."""
    background = False
    """True when average() may run on a background thread after use_from_background() (overlap)."""
    must_join = False
    """True while this node must join the job (rejoin()) before its first average."""
    keeps_input = False
    """True when a background average may need its input back for a retry (DiLoCo keeps a copy)."""
    reports_quant_error = False
    """True when the averages report the codec's error themselves (QUANT_ERROR_FIELDS)."""
    sparse = False
    """True when the sync carries the topk codec (its all-reduces take keep= and keep_average=, bind()'s settings
    "keep" and "keep_average") and take_dropped() hands back what the selections dropped."""
    weighs = False
    """True when average() takes `trained` and returns every contributor's count (time phases' token weights),
    and, for a sync that is also `pipelined`, weigh() exists."""

    def take_dropped(self, buf: torch.Tensor) -> Optional[torch.Tensor]:
        """A sparse codec: what this node's selection of the average of the shards it owns left out of the last
        successful all-reduce of `buf` (a CPU fp32 buffer of buf's size, to add to the residual), once; None
        when there is nothing (every other codec)."""
        return None

    def weigh(self, trained: int, *, outer_step: int) -> list:
        """Before a pipelined average (average_pieces) of outer step `outer_step`: every node's count of inner
        steps trained for it, in member order (prime.weights), the same list on every node."""
        raise OuterSyncError(f"outer step {outer_step}: {type(self).__name__} cannot weigh averages by the "
                             "inner steps each node trained (diloco.phase = 'time')")

    def use_from_background(self) -> None:
        """Prepares average() to run on a background thread while the main thread trains (every process of
        the node calls it at the same point)."""

    def applying(self, result: SyncResult) -> None:
        """Called right before the outer update of `result` changes the bound states."""

    def rejoin(self, reason: str, *, outer_step: int) -> SyncResult:
        """After LeftBehind: brings this node back into the job on the main thread (a result with joined=True),
        or raises OuterSyncError when it cannot."""
        raise OuterSyncError(f"outer step {outer_step}: {reason}; {type(self).__name__} cannot take a node back")


_EXTRAS = ("pipelined", "background", "must_join", "keeps_input", "reports_quant_error", "use_from_background",
           "applying", "rejoin", "take_dropped", "sparse", "weighs", "weigh")


class _Completed(SyncExtras):
    """A Sync that declares only part of SyncExtras: what it declares is its own, the rest the defaults."""

    def __init__(self, sync):
        self._inner = sync
        for name in _EXTRAS:
            if hasattr(sync, name):
                setattr(self, name, getattr(sync, name))

    def __getattr__(self, name):  # bind, agree, verify, average, committed, close, and the sync's own
        return getattr(self._inner, name)


def complete(sync):
    """`sync` itself when it declares everything of SyncExtras, else a view of it with the defaults filled in
    (a Sync written to the six methods keeps working). must_join stays the sync's own when it has one."""
    if all(hasattr(sync, name) for name in _EXTRAS):
        return sync
    return _Completed(sync)


# -- what a ring reports and how it fails --------------------------------------------


QUANT_ERROR_FIELDS = ("quant_err_sq", "quant_in_sq")
"""WorkStats fields a ring may report so that DiLoCo needs no quantize/dequantize pass of its own to measure the
int8 error: sum over every int8 block this rank quantized in the all-reduce of ||dequantize(quantize(x)) - x||^2
(quant_err_sq) and of ||x||^2 (quant_in_sq), as float64. OuterStepResult.compression_error is then
sqrt(quant_err_sq / quant_in_sq): the relative error of one quantization, averaged over the hops of this rank."""


_RECORDED = {
    "bytes_sent": "bytes_sent",
    "bytes_received": "bytes_received",
    "quantize_s": "quantize_s",
    "wait_s": "wire_s",  # the time blocked on the wire
    "reduce_s": "reduce_s",
    "total_s": "total_s",
    "copy_back_s": None,  # part of commit_s
}
"""WorkStats fields the trainer records for every all-reduce, in this order, each under the name given here (None:
never recorded). Every other timer of the ring (RING_TIMERS, csrc/ring/timers.h) is a SPLIT_FIELDS entry."""


SPLIT_FIELDS = tuple(name for name, _ in RING_TIMERS if name not in _RECORDED)
"""WorkStats times recorded beside the main ones, under their own names, when non-zero (csrc/ring/timers.h says what
each counts): the split of a GPU all-reduce, and the time spent sealing and opening frames."""


def work_stats(work) -> dict:
    """A finished ring Work's statistics (prime.comm.WorkStats) under the names the trainer records."""
    s = work.stats()
    out = {recorded: getattr(s, name) for name, recorded in _RECORDED.items() if recorded is not None}
    for name in SPLIT_FIELDS:  # where the rest of the time went, when the ring reports it
        v = getattr(s, name, None)
        if v:
            out[name] = float(v)
    for name in QUANT_ERROR_FIELDS:  # rings that measure their own int8 error (see QUANT_ERROR_FIELDS)
        v = getattr(s, name, None)
        if v is not None:
            out[name] = float(v)
    return out


def _add_stats(totals: dict, stats: dict) -> None:
    """Adds one piece's work_stats() to the totals of a pipelined average (sums; None stays None)."""
    for k, v in stats.items():
        if v is None:
            totals.setdefault(k, None)
        elif totals.get(k) is None and k in totals:
            continue
        else:
            totals[k] = totals.get(k, 0) + v


def is_comm_error(e: BaseException) -> bool:
    """True for a failed collective: prime.comm.CommError, or an exception of that name (test doubles)."""
    try:
        from prime.comm import CommError

        if isinstance(e, CommError):
            return True
    except ImportError:  # the extension is not built: only test doubles can fail
        pass
    return type(e).__name__ == "CommError"


# -- the node-local group -------------------------------------------------------------


def node_local_group(group=None):
    """The process group of this node's processes, for agreeing on failures (None: a single process).

    Given a group, checks that it does not span nodes. Without one, derives it
    from torchrun's local world: the default group when WORLD_SIZE equals
    LOCAL_WORLD_SIZE (one torchrun per node). Raises ValueError when the
    group would span nodes or when the node's processes cannot be told. A group of threads
    (prime.shares.MemberGroup: the rings of a one-process node) is returned as it is."""
    import torch.distributed as dist

    if hasattr(group, "all_min"):
        return group
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("local_group was given but torch.distributed is not initialized")
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if group is None:
        world = dist.get_world_size()
        if world == 1:
            return dist.group.WORLD
        if local is None:
            raise ValueError(
                f"torch.distributed is initialized with {world} processes but LOCAL_WORLD_SIZE is not set, so "
                "DiLoCo cannot tell which of them share this node: pass local_group= (a group of this node's "
                "processes), or start with torchrun, which sets LOCAL_WORLD_SIZE")
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    if local is not None and size > int(local):
        raise ValueError(
            f"the local group has {size} processes but this node runs {local} (LOCAL_WORLD_SIZE): it spans "
            "nodes. DiLoCo agrees on failures among one node's processes only; nodes are joined by the ring. "
            "Start one torchrun per node (--nnodes 1), or pass local_group= with this node's processes "
            "(e.g. from torch.distributed.new_subgroups())")
    return group


def min_local(group, value: int) -> int:
    """The least of `value` (a small integer) over every process of `group` (a tiny MIN all-reduce; None: this
    process alone; a group of threads, prime.shares.MemberGroup: its all_min)."""
    if group is None:
        return int(value)
    if hasattr(group, "all_min"):
        return int(group.all_min(int(value)))
    import torch.distributed as dist

    dev = "cpu"
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):  # a group without a queryable backend: use the CPU
        backend = ""
    if backend == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([int(value)], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item())


def all_local(group, ok: bool) -> bool:
    """True when `ok` holds on every process of `group` (min_local over 0 / 1)."""
    return min_local(group, 1 if ok else 0) == 1


# -- a fixed ring ------------------------------------------------------------------------


def sparse_all_reduce(ring, buf: torch.Tensor, op: str, chunk: int, keep: int,
                      keep_average: Optional[int] = None) -> tuple:
    """The topk codec's all-reduce of buf on ring: (its Work, the buffer its selections drop into), which holds
    what they dropped once the collective succeeded (a failed one's buffer is dropped unread). For a CUDA buf it
    lives on buf's GPU when the ring reduces there (a CUDA build: the ring fills it as it goes, with no copy of
    its own), else in pinned host memory (the staging goes through the host)."""
    if buf.is_cuda and ring.reduces_on_device(buf):  # filled on the device as the collective runs
        dropped = torch.empty(buf.numel(), dtype=torch.float32, device=buf.device)
        return (ring.all_reduce(buf, op=op, codec="topk", block_size=chunk, keep=keep, dropped=dropped,
                                keep_average=keep_average), dropped)
    dropped = torch.zeros(buf.numel(), dtype=torch.float32, pin_memory=buf.is_cuda)
    return (ring.all_reduce(buf, op=op, codec="topk", block_size=chunk, keep=keep, residual=dropped,
                            keep_average=keep_average), dropped)


def start_all_reduce(ring, buf: torch.Tensor, op: str, codec: str, block_size: int, keep: Optional[int] = None,
                     keep_average: Optional[int] = None) -> tuple:
    """Queues buf's all-reduce on ring with the wire codec (codec, block_size) that prime.codecs.wire_codec chose
    for the outer step: (its Work, the buffer the topk codec's selections drop into, or None for a dense
    codec). What the fixed ring (RingSync) and the elastic rings both launch."""
    if codec == "topk":
        return sparse_all_reduce(ring, buf, op, block_size, keep, keep_average)
    return ring.all_reduce(buf, op=op, codec=codec, block_size=block_size), None


def dropped_on_device(dropped: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """A CUDA buffer's dropped part goes up to its device on this thread's stream as soon as the collective
    succeeded (from pinned memory, not blocking): an overlapped average then hands the outer state a device
    tensor instead of a host copy on the training thread."""
    return dropped.to(buf.device, non_blocking=True) if buf.is_cuda and not dropped.is_cuda else dropped


_COLLECTIVE_STREAMS: dict = {}


def collective_stream(device: torch.device):
    """The CUDA stream an average in the background runs its copies on (one per device, for the life of the
    process: the caching allocator reuses what was allocated on it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COLLECTIVE_STREAMS:
        _COLLECTIVE_STREAMS[index] = torch.cuda.Stream(device=torch.device("cuda", index))
    return _COLLECTIVE_STREAMS[index]


def warm_sparse_staging(states) -> None:
    """What the sparse codec allocates per average of a CUDA buffer: the buffer its selections drop into, on the
    GPU where the ring reduces there (prime.comm.ring.reduces_on_gpu), or else the pinned host staging (its input, its average and what
    the owners dropped) and the dropped part's device copy on the collective stream. Allocating those blocks once
    here, before training, leaves them in torch's caching allocators, so that the first averages do not pay
    cudaHostAlloc and cudaMalloc beside the inner steps. Counted in the memory plan."""
    states = list(states)
    cuda = [st for st in states if st.work_device.type == "cuda"]
    if not cuda:
        return
    from prime.comm.ring import reduces_on_gpu

    n, device = max(st.numel for st in cuda), cuda[0].work_device
    held = [] if reduces_on_gpu() else [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(3)]
    with torch.cuda.stream(collective_stream(device)):
        held.append(torch.empty(n, dtype=torch.float32, device=device))
    del held


class RingSync(SyncExtras):
    """The average over a fixed set of nodes on prime.comm.Ring, with retries on fresh rings.

    ring:          the ring of this process (local rank g of every node), or None to build one with
                   ring_factory("start"); a ring passed in stays the caller's: it is never closed here
    ring_factory:  ring_factory(tag) -> a new Ring; tag names the outer step and attempt ("o3a1"), so that
                   processes at different outer steps never meet in one ring. None: no retries
    retries:       retries per outer step (with ring_factory)
    local_group:   this node's processes, which agree before every retry so that all rings of the node
                   are rebuilt together (see node_local_group)

    A CommError is retried after every process of the node agrees that the
    attempt failed; when no attempt works, OuterSyncError is raised and the
    caller's outer weights are left as they were. A rank may fail after its
    peers had all they needed (they complete, it raises): with agree_through()
    (prime's trainer does it) every node then follows one decision taken
    through the job's store (prime.outcomes), else only the node's processes
    agree and the node that completed applies while the other gives up.
    """

    pipelined = True
    background = True
    must_join = False
    weighs = True
    sparse = True

    def __init__(self, ring=None, *, ring_factory: Optional[Callable[[str], object]] = None, retries: int = 2,
                 local_group=None):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if ring is None and ring_factory is None:
            raise ValueError("RingSync needs a ring or a ring_factory")
        self.ring_factory, self.retries = ring_factory, retries
        self._closed = False  # close() was called: no new ring (an average still running fails instead)
        self.local_group = local_group
        self.average_group = local_group
        """The group average() agrees in before a retry (use_from_background() gives it one of its own)."""
        self.codec, self.block_size, self.keep, self.keep_average = "int8", 64, None, None  # set by bind()
        self.dense: Callable[[int], bool] = lambda k: False
        """Whether outer step k is one of a sparse codec's dense start (set by bind(): the states' schedule)."""
        self._dropped: dict = {}  # topk: buffer address -> what its owners' selections dropped (take_dropped)
        self._caller_ring = ring
        self.last_apply_s = 0.0
        """average_pieces(): seconds the last piece's apply() took (the update left after the wire)."""
        self.ring = ring if ring is not None else ring_factory("start")
        self.rank, self.world_size = self.ring.rank, self.ring.world_size
        self.outcomes = None
        """prime.outcomes.StoreOutcomes: every node's outcome of each all-reduce, agreed (agree_through())."""
        self._collectives = 0  # all-reduces run (their order is the same on every node: the ring requires it)

    def agree_through(self, outcomes) -> None:
        """From now on, apply an all-reduce only where every node's worked (prime.outcomes.StoreOutcomes: a
        decision taken through the job's store); before, only this node's processes agree."""
        self.outcomes = outcomes

    def bind(self, states, settings: dict) -> None:
        self.codec, self.block_size, self.keep = settings["codec"], settings["block_size"], settings.get("keep")
        self.keep_average = settings.get("keep_average")
        self.dense = states.schedule.dense

    def take_dropped(self, buf: torch.Tensor) -> Optional[torch.Tensor]:
        return self._dropped.pop(buf.data_ptr(), None)

    def _dropped_to(self, buf: torch.Tensor) -> None:
        d = self._dropped.get(buf.data_ptr())
        if d is not None:
            self._dropped[buf.data_ptr()] = dropped_on_device(d, buf)

    @property
    def reports_quant_error(self) -> bool:
        """True when the ring measures its own quantization error (prime.sync.QUANT_ERROR_FIELDS)."""
        return bool(getattr(self.ring, "reports_quant_error", False))

    @property
    def keeps_input(self) -> bool:
        """True when a retry after this process's own all-reduce worked needs its input back: a background
        average that can rebuild its ring, on any node (another process of the node, or with agree_through()
        another node, may have failed while this one completed; agree_through() comes after the fragments'
        buffers are planned, so this does not wait for it)."""
        return self.ring_factory is not None

    def use_from_background(self) -> None:
        """Prepares average() to run on a background thread (DiLoCo's overlap) while the main thread keeps
        using the node's process group (FSDP2, DiLoCo's finiteness check): the agreement before a retry then
        goes through a gloo group of its own, so that the two threads' collectives never interleave on one
        group. Every process of the node calls this at the same point (it creates a group)."""
        g = self.local_group
        if g is None:
            return
        if hasattr(g, "all_min"):  # the rings of a one-process node (prime.shares): their background twin
            self.average_group = g.background
            return
        import torch.distributed as dist

        if dist.get_world_size(g) == 1:
            self.average_group = None  # agreeing with oneself needs no collective
        elif g is dist.group.WORLD:
            self.average_group = dist.new_group(backend="gloo")
        else:
            raise ValueError(
                "overlap on a node of several processes needs the node's group to be the default group (one "
                "torchrun per node), so that a group of its own can be made for the background all-reduce; "
                "a local_group passed in cannot be duplicated here")

    def agree(self, ok: bool) -> bool:
        return all_local(self.local_group, ok)

    def _drop_ring(self) -> None:
        """Forgets the current ring; closes it unless it is the caller's."""
        ring, self.ring = self.ring, None
        if ring is not None and ring is not self._caller_ring:
            try:
                ring.close()
            except Exception:  # the ring is already broken; closing it is best effort
                pass

    def _allreduce(self, buf: torch.Tensor, *, op: str, codec: tuple, outer_step: int,
                   recompute: Optional[Callable[[torch.Tensor], None]], group=None) -> SyncResult:
        """ring.all_reduce(buf) with retries on fresh rings, for outer step `outer_step` (the next one): one piece
        of _attempts(). When this process's all-reduce worked but another process of the node failed, buf holds
        an average: recompute(buf) restores this process's input before the retry."""
        return self._attempts([buf], op=op, codec=codec, outer_step=outer_step, group=group,
                              restore=None if recompute is None else (lambda j: recompute(buf)))

    def average(self, grad: torch.Tensor, *, outer_step: int, inner_step: int,
                recompute: Callable[[torch.Tensor], None], trained: Optional[int] = None) -> SyncResult:
        t0 = time.perf_counter()
        counts = None if trained is None else self.weigh(trained, outer_step=outer_step, group=self.average_group)
        weigh_s = time.perf_counter() - t0  # the counts' exchange waits for the other nodes too: wire time
        r = self._allreduce(grad, op="avg", codec=self._codec_at(outer_step), outer_step=outer_step,
                            recompute=recompute, group=self.average_group)
        r.counts = counts
        r.allreduce_s += weigh_s
        return r

    def average_pieces(self, ranges: list, *, outer_step: int, inner_step: int, buffer: Callable[[int], torch.Tensor],
                       prepare: Callable[[int], None], apply: Callable[[int], None], start: int = 0,
                       window: int = 3) -> SyncResult:
        """A pipelined average in pieces, from piece `start` on: prepare(j) writes piece j's pseudo-gradient into
        buffer(j) (and may raise to stop: a pseudo-gradient that is not finite; it may agree with the node's
        other processes); its all-reduce is queued on the ring at once, so the wire starts with the first piece
        while the next ones are prepared. apply(j) runs once piece j's average is in buffer(j), in order, while
        later pieces are on the wire. At most `window` pieces are prepared and not yet applied (buffer(j) may
        reuse buffer(j - window)'s memory).

        Every process of the node agrees on each piece before applying it (all rings of the node then fail and
        are rebuilt together). A failed piece is retried, with every piece after it, on a fresh ring (tagged
        with the outer step, the piece and the attempt); pieces already applied stay applied. OuterSyncError
        when no attempt works: the outer weights then hold the pieces before the failed one (the caller's
        Fragment records how many, so that a resumed run does only the rest)."""
        self.last_apply_s = 0.0
        return self._attempts(ranges, op="avg", codec=self._codec_at(outer_step), outer_step=outer_step,
                              group=self.local_group,
                              buffer=buffer, prepare=prepare, apply=apply, start=start, window=window)

    def _codec_at(self, k: int) -> tuple:
        """(codec, block size) of outer step k's average: the job's, or int8 in a dense start."""
        return wire_codec(self.codec, self.block_size, self.dense(k))

    def _attempts(self, pieces: list, *, op: str, codec: tuple, outer_step: int, group, buffer=None, prepare=None,
                  apply=None, restore=None, start: int = 0, window: int = 1) -> SyncResult:
        """The retry loop of every all-reduce of this sync, over pieces[start:] (one piece: a plain all-reduce
        of pieces[0]; with buffer/prepare/apply, a pipelined one as average_pieces says). Each attempt builds a
        ring when there is none (ring_factory), launches up to `window` pieces ahead of the last applied one,
        and agrees with the node's other processes on each piece before applying it. A piece that failed
        anywhere on the node drops the ring here (so that every ring of the node is rebuilt together under the
        next tag) and the next attempt redoes it and every later one; restore(j) first gives back this
        process's input of piece j when its own all-reduce had worked. Errors other than network failures are
        raised at once (a bug or a bad argument: no retry)."""
        t0, pipelined = time.perf_counter(), prepare is not None
        collective, self._collectives = self._collectives, self._collectives + 1
        buffer = buffer or (lambda j: pieces[j])
        attempts = 1 + (self.retries if self.ring_factory is not None else 0)
        totals: dict = {}
        done, last = start, None
        for attempt in range(attempts):
            tag = f"o{outer_step - 1}p{done}a{attempt}" if pipelined else f"o{outer_step - 1}a{attempt}"
            works: dict = {}
            launch = {"next": done, "err": None}

            def launch_upto(limit: int) -> None:
                # Every process prepares the same pieces (prepare may agree with the others), launched or not.
                while launch["next"] < min(len(pieces), limit):
                    j = launch["next"]
                    if prepare is not None:
                        prepare(j)
                    launch["next"] = j + 1
                    if launch["err"] is None:
                        try:
                            works[j] = self._launch(buffer(j), tag, op, codec, pipelined)
                        except Exception as e:
                            if not (is_comm_error(e) or isinstance(e, OuterSyncError)):
                                raise
                            launch["err"] = e

            launch_upto(done + window)
            for j in range(done, len(pieces)):
                err, stats = (launch["err"], {}) if j not in works else self._wait(works[j])
                node_ok = all_local(group, err is None)
                if not self._everywhere(group, f"c{collective}a{attempt}j{j}", node_ok, outer_step, done, pipelined,
                                        len(pieces)):
                    last = err or last or RuntimeError("the all-reduce failed on another process of this node"
                                                       if not node_ok else "the all-reduce failed on another node")
                    self._drop_ring()
                    if err is None and restore is not None:
                        restore(j)
                    break
                _add_stats(totals, stats)
                self._dropped_to(buffer(j))  # topk: its dropped part to its device once the collective succeeded
                if apply is not None:
                    buf = buffer(j)
                    if buf.is_cuda:
                        torch.cuda.synchronize(buf.device)  # the ring's decode is in the buffer
                    u0 = time.perf_counter()
                    apply(j)
                    self.last_apply_s = time.perf_counter() - u0
                done = j + 1
                launch_upto(done + window)  # piece j's buffer is free again
            else:
                return SyncResult(members=list(range(self.world_size)), contributors=self.world_size,
                                  attempts=attempt + 1, allreduce_s=time.perf_counter() - t0, stats=totals)
        if not pipelined:
            raise OuterSyncError(
                f"outer step {outer_step}: the all-reduce across nodes failed {attempts} time(s) "
                f"(last error: {last}). The outer weights were not changed; stopping so that nodes do not diverge. "
                "Restart every node from the last checkpoint.")
        raise OuterSyncError(
            f"outer step {outer_step}: the all-reduce across nodes failed {attempts} time(s) at piece {done + 1} of "
            f"{len(pieces)} (last error: {last}). Pieces 1 to {done} were applied; the rest was not. Stopping so that "
            "nodes do not diverge: restart every node from the last checkpoint."
        )

    def _everywhere(self, group, name: str, node_ok: bool, outer_step: int, done: int, pipelined: bool,
                    pieces: int) -> bool:
        """Whether every node applies all-reduce `name` (node_ok: it worked on every process of this node): the
        store's decision with agree_through(), else node_ok. Raises OuterSyncError on every process of the node
        when the decision cannot be learned (another node may have applied it)."""
        if self.outcomes is None:
            return node_ok
        verdict = self.outcomes.decide(name, node_ok)
        # One agreement for both questions: 0 when a process learned no decision, 1 a retry, 2 every node applies.
        agreed = min_local(group, 0 if verdict is None else 1 + int(verdict))
        if agreed == 0:
            self._drop_ring()
            applied = f" Pieces 1 to {done} of {pieces} were applied; the rest was not." if pipelined else ""
            raise OuterSyncError(
                f"outer step {outer_step}: could not learn from the store whether every node's all-reduce worked "
                f"(within {2 * self.outcomes.timeout_s:g} s, or the store failed); other nodes may have applied it."
                f"{applied} Stopping: restart every node from the last checkpoint.")
        return agreed == 2

    def _launch(self, buf: torch.Tensor, tag: str, op: str, codec: tuple, pipelined: bool):
        """Queues buf's all-reduce on the ring, building one (ring_factory(tag)) when there is none; codec:
        (codec, block size)."""
        if self.ring is None:
            if self._closed:
                raise OuterSyncError("the sync was closed (the run is stopping): no ring is built again")
            if self.ring_factory is None:
                raise OuterSyncError("the ring failed earlier and no ring_factory was given to rebuild it; "
                                     "restart the job")
            self.ring = self.ring_factory(tag)
        if pipelined and buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()  # the piece is written
        work, dropped = start_all_reduce(self.ring, buf, op, *codec, self.keep, self.keep_average)
        if dropped is not None:  # topk: the owners' selections' losses, for the residual (take_dropped)
            self._dropped[buf.data_ptr()] = dropped
        return work

    @staticmethod
    def _wait(work) -> tuple:
        """(None, the work's statistics) once it completed, or (the network error, {})."""
        try:
            work.wait()
            return None, work_stats(work)
        except Exception as e:
            if not is_comm_error(e):
                raise
            return e, {}

    def applying(self, result: SyncResult) -> None:
        pass

    def committed(self, result: SyncResult) -> None:
        pass

    def rejoin(self, reason: str, *, outer_step: int) -> SyncResult:
        raise OuterSyncError(f"outer step {outer_step}: {reason}; a fixed ring cannot take a node back")

    def weigh(self, trained: int, *, outer_step: int, group: Any = "local") -> list:
        from prime.weights import from_limbs, to_limbs

        return [from_limbs(row) for row in self.exchange(to_limbs(trained), outer_step=outer_step, group=group)]

    @torch.no_grad()
    def exchange(self, pieces: list, *, outer_step: int = 0, group: Any = "local") -> list:
        """Every node's small integers (each < 2^24; the same count on every node) to every node, in node order:
        each node puts its pieces in its own slots of a vector, and an exact sum all-reduce (zeros elsewhere)
        gathers them everywhere, since sums of integers below 2^24 are exact in fp32. Over the ring, so what
        arrives is authenticated and fresh."""
        rank, size, slots = self.rank, self.world_size, len(pieces)

        def fill(v: torch.Tensor) -> None:
            v.zero_()
            v[rank * slots : (rank + 1) * slots] = torch.tensor(pieces, dtype=torch.float32)

        vec = torch.empty(size * slots, dtype=torch.float32)
        fill(vec)
        self._allreduce(vec, op="sum", codec=("none", self.block_size), outer_step=outer_step, recompute=fill,
                        group=self.local_group if isinstance(group, str) else group)
        return vec.view(size, slots).to(torch.int64).tolist()

    @torch.no_grad()
    def verify(self, fingerprint: tuple, *, outer_step: int) -> None:
        """Each node puts 16-bit pieces of its fingerprint (weights hash, settings hash, element count) in
        its own slots of a small vector; exchange() gathers them everywhere."""
        rank, size = self.rank, self.world_size
        w, s, n = fingerprint
        pieces = [(w >> (16 * i)) & 0xFFFF for i in range(4)] + [(s >> (16 * i)) & 0xFFFF for i in range(4)]
        pieces += [(n >> (16 * i)) & 0xFFFF for i in range(3)]
        table = self.exchange(pieces, outer_step=outer_step)
        problems = []
        for what, lo, hi in ((FINGERPRINT_PARTS[2], 8, 11), (FINGERPRINT_PARTS[1], 4, 8), (FINGERPRINT_PARTS[0], 0, 4)):
            mine = table[rank][lo:hi]
            differ = [r for r in range(size) if table[r][lo:hi] != mine]
            if differ:
                problems.append(f"{what} differ from node(s) {differ}")
        if not self.agree(not problems):
            detail = "; ".join(problems) or "another process of this node found a mismatch"
            raise ReplicaMismatchError(f"node {rank}: {detail}. Every node must {SAME_START}.")

    def close(self) -> None:
        """Closes the rings this sync built (not one passed to it). An average still running on a background
        thread then fails at once: its retry builds no new ring (which would wait for peers up to the ring's
        timeout)."""
        self._closed = True
        self._drop_ring()
