"""Streaming fragments: the outer step of DiLoCo, one fragment of the model at a time.

With `fragments = P` (prime.DiLoCo, `diloco.fragments`) the model's parameters
are cut into P fragments of contiguous layers with balanced bytes
(split_fragments). Each fragment is an outer step of its own (Fragment): its
own outer weights and momentum, its own phase of H inner steps, offset in the
phase so that fragment p syncs at inner steps (p + 1) H / P + k H
(FragmentSchedule). One fragment's all-reduce is in flight at a time and
carries 1/P of the bytes; with overlap its average is applied `overlap_steps`
(at most H / P) inner steps later, and the buffers it needs on the GPU are 1/P
of the model's. The algorithm per fragment is the whole-model one (docs/
training.md, "Streaming fragments"); with P = 1 it is exactly DiLoCo's outer
step as it always was.

    Streaming DiLoCo (Douillard et al., 2025) syncs fragments the same way; torchft's
    DiLoCo walks fragment objects with their own sync offset and delay.

A synchronous outer step of a large fragment is pipelined: its flat range is cut
into pieces (about SYNC_PIECE_VALUES values each), every piece's pseudo-gradient
is computed and handed to the ring as soon as it is ready, and every piece's
update is applied as soon as its average is back, while later pieces are still
on the wire (prime.pipeline). Only the first piece's preparation and the last
piece's update are left on the critical path beside the wire.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from prime.codecs import CODECS
from prime.outer import OuterState
from prime.overlap import MERGE_ALPHA, STAND_IN_OTHERS, OverlapPolicy, make_policy, stand_in_share  # noqa: F401
from prime.pipeline import PIPELINE_DEPTH, PipelinedStep  # noqa: F401
from prime.sync import OuterSyncError, SyncResult, collective_stream
from prime.weights import Weighing

__all__ = ["split_fragments", "layer_units", "FragmentSchedule", "Fragment", "BufferPool", "OuterStepResult",
           "SYNC_PIECE_VALUES", "sync_pieces", "MERGE_ALPHA", "STAND_IN_OTHERS", "stand_in_share"]

SYNC_PIECE_VALUES = 1 << 27
"""A synchronous outer step of a fragment larger than this (per process) is pipelined in pieces of about this
many values (128M: 512 MiB of fp32, 128 MiB of int8, 0.2 s of a 5 Gbit/s link; PCIe moves it in ~10 ms), so
that preparing and applying pieces overlaps the wire. Smaller fragments go in one all-reduce, as before."""


def sync_pieces(global_numel: int, local_world: int) -> int:
    """How many pieces a synchronous outer step of a fragment of `global_numel` values is pipelined in: about
    SYNC_PIECE_VALUES per process, from the global size, so that every process of a node cuts its shard into as
    many (they agree on each piece)."""
    return max(1, -(-global_numel // (max(1, local_world) * SYNC_PIECE_VALUES)))


# -- which parameters each fragment holds ---------------------------------------------------


def layer_units(names: list) -> list:
    """Groups consecutive parameter names into layers: a name's layer is its prefix up to the first numeric
    part ("layers.3.attention.wq.weight" -> "layers.3"), else its first part ("tok_embeddings.weight" ->
    "tok_embeddings"). Returns [(layer, [indices])] in parameter order; fragments are cut between layers only."""
    units: list = []
    for i, name in enumerate(names):
        parts = name.split(".")
        key = parts[0]
        for j, part in enumerate(parts[:-1]):
            if part.isdigit():
                key = ".".join(parts[: j + 1])
                break
        if units and units[-1][0] == key:
            units[-1][1].append(i)
        else:
            units.append((key, [i]))
    return units


def split_fragments(names: list, sizes: list, fragments: int) -> list:
    """Cuts parameters (in order, with their element counts) into `fragments` groups of consecutive whole layers
    whose largest group is as small as possible (bytes on the wire and buffers are proportional to it). Returns
    one list of parameter indices per fragment. Raises ValueError when the model has fewer layers than that."""
    units = layer_units(names)
    if fragments < 1:
        raise ValueError(f"diloco.fragments must be >= 1, got {fragments}")
    if fragments > len(units):
        raise ValueError(f"diloco.fragments ({fragments}) is more than the model's {len(units)} layers "
                         f"({', '.join(u for u, _ in units[:6])}{', ...' if len(units) > 6 else ''}); a fragment "
                         "holds whole layers")
    weights = [sum(sizes[i] for i in idx) for _, idx in units]
    n = len(units)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest possible largest group when units[:i] form k groups; cut[k][i]: where the last starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(fragments + 1)]
    cut = [[0] * (n + 1) for _ in range(fragments + 1)]
    best[0][0] = 0
    for k in range(1, fragments + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(fragments, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    bounds.reverse()
    return [[p for _, idx in units[a:b] for p in idx] for a, b in bounds]


@dataclass(frozen=True)
class FragmentSchedule:
    """When each of P fragments syncs in a phase of H inner steps: fragment p at inner steps offset(p) + k H,
    offset(p) = round((p + 1) H / P), so the last one syncs where whole-model DiLoCo does. With overlap a
    fragment's average is applied `delay` inner steps after its sync, at most the spacing of two syncs, so that
    one average is in flight at a time."""

    inner_steps: int
    fragments: int
    dense_steps: int = 0
    """A sparse codec's dense start: each fragment's first dense_steps outer steps average densely (dense())."""

    def __post_init__(self):
        if not 1 <= self.fragments <= self.inner_steps:
            raise ValueError(f"diloco.fragments must be in [1, diloco.inner_steps = {self.inner_steps}], "
                             f"got {self.fragments}")

    def offset(self, p: int) -> int:
        """The inner step of the phase at which fragment p syncs (its first phase is this long)."""
        return (2 * (p + 1) * self.inner_steps + self.fragments) // (2 * self.fragments)  # round half up

    def spacing(self) -> int:
        """The fewest inner steps between two syncs of the schedule (the longest delay that keeps one average in
        flight at a time)."""
        offs = [0] + [self.offset(p) for p in range(self.fragments)]
        return min(b - a for a, b in zip(offs, offs[1:]))

    def default_delay(self) -> int:
        """overlap_steps when it is not set: the whole phase for one fragment, else the spacing."""
        return self.inner_steps if self.fragments == 1 else self.spacing()

    # The job's outer steps are numbered across fragments: k = 1, 2, ... in the order they run, fragment
    # (k - 1) mod P at inner step offset(p) + (k - 1) // P * H (offsets are distinct and increasing).

    def fragment_of(self, k: int) -> int:
        """The fragment whose outer step is the job's outer step k (k >= 1)."""
        return (k - 1) % self.fragments

    def dense(self, k: int) -> bool:
        """True when the job's outer step k is one of its fragment's first dense_steps: a sparse codec's dense
        start, which sends the pseudo-gradient as int8 and applies the average as it is (docs/codec.md, "Dense
        start"). Every node decides from k alone, so all agree."""
        return (k - 1) // self.fragments < self.dense_steps

    def step_of(self, k: int) -> int:
        """The inner step at which the job's outer step k runs (k >= 1)."""
        return (k - 1) // self.fragments * self.inner_steps + self.offset(self.fragment_of(k))

    def position(self, p: int, step: int) -> tuple:
        """(outer steps of fragment p done, inner steps since its last one) after inner step `step`: what a
        node that takes the job's step (an elastic joiner) sets its fragment's counters to."""
        first = self.offset(p)
        if step < first:
            return 0, step
        return (step - first) // self.inner_steps + 1, (step - first) % self.inner_steps

    def last_step(self, total_steps: int) -> int:
        """The inner step of the last scheduled outer step at or before `total_steps` (0: none)."""
        H, P = self.inner_steps, self.fragments
        k = total_steps // H * P + sum(1 for p in range(P) if self.offset(p) <= total_steps % H)
        return self.step_of(k) if k else 0


