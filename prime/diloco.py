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
continues with replicas that differ, given a sync whose nodes agree on each
all-reduce's outcome (prime's trainer: RingSync.agree_through(), elastic
nodes); a RingSync made here from a ring or a ring_factory alone agrees only
within the node (docs/ring-failures.md).

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

DiLoCo's arguments:

    model:            a plain nn.Module or one sharded with FSDP2 `fully_shard` (each process then handles
                      only its local shards)
    inner_optimizer:  the optimizer of the inner steps (build it after fully_shard). Its step hooks take the
                      outer weights before its first step, check that step() is not forgotten and, inside
                      `with diloco:`, run step() after each of its steps (a step with lr 0 in every group is
                      not counted). None: call reset_outer() and step() yourself
    sync:             a prime.comm.Ring joining this process with local rank g of every other node, a
                      prime.sync.Sync (e.g. prime.elastic.ElasticSync), or None for a single node (step()
                      then only counts). A ring or sync passed in stays the caller's: close() leaves it open
    inner_steps:      H, inner steps between outer steps
    outer_lr, outer_momentum, nesterov: the default outer update, bit-identical on every node (prime/update.py).
                      None: the codec's (prime.codecs): Nesterov with lr 0.7 and momentum 0.9, for topk lr 3
                      and no momentum (its error feedback is the memory; docs/codec.md, "The sparse codec")
    outer_optimizer:  outer_optimizer(params) -> any torch optimizer over the outer parameters, in place of the
                      default update (nodes then agree bit for bit only on the same torch build and CPU)
    codec:            "int8" (default: 0.254x the bytes of fp32, ~1% relative L2 error per node), "fp4"
                      (half of int8's bytes, ~11%), "topk" (sparse, 0.0055x at the default densities: each round
                      sends the largest values of every chunk, error feedback the rest later; fixed or elastic
                      nodes) or "none" (exact fp32); prime/codecs.py
    block_size:       codec block size, topk's chunk; None: the codec's default (int8 64, fp4 256, topk 4096)
    ring_factory:     ring_factory(tag) -> new Ring, to retry after a failure (None: no retries)
    retries:          retries per outer step when ring_factory is given
    local_group:      this node's processes, which agree on failures (default: torchrun's local world; a
                      group spanning nodes is refused)
    measure_compression_error: report OuterStepResult.compression_error (the ring's own measure when it has one)
    check_replicas:   compare weights and settings across nodes at the first outer step and after a load
    overlap:          average outer step k on a background thread during the inner steps of k+1 (the sync must
                      declare `background`); call finish() after the last inner step (docs/overlap.md)
    overlap_scheme:   how the inner steps start while an average is in flight: "eager-merge" (default),
                      "eager", "eager-adaptive" or "delayed" (OVERLAP_SCHEMES; one class each in prime/overlap.py)
    overlap_steps:    with overlap, apply the average in flight after this many inner steps (None: inner_steps
                      / fragments); below inner_steps it needs an eager scheme
    outer_state_device: "cpu", "gpu" or "auto" (default): where the outer weights and momentum live; the
                      arithmetic runs on the parameters' device either way (prime/fragment_plan.py)
    fragments:        P, streaming fragments of whole layers, fragment p syncing at inner steps
                      (p + 1) H / P + k H (prime/fragments.py); finish() syncs the ones not yet averaged
    auto_margin_bytes: GPU memory outer_state_device="auto" keeps free (None: max(8 GiB, 15% of the card))
    error_feedback:   feed what this node's contribution lost to the codec into its next pseudo-gradient
                      (prime/feedback.py). None: on for "fp4" and "topk", off for "int8"; refused with "none",
                      and off is refused with "topk"
    density:          topk: the share of each chunk's values sent per round (None: 48/4096); k = density x
                      block_size, at least 1. Refused with the other codecs
    average_density:  topk: the share of each chunk of the average that its owner sends back (None: 96/4096
                      when density is None too, else density). Above density the owner drops less of the sum
                      of N contributions (docs/codec.md)
    feedback_decay:   error feedback: the share of the residual added to the next pseudo-gradient, in (0, 1]
                      (None: 1, all of it; topk 0.8: old residual fades, as SparseLoCo's accumulator)
    weights:          "equal" (default) or "tokens": each outer step averages the nodes' pseudo-gradients
                      weighted by the inner steps each trained since that fragment's last outer step (time
                      phases, where a faster node trains more; every node must train the same tokens per inner
                      step). The counts travel over the ring (prime.weights); the sync must declare `weighs`
    shard:            shard(p) -> the tensor of parameter p this DiLoCo averages (None: the process's local shard).
                      prime.shares: a process on several rings (its node runs fewer processes than others) runs one
                      DiLoCo per ring, each over the rows of its parameters that ring carries
    rings:            the rings the job's model is cut across (None: this node's processes; prime.shares)
    step_weight:      what one inner step counts with weights="tokens" (default 1; prime.shares: the node's
                      processes over the fewest any node runs, so that a node's count is its tokens)
    dense_outer_steps: topk: each fragment's first dense_outer_steps outer steps send the pseudo-gradient dense,
                      as int8, and apply the average as it is (outer lr 1, no momentum), before the sparse codec
                      takes over (docs/codec.md, "Dense start"). Default 0: none. Refused with the other codecs
                      and with outer_optimizer
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Callable, Optional

import torch
from torch import nn

from prime.codecs import codec as codec_named
from prime.feedback import check_feedback_decay, resolve_error_feedback
from prime.fragment_plan import FragmentPlan, OuterUpdate, plan_fragments, work_buffers
from prime.fragments import FragmentSchedule, OuterStepResult
from prime.hooks import InnerStepHooks
from prime.ops import default_block_size
from prime.outer import OUTER_STATE_DEVICES, OuterOptimizerFactory, OuterState
from prime.outer_states import OuterStates
from prime.overlap import MERGE_ALPHA, SCHEMES, STAND_IN_OTHERS, stand_in_share
from prime.stepper import OuterSteps, agree_finite
from prime.sync import (OuterSyncError, ReplicaMismatchError, RingSync, Sync, complete, node_local_group,
                        warm_sparse_staging, work_stats)
from prime.weights import WEIGHTINGS

__all__ = ["DiLoCo", "OuterStepResult", "OuterSyncError", "ReplicaMismatchError", "work_stats", "OVERLAP_SCHEMES",
           "MERGE_ALPHA", "STAND_IN_OTHERS", "stand_in_share"]

logger = logging.getLogger("prime.diloco")

OVERLAP_SCHEMES = tuple(SCHEMES)
"""How the next inner steps start while the average of the last outer step is in flight: one class per scheme in
prime/overlap.py (docs/overlap.md, "Overlapping the all-reduce")."""

class DiLoCo:
    """Outer optimization across nodes for one process's share of a model: its arguments are described in this
    module's docstring, "DiLoCo's arguments" (and docs/diloco-api.md)."""


    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Optional[torch.optim.Optimizer],
        sync=None,
        *,
        inner_steps: int = 100,
        outer_lr: Optional[float] = None,
        outer_momentum: Optional[float] = None,
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
        density: Optional[float] = None,
        weights: str = "equal",
        average_density: Optional[float] = None,
        feedback_decay: Optional[float] = None,
        shard: Optional[Callable] = None,
        rings: Optional[int] = None,
        step_weight: int = 1,
        dense_outer_steps: int = 0,
    ):
        block_size = default_block_size(codec) if block_size is None else block_size
        # unset settings take the codec's defaults (prime.codecs: topk's differ from the block codecs')
        unset = codec_named(codec).outer_settings(outer_lr, outer_momentum, feedback_decay, density, average_density)
        outer_lr, outer_momentum, feedback_decay = unset["outer_lr"], unset["outer_momentum"], unset["feedback_decay"]
        self.keep = _sparse_keep(codec, block_size, unset["density"])
        """codec topk: the values kept per chunk of block_size (density x block_size, at least 1); None otherwise."""
        self.keep_average = _sparse_keep(codec, block_size, unset["average_density"], "average_density")
        """codec topk: the values each owner keeps per chunk of its shard's average (None otherwise)."""
        overlap_steps = _check_arguments(inner_steps, outer_lr, outer_momentum, block_size, retries, overlap,
                                         overlap_scheme, overlap_steps, outer_state_device, fragments, outer_optimizer)
        self.schedule = FragmentSchedule(inner_steps, fragments, _dense_steps(dense_outer_steps, codec,
                                                                             outer_optimizer))
        """When each fragment syncs, and which of its outer steps are a dense start (prime.fragments)."""
        self.error_feedback = resolve_error_feedback(error_feedback, codec)
        """True when this node feeds its quantization error back into its next pseudo-gradient."""
        self.feedback_decay = check_feedback_decay(feedback_decay, self.error_feedback)
        """Error feedback: the share of the residual carried into the next pseudo-gradient (1: all of it)."""
        self.model = model
        named = list(model.named_parameters())
        _check_optimizer(inner_optimizer, [p for _, p in named])
        self.inner_optimizer = inner_optimizer
        self.inner_steps, self.codec, self.block_size = inner_steps, codec, block_size
        # int8 and fp4 rings report their own error; the fallback pass of our own knows int8 only
        self.measure_compression_error = measure_compression_error and codec_named(codec).lossy
        self._sync, self._owns_sync = _make_sync(sync, ring_factory, retries, local_group)
        self.weights = _check_sync(self.keep, weights, self._sync)
        if overlap and self._sync is not None and not self._sync.background:
            raise ValueError(f"overlap=True needs a ring, or a sync that can average in the background "
                             f"(prime.sync.SyncExtras.background); {type(sync).__name__} does not declare it")
        overlap = overlap and self._sync is not None
        self.overlap_scheme, self.overlap_steps = overlap_scheme, overlap_steps
        self.distributed = self._sync is not None
        """True when outer steps run (a ring or sync was given); False: step() only counts."""
        self._plan = FragmentPlan()
        if self.distributed:
            if overlap:
                self._sync.use_from_background()
            self._plan = plan_fragments(
                named, inner_optimizer, schedule=self.schedule, sync=self._sync, device=outer_state_device,
                update=OuterUpdate(outer_lr, outer_momentum, nesterov, outer_optimizer), codec=codec,
                block_size=block_size, error_feedback=self.error_feedback, feedback_keep=self.keep,
                feedback_decay=self.feedback_decay,
                measure_compression_error=self.measure_compression_error, overlap=overlap,
                overlap_scheme=overlap_scheme, overlap_steps=overlap_steps, margin=auto_margin_bytes,
                check_finite=functools.partial(agree_finite, self._sync), weights=self.weights, shard=shard,
                rings=rings)
        self.fragments: list = self._plan.fragments
        """The fragments (one, the whole model, unless fragments > 1), each with its OuterState."""
        self.states: Optional[OuterStates] = OuterStates([f.state for f in self.fragments], self.schedule) \
            if self.distributed else None
        """Every fragment's outer state, as the sync sees it (prime.outer_states)."""
        self.placement, self.work_bytes = self._plan.placement, self._plan.work_bytes
        """Where the outer state lives and why, in one line (empty on a single node); the work buffers' bytes."""
        self.steps = OuterSteps(self.fragments, self.schedule, self._sync, self._plan.settings,
                                overlap=overlap, measure_compression_error=self.measure_compression_error,
                                check_replicas=check_replicas, fingerprint=self._fingerprint)
        """The engine: the counters and the outer steps of the fragments (prime.stepper)."""
        self.shard = shard
        """shard(p): the tensor of parameter p this DiLoCo averages (None: the process's local shard)."""
        self.steps.step_weight = _check_step_weight(step_weight, self.weights)
        if self.distributed:
            self._bind_sync()
        self._hooks = InnerStepHooks(inner_optimizer, before=self._before_inner_step, count=self._count)
        self.resume_changes: list = []
        """After load_state_dict(): the outer update's settings that differ from the checkpoint's run, as (name,
        the checkpoint's value, this run's); empty when none do or the checkpoint did not record them."""

    def _bind_sync(self) -> None:
        """Hands the sync the outer states and the run's settings; topk's staging is warmed whichever sync carries
        it (fixed ring or elastic rings), and without an inner optimizer the states are taken now (no first inner
        step to wait for)."""
        self._sync.bind(self.states, self.settings())
        if self.codec == "topk":
            warm_sparse_staging(self.states)
        if self.inner_optimizer is None:
            self.states.take()

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
        return self.steps.since_sync

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
    def steps_to_sync(self) -> int:
        """Steps of the schedule until the next outer step (of any fragment) is due, at least 1."""
        return self.steps.steps_to_sync

    def owes_outer_step(self) -> bool:
        """True when some fragment's outer step is due and has not run (a checkpoint written after a failed
        outer step): the nodes component runs sync() before the first inner step."""
        return self.steps.owes()

    @property
    def overlap(self) -> bool:
        """True when the all-reduce of each outer step runs during the next inner steps."""
        return self.steps.overlap

    @property
    def inner_step(self) -> int:
        """Inner steps taken in total."""
        return self.steps.inner_step

    @inner_step.setter
    def inner_step(self, value: int) -> None:
        self.steps.inner_step = value

    @property
    def outer_step(self) -> int:
        """Outer steps completed (every fragment's counted)."""
        return self.steps.outer_step

    @outer_step.setter
    def outer_step(self, value: int) -> None:
        self.steps.outer_step = value

    @property
    def result(self) -> Optional[OuterStepResult]:
        """The result of the latest step() (also of the ones the optimizer hook runs)."""
        return self.steps.result

    def settings(self) -> dict:
        """What every node must share: the cadence, the codec, overlap, fragments and the outer update over the
        same shapes."""
        s = {"inner_steps": self.inner_steps, "codec": self.codec, "block_size": self.block_size}
        if self.keep is not None:
            s["keep"] = self.keep
            if self.keep_average != self.keep:
                s["keep_average"] = self.keep_average
        if self.feedback_decay != 1.0:
            s["feedback_decay"] = self.feedback_decay
        if self.overlap:
            s["overlap"] = self.overlap_scheme
            s["overlap_steps"] = self.overlap_steps
        if self.schedule.fragments > 1:
            s["fragments"] = self.schedule.fragments
        if self.error_feedback:
            s["error_feedback"] = True
        if self.weights != "equal":
            s["weights"] = self.weights
        if self.schedule.dense_steps:
            s["dense_outer_steps"] = self.schedule.dense_steps
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

    def step(self, nominal_steps: int = 1) -> OuterStepResult:
        """Call after every inner optimizer step (not inside `with diloco:`, where the optimizer's hook
        calls it). Runs an outer step when one is due; returns what it did. nominal_steps: 1, or 0 for an inner
        step that does not move the schedule (time phases, prime.phases: a fast node's step within one nominal
        step; it counts for this node's weight all the same); advance() moves it further."""
        if self._hooks.attached:
            raise RuntimeError("inside `with diloco:` the inner optimizer's step hook runs DiLoCo.step(); "
                               "calling it as well would count every inner step twice")
        if nominal_steps not in (0, 1):
            raise ValueError(f"nominal_steps must be 0 or 1 (advance() moves the schedule further), got "
                             f"{nominal_steps!r}")
        return self._count(nominal_steps)

    def _count(self, nominal_steps: int = 1) -> OuterStepResult:
        self._hooks.unstepped = 0
        self.steps.trained()
        return self.steps.tick() if nominal_steps else self.steps.idle()

    def advance(self) -> OuterStepResult:
        """Time phases (prime.phases): one nominal step of the schedule passes without an inner step (the
        node's clock passed it during a long inner step, or a step that would not end in time was not started).
        Runs the outer steps due then, like step()."""
        return self.steps.tick()

    @torch.no_grad()
    def sync(self) -> OuterStepResult:
        """Runs an outer step now: of every fragment that is due, or of every fragment when none is. Raises
        OuterSyncError (that fragment's outer weights unchanged) when the average keeps failing.

        With overlap, the average of this outer step is started in the background and the one of the
        previous outer step is applied (its failure raises OuterSyncError here)."""
        if not self.distributed:
            raise RuntimeError("DiLoCo.sync() needs a ring or a sync; this DiLoCo was built with sync=None")
        return self.steps.sync_now()

    def finish(self) -> list:
        """End of training. With overlap, waits for the averages in flight and applies them; when the inner
        steps end on an outer step, the model gets the outer weights (the same on every node). With fragments,
        every fragment whose inner steps since its last outer step are not yet averaged syncs once more
        (synchronously), so that every node ends with the same weights. Returns the outer steps it ran (logged
        like any other). Raises OuterSyncError when an average failed."""
        if not self.distributed:
            return []
        return self.steps.finish()

    # -- consistency across nodes ----------------------------------------------

    def weights_hash(self) -> int:
        """64-bit hash of the outer weights of every fragment."""
        return self.states.weights_hash()

    def outer_weights(self) -> torch.Tensor:
        """The outer weights of every fragment, flat, in fragment order (a CPU tensor)."""
        return self.states.outer_weights()

    def _fingerprint(self) -> tuple[int, int, int]:
        return _fingerprint(self)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Checks that every node holds the same outer weights, settings and shard size (through the sync).

        Raises ReplicaMismatchError on every process when any node differs."""
        if self.distributed:
            self.steps.check_replicas()

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Counters, and each fragment's outer weights and momentum under "fragments" (CPU tensors; the caller
        may save them with torch.save), and under "settings" the outer update's settings (update_settings()).

        With overlap, first waits for the averages in flight and applies them to the outer weights (what their
        due step would do first, with the same bits): a checkpoint never holds anything in flight. The eager
        schemes add "start", the point the current inner steps started from (eager-adaptive also its weight
        "alpha")."""
        return dict(self.steps.state_dict(), settings=self.update_settings())

    def update_settings(self) -> dict:
        """The settings that decide what an outer step does with a pseudo-gradient (the codec, its counts, error
        feedback and its decay, the outer update, the dense start), each with its value in effect, unset ones
        resolved: what a checkpoint records so that a resume can say what changed (resume_changes)."""
        s = self.settings()
        return {name: s.get(name, default) for name, default in UPDATE_SETTINGS.items()}

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); the model's local weights must already be restored. Also loads the layout
        one-fragment runs wrote before every run wrote "fragments" (the fragment's part at the top level). The
        outer update's settings may differ from the checkpoint's (a run may change them on purpose): each one that
        does is in resume_changes (logged at INFO; prime-train prints it); a checkpoint written before they were
        recorded is not compared."""
        self.steps.load_state_dict(sd)
        saved, now = sd.get("settings"), self.update_settings()
        self.resume_changes = [] if saved is None else [
            (name, saved.get(name, UPDATE_SETTINGS[name]), value) for name, value in now.items()
            if saved.get(name, UPDATE_SETTINGS[name]) != value]
        if self.resume_changes:
            logger.info(describe_changes(self.resume_changes))

    def close(self, wait: bool = True) -> None:
        """Removes the optimizer hooks and closes what this DiLoCo created (a ring or sync passed in stays open).
        wait=False (a run stopping on a signal): an average in flight that does not end within 0.5 s is left to
        its daemon thread, and reported as failed."""
        self._hooks.remove()
        error, step = self.steps.abandon(wait)  # raised below, after the sync is closed
        if self._owns_sync and self._sync is not None:
            self._sync.close()
        if error is not None:
            raise OuterSyncError(f"the average of outer step {step}, in flight at close(), failed: {error}") from error


def _fingerprint(d: DiLoCo) -> tuple[int, int, int]:
    """(weights hash, settings hash, numel): what the replica check compares across nodes."""
    s = d.settings()
    sizes = [n for f in d.fragments for n in f.state.sizes]
    numel = sum(f.state.numel for f in d.fragments)
    fields = (d.inner_steps, s.get("outer_lr"), s.get("outer_momentum"), s.get("nesterov"),
              s.get("outer_optimizer"), s.get("outer_defaults"), d.codec, d.block_size, sizes,
              d.outer_step)
    if d.overlap:  # appended only with overlap: the hash of a run without it is unchanged
        fields += (d.overlap_scheme, d.overlap_steps)
    if len(d.fragments) > 1:  # likewise for fragments
        fields += (len(d.fragments), [len(g) for g in d._plan.groups],
                   [(f.outer_step, f.since_sync) for f in d.fragments])
    if d.error_feedback:  # and error feedback (the residuals themselves differ from node to node)
        fields += ("error_feedback",)
    if d.weights != "equal":  # and token weights
        fields += ("weights", d.weights)
    if d.keep is not None:  # and the sparse codec's counts (a mismatch would fail the ring's frames, later)
        fields += ("keep", d.keep, d.keep_average)
    if d.feedback_decay != 1.0:
        fields += ("feedback_decay", d.feedback_decay)
    h = hashlib.blake2b(repr(fields).encode(), digest_size=8).digest()
    return d.weights_hash(), int.from_bytes(h, "little"), numel


def _sparse_keep(codec: str, block_size: int, density: Optional[float], name: str = "density") -> Optional[int]:
    """Values kept per chunk for a sparse codec (None for the others, which take no density); `density` is set
    (the codec's default already in it)."""
    if not codec_named(codec).sparse:
        if density is not None:
            raise ValueError(f"{name} is a setting of codec 'topk', not of {codec!r}")
        return None
    from prime import sparse

    try:
        keep = sparse.keep_for_density(density, block_size)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return keep


UPDATE_SETTINGS = {"codec": None, "block_size": None, "keep": None, "keep_average": None, "error_feedback": False,
                   "feedback_decay": 1.0, "outer_lr": None, "outer_momentum": None, "nesterov": None,
                   "outer_optimizer": None, "outer_defaults": None, "dense_outer_steps": 0}
"""DiLoCo.update_settings(): the name of each setting in DiLoCo.settings() that decides what an outer step does
with a pseudo-gradient, and its value when settings() leaves it out (keep_average: the same as keep)."""


def describe_changes(changes: list) -> str:
    """One line for the outer update's settings a resumed run changed: [(name, the checkpoint's, now)]."""
    return ("the outer step's settings differ from the checkpoint's run, and apply from here on: "
            + "; ".join(f"{name} {now!r} (was {was!r})" for name, was, now in changes))


def _dense_steps(steps, codec: str, outer_optimizer) -> int:
    """dense_outer_steps, checked: an int >= 0, above 0 only with a sparse codec and the default outer update."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"dense_outer_steps must be an int >= 0, got {steps!r}")
    if steps and not codec_named(codec).sparse:
        raise ValueError(f"dense_outer_steps is a setting of codec 'topk' (its first outer steps sent dense), not "
                         f"of {codec!r}, which is dense already; leave it at 0")
    if steps and outer_optimizer is not None:
        raise ValueError("dense_outer_steps needs the default outer update (a dense start applies the average as "
                         "it is, outer lr 1); use outer_optimizer=None or dense_outer_steps=0")
    return steps


def _check_sync(keep: Optional[int], weights: str, sync) -> str:
    """A sparse codec needs a sync that carries it (SyncExtras.sparse: RingSync, ElasticSync). Token weights need
    a sync that exchanges the counts (SyncExtras.weighs). Returns weights."""
    if keep is not None and sync is not None and not getattr(sync, "sparse", False):
        raise ValueError(f"codec 'topk' needs a sync that carries it (prime.sync.SyncExtras.sparse: RingSync, "
                         f"ElasticSync); {type(sync).__name__} does not declare it: use int8 or fp4")
    if weights not in WEIGHTINGS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTINGS)}, got {weights!r}")
    if weights == "tokens" and sync is not None and not sync.weighs:
        raise ValueError(f"weights='tokens' needs a sync that exchanges each node's inner-step count "
                         f"(prime.sync.SyncExtras.weighs); {type(sync).__name__} does not declare it")
    return weights


def _check_step_weight(step_weight, weights: str) -> int:
    """What an inner step counts in a token-weighted average (1 unless weights='tokens')."""
    if step_weight == 1:
        return 1
    if not (isinstance(step_weight, int) and step_weight >= 1):
        raise ValueError(f"step_weight must be an int >= 1, got {step_weight!r}")
    if weights != "tokens":
        raise ValueError("step_weight is what an inner step counts in a token-weighted average: it needs "
                         "weights='tokens'")
    return step_weight


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
        why = "" if fragments == 1 else (" = inner_steps / fragments, the spacing of the fragments' syncs, so "
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
