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

    pseudo_gradient = outer_weights - local_weights          (fp32, on the parameters' device; prime.outer)
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

With a lossy codec, error feedback (on by default for fp4) keeps per node what
its contribution lost to quantization and adds it to its next pseudo-gradient
(prime/feedback.py); the average stays bit-identical on every node.

With fragments=P the model is cut into P fragments of whole layers, each with
its own outer step at its own offset in the phase (prime/fragments.py:
streaming fragments): one fragment's all-reduce is in flight at a time, with
1/P of the bytes and work buffers of 1/P of the model. DiLoCo walks its
fragments after every inner step; the outer step of each is the one above.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import Callable, Optional

import torch
from torch import nn

from prime.codecs import codec as codec_named
from prime.feedback import resolve_error_feedback
from prime.fragment_plan import FragmentPlan, OuterUpdate, plan_fragments, work_buffers
from prime.fragments import Fragment, FragmentSchedule, OuterStepResult
from prime.hooks import InnerStepHooks
from prime.ops import default_block_size
from prime.outer import OUTER_STATE_DEVICES, OuterOptimizerFactory, OuterState
from prime.outer_states import OuterStates
from prime.overlap import MERGE_ALPHA, SCHEMES, STAND_IN_OTHERS, stand_in_share
from prime.sync import (LeftBehind, OuterSyncError, ReplicaMismatchError, RingSync, Sync, SyncResult, complete,
                        node_local_group, work_stats)

__all__ = ["DiLoCo", "OuterStepResult", "OuterSyncError", "ReplicaMismatchError", "work_stats", "OVERLAP_SCHEMES",
           "MERGE_ALPHA", "STAND_IN_OTHERS", "stand_in_share"]

logger = logging.getLogger("prime.diloco")

OVERLAP_SCHEMES = tuple(SCHEMES)
"""How the next inner steps start while the average of the last outer step is in flight: one class per scheme in
prime/overlap.py (docs/overlap.md, "Overlapping the all-reduce")."""

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
    codec:            "int8" (default), "fp4" or "none". int8 sends about a quarter of
                      the bytes of fp32 but each node's pseudo-gradient is quantized
                      with a relative L2 error of about 1% per node (OuterStepResult.
                      compression_error); the average is then not the exact one. fp4
                      (4-bit floats, docs/wire-format.md) sends half of int8's bytes at
                      about 11% error per quantization. codec="none" averages in exact
                      fp32 (4x the bytes)
    block_size:       codec block size (int8, fp4); each parameter starts a new block.
                      None: the codec's default (int8 64, fp4 256; prime.ops.default_block_size)
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
                      Needs a sync that declares background (a ring, RingSync,
                      ElasticSync). Call finish() at the end of training to apply
                      the last one
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
                      optimizer state still to come, the work buffers and a margin for
                      activations. The arithmetic runs on the parameters' device either
                      way (a CPU home is streamed through the GPU in pieces)
    fragments:        P, streaming fragments (prime/fragments.py): the model is cut into
                      P fragments of whole layers with balanced bytes, fragment p syncs
                      at inner steps (p + 1) inner_steps / P + k inner_steps; with
                      overlap, overlap_steps is at most inner_steps / P (default: that).
                      finish() then syncs every fragment with inner steps not yet
                      averaged, so that every node ends with the same weights
    auto_margin_bytes: GPU memory outer_state_device="auto" keeps free for activations
                      and the like (None: max(8 GiB, 15% of the card); the trainer
                      passes its memory plan's estimate, prime.memory.auto_margin_bytes)
    error_feedback:   keep what this node's contribution lost to the codec (a residual
                      beside the outer weights, per node) and add it to its next
                      pseudo-gradient (prime/feedback.py; docs/training.md, "Error
                      feedback"). None (default): on for codec "fp4", off for "int8";
                      True with codec "none" is refused (ValueError)
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
        block_size: Optional[int] = None,
        ring_factory: Optional[Callable[[str], object]] = None,
        retries: int = 2,
        local_group=None,
        measure_compression_error: bool = True,
        check_replicas: bool = True,
        overlap: bool = False,
        overlap_scheme: str = "eager-merge",
        outer_state_device: str = "auto",
        overlap_steps: Optional[int] = None,
        fragments: int = 1,
        auto_margin_bytes: Optional[int] = None,
        error_feedback: Optional[bool] = None,
    ):
        block_size = default_block_size(codec) if block_size is None else block_size
        overlap_steps = _check_arguments(inner_steps, outer_lr, outer_momentum, block_size, retries, overlap,
                                         overlap_scheme, overlap_steps, outer_state_device, fragments, outer_optimizer)
        self.schedule = FragmentSchedule(inner_steps, fragments)
        """When each fragment syncs (prime.fragments.FragmentSchedule)."""
        self.error_feedback = resolve_error_feedback(error_feedback, codec)
        """True when this node feeds its quantization error back into its next pseudo-gradient."""
        self.model = model
        named = list(model.named_parameters())
        _check_optimizer(inner_optimizer, [p for _, p in named])
        self.inner_optimizer = inner_optimizer
        self.inner_steps, self.codec, self.block_size = inner_steps, codec, block_size
        # int8 and fp4 rings report their own error; the fallback pass of our own knows int8 only
        self.measure_compression_error = measure_compression_error and codec_named(codec).lossy
        self._sync, self._owns_sync = _make_sync(sync, ring_factory, retries, local_group)
        if overlap and self._sync is not None and not self._sync.background:
            raise ValueError(f"overlap=True needs a ring, or a sync that can average in the background "
                             f"(prime.sync.SyncExtras.background); {type(sync).__name__} does not declare it")
        self.overlap = overlap and self._sync is not None
        """True when the all-reduce of each outer step runs during the next inner steps."""
        self.overlap_scheme, self.overlap_steps = overlap_scheme, overlap_steps
        self.distributed = self._sync is not None
        """True when outer steps run (a ring or sync was given); False: step() only counts."""
        self._check_pending = check_replicas and self.distributed
        self.inner_step = 0  # inner steps taken in total
        self.outer_step = 0  # outer steps completed (every fragment's counted)
        self.result: Optional[OuterStepResult] = None
        """The result of the latest step() (also of the ones the optimizer hook runs)."""
        self._plan = FragmentPlan()
        if self.distributed:
            if self.overlap:
                self._sync.use_from_background()
            self._plan = plan_fragments(
                named, inner_optimizer, schedule=self.schedule, sync=self._sync, device=outer_state_device,
                update=OuterUpdate(outer_lr, outer_momentum, nesterov, outer_optimizer), codec=codec,
                block_size=block_size, error_feedback=self.error_feedback,
                measure_compression_error=self.measure_compression_error, overlap=self.overlap,
                overlap_scheme=overlap_scheme, overlap_steps=overlap_steps, margin=auto_margin_bytes,
                check_finite=self._agree_finite)
        self.fragments: list = self._plan.fragments
        """The fragments (one, the whole model, unless fragments > 1), each with its OuterState."""
        self.states: Optional[OuterStates] = OuterStates([f.state for f in self.fragments], self.schedule) \
            if self.distributed else None
        """Every fragment's outer state, as the sync sees it (prime.outer_states)."""
        self.placement, self.work_bytes = self._plan.placement, self._plan.work_bytes
        """Where the outer state lives and why, in one line (empty on a single node); the work buffers' bytes."""
        if self.distributed:
            self._sync.bind(self.states, self.settings())
            if inner_optimizer is None:
                self.states.take()  # no first inner step to wait for
        self._since_sync_single = 0  # a single node's count (it has no fragments)
        self._hooks = InnerStepHooks(inner_optimizer, before=self._before_inner_step, count=self._count)

    def work_buffers(self) -> tuple:
        """(pseudo-gradient buffers, start buffers) of the largest fragment's size this DiLoCo keeps at most on
        the work device (prime.fragment_plan.work_buffers)."""
        return work_buffers(self.schedule, self.overlap, self.overlap_scheme, self.overlap_steps)

    @property
    def state(self) -> Optional[OuterState]:
        """The outer state of a DiLoCo without fragments (None on a single node; with fragments, see
        `fragments`)."""
        if len(self.fragments) > 1:
            raise AttributeError("DiLoCo.state: with fragments > 1 every fragment has its own outer state "
                                 "(DiLoCo.fragments[p].state)")
        return self.fragments[0].state if self.fragments else None

    @property
    def since_sync(self) -> int:
        """Inner steps since the last outer step (with fragments: since the oldest fragment's last one)."""
        return max((f.since_sync for f in self.fragments), default=self._since_sync_single)

    @since_sync.setter
    def since_sync(self, value: int) -> None:
        for f in self.fragments:
            f.since_sync = value
        self._since_sync_single = value

    @property
    def start(self) -> Optional[torch.Tensor]:
        """Eager overlap without fragments: the weights the current inner steps started from (None: the outer
        weights)."""
        return self.fragments[0].start if len(self.fragments) == 1 else None

    @property
    def _inflight(self):
        """The average in flight of the first fragment (overlap), if any."""
        return self.fragments[0]._inflight if self.fragments else None

    @property
    def alpha(self) -> float:
        return self.fragments[0].alpha if self.fragments else 1.0

    def owes_outer_step(self) -> bool:
        """True when some fragment's outer step is due and has not run (a checkpoint written after a failed
        outer step): the nodes component runs sync() before the first inner step."""
        return self.distributed and any(f.sync_due() for f in self.fragments)

    def settings(self) -> dict:
        """What every node must share: the cadence, the codec, overlap, fragments and the outer update over the
        same shapes."""
        s = {"inner_steps": self.inner_steps, "codec": self.codec, "block_size": self.block_size}
        if self.overlap:
            s["overlap"] = self.overlap_scheme
            s["overlap_steps"] = self.overlap_steps
        if self.schedule.fragments > 1:
            s["fragments"] = self.schedule.fragments
        if self.error_feedback:
            s["error_feedback"] = True
        if self.states is not None:
            s.update(self.states.settings())
        return s

    # -- the hook form -------------------------------------------------------------

    def __enter__(self) -> "DiLoCo":
        """Inside `with diloco:`, every inner_optimizer.step() also runs step(); leaving closes (see close())."""
        self._hooks.attach()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except OuterSyncError as e:
            if exc is None:
                raise
            logger.error("while leaving `with diloco:` on %s: %s", exc_type.__name__, e)  # the first error wins

    def _before_inner_step(self) -> None:
        if self.states is not None:
            self.states.ensure_taken()  # the first inner step: weights loaded after construction are kept

    def reset_outer(self) -> None:
        """Outer weights := the model's current weights (momentum kept). Call after loading weights when
        no inner optimizer was given; with one, its first step does this."""
        if self.states is not None:
            self.states.take()

    # -- the step ----------------------------------------------------------------------

    def step(self) -> OuterStepResult:
        """Call after every inner optimizer step (not inside `with diloco:`, where the optimizer's hook
        calls it). Runs an outer step when one is due; returns what it did."""
        if self._hooks.attached:
            raise RuntimeError("inside `with diloco:` the inner optimizer's step hook runs DiLoCo.step(); "
                               "calling it as well would count every inner step twice")
        return self._count()

    def _count(self) -> OuterStepResult:
        self._hooks.unstepped = 0
        self.inner_step += 1
        if not self.distributed:
            self.result = OuterStepResult(False, self.inner_step, self.outer_step)
            return self.result
        for f in self.fragments:
            f.tick()
        try:
            for f in self.fragments:  # the schedule: first the averages due (freeing their buffers), then the syncs
                if f.apply_due():
                    f.apply_midway()
            due = [f for f in self.fragments if f.sync_due()]
            self.result = self._sync_fragments(due) if due else OuterStepResult(False, self.inner_step,
                                                                                self.outer_step)
        except LeftBehind as e:  # an average (maybe in the background) found this node out of the job
            self.result = self._rejoin(e.reason)
        return self.result

    @torch.no_grad()
    def sync(self) -> OuterStepResult:
        """Runs an outer step now: of every fragment that is due, or of every fragment when none is. Raises
        OuterSyncError (that fragment's outer weights unchanged) when the average keeps failing.

        With overlap, the average of this outer step is started in the background and the one of the
        previous outer step is applied (its failure raises OuterSyncError here)."""
        if not self.distributed:
            raise RuntimeError("DiLoCo.sync() needs a ring or a sync; this DiLoCo was built with sync=None")
        due = [f for f in self.fragments if f.sync_due()] or list(self.fragments)
        try:
            return self._sync_fragments(due)
        except LeftBehind as e:
            return self._rejoin(e.reason)

    def _sync_fragments(self, due: list) -> OuterStepResult:
        if self._sync.must_join:  # a node that joins a running job: its first outer step is the join
            return self._rejoin("new node")
        result = None
        for f in due:
            result = self._sync_one(f)
        return result

    def _rejoin(self, reason: str) -> OuterStepResult:
        """This node is (back) in the job through the sync (prime.sync.LeftBehind, or a joiner's first outer
        step): averages in flight and eager start points are dropped (the job's state replaces them), the sync
        downloads the job's state and applies the admitting outer step (SyncResult.joined), and every counter
        takes the job's position. On the caller's (main) thread: the model's weights change here."""
        t0 = time.perf_counter()
        for f in self.fragments:
            f.abandon()  # (an average that raised LeftBehind has ended; its result is not applied)
            f.forget_flight_state()
        r = self._sync.rejoin(reason, outer_step=self.outer_step + 1)
        self.inner_step, self.outer_step = r.inner_step, r.outer_step
        for f in self.fragments:
            f.outer_step, f.since_sync = self.schedule.position(f.index, self.inner_step)
        self._sync.committed(r)
        f = self.fragments[self.schedule.fragment_of(r.outer_step)]
        return self._result(f, r, t0, {"prepare_s": 0.0, "update_s": 0.0}, 0.0, None)

    def _sync_one(self, f: Fragment) -> OuterStepResult:
        t0 = time.perf_counter()
        if self._check_pending:
            if self.overlap:
                for other in self.fragments:
                    other.drain()
            self.check_replicas()
        k = self.outer_step + 1
        if self.overlap:
            r, times, norm, err, applied = f.sync_overlapped(self.inner_step, k)
            self.outer_step += 1
            return self._result(f, r, t0, times, norm, self._ring_error(r, err) if r else err, overlapped=True,
                                wait_s=times["wait_s"], applied_outer_step=applied)
        r, times, norm, err = f.sync(self.inner_step, k)
        self.outer_step = k if r.outer_step is None else r.outer_step
        if len(self.fragments) == 1:
            f.outer_step = self.outer_step
        if r.inner_step is not None and r.inner_step != self.inner_step:
            # A sync that moved this node to the job's step, where fragment f just synced: every other fragment
            # is as far from its own sync as the schedule puts it from f's (one fragment: since_sync 0).
            self.inner_step = r.inner_step
            H = self.inner_steps
            for g in self.fragments:
                g.since_sync = (self.schedule.offset(f.index) - self.schedule.offset(g.index)) % H
                g.outer_step = max(g.outer_step, 1)  # past its first, shorter phase
        self._sync.committed(r)
        return self._result(f, r, t0, times, norm if r.contributed else 0.0,
                            self._ring_error(r, err) if r.contributed else None)

    def _ring_error(self, r: SyncResult, own: Optional[float]) -> Optional[float]:
        return ring_error(r, own) if self.measure_compression_error else None

    def _agree_finite(self, finite: bool, outer_step: int) -> None:
        if not self._sync.agree(finite):
            raise OuterSyncError(
                f"outer step {outer_step}: the pseudo-gradient is not finite "
                f"({'here' if not finite else 'on another process of this node'}): inner training diverged; "
                "lower optim.lr or resume from an earlier checkpoint"
            )

    def _result(self, f: Fragment, r: Optional[SyncResult], t0: float, times: dict, norm: float,
                comp_err: Optional[float], **extra) -> OuterStepResult:
        return outer_step_result(f, r, inner_step=self.inner_step, outer_step=self.outer_step,
                                 fragments=len(self.fragments), outer_s=time.perf_counter() - t0, times=times,
                                 norm=norm, compression_error=comp_err, **extra)

    def finish(self) -> list:
        """End of training. With overlap, waits for the averages in flight and applies them; when the inner
        steps end on an outer step, the model gets the outer weights (the same on every node). With fragments,
        every fragment whose inner steps since its last outer step are not yet averaged syncs once more
        (synchronously), so that every node ends with the same weights. Returns the outer steps it ran (logged
        like any other). Raises OuterSyncError when an average failed."""
        if not self.distributed:
            return []
        try:
            for f in self.fragments:
                f.drain()
        except LeftBehind as e:
            self._rejoin(e.reason)
        results = []
        overlap, self.overlap = self.overlap, False  # the last syncs are synchronous
        self._plan.settings.overlap = False
        try:
            for f in self.fragments:
                if f.since_sync == 0:  # synced at the last step: its average is applied, the model gets it
                    if f.state.taken:
                        f._give_start()
                        f.state.load_into_model()
                elif len(self.fragments) > 1:  # (one fragment: the steps after its last outer step stay local)
                    if f.start is not None:  # ended before its average was due: the shift it would have made
                        f.apply_midway()
                    results.append(self._sync_one(f))
        finally:
            self.overlap, self._plan.settings.overlap = overlap, overlap
        return results

    # -- consistency across nodes ----------------------------------------------

    def weights_hash(self) -> int:
        """64-bit hash of the outer weights of every fragment."""
        return self.states.weights_hash()

    def outer_weights(self) -> torch.Tensor:
        """The outer weights of every fragment, flat, in fragment order (a CPU tensor)."""
        return self.states.outer_weights()

    def _fingerprint(self) -> tuple[int, int, int]:
        s = self.settings()
        sizes = [n for f in self.fragments for n in f.state.sizes]
        numel = sum(f.state.numel for f in self.fragments)
        fields = (self.inner_steps, s.get("outer_lr"), s.get("outer_momentum"), s.get("nesterov"),
                  s.get("outer_optimizer"), s.get("outer_defaults"), self.codec, self.block_size, sizes,
                  self.outer_step)
        if self.overlap:  # appended only with overlap: the hash of a run without it is unchanged
            fields += (self.overlap_scheme, self.overlap_steps)
        if len(self.fragments) > 1:  # likewise for fragments
            fields += (len(self.fragments), [len(g) for g in self._plan.groups],
                       [(f.outer_step, f.since_sync) for f in self.fragments])
        if self.error_feedback:  # and error feedback (the residuals themselves differ from node to node)
            fields += ("error_feedback",)
        h = hashlib.blake2b(repr(fields).encode(), digest_size=8).digest()
        return self.weights_hash(), int.from_bytes(h, "little"), numel

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
        """Counters, and each fragment's outer weights and momentum under "fragments" (CPU tensors; the caller
        may save them with torch.save).

        With overlap, first waits for the averages in flight and applies them to the outer weights (what their
        due step would do first, with the same bits): a checkpoint never holds anything in flight. The eager
        schemes add "start", the point the current inner steps started from (eager-adaptive also its weight
        "alpha")."""
        return {"inner_step": self.inner_step, "outer_step": self.outer_step, "since_sync": self.since_sync,
                "fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); the model's local weights must already be restored. Also loads the layout
        one-fragment runs wrote before every run wrote "fragments" (the fragment's part at the top level)."""
        if any(f.in_flight for f in self.fragments):
            raise RuntimeError("load_state_dict while an average is in flight: load before training")
        parts = sd["fragments"] if "fragments" in sd else [sd] if "outer" in sd else []
        if self.fragments and (len(parts) or 1) != len(self.fragments):
            raise ValueError(f"the checkpoint was written with diloco.fragments = {len(parts) or 1}, this run has "
                             f"{len(self.fragments)}: resume with the same diloco.fragments")
        self.inner_step, self.outer_step = int(sd["inner_step"]), int(sd["outer_step"])
        self.since_sync = int(sd["since_sync"])
        for f, part in zip(self.fragments, parts):
            f.load_state_dict(part)
        if self.distributed:
            self._check_pending = True  # verify all nodes resumed the same state before the next outer step

    def close(self, wait: bool = True) -> None:
        """Removes the optimizer hooks and closes what this DiLoCo created (a ring or sync passed in stays open).
        wait=False (a run stopping on a signal): an average in flight that does not end within 0.5 s is left to
        its daemon thread, and reported as failed."""
        self._hooks.remove()
        error, step = None, None
        for f in self.fragments:
            # An average still in flight (overlap, finish() not called): wait for it rather than pull the ring
            # from under it (the peers would see a dead node); it ends within the ring's timeout. Its result is
            # not applied; a failure is raised below, after the sync is closed.
            flight = f._inflight
            e = f.abandon(wait)
            if e is not None and error is None:
                error, step = e, flight.outer_step
        if self._owns_sync and self._sync is not None:
            self._sync.close()
        if error is not None:
            raise OuterSyncError(f"the average of outer step {step}, in flight at close(), failed: {error}") from error


def _check_arguments(inner_steps, outer_lr, outer_momentum, block_size, retries, overlap, overlap_scheme,
                     overlap_steps, outer_state_device, fragments, outer_optimizer) -> int:
    """Refuses bad arguments with the argument named; returns overlap_steps (None: its default)."""
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
    if outer_lr <= 0:
        raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
    if block_size < 32 or block_size > 4096 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two from 32 to 4096, got {block_size}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if overlap_scheme not in SCHEMES:
        raise ValueError(f"overlap_scheme must be one of {', '.join(SCHEMES)}, got {overlap_scheme!r}")
    eager = SCHEMES[overlap_scheme].eager
    if not isinstance(fragments, int) or not 1 <= fragments <= inner_steps:
        raise ValueError(f"fragments must be an int in [1, inner_steps={inner_steps}], got {fragments!r}")
    limit = FragmentSchedule(inner_steps, fragments).default_delay()
    overlap_steps = limit if overlap_steps is None else overlap_steps
    if not 1 <= overlap_steps <= limit:
        why = "" if fragments == 1 else (f" = inner_steps / fragments, the spacing of the fragments' syncs, so "
                                         "that one average is in flight at a time")
        raise ValueError(f"overlap_steps must be in [1, {limit}{why}], got {overlap_steps}")
    if overlap and overlap_steps < inner_steps and not eager:
        raise ValueError(f"overlap_steps < inner_steps needs an eager overlap_scheme, got {overlap_scheme!r}")
    if outer_state_device not in OUTER_STATE_DEVICES:
        raise ValueError(f"outer_state_device must be 'cpu', 'gpu' or 'auto', got {outer_state_device!r}")
    if overlap and eager and outer_optimizer is not None:
        raise ValueError(f"overlap with overlap_scheme={overlap_scheme!r} needs the default outer update (its lookahead "
                         "is the Nesterov step without the momentum write); use outer_optimizer=None or "
                         "overlap_scheme='delayed'")
    return overlap_steps


def _check_optimizer(inner_optimizer, params: list) -> None:
    if inner_optimizer is None:
        return
    ids = {id(p) for p in params}
    stray = sum(1 for g in inner_optimizer.param_groups for p in g["params"] if id(p) not in ids)
    if stray:
        raise ValueError(f"the inner optimizer holds {stray} tensors that are not parameters of the model; "
                         "build the optimizer after fully_shard(), which replaces the parameters")


def _make_sync(sync, ring_factory, retries: int, local_group) -> tuple:
    """(the Sync, whether DiLoCo owns it): a Sync passed in stays the caller's; a ring (or a ring_factory alone)
    is wrapped in a RingSync that DiLoCo closes; None: a single node."""
    if isinstance(sync, Sync):
        if ring_factory is not None or local_group is not None:
            raise ValueError("ring_factory and local_group belong to the ring: give them to the Sync, "
                             "not to DiLoCo, when passing a Sync")
        return complete(sync), False
    if sync is not None or ring_factory is not None:
        return RingSync(sync, ring_factory=ring_factory, retries=retries,
                        local_group=node_local_group(local_group)), True
    return None, False


def ring_error(r: SyncResult, own: Optional[float]) -> Optional[float]:
    """The relative L2 quantization error of an outer step: the ring's own measure when it reports one
    (prime.sync.QUANT_ERROR_FIELDS), else `own` (a pass of this node's own)."""
    err, ref = r.stats.get("quant_err_sq"), r.stats.get("quant_in_sq")
    if err is not None and ref is not None:
        return math.sqrt(err / ref) if ref > 0 else 0.0
    return own


def outer_step_result(f: Fragment, r: Optional[SyncResult], *, inner_step: int, outer_step: int, fragments: int,
                      outer_s: float, times: dict, norm: float, compression_error: Optional[float],
                      **extra) -> OuterStepResult:
    """What fragment f's outer step did, from the sync's result r (None: nothing was averaged)."""
    stats = dict(r.stats) if r is not None else {}
    for name in ("quant_err_sq", "quant_in_sq"):
        stats.pop(name, None)
    return OuterStepResult(
        did_sync=True, inner_step=inner_step, outer_step=outer_step, numel=f.state.numel,
        allreduce_s=r.allreduce_s if r is not None else 0.0, outer_s=outer_s,
        prepare_s=times["prepare_s"], update_s=times["update_s"],
        bytes_sent=stats.pop("bytes_sent", None), bytes_received=stats.pop("bytes_received", None),
        compression_error=compression_error, pseudo_grad_norm=norm,
        attempts=r.attempts if r is not None else 0, ring_stats=stats,
        members=list(r.members) if r is not None else [], contributors=r.contributors if r is not None else 0,
        details=r.details if r is not None else None,
        fragment=f.index, fragments=fragments, share=f.share, pieces=f.pieces, **extra)