# -- work buffers ---------------------------------------------------------------------------


class BufferPool:
    """Work buffers on the work device shared by the fragments: flat fp32 buffers of the largest fragment's
    length, made on first need and handed back after use (a fragment uses a prefix of one)."""

    def __init__(self, numel: int, device: torch.device):
        self.numel, self.device = numel, device
        self.free: list = []
        self.made = 0
        """Buffers made so far (the most ever in use at once)."""

    def take(self) -> torch.Tensor:
        if self.free:
            return self.free.pop()
        self.made += 1
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def give(self, buf: Optional[torch.Tensor]) -> None:
        if buf is not None and not any(b is buf for b in self.free):
            self.free.append(buf)


# -- what one outer step did ----------------------------------------------------------------


@dataclass
class OuterStepResult:
    """What `DiLoCo.step()` did."""

    did_sync: bool
    """True when this call ran an outer step."""
    inner_step: int
    """Inner steps taken so far (this call included)."""
    outer_step: int
    """Outer steps completed so far (with fragments: fragment outer steps, all fragments counted)."""
    numel: int = 0
    """Values all-reduced by this process (its shard of the fragment, padded to whole codec blocks)."""
    allreduce_s: float = 0.0
    """Wall time of the average across nodes (all attempts)."""
    outer_s: float = 0.0
    """Wall time of the whole outer step: copies, all-reduce, outer update."""
    prepare_s: float = 0.0
    """Part of outer_s: the pseudo-gradient pass, its norm and (when measured and the ring does not report it)
    its int8 error; for a pipelined step, the first piece's (the rest overlaps the wire)."""
    update_s: float = 0.0
    """Part of outer_s: the outer update and the copy into the model; for a pipelined step, after the last
    piece's average arrived (the rest overlaps the wire)."""
    bytes_sent: Optional[int] = None
    """Bytes this process sent on the ring, as the ring reports them (None: not reported)."""
    bytes_received: Optional[int] = None
    """Bytes this process received on the ring (None: not reported)."""
    compression_error: Optional[float] = None
    """int8 round-trip error of the local pseudo-gradient: ||deq(q(d)) - d|| / ||d|| (None: codec none, off,
    or this process did not contribute)."""
    pseudo_grad_norm: float = 0.0
    """L2 norm of this process's local pseudo-gradient, before averaging (0: it did not contribute)."""
    attempts: int = 0
    """All-reduce attempts (1 when the first worked)."""
    ring_stats: dict = field(default_factory=dict)
    """Further timings the ring reports (quantize / wire / reduce seconds, ...)."""
    members: list = field(default_factory=list)
    """Nodes that took part in the outer step (ring order)."""
    contributors: int = 0
    """Nodes whose pseudo-gradient is in the average."""
    details: Any = None
    """What the sync reports beyond this (prime.elastic.ElasticReport for elastic nodes)."""
    overlapped: bool = False
    """True with overlap: the average of this outer step is still in flight (applied later), and
    allreduce_s, bytes and attempts describe the average applied since the last one of this fragment."""
    wait_s: float = 0.0
    """Part of outer_s (overlap only): blocked waiting for the previous outer step's average."""
    applied_outer_step: Optional[int] = None
    """The outer step whose average this call applied to the outer weights (overlap: the previous one of this
    fragment; None: none was in flight)."""
    fragment: int = 0
    """The fragment this outer step synced (0 without fragments)."""
    fragments: int = 1
    """How many fragments the model is cut into."""
    share: float = 1.0
    """The fragment's share of the model's values (what data parallelism would have sent scales with it)."""
    pieces: int = 1
    """All-reduces the outer step was pipelined in."""
    dense: bool = False
    """True when the average the bytes describe was one of a sparse codec's dense start (int8; with overlap, the
    average applied here)."""
    weights: Any = None
    """A token-weighted average: every node's inner steps in the window (prime.weights.StepWeights; None: equal
    weights). With overlap, those of the average applied here."""


