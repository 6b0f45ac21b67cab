"""DiLoCo: the outer step. Pseudo-gradient, average across nodes, outer update, sync cadence.

    model = ...; opt = torch.optim.AdamW(model.parameters(), ...)
    with prime.DiLoCo(model, opt, ring, inner_steps=100) as diloco:
        for batch in data:
            loss(model, batch).backward(); opt.step(); opt.zero_grad()
            # every 100 opt.step() calls, opt.step() also runs an outer step (diloco.result says how it went)

or, without `with`, call `diloco.step()` after every inner step (forgetting it
is an error at the next `opt.step()`).

Every `inner_steps` inner steps, for the parameters this process holds (the
local shard of each FSDP2 DTensor, or the whole tensor of a plain module):

    pseudo_gradient = outer_weights - local_weights          (fp32, on CPU; prime.outer.OuterState)
    average it across nodes                                 (prime.sync: a ring, or elastic membership)
    outer_weights = outer_update(outer_weights, average)    (Nesterov SGD by default)
    local_weights = outer_weights

The outer weights are taken from the model at the first inner step (or by
reset_outer()), so weights loaded after construction are kept. The default
outer update rounds once per elementwise operation and never fuses a
multiply-add, so every node computes the same bits on any CPU
(prime/outer.py); the average is bit-identical everywhere (the ring
guarantees it).

Failure: the sync retries or gives up with OuterSyncError, leaving the outer
weights as they were: the caller saves a checkpoint and stops. It never
continues with replicas that differ.

With overlap=True the average of outer step k runs on a background thread
during the inner steps of outer step k+1 and is applied after overlap_steps of
them (default: at outer step k+1); meanwhile the inner steps start from the
outer update the local pseudo-gradient would give (the eager scheme). The
outer weights and momentum only ever receive averages, in order, so they stay
bit-identical on every node. docs/training.md, "Overlapping the all-reduce",
has the math and a worked example.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from prime.outer import OUTER_STATE_DEVICES, OuterOptimizerFactory, OuterState
from prime.sync import (OuterSyncError, ReplicaMismatchError, RingSync, Sync, SyncResult, node_local_group,
                        work_stats)

__all__ = ["DiLoCo", "OuterStepResult", "OuterSyncError", "ReplicaMismatchError", "work_stats", "OVERLAP_SCHEMES"]

logger = logging.getLogger("prime.diloco")

OVERLAP_SCHEMES = ("eager", "eager-adaptive", "delayed", "eager-merge")
"""How the next inner steps start while the average of the last outer step is in flight (docs/training.md,
"Overlapping the all-reduce"): "eager" from the outer update the local pseudo-gradient would give (the local
pseudo-gradient stands in for the average), "eager-adaptive" from the one alpha times it would give, alpha =
||a||^2 / ||d||^2 of the previous outer step clamped to [1/nodes, 1] (the least-squares shrink of a noisy
local estimate), "delayed" from the outer weights as they are (without the step in flight), "eager-merge" as
eager, but when the average arrives the local weights keep MERGE_ALPHA of their start point's offset from the
outer weights (Streaming DiLoCo's merge), so that the next start does not echo the part of the offset that
the inner steps already undid; with overlap_steps < inner_steps its start is the lookahead of stand_in_share()
of the local pseudo-gradient (the nodes' starts spread less; the shift after overlap_steps corrects the lag)."""

STAND_IN_OTHERS = 0.5
"""eager-merge with overlap_steps < inner_steps: the weight of the local pseudo-gradient as a stand-in for the
other nodes' part of the average (stand_in_share()). Measured in benchmarks/RESULTS.md, "Overlap at longer
phases: the stand-in share"."""


def stand_in_share(nodes: int) -> float:
    """eager-merge with overlap_steps < inner_steps: the next start is the lookahead of this share of the local
    pseudo-gradient: its own part of the average, 1/nodes, in full, and the other nodes' part, 1 - 1/nodes,
    estimated by STAND_IN_OTHERS times it (a noisy local estimate, shrunk). The common lag this leaves is
    corrected by the shift after overlap_steps. One node: 1, the synchronous outer step."""
    return 1.0 / nodes + (1.0 - 1.0 / nodes) * STAND_IN_OTHERS


MERGE_ALPHA = 0.5
"""eager-merge: the share of the start point's offset (start - outer weights) that the local weights keep when
the average arrives. 1/2 is Streaming DiLoCo's mixing factor, and the value that keeps the node's offset
from growing whatever fraction c in [0, 1] of it the inner steps undo (the offset of the next start is
-lr (1 + mu) (c - 1/2) times this one, plus fresh noise: a gain below 1 while lr (1 + mu) < 2); measured in benchmarks/RESULTS.md, "Overlap:
the eager-merge scheme"."""


@dataclass
class OuterStepResult:
    """What `DiLoCo.step()` did."""

    did_sync: bool
    """True when this call ran an outer step."""
    inner_step: int
    """Inner steps taken so far (this call included)."""
    outer_step: int
    """Outer steps completed so far."""
    numel: int = 0
    """Values all-reduced by this process (its shard, padded to whole codec blocks)."""
    allreduce_s: float = 0.0
    """Wall time of the average across nodes (all attempts)."""
    outer_s: float = 0.0
    """Wall time of the whole outer step: copies, all-reduce, outer update."""
    prepare_s: float = 0.0
    """Part of outer_s: device-to-host copy and pseudo-gradient, its norm and (when measured and the ring does not
    report it) its int8 error."""
    update_s: float = 0.0
    """Part of outer_s: the outer update of the outer weights and the host-to-device copy back."""
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
    """True with overlap: the average of this outer step is still in flight (applied at the next one), and
    allreduce_s, bytes and attempts describe the average applied here, that of the previous outer step."""
    wait_s: float = 0.0
    """Part of outer_s (overlap only): blocked waiting for the previous outer step's average."""
    applied_outer_step: Optional[int] = None
    """The outer step whose average this call applied to the outer weights (overlap: the previous one;
    None: none was in flight)."""


class _InFlight:
    """One average running on a background thread (overlap): the buffer, the thread, and how it ended."""

    def __init__(self, outer_step: int, inner_step: int, buf: torch.Tensor, saved: Optional[torch.Tensor]):
        self.outer_step, self.inner_step, self.buf, self.saved = outer_step, inner_step, buf, saved
        self.result: Optional[SyncResult] = None
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None

    def run(self, sync, ready: Optional[Any], device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if ready is not None:
                ready.synchronize()  # the pseudo-gradient kernels of the main thread have written buf
            recompute = None if self.saved is None else (lambda b: b.copy_(self.saved))
            self.result = sync.average(self.buf, outer_step=self.outer_step, inner_step=self.inner_step,
                                       recompute=recompute)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the average is in buf before the main thread reads it
        except BaseException as e:  # handed to the main thread at the next outer step (or close)
            self.error = e

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


class DiLoCo:
    """Outer optimization across nodes for one process's share of a model.

    model:            a plain nn.Module or one sharded with FSDP2 `fully_shard`
                      (each process then handles only its local shards)
    inner_optimizer:  the optimizer of the inner steps (build it after fully_shard).
                      Its step hooks take the outer weights before its first step,
                      check that step() is not forgotten, and, inside `with diloco:`,
                      run step() after each of its steps (a step with lr 0 in every
                      group, as torch.distributed.checkpoint takes to initialize the
                      optimizer's state, changes nothing and is not counted). None:
                      call reset_outer() and step() yourself (the outer weights are
                      taken at construction)
    sync:             a prime.comm.Ring joining this process with its peers on the
                      other nodes (local rank g of every node), or a prime.sync.Sync
                      (e.g. prime.elastic.ElasticSync), or None for a single node:
                      step() then only counts steps. A ring or sync passed in stays
                      the caller's: close() does not close it
    inner_steps:      H, inner steps between outer steps
    outer_lr, outer_momentum, nesterov: the default outer update (bit-identical on
                      every node, see prime/outer.py)
    outer_optimizer:  outer_optimizer(params) -> any torch optimizer over the outer
                      parameters (fp32 CPU tensors, one per model parameter), in place
                      of the default update. Nodes then agree bit for bit only when
                      they run the same torch build on the same CPU instruction set
    codec:            "int8" (default) or "none". int8 sends about a quarter of the
                      bytes of fp32 but each node's pseudo-gradient is quantized with
                      a relative L2 error of about 1% per node (OuterStepResult.
                      compression_error); the average is then not the exact one.
                      codec="none" averages in exact fp32 (4x the bytes)
    block_size:       int8 block size; each parameter starts a new block
    ring_factory:     ring_factory(tag) -> new Ring, used to retry after a failure
                      (with a ring or sync=None; None: no retries)
    retries:          retries per outer step when ring_factory is given
    local_group:      process group of this node's processes, to agree on failures;
                      default: derived from torchrun's local world (the default group
                      when WORLD_SIZE == LOCAL_WORLD_SIZE); a group spanning nodes is
                      refused (ValueError)
    measure_compression_error: compute OuterStepResult.compression_error (from the
                      ring's own statistics when it reports them, prime.sync.
                      QUANT_ERROR_FIELDS; else by a quantize/dequantize pass of its own)
    check_replicas:   compare weights and settings across nodes at the first
                      outer step (see check_replicas())
    overlap:          run the average of outer step k on a background thread while
                      the inner steps of outer step k+1 proceed; it is applied at
                      outer step k+1 (docs/training.md, "Overlapping the all-reduce").
                      Needs a ring (or RingSync), not an elastic sync. Call finish()
                      at the end of training to apply the last one
    overlap_scheme:   "eager-merge" (default: eager, but when the average arrives the
                      local weights keep half of their start point's offset from the
                      outer weights, and with overlap_steps < inner_steps the start
                      is the lookahead of a shrunk local pseudo-gradient,
                      stand_in_share(): the smallest loss cost at high overlap_steps),
                      "eager" (the inner steps start from the outer update the local
                      pseudo-gradient would give), "eager-adaptive" (the local
                      pseudo-gradient shrunk by how much of it the last average
                      kept) or "delayed" (from the outer weights without the step in
                      flight); see
                      OVERLAP_SCHEMES
    overlap_steps:    with overlap, apply the average in flight after this many inner
                      steps of the next outer step, shifting the local weights by what
                      the start point missed (None: inner_steps, the whole phase).
                      Fewer steps cost less loss; enough to hide the wire is enough.
                      Below inner_steps it needs an eager scheme
    outer_state_device: "cpu", "gpu" or "auto" (default): where the outer weights and
                      momentum live (prime/outer.py); "auto" picks the parameters' GPU
                      when they fit in its free memory less the gradients and inner
                      optimizer state still to come and a margin for activations
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Optional[torch.optim.Optimizer],
        sync=None,
        *,
        inner_steps: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        codec: str = "int8",
        block_size: int = 256,
        ring_factory: Optional[Callable[[str], object]] = None,
        retries: int = 2,
        local_group=None,
        measure_compression_error: bool = True,
        check_replicas: bool = True,
        overlap: bool = False,
        overlap_scheme: str = "eager-merge",
        outer_state_device: str = "auto",
        overlap_steps: Optional[int] = None,
    ):
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        if codec not in ("int8", "fp4", "none"):
            raise ValueError(f"codec must be 'int8', 'fp4' or 'none', got {codec!r}")
        if block_size < 32 or block_size > 4096 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two from 32 to 4096, got {block_size}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if overlap_scheme not in OVERLAP_SCHEMES:
            raise ValueError(f"overlap_scheme must be one of {', '.join(OVERLAP_SCHEMES)}, got {overlap_scheme!r}")
        overlap_steps = inner_steps if overlap_steps is None else overlap_steps
        if not 1 <= overlap_steps <= inner_steps:
            raise ValueError(f"overlap_steps must be in [1, inner_steps={inner_steps}], got {overlap_steps}")
        if overlap and overlap_steps < inner_steps and not overlap_scheme.startswith("eager"):
            raise ValueError(f"overlap_steps < inner_steps needs an eager overlap_scheme, got {overlap_scheme!r}")
        if outer_state_device not in OUTER_STATE_DEVICES:
            raise ValueError(f"outer_state_device must be 'cpu', 'gpu' or 'auto', got {outer_state_device!r}")
        if overlap and overlap_scheme.startswith("eager") and outer_optimizer is not None:
            raise ValueError(f"overlap with overlap_scheme={overlap_scheme!r} needs the default outer update (its lookahead "
                             "is the Nesterov step without the momentum write); use outer_optimizer=None or "
                             "overlap_scheme='delayed'")
        self.model = model
        params = list(model.parameters())
        if inner_optimizer is not None:
            ids = {id(p) for p in params}
            stray = sum(1 for g in inner_optimizer.param_groups for p in g["params"] if id(p) not in ids)
            if stray:
                raise ValueError(
                    f"the inner optimizer holds {stray} tensors that are not parameters of the model; "
                    "build the optimizer after fully_shard(), which replaces the parameters"
                )
        self.inner_optimizer = inner_optimizer
        self.inner_steps, self.codec, self.block_size = inner_steps, codec, block_size
        self.measure_compression_error = measure_compression_error and codec == "int8"
        if isinstance(sync, Sync):
            if ring_factory is not None or local_group is not None:
                raise ValueError("ring_factory and local_group belong to the ring: give them to the Sync, "
                                 "not to DiLoCo, when passing a Sync")
            self._sync, self._owns_sync = sync, False
        elif sync is not None or ring_factory is not None:
            self._sync = RingSync(sync, ring_factory=ring_factory, retries=retries,
                                  local_group=node_local_group(local_group))
            self._owns_sync = True
        else:
            self._sync, self._owns_sync = None, False
        if overlap and self._sync is not None and not isinstance(self._sync, RingSync):
            raise ValueError(
                f"overlap=True needs a ring (or a prime.sync.RingSync); {type(self._sync).__name__} cannot average "
                "in the background (elastic membership decides who contributes at each outer step)")
        if self._sync is not None and not isinstance(self._sync, RingSync):
            # Another sync (elastic) reads and writes the outer state through the CPU (state transfer, digests).
            if outer_state_device == "gpu":
                raise ValueError(f"outer_state_device='gpu' needs a ring (or a prime.sync.RingSync); "
                                 f"{type(self._sync).__name__} keeps the outer state in CPU memory")
            outer_state_device = "cpu"
        self.overlap = overlap and self._sync is not None
        """True when the all-reduce of each outer step runs during the next inner steps."""
        self.overlap_scheme = overlap_scheme
        self.overlap_steps = overlap_steps
        self.distributed = self._sync is not None
        """True when outer steps run (a ring or sync was given); False: step() only counts."""
        self._check_pending = check_replicas and self.distributed
        self.inner_step = 0  # inner steps taken in total
        self.outer_step = 0  # outer steps completed
        self.since_sync = 0  # inner steps since the last outer step
        self.result: Optional[OuterStepResult] = None
        """The result of the latest step() (also of the ones the optimizer hook runs)."""
        self.state: Optional[OuterState] = None
        """The outer weights and momentum (None on a single node)."""
        if self.distributed:
            extra = (1 if overlap_scheme == "delayed" else 2) + (outer_optimizer is not None)
            self.state = OuterState(params, block_size=block_size, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                    nesterov=nesterov, optimizer_factory=outer_optimizer, device=outer_state_device,
                                    extra_buffers=extra if self.overlap else 0, inner_optimizer=inner_optimizer)
            self._sync.bind(self.state, self.settings())
            if inner_optimizer is None:
                self.state.take()  # no first inner step to wait for
        # Overlap: the average in flight, the buffer the next pseudo-gradient goes to, and (eager) the
        # point the current inner steps started from, when it is not the outer weights.
        self._inflight: Optional[_InFlight] = None
        self._pool: list = []  # free pseudo-gradient buffers (at most one: with the one in flight, two in all)
        self.start: Optional[torch.Tensor] = None
        """Eager overlap: the weights the current inner steps started from (None: the outer weights)."""
        self.alpha = 1.0
        """eager-adaptive: the weight of the local pseudo-gradient in the next lookahead."""
        self._last_sq: Optional[float] = None  # eager-adaptive: ||d||^2 of the pseudo-gradient in flight
        self._keep_input = False
        self._midway: Optional[tuple] = None  # (SyncResult, outer step, wait) of an average applied mid-phase
        self._start_buf: Optional[torch.Tensor] = None
        if self.overlap:
            # st.grad is free with the default update; a custom optimizer reads its .grad, which must never be
            # the buffer being averaged.
            self._pool = [self.state.grad if self.state.optimizer is None else self.state.new_buffer()]
            self._sync.use_from_background()
            # A retry on a multi-process node may need this process's input back after its own all-reduce worked.
            self._keep_input = self._sync.average_group is not None and self._sync.ring_factory is not None
        # Hooks: the pre-hook runs before every inner step, the post-hook only inside `with`.
        self._unstepped = 0  # inner optimizer steps since the last step() call
        self._post_hook = None
        self._pre_hook = inner_optimizer.register_step_pre_hook(self._before_inner_step) if inner_optimizer else None

    def settings(self) -> dict:
        """What every node must share: the cadence, the codec, overlap and the outer update over the same shapes."""
        s = {"inner_steps": self.inner_steps, "codec": self.codec, "block_size": self.block_size}
        if self.overlap:
            s["overlap"] = self.overlap_scheme
            s["overlap_steps"] = self.overlap_steps
        if self.state is not None:
            s.update(self.state.settings())
        return s

    # -- the hook form -------------------------------------------------------------

    def __enter__(self) -> "DiLoCo":
        """Inside `with diloco:`, every inner_optimizer.step() also runs step(); leaving closes (see close())."""
        if self.inner_optimizer is None:
            raise RuntimeError("`with DiLoCo(...)` needs the inner optimizer, whose step hook drives the outer "
                               "steps; without one, call step() after every inner step")
        if self._post_hook is None:
            self._post_hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except OuterSyncError as e:
            if exc is None:
                raise
            logger.error("while leaving `with diloco:` on %s: %s", exc_type.__name__, e)  # the first error wins

    def _is_inner_step(self) -> bool:
        # torch.distributed.checkpoint initializes optimizer state with a step at lr 0 in every group
        # (torch's _init_optim_state): it changes nothing and is not an inner step.
        return any(float(g.get("lr", 1.0)) != 0.0 for g in self.inner_optimizer.param_groups)

    def _after_inner_step(self, *_) -> None:
        if self._is_inner_step():
            self._count()

    def _before_inner_step(self, *_) -> None:
        if not self._is_inner_step():
            return
        if self.state is not None:
            self.state.ensure_taken()  # the first inner step: weights loaded after construction are kept
        if self._post_hook is None and self._unstepped >= 1:
            raise RuntimeError(
                "the inner optimizer stepped twice without DiLoCo.step() in between, so no outer step would ever "
                "run: call diloco.step() after every inner_optimizer.step(), or use `with diloco:` to let the "
                "optimizer's step hook do it")
        self._unstepped += 1

    def reset_outer(self) -> None:
        """Outer weights := the model's current weights (momentum kept). Call after loading weights when
        no inner optimizer was given; with one, its first step does this."""
        if self.state is not None:
            self.state.take()

    # -- the step ----------------------------------------------------------------------

    def step(self) -> OuterStepResult:
        """Call after every inner optimizer step (not inside `with diloco:`, where the optimizer's hook
        calls it). Runs an outer step when inner_steps steps have passed; returns what it did."""
        if self._post_hook is not None:
            raise RuntimeError("inside `with diloco:` the inner optimizer's step hook runs DiLoCo.step(); "
                               "calling it as well would count every inner step twice")
        return self._count()

    def _count(self) -> OuterStepResult:
        self._unstepped = 0
        self.inner_step += 1
        self.since_sync += 1
        if not self.distributed:
            self.since_sync = 0
            self.result = OuterStepResult(False, self.inner_step, self.outer_step)
        elif self.since_sync < self.inner_steps:
            if self.overlap and self.since_sync == self.overlap_steps:
                self._apply_midway()
            self.result = OuterStepResult(False, self.inner_step, self.outer_step)
        else:
            self.result = self.sync()
        return self.result

    @torch.no_grad()
    def sync(self) -> OuterStepResult:
        """Runs an outer step now. Raises OuterSyncError (weights unchanged) when the average keeps failing.

        With overlap, the average of this outer step is started in the background and the one of the
        previous outer step is applied (its failure raises OuterSyncError here)."""
        if not self.distributed:
            raise RuntimeError("DiLoCo.sync() needs a ring or a sync; this DiLoCo was built with sync=None")
        if self.overlap:
            return self._sync_overlapped()
        t0 = time.perf_counter()
        if self._check_pending:
            self.check_replicas()
        st = self.state
        st.ensure_taken()
        g = st.grad
        norm = math.sqrt(st.pseudo_gradient(g))
        finite = math.isfinite(norm)
        comp_err = self._own_error(g, norm) if finite else None
        prepare_s = time.perf_counter() - t0
        self._agree_finite(finite)
        r: SyncResult = self._sync.average(g, outer_step=self.outer_step + 1, inner_step=self.inner_step,
                                           recompute=st.pseudo_gradient)
        u0 = time.perf_counter()
        st.update(g, load=True)
        update_s = time.perf_counter() - u0
        self.outer_step = self.outer_step + 1 if r.outer_step is None else r.outer_step
        if r.inner_step is not None:
            self.inner_step = r.inner_step  # elastic: a node that joined takes the job's step
        self.since_sync = 0
        self._sync.committed(r)
        return self._result(r, t0, prepare_s, update_s, norm if r.contributed else 0.0,
                            self._ring_error(r, comp_err) if r.contributed else None)

    def _own_error(self, g: torch.Tensor, norm: float) -> Optional[float]:
        """The int8 error by a pass of our own, only when it is asked for and the ring cannot report it."""
        if not self.measure_compression_error or self._ring_reports_error():
            return None
        return math.sqrt(self.state.int8_error_sq(g)) / norm if norm > 0 else 0.0

    def _ring_reports_error(self) -> bool:
        ring = getattr(self._sync, "ring", None)
        return bool(getattr(ring, "reports_quant_error", False))

    def _ring_error(self, r: SyncResult, own: Optional[float]) -> Optional[float]:
        if not self.measure_compression_error:
            return None
        err, ref = r.stats.get("quant_err_sq"), r.stats.get("quant_in_sq")
        if err is not None and ref is not None:
            return math.sqrt(err / ref) if ref > 0 else 0.0
        return own

    def _agree_finite(self, finite: bool) -> None:
        if not self._sync.agree(finite):
            raise OuterSyncError(
                f"outer step {self.outer_step + 1}: the pseudo-gradient is not finite "
                f"({'here' if not finite else 'on another process of this node'}): inner training diverged; "
                "lower optim.lr or resume from an earlier checkpoint"
            )

    def _result(self, r: Optional[SyncResult], t0: float, prepare_s: float, update_s: float, norm: float,
                comp_err: Optional[float], **extra) -> OuterStepResult:
        stats = dict(r.stats) if r is not None else {}
        for name in ("quant_err_sq", "quant_in_sq"):
            stats.pop(name, None)
        return OuterStepResult(
            did_sync=True,
            inner_step=self.inner_step,
            outer_step=self.outer_step,
            numel=self.state.numel,
            allreduce_s=r.allreduce_s if r is not None else 0.0,
            outer_s=time.perf_counter() - t0,
            prepare_s=prepare_s,
            update_s=update_s,
            bytes_sent=stats.pop("bytes_sent", None),
            bytes_received=stats.pop("bytes_received", None),
            compression_error=comp_err,
            pseudo_grad_norm=norm,
            attempts=r.attempts if r is not None else 0,
            ring_stats=stats,
            members=list(r.members) if r is not None else [],
            contributors=r.contributors if r is not None else 0,
            details=r.details if r is not None else None,
            **extra,
        )

    # -- overlap ------------------------------------------------------------------------

    def _sync_overlapped(self) -> OuterStepResult:
        """One outer step with overlap (docs/training.md, "Overlapping the all-reduce"):

            d_k    = start_k - local                    pseudo-gradient of the inner steps just done
            wait for avg_{k-1}; outer, momentum = Nesterov(outer, momentum, avg_{k-1})   same on every node
            start_{k+1} = eager: Nesterov lookahead(outer, momentum, d_k)   delayed: outer
            average d_k in the background; local := start_{k+1}
        """
        t0 = time.perf_counter()
        if self._check_pending:
            self._drain()
            self.check_replicas()
        st = self.state
        st.ensure_taken()
        g = self._pool.pop() if self._pool else st.new_buffer()  # a new one once: at the second outer step
        sq = st.pseudo_gradient(g, anchor=self.start)
        norm = math.sqrt(sq)
        finite = math.isfinite(norm)
        own_err = self._own_error(g, norm) if finite else None  # before the ring overwrites g
        prepare_s = time.perf_counter() - t0
        self._agree_finite(finite)
        w0 = time.perf_counter()
        prev, r = self._inflight, None
        if prev is not None:
            self._inflight = None
            r = self._join(prev)
        wait_s = time.perf_counter() - w0
        applied = prev.outer_step if prev is not None else None
        if self._midway is not None:  # applied after overlap_steps inner steps: report it here
            r, applied, wait_s = self._midway
            self._midway = None
        u0 = time.perf_counter()
        eager = self.overlap_scheme.startswith("eager")
        if prev is not None:
            a_sq = st.update(prev.buf, load=not eager, norm=True)  # the average of k-1, in order, everywhere
            self._adapt(a_sq)
            self._pool.append(prev.buf)
        elif not eager:
            st.load_into_model()
        if eager:
            src = g
            if self.start is None:
                self.start = self._start_buf if self._start_buf is not None else st.new_buffer()
            elif self.overlap_scheme == "eager-merge":
                # overlap_steps = inner_steps: the average arrived at this boundary. The local weights, merged,
                # would be x + (1 - alpha)(w - s): their pseudo-gradient from w is d - alpha (s - w).
                src = self._merge_stand_in(g)
            st.lookahead(src, self.start, load=True, scale=self._stand_in_scale())
            self._last_sq = sq
        else:
            self.start = None
        update_s = time.perf_counter() - u0
        self.outer_step += 1
        self.since_sync = 0
        flight = _InFlight(self.outer_step, self.inner_step, g, g.clone() if self._keep_input else None)
        ready = None
        if g.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(g.device))
        flight.start(self._sync, ready, g.device)
        self._inflight = flight
        return self._result(r, t0, prepare_s, update_s, norm, self._ring_error(r, own_err) if r else own_err,
                            overlapped=True, wait_s=wait_s, applied_outer_step=applied)

    def _stand_in_scale(self) -> Optional[float]:
        """The factor of the stand-in in the next lookahead (None: 1): eager-adaptive's alpha; eager-merge with
        overlap_steps < inner_steps, stand_in_share() of the ring's nodes (over the whole phase no shift follows
        that would correct the lag of a shrunk stand-in: measured worse, so the stand-in stays whole)."""
        if self.overlap_scheme == "eager-adaptive":
            scale = self.alpha
        elif self.overlap_scheme == "eager-merge" and self.overlap_steps < self.inner_steps:
            scale = stand_in_share(self._sync.world_size)
        else:
            return None
        return None if scale == 1.0 else scale

    @torch.no_grad()
    def _apply_midway(self) -> None:
        """overlap_steps < inner_steps, after overlap_steps inner steps: apply the average in flight to the outer
        weights, then shift the local weights by (outer weights - start point), so that the inner steps go on
        from where they would be had they started from the outer weights; the outer weights become the anchor
        of this outer step's pseudo-gradient. (A checkpoint may have applied the average already.)"""
        t0 = time.perf_counter()
        flight, self._inflight = self._inflight, None
        if flight is not None:
            r = self._join(flight)
            self._adapt(self.state.update(flight.buf, norm=True))
            self._pool.append(flight.buf)
            self._midway = (r, flight.outer_step, time.perf_counter() - t0)
        if self.start is not None:
            st = self.state
            torch.sub(st.outer, self.start, out=self.start)  # what the start point missed
            if self.overlap_scheme == "eager-merge":
                self.start.mul_(1.0 - MERGE_ALPHA)  # keep alpha of the offset: the inner steps undid part of it
            st.add_to_model(self.start)
            self._start_buf, self.start = self.start, None  # the buffer is reused at the next outer step

    def _merge_stand_in(self, g: torch.Tensor) -> torch.Tensor:
        """eager-merge at a boundary with the start still set (the average applied at the boundary): the start
        buffer := g - alpha (start - outer weights), each operation rounded once; returns it (lookahead reads
        each chunk before writing it, so it may be both the input and the output)."""
        s = self.start
        torch.sub(s, self.state.outer, out=s)  # the start point's offset from the new outer weights
        s.mul_(MERGE_ALPHA)
        torch.sub(g, s, out=s)
        return s

    def _join(self, flight: _InFlight) -> SyncResult:
        """The average of `flight`, or OuterSyncError: an outer step whose average failed is never applied, on
        any node."""
        try:
            r = flight.join()
        except OuterSyncError as e:
            raise OuterSyncError(f"{e} (overlap: the average of outer step {flight.outer_step} is dropped)") from e
        self._sync.committed(r)
        return r

    def _drain(self) -> Optional[int]:
        """Waits for the average in flight and applies it to the outer weights (not to the model). Returns
        the outer step it completed, or None when nothing was in flight. Bit for bit the same state as
        applying it at the next outer step: nothing else touches the outer weights in between."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return None
        self._join(flight)
        self._adapt(self.state.update(flight.buf, norm=True))
        if not self._pool:
            self._pool.append(flight.buf)
        return flight.outer_step

    def _adapt(self, a_sq: float) -> None:
        """eager-adaptive: alpha = ||a||^2 / ||d||^2 (the average against this node's own pseudo-gradient of the
        same outer step), clamped to [1/nodes, 1]. With nodes' pseudo-gradients d_r = mu + e_r (e_r independent,
        of variance s^2), the least-squares weight of d_r as an estimate of their mean is
        (|mu|^2 + s^2/n) / (|mu|^2 + s^2) = E||a||^2 / E||d_r||^2."""
        if self.overlap_scheme != "eager-adaptive" or not self._last_sq or not math.isfinite(a_sq):
            return
        lo = 1.0 / self._sync.world_size
        self.alpha = min(1.0, max(lo, a_sq / self._last_sq))

    def finish(self) -> None:
        """End of training with overlap: waits for the last average and applies it; when the inner steps end
        on an outer step, the model gets the outer weights (the same on every node). Without overlap, nothing
        to do. Raises OuterSyncError when that average failed."""
        if not self.overlap:
            return
        self._drain()
        if self.since_sync == 0 and self.state is not None and self.state.taken:
            self.start = None
            self.state.load_into_model()

    # -- consistency across nodes ----------------------------------------------

    def _fingerprint(self) -> tuple[int, int, int]:
        st = self.state
        s = self.settings()
        fields = (self.inner_steps, s.get("outer_lr"), s.get("outer_momentum"), s.get("nesterov"),
                  s.get("outer_optimizer"), s.get("outer_defaults"), self.codec, self.block_size, st.sizes,
                  self.outer_step)
        if self.overlap:  # appended only with overlap: the hash of a run without it is unchanged
            fields += (self.overlap_scheme, self.overlap_steps)
        settings = repr(fields)
        h = hashlib.blake2b(settings.encode(), digest_size=8).digest()
        return st.weights_hash(), int.from_bytes(h, "little"), st.numel

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Checks that every node holds the same outer weights, settings and shard size (through the sync).

        Raises ReplicaMismatchError on every process when any node differs."""
        if not self.distributed:
            return
        self._sync.verify(self._fingerprint(), outer_step=self.outer_step + 1)
        self._check_pending = False

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Counters, outer weights and momentum (CPU tensors; the caller may save them with torch.save).

        With overlap, first waits for the average in flight and applies it to the outer weights (what the
        next outer step would do first, with the same bits): a checkpoint never holds anything in flight.
        The eager schemes add "start", the point the current inner steps started from (eager-adaptive also
        its weight "alpha")."""
        if self.overlap:
            self._drain()
        sd = {"inner_step": self.inner_step, "outer_step": self.outer_step, "since_sync": self.since_sync}
        if self.state is not None:
            sd.update(self.state.state_dict())
            if self.start is not None:
                sd["start"] = self.start.cpu()
            if self.overlap_scheme == "eager-adaptive":
                sd["alpha"] = self.alpha
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); the model's local weights must already be restored."""
        if self._inflight is not None:
            raise RuntimeError("load_state_dict while an average is in flight: load before training")
        self.inner_step, self.outer_step = int(sd["inner_step"]), int(sd["outer_step"])
        self.since_sync = int(sd["since_sync"])
        if "outer" in sd and self.state is not None:
            self.state.load_state_dict(sd)
            if "start" in sd and self.overlap and self.overlap_scheme.startswith("eager"):
                if self.start is None:
                    self.start = self.state.new_buffer()
                self.start.copy_(sd["start"])
            else:
                self.start = None
            self.alpha = float(sd.get("alpha", 1.0))
        if self.distributed:
            self._check_pending = True  # verify all nodes resumed the same state before the next outer step

    def close(self) -> None:
        """Removes the optimizer hooks and closes what this DiLoCo created (a ring or sync passed in stays open)."""
        for h in (self._pre_hook, self._post_hook):
            if h is not None:
                h.remove()
        self._pre_hook = self._post_hook = None
        flight, self._inflight = getattr(self, "_inflight", None), None
        error = None
        if flight is not None:
            # An average still in flight (overlap, finish() not called): wait for it rather than pull the ring
            # from under it (the peers would see a dead node); it ends within the ring's timeout. Its result is
            # not applied; a failure is raised below, after the sync is closed.
            flight.thread.join()
            error = flight.error
        if self._owns_sync and self._sync is not None:
            self._sync.close()
        if error is not None:
            raise OuterSyncError(f"the average of outer step {flight.outer_step}, in flight at close(), failed: "
                                 f"{error}") from error