class _InFlight:
    """One average running on a background thread (overlap): the buffer, the thread, and how it ended."""

    def __init__(self, outer_step: int, inner_step: int, buf: torch.Tensor, base: torch.Tensor,
                 saved: Optional[torch.Tensor], weighing: Optional[Weighing] = None):
        self.outer_step, self.inner_step, self.buf, self.base, self.saved = outer_step, inner_step, buf, base, saved
        self.weighing = weighing
        self.result: Optional[SyncResult] = None
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None

    def run(self, sync, ready: Optional[Any], device: torch.device) -> None:
        try:
            side = None
            if device.type == "cuda":
                torch.cuda.set_device(device)
                # The collective's own copies (a codec staged through the host: the input down, the average and
                # the dropped part up) run on a stream of their own, beside training's kernels, not between them.
                side = collective_stream(device)
            if ready is not None:
                ready.synchronize()  # the pseudo-gradient kernels of the main thread have written buf
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                self._average(sync)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the average is in buf before the main thread reads it
        except BaseException as e:  # handed to the main thread at the next outer step (or close)
            self.error = e

    def _average(self, sync) -> None:
        recompute = None if self.saved is None else (lambda b: b.copy_(self.saved))
        if self.weighing is None:
            self.result = sync.average(self.buf, outer_step=self.outer_step, inner_step=self.inner_step,
                                       recompute=recompute)
        else:  # the token-weighted average (prime.weights)
            self.result = sync.average(self.buf, outer_step=self.outer_step, inner_step=self.inner_step,
                                       recompute=recompute, trained=self.weighing.trained)
            self.result.weights = self.weighing.of(self.result.counts)
            self.buf.mul_(self.result.weights.factor)

    def start(self, sync, ready, device) -> None:
        self.thread = threading.Thread(target=self.run, args=(sync, ready, device), daemon=True,
                                       name=f"prime-outer-allreduce-{self.outer_step}")
        self.thread.start()

    def join(self) -> SyncResult:
        """Waits for the average; returns its SyncResult or raises what the background thread raised."""
        self.thread.join()  # bounded: every wait of the ring has the ring's timeout
        if self.error is not None:
            raise self.error
        return self.result


# -- one fragment's outer step ---------------------------------------------------------------


@dataclass
class FragmentSettings:
    """What every fragment of one DiLoCo shares."""

    sync: Any
    inner_steps: int
    codec: str
    measure_compression_error: bool
    overlap: bool
    overlap_scheme: str
    overlap_steps: int
    fragments: int
    grads: BufferPool
    starts: BufferPool
    keep_input: bool = False
    nodes: Callable[[], int] = lambda: 1
    check_finite: Optional[Callable[[bool, int], None]] = None
    weights: str = "equal"
    """How the nodes' pseudo-gradients count in an average: "equal" or "tokens" (prime.weights)."""
    dense: Callable[[int], bool] = lambda k: False
    """Whether the job's outer step k is one of a sparse codec's dense start (FragmentSchedule.dense)."""

    def own_error_pass(self) -> bool:
        """The int8 error is measured by a pass of our own: asked for, the codec needs one, and the ring cannot
        report it."""
        return self.measure_compression_error and CODECS[self.codec].own_error_pass and \
            not _ring_reports_error(self.sync)


class Fragment:
    """One fragment's outer step: its OuterState, its phase, its average in flight (overlap) and the point its
    inner steps started from (eager overlap schemes). DiLoCo walks its fragments after every inner step:
    apply_due() (overlap: the average in flight, overlap_steps after the sync), then sync_due()."""

    def __init__(self, index: int, state: OuterState, first_phase: int, settings: FragmentSettings,
                 numel_share: float = 1.0, pieces: int = 1):
        self.index, self.state, self.first_phase, self.s = index, state, first_phase, settings
        self.share, self.pieces = numel_share, pieces
        self.outer_step = 0
        """Outer steps of this fragment completed."""
        self.since_sync = 0
        """Inner steps since this fragment's last outer step (nominal steps of the schedule, with time phases)."""
        self.trained = 0
        """Inner steps this node trained since this fragment's last outer step (its weight, prime.weights)."""
        self.early = 0
        """Steps of the current phase a final sync (finish()) already averaged: the phase is that much shorter, so
        that a run resumed from the final checkpoint keeps the schedule (fragments never come due together)."""
        self._pipeline = PipelinedStep(state, settings)  # the synchronous outer step, in pieces
        self.start: Optional[torch.Tensor] = None
        """Overlap: the weights the current inner steps started from, the anchor of this fragment's next
        pseudo-gradient (a work buffer; None: the outer weights). Eager schemes: their lookahead. delayed: set
        only when drain() applied the average in flight before its outer step (a checkpoint): the outer weights
        as they were before it (_keep_anchor)."""
        self.policy: Optional[OverlapPolicy] = make_policy(settings.overlap_scheme, settings) if settings.overlap \
            else None
        """How the inner steps start while this fragment's average is in flight (prime.overlap; None: no overlap)."""
        self._inflight: Optional[_InFlight] = None
        self._midway: Optional[tuple] = None  # (SyncResult, outer step, wait) of an average applied mid-phase

    # -- the schedule -----------------------------------------------------------------

    @property
    def phase(self) -> int:
        """Inner steps of this fragment's current phase (the first is its schedule offset)."""
        return (self.first_phase if self.outer_step == 0 else self.s.inner_steps) - self.early

    def tick(self) -> None:
        self.since_sync += 1

    @property
    def dense_now(self) -> bool:
        """This fragment's outer step now starting (its own count: outer_step) is one of a dense start: the
        lookahead of its pseudo-gradient applies it as the dense start's update does."""
        return self.s.dense(self.s.fragments * self.outer_step + self.index + 1)

    def weighing(self) -> Optional[Weighing]:
        """The weighted average of this window (None: equal weights); the count restarts once it succeeded."""
        if self.s.weights != "tokens":
            return None
        return Weighing(self.trained, self.s.inner_steps)

    def sync_due(self) -> bool:
        return self.since_sync >= self.phase

    def apply_due(self) -> bool:
        """Overlap with overlap_steps shorter than the phase: the average in flight is applied now."""
        s = self.s
        return s.overlap and self.since_sync == s.overlap_steps and s.overlap_steps < s.inner_steps

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    # -- the synchronous outer step (pipelined in pieces) -----------------------------------

    @torch.no_grad()
    def sync(self, inner_step: int, outer_step: int) -> tuple:
        """A synchronous outer step of this fragment, pipelined in `pieces` pieces when there are several
        (prime.pipeline). Returns (SyncResult, timings dict, norm, own error)."""
        out = self._pipeline.run(self.pieces, inner_step, outer_step, self.weighing())
        self.outer_step += 1
        self.since_sync = self.trained = self.early = 0
        return out

    @property
    def pieces_done(self) -> int:
        """Pieces of a pipelined synchronous outer step already applied when it failed part way (0 otherwise):
        the next attempt (also after a resume) does the rest."""
        return self._pipeline.done

    @pieces_done.setter
    def pieces_done(self, value: int) -> None:
        self._pipeline.done = value

    # -- the overlapped outer step ---------------------------------------------------------

    @torch.no_grad()
    def sync_overlapped(self, inner_step: int, outer_step: int) -> tuple:
        """One outer step with overlap (docs/training.md, "Overlapping the all-reduce"):

            d_k    = start_k - local                    pseudo-gradient of the inner steps just done
            wait for avg_{k-1}; outer, momentum = Nesterov(outer, momentum, avg_{k-1})   same on every node
            start_{k+1} = eager: Nesterov lookahead(outer, momentum, d_k)   delayed: outer
            average d_k in the background; local := start_{k+1}

        Returns (SyncResult of the average applied here or None, timings, norm, own error, applied step)."""
        t0 = time.perf_counter()
        st, s = self.state, self.s
        st.ensure_taken()
        base = s.grads.take()  # a second one once: at the second outer step of a whole-phase overlap
        g = base[: st.numel]
        policy = self.policy
        eager = policy.eager
        fused = eager and self.start is None and self._inflight is None  # overlap_steps < the phase (fragments)
        if fused:  # the pseudo-gradient and the next start in one pass over the outer state
            self.start = s.starts.take()[: st.numel]
            sq = st.pseudo_gradient_and_lookahead(g, self.start, scale=policy.scale(), dense=self.dense_now)
        else:
            sq = st.pseudo_gradient(g, anchor=self.start)
        norm = math.sqrt(sq)
        finite = math.isfinite(norm)
        own_err = self._own_error(g, norm) if finite else None  # before the ring overwrites g
        prepare_s = time.perf_counter() - t0
        try:
            s.check_finite(finite, outer_step)
        except BaseException:
            s.grads.give(base)
            raise
        prev, r, wait_s, applied = self._join_previous(base)
        u0 = time.perf_counter()
        self._apply_previous(prev, r)
        if fused:
            policy.seen(sq)
        else:
            policy.next_start(self, g, sq)
        weighing = self.weighing()
        if weighing is not None and weighing.scale != 1.0:  # before the residual: it is part of the contribution
            g.mul_(weighing.scale)
        if st.residual is not None:
            # Error feedback: the contribution leaves now and may fail in the background, where a failed average
            # stops training anyway; so the residual is committed here (d_k above, the stand-in, is unchanged).
            st.compensate(g, commit=True)
        update_s = time.perf_counter() - u0
        self.outer_step += 1
        self.since_sync = self.trained = self.early = 0
        self._launch(_InFlight(outer_step, inner_step, g, base, g.clone() if s.keep_input else None, weighing))
        return r, {"prepare_s": prepare_s, "update_s": update_s, "wait_s": wait_s}, norm, own_err, applied

    def _join_previous(self, base) -> tuple:
        """Waits for the average in flight, if any: (its _InFlight or None, the SyncResult to report, seconds
        waited, the outer step it belongs to). An average already applied midway (after overlap_steps inner steps)
        is reported here instead. A failed one gives both gradient buffers back before it raises."""
        w0 = time.perf_counter()
        prev, r = self._inflight, None
        if prev is not None:
            self._inflight = None
            try:
                r = self._join(prev)
            except BaseException:
                self.s.grads.give(base)
                self.s.grads.give(prev.base)
                raise
        wait_s = time.perf_counter() - w0
        applied = prev.outer_step if prev is not None else None
        if self._midway is not None:  # applied after overlap_steps inner steps: report it here
            r, applied, wait_s = self._midway
            self._midway = None
        return prev, r, wait_s, applied

    def _apply_previous(self, prev, r) -> None:
        """The average of the outer step before (prev: its _InFlight), in order, the same on every node: the outer
        update, what its selections dropped into the residual, the policy told its size. Without one, a delayed
        scheme loads the outer weights into the model (eager ones start from their lookahead)."""
        st, s = self.state, self.s
        if prev is not None:
            s.sync.applying(r)
            a_sq = st.update(prev.buf, load=not self.policy.eager, norm=True, dense=s.dense(prev.outer_step))
            st.add_to_residual(s.sync.take_dropped(prev.buf))
            s.sync.committed(r)
            self.policy.adapt(a_sq)
            s.grads.give(prev.base)
        elif not self.policy.eager:
            st.load_into_model()

    def _launch(self, flight: "_InFlight") -> None:
        """Starts the average of this outer step's contribution in the background, once the current stream has
        written it (a CUDA event the ring waits on)."""
        g = flight.buf
        ready = None
        if g.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(g.device))
        flight.start(self.s.sync, ready, g.device)
        self._inflight = flight

    def _start_pool(self) -> BufferPool:
        """Where `start` comes from: the start buffers of eager schemes; delayed (which has none) borrows a
        pseudo-gradient buffer: a whole-phase overlap has two and uses one between outer steps, so its anchor
        needs no memory beyond the second, which its next outer step takes anyway."""
        return self.s.starts if self.policy is None or self.policy.eager else self.s.grads

    def _give_start(self) -> None:
        if self.start is not None:
            self._start_pool().give(self.start._base if self.start._base is not None else self.start)
            self.start = None

    def _keep_anchor(self) -> None:
        """delayed, before drain() applies the average in flight to the outer weights: the current inner steps
        started from the outer weights as they are now, and the next pseudo-gradient must be taken from there
        (as it is when the average lands at its outer step); they are kept in `start`, its anchor, until then.
        Eager schemes keep theirs in `start` already."""
        if self.policy is None or self.policy.eager or self.start is not None:
            return
        start = self._start_pool().take()[: self.state.numel]
        start.copy_(self.state.outer)  # fp32 to fp32, from a resident, pinned or plain home: the same bits
        self.start = start

    @torch.no_grad()
    def apply_midway(self) -> None:
        """overlap_steps < inner_steps, after overlap_steps inner steps: apply the average in flight to the outer
        weights, then shift the local weights by (outer weights - start point), so that the inner steps go on
        from where they would be had they started from the outer weights; the outer weights become the anchor
        of this fragment's next pseudo-gradient. (A checkpoint may have applied the average already.)"""
        t0 = time.perf_counter()
        flight, self._inflight = self._inflight, None
        keep = self.policy.keep
        if flight is not None:
            r = self._join(flight)
            self.s.sync.applying(r)
            dense = self.s.dense(flight.outer_step)
            if self.start is not None:  # the update and the shift in one pass over the outer state
                self.policy.adapt(self.state.update(flight.buf, norm=True, shift=self.start, keep=keep,
                                                    dense=dense))
                self._give_start()
            else:
                self.policy.adapt(self.state.update(flight.buf, norm=True, dense=dense))
            self.state.add_to_residual(self.s.sync.take_dropped(flight.buf))
            self.s.sync.committed(r)
            self.s.grads.give(flight.base)
            self._midway = (r, flight.outer_step, time.perf_counter() - t0)
        if self.start is not None:  # (a checkpoint applied the average already)
            self.state.shift_to_outer(self.start, keep)  # keep alpha of the offset: the inner steps undid part
            self._give_start()

    def _join(self, flight: _InFlight) -> SyncResult:
        """The average of `flight`, or OuterSyncError: an outer step whose average failed is never applied, on
        any node."""
        try:
            return flight.join()
        except OuterSyncError as e:
            raise OuterSyncError(f"{e} (overlap: the average of outer step {flight.outer_step} is dropped)") from e

    def drain(self) -> Optional[int]:
        """Waits for the average in flight and applies it to the outer weights (not to the model). Returns the
        outer step it completed, or None when nothing was in flight. Bit for bit the same state as applying it
        at its due time: nothing else touches this fragment's outer weights in between; and a delayed scheme,
        whose next pseudo-gradient is taken from the outer weights, first keeps them as they were in `start`
        (_keep_anchor), so that it is the same too."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return None
        r = self._join(flight)
        self._keep_anchor()  # delayed: the next pseudo-gradient's anchor, before the outer weights move
        self.s.sync.applying(r)
        self.policy.adapt(self.state.update(flight.buf, norm=True, dense=self.s.dense(flight.outer_step)))
        self.state.add_to_residual(self.s.sync.take_dropped(flight.buf))
        self.s.sync.committed(r)
        self.s.grads.give(flight.base)
        return flight.outer_step

    def _own_error(self, g: torch.Tensor, norm: float) -> Optional[float]:
        """The int8 error by a pass of our own, only when it is asked for and the ring cannot report it."""
        if not self.s.own_error_pass():
            return None
        return math.sqrt(self.state.int8_error_sq(g)) / norm if norm > 0 else 0.0

    def forget_flight_state(self) -> None:
        """A node that (re)joins the job: no start point, no pieces done, no adaptive history of its own."""
        self._give_start()
        self.pieces_done = 0
        self._midway = None
        if self.policy is not None:
            self.policy.reset()

    def abandon(self, wait: bool = True) -> Optional[BaseException]:
        """close(): waits for an average still in flight without applying it; returns its error, if any. With
        wait=False (a run that stops on a signal) an average still running is left to its daemon thread and
        reported as an error."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return None
        flight.thread.join(timeout=None if wait else 0.5)
        if flight.thread.is_alive():
            return RuntimeError("still running when the run stopped; left behind")
        return flight.error

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Counters, outer weights and momentum (after draining the average in flight), and the overlap start:
        "start" for eager schemes, "anchor" for delayed (the outer weights before the drained average, only
        while its outer step is still to come)."""
        self.drain()
        sd = {"outer_step": self.outer_step, "since_sync": self.since_sync}
        if self.s.weights == "tokens":
            sd["trained"] = self.trained
        if self.early:
            sd["early"] = self.early
        sd.update(self.state.state_dict())
        if self.start is not None:
            sd[self._start_key()] = self.start.cpu()
        if self.policy is not None:
            sd.update(self.policy.state_dict())
        if self.pieces_done:
            sd["pieces_done"] = self.pieces_done
        return sd

    def load_state_dict(self, sd: dict, counters: bool = True) -> None:
        if counters:
            self.outer_step, self.since_sync = int(sd["outer_step"]), int(sd["since_sync"])
            self.trained = int(sd.get("trained", self.since_sync))
            self.early = int(sd.get("early", 0))
        self.pieces_done = int(sd.get("pieces_done", 0))
        if "outer" not in sd:
            return
        self.state.load_state_dict(sd)
        key = self._start_key()
        if self.policy is not None and key in sd:
            if self.start is None:
                self.start = self._start_pool().take()[: self.state.numel]
            self.start.copy_(sd[key])
        else:
            self._give_start()
        if self.policy is not None:
            self.policy.load_state_dict(sd)

    def _start_key(self) -> str:
        """The key of `start` in state_dict(): "start" (eager schemes' lookahead) or "anchor" (delayed's kept
        outer weights); a run resumed with another scheme ignores the other's."""
        return "anchor" if self.policy is not None and not self.policy.eager else "start"

    @property
    def alpha(self) -> float:
        """eager-adaptive: the weight of the local pseudo-gradient in the next lookahead (1 otherwise)."""
        return self.policy.alpha if self.policy is not None else 1.0


def _ring_reports_error(sync) -> bool:
    return bool(getattr(sync, "reports_quant_error", False))
