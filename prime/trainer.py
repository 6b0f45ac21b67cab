"""The Trainer: builds a run from a Config with prime.builders, then runs the inner-step loop.

One process per device, one torchrun per node. Inside a node the processes
share the model through FSDP2 (gloo on CPU, NCCL on GPU). Between nodes there
is no process group at all: local rank g of every node joins ring g
(prime.comm.Ring), which carries that rank's shard of the pseudo-gradient; a
node with G devices therefore uses G parallel links. The rings meet through a
TCPStore hosted by node 0's first process.

The Trainer owns the loop and nothing else: the environment, the model and
optimizer, the data, the metrics, the outer step (DiLoCo over a nodes
component: a fixed ring or elastic membership) and the checkpoints are built by
the functions of prime/builders.py, and the loop calls the nodes component at
one point, after each outer step (prime/nodes.py).
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.nn.functional as F

from prime import faults
from prime.builders import (build_checkpoints, build_data, build_memory_plan, build_metrics,
                            build_model_and_optimizer, build_outer_step)
from prime.checkpoint import CheckpointError
from prime.config import Config
from prime.diloco import OuterStepResult, OuterSyncError, ReplicaMismatchError, describe_changes
from prime.memory import MemoryPlanError
from prime.nodes import AfterOuter
from prime.phases import PhaseClock
from prime.runtime import build_environment

__all__ = ["Trainer", "lr_at", "likely_divergence_cause", "TrainingStopped", "TrainingDiverged", "NothingToDo"]



class TrainingStopped(RuntimeError):
    """Training stopped on an error that a checkpoint and a restart can get past (message says what to do)."""


class NothingToDo(Exception):
    """The job ended before this process could take part in it (an elastic joiner that started too late)."""


class TrainingDiverged(TrainingStopped):
    """The loss, the gradient norm or the weights stopped being finite; nothing of that state was saved."""


def lr_at(step: int, total: int, lr: float, warmup: int, decay: int, min_ratio: float) -> float:
    """Warmup-stable-decay: linear warmup over `warmup` steps, flat, then linear decay to min_ratio * lr over the last `decay` steps."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    decay_start = total - decay
    if decay > 0 and step > decay_start:
        frac = min(1.0, (step - decay_start) / decay)
        return lr * (1.0 - (1.0 - min_ratio) * frac)
    return lr


def likely_divergence_cause(cfg: Config, step: int, resumed_from: Optional[int], after_outer: bool) -> str:
    """The setting that most likely made inner step `step` diverge (after_outer: an outer step came just before)."""
    if after_outer:
        lr = cfg.diloco.outer_settings()["outer_lr"]
        return f"diloco.outer_lr ({lr:g}) too high: the outer step just before this inner step made the weights diverge"
    if resumed_from is not None and step == resumed_from + 1:
        return (f"the checkpoint of step {resumed_from} that this run resumed from (its state is not "
                f"finite), or optim.lr ({cfg.optim.lr}) too high")
    if step == 1 and resumed_from is None:
        return "the model or its precision (model.*, train.mixed_precision): the first step diverged before any update"
    return f"optim.lr ({cfg.optim.lr}) too high (or optim.warmup_steps ({cfg.optim.warmup_steps}) too short)"


class Trainer:
    """One process of a training job: its components (built by prime.builders) and the inner-step loop."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.env = env = build_environment(cfg)
        self.parts = build_model_and_optimizer(cfg, env)
        self.model, self.optimizer = self.parts.model, self.parts.optimizer
        self.data = build_data(cfg, env, self.parts.args.vocab_size)
        self.metrics = build_metrics(cfg, env, self.parts, self.data)
        self.diloco, self.nodes = build_outer_step(cfg, env, self.parts, self.data, self.metrics)
        self.checkpoints = build_checkpoints(cfg, env, self.parts, self.data, self.diloco)
        self.step, self.resumed_from = 0, None
        self.trained = 0
        """Inner steps this process trained (self.step in steps mode; with time phases self.step is nominal)."""
        d = cfg.diloco
        self.clock = PhaseClock(d.inner_steps, d.phase_seconds, agree=env.from_first if env.local_world > 1 else None) \
            if d.phase == "time" and self.diloco.distributed else None
        """Time phases: this node's clock of nominal steps (prime.phases); None in steps mode."""
        try:  # before anything is loaded or trained: a run that cannot fit stops here, on every node
            self.memory = build_memory_plan(cfg, env, self.parts, self.diloco, self.nodes, self.checkpoints,
                                            say=self.metrics.print)
        except MemoryPlanError:
            self.close(failed=True)
            raise
        if self.checkpoints is not None and cfg.checkpoint.resume and self.nodes.resumes:
            try:  # verified against its manifest on every node first
                self.resumed_from = self.checkpoints.resume(self.nodes.records, env.node_rank, env.num_nodes,
                                                            publish=env.local_rank == 0, log=self.metrics.print,
                                                            scope=self.nodes.launch_scope())
            except CheckpointError:
                self.close()  # every process of every node stops here alike: leave store, rings, groups in order
                raise
            self.step = self.resumed_from or 0
        m = cfg.metrics  # opened last: a resumed run keeps the curve up to its checkpoint and appends to it
        self.metrics.open(tensorboard=m.tensorboard, wandb=m.wandb, wandb_project=m.wandb_project,
                          wandb_mode=m.wandb_mode, run_id=cfg.nodes.run_id, progress=m.progress,
                          config=cfg.to_dict(), resume_step=self.resumed_from)

    def train_step(self) -> tuple[float, float]:
        """One inner step (forward/backward over grad_accum micro-batches, clip, AdamW). Returns (loss, grad norm) tensors."""
        cfg = self.cfg
        accum = cfg.train.grad_accum
        loss_sum = torch.zeros((), device=self.env.device)
        for micro in range(accum):
            inputs, targets = self.data.next_batch()
            inputs, targets = inputs.to(self.env.device, non_blocking=True), targets.to(self.env.device, non_blocking=True)
            if self.env.fsdp:
                # Reduce-scatter gradients only after the last micro-batch (costs memory for unsharded grads).
                self.model.set_requires_gradient_sync(micro == accum - 1)
            with self.parts.autocast:
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / accum
            loss.backward()
            loss_sum += loss.detach()
        if cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm

    def train(self) -> dict:
        """Runs the inner steps up to train.steps, with outer steps, logging and checkpoints. Returns the summary.

        With time phases (diloco.phase = "time", prime.phases) self.step counts nominal steps, the schedule's:
        an inner step may pass none of them (a fast node) or several (a slow one), and one that would not end
        before the next outer step's time is not started."""
        cfg, m = self.cfg, self.metrics
        _describe(self)
        m.reset()
        t_start = time.perf_counter()
        try:
            t0 = time.perf_counter()
            result = self.nodes.start()  # fixed: replicas checked; elastic: the state served, or joined
            m.spend("start", time.perf_counter() - t0)
            if result is None:  # the job ended before this node got in
                return m.summary(self._steps_done, time.perf_counter() - t_start, self.diloco.outer_step,
                                 self.nodes.multi_node)
            if result.did_sync:
                self._log_outer(result, self.nodes.after_outer(result))
            if self.clock is not None:
                self.clock.start(self.step)
            while self.step < cfg.train.steps:
                if self.clock is not None and not self.clock.fits_before(self.step + self.diloco.steps_to_sync):
                    self._advance(self.diloco.steps_to_sync)  # straight to the outer step: no step would end in time
                    continue
                self._inner_step()
            # overlap: the last averages are applied; fragments: those with inner steps not yet averaged sync
            for result in self.diloco.finish():
                self._log_outer(result, AfterOuter(note=" | final sync of this fragment", fields={"final_sync": True}))
        except self.nodes.finished_errors as e:  # elastic: evicted, and the job ended before this node got back in
            m.print(f"elastic: {e}; stopping")
        except (OuterSyncError, ReplicaMismatchError, *self.nodes.stop_errors) as e:
            raise TrainingStopped(f"{e}{self._saved_after(e)}") from e
        self._save(block=True)
        summary = m.summary(self._steps_done, time.perf_counter() - t_start, self.diloco.outer_step,
                            self.nodes.multi_node)
        m.print(self.memory.peaks(self.env.device))
        summary.update(self.nodes.finish(self.model))  # the final-weights agreement across nodes
        return summary

    @property
    def _steps_done(self) -> int:
        """What the summary counts: the job's inner steps, or with time phases the ones this node trained."""
        return self.trained if self.clock is not None else self.step

    def _inner_step(self) -> None:
        """One inner step, then what it brings: the outer steps due, logging, checkpoints."""
        cfg, m, d, clock = self.cfg, self.metrics, self.diloco, self.clock
        nominal = 1  # steps of the schedule this inner step passes (time phases: known once it ended)
        if clock is None:
            self.step += 1
        lr = lr_at(self.step + (clock is not None), cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.decay_steps,
                   cfg.optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        if not cfg.elastic.enabled:  # (elastic nodes: the inner optimizer's step hook); inside the step's time
            faults.hit("train.before_step", self.step if clock is None else self.trained + 1, log=m.print)
        loss, gnorm = self.train_step()
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()  # honest step times; the loss is read below anyway
        step_s = time.perf_counter() - t0
        if cfg.train.slowdown > 1:  # an emulated slower node: the step takes slowdown times its own time
            time.sleep(step_s * (cfg.train.slowdown - 1))
            step_s = time.perf_counter() - t0
        m.compute(step_s)
        self.trained += 1
        if clock is not None:  # time phases: did this step's time pass a nominal step? (the rest: _advance)
            clock.stepped(step_s)
            if self.trained == 1:  # the launch's first step compiled, for a time that differs between nodes:
                t1 = time.perf_counter()  # they meet, and their clocks start together after it (one nominal step)
                self.nodes.meet()
                m.spend("start", time.perf_counter() - t1)
                clock.start(self.step + 1)
            nominal = 1 if clock.reached() > self.step else 0
            self.step += nominal
        # The norm is of the node's whole gradient (the same on every process): when it is
        # not finite, every process stops here, before a poisoned state reaches the ring.
        gnorm = float(gnorm)
        if not math.isfinite(gnorm):
            self._diverged(float(loss), gnorm)
        if d.distributed and nominal and d.since_sync + 1 >= d.inner_steps:
            m.outer_running(d.outer_step + 1)
        t0 = time.perf_counter()
        result = d.step(nominal)
        decision = self._after_outer(result, t0)
        if decision.rejoined_at is not None:  # (re)joined the job: go on from the job's step and data
            return
        show = nominal and (self.step % cfg.metrics.log_every == 0 or self.step in (1, cfg.train.steps)
                            or result.did_sync)
        node_loss = m.inner_step(self.step, float(loss), gnorm, lr, step_s, show, trained=self.trained)
        if not math.isfinite(node_loss):  # the node's mean: every process sees the same value
            self._diverged(node_loss, gnorm)
        if result.did_sync:
            self._log_outer(result, decision)
        if nominal:
            self._after_nominal_step()
        if clock is not None and not self._stops_at(result):
            self._advance(clock.reached() - self.step)

    def _advance(self, steps: int) -> None:
        """Time phases: `steps` nominal steps pass without an inner step (at most to train.steps), up to an outer
        step that stops them (_stops_at)."""
        for _ in range(min(steps, self.cfg.train.steps - self.step)):
            self.step += 1
            t0 = time.perf_counter()
            result = self.diloco.advance()
            decision = self._after_outer(result, t0)
            if decision.rejoined_at is not None:
                return
            if result.did_sync:
                self._log_outer(result, decision)
            self._after_nominal_step()
            if self._stops_at(result):
                return

    def _stops_at(self, result: OuterStepResult) -> bool:
        """Time phases: nominal steps stop passing at an outer step that ran: a synchronous one (every node leaves it
        at the same moment, and the clock restarts), or an overlapped one while this node's inner step keeps up
        with the time between outer steps, so that a node behind its schedule (a transient) trains one inner step
        per outer step while it catches up (PhaseClock.keeps_up)."""
        return result.did_sync and (not result.overlapped or self.clock.keeps_up(self.diloco.steps_to_sync))

    def _after_outer(self, result: OuterStepResult, t0: float) -> AfterOuter:
        """What an outer step (if one ran) changes for this node, its time, and the phase clock."""
        m = self.metrics
        # The loop's one call into the nodes component: what this outer step changes for this node.
        decision = self.nodes.after_outer(result) if result.did_sync else AfterOuter()
        m.spend("outer", time.perf_counter() - t0)
        if result.did_sync:  # the all-reduce (synchronous) or the wait for the previous average (overlap)
            m.spend("outer_wait", result.wait_s if result.overlapped else result.allreduce_s)
            # Every node left a synchronous all-reduce together: the phase restarts. An overlapped one leaves the
            # clock alone: a wait for an average in flight is phase time, so that every node stays on the
            # schedule of the common start and a transient (a recompile, a late node) is not carried on.
            if self.clock is not None:
                self.clock.outer()
                if not result.overlapped:
                    self.clock.start(self.step)
        if decision.rejoined_at is not None:
            self._log_outer(result, decision)  # (takes the job's step)
            if self.clock is not None:
                self.clock.start(self.step)  # the job's phase goes on from its outer step
        return decision

    def _after_nominal_step(self) -> None:
        """Checkpoints and the test fault points, once per step of the schedule."""
        cfg = self.cfg
        if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
            self._save()
        faults.hit("train.after_step", self.step, log=self.metrics.print,  # prime/faults.py
                   before_exit=self.checkpoints.wait if self.checkpoints is not None else None)

    def _log_outer(self, result: OuterStepResult, decision: AfterOuter) -> None:
        if decision.rejoined_at is not None:  # the job's step; the time spent before joining is not compute
            self.step = decision.rejoined_at
            self.metrics.forget_phase()
        fields = decision.fields
        if self.cfg.metrics.outer_hash and self.diloco.distributed:
            fields = dict(fields or {}, outer_hash=f"{self.diloco.weights_hash():016x}")
        self.metrics.outer_step(self.step, result, decision.note, fields)

    def _save(self, block: bool = False) -> None:
        """Checkpoints the current state (if checkpoint.dir is set); raises TrainingDiverged when it is not finite."""
        if self.checkpoints is None:
            return
        t0 = time.perf_counter()
        saved = self.checkpoints.save(self.step, block=block)
        self.metrics.spend("checkpoint", time.perf_counter() - t0)
        if not saved:
            raise TrainingDiverged(
                f"step {self.step}: the weights or the optimizer state are not finite; they were not saved as a "
                f"checkpoint. {self._restart_hint()}"
            )

    def _saved_after(self, e: Exception) -> str:
        """After a failed outer step: saves the state (the step is redone on resume) and says where it is."""
        if not isinstance(e, OuterSyncError):
            return ""
        if self.checkpoints is None:
            return " No checkpoint.dir was set, so the progress of this run is lost."
        try:
            self._save(block=True)
        except TrainingDiverged as d:  # e.g. a pseudo-gradient that is not finite
            raise TrainingDiverged(f"{e}. {d}") from e
        return (f" Checkpoint of step {self.step} saved under {self.cfg.checkpoint.dir}: restart every node "
                "with the same command to resume.")

    def _restart_hint(self) -> str:
        if self.checkpoints is None:
            return "No checkpoint.dir was set, so the progress of this run is lost."
        newest = self.checkpoints.newest()  # waits for a save in flight: it is of a state from before the divergence
        if newest is None:
            return "No checkpoint was written before; fix the setting and start again."
        return (f"The newest checkpoint is of step {newest} under {self.cfg.checkpoint.dir}: fix the setting and "
                "restart every node with the same command to resume from it.")

    def _diverged(self, loss: float, gnorm: float) -> None:
        """Stops the run (every process of the node alike) naming the step and the setting that likely caused it."""
        d = self.diloco
        likely = likely_divergence_cause(self.cfg, self.step, self.resumed_from,
                                         after_outer=d.distributed and d.since_sync == 0 and d.outer_step > 0)
        raise TrainingDiverged(
            f"step {self.step}: the loss is {loss} and the gradient norm {gnorm}: training diverged; likely cause: "
            f"{likely}. Nothing of this state was saved. {self._restart_hint()}"
        )

    def close(self, failed: bool = False, stopping: bool = False) -> Optional[str]:
        """Finishes checkpoint writes, closes rings and logs, writes the plot (node 0), releases the store.

        After a failure (`failed`) the store's host does not wait for the other nodes. `stopping` (a signal,
        docs/stopping.md): the rings close before the outer step, so that an average in flight behind overlap
        is abandoned at once (the peers see a CommError) rather than waited for; its failure is then expected,
        and returned as a note for the stop line instead of raised."""
        # Teardown order: checkpoint writer, outer step (an average in flight), rings (elastic: leave the
        # job), logs and plot, the store; then barrier and destroy_process_group, last. Every step runs even
        # when an earlier one raised; the first error is raised at the end, and after one the barrier is
        # skipped (the other local ranks may never reach it).
        error: Optional[BaseException] = None
        note = None

        def run(step) -> None:
            nonlocal error
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - raised below, after the process group is gone
                error = error or e

        if self.checkpoints is not None:
            run(self.checkpoints.close)
        if stopping:
            run(self.nodes.close)  # an all-reduce in flight fails at once
            try:
                self.diloco.close(wait=False)  # (one that does not, e.g. waiting for a peer that left, is left)
            except OuterSyncError:  # that average, abandoned
                note = "an outer step's average in flight was abandoned"
            except BaseException as e:  # noqa: BLE001 - raised below, after the process group is gone
                error = error or e
        else:
            run(self.diloco.close)
            run(self.nodes.close)
        run(lambda: self.metrics.close(plot=self.cfg.metrics.plot))
        if not failed and error is None:
            run(self.nodes.release)  # the store's host waits for the others only after a clean run
        self.env.close(failed or error is not None)
        if error is not None:
            raise error
        return note


def _describe(t: Trainer) -> None:
    """The run's opening lines: model, data, nodes, where the outer state went, a resume, an emulated slowdown."""
    lines = [t.parts.describe(t.cfg, t.env, t.metrics.peak), t.data.describe(), t.nodes.describe()]
    if t.diloco.placement and t.env.device.type == "cuda":  # where the outer state went, and why
        lines.append(t.diloco.placement)
    if t.resumed_from is not None:
        lines.append(f"resumed from the checkpoint of step {t.resumed_from}")
        if getattr(t.diloco, "resume_changes", None):  # (the outer update set otherwise than before, or new defaults)
            lines.append(describe_changes(t.diloco.resume_changes))
    if t.cfg.train.slowdown > 1:
        lines.append(f"inner steps slowed {t.cfg.train.slowdown:g}x (train.slowdown): an emulated slower node")
    if t.clock is not None:
        lines.append(f"time phases: {t.cfg.diloco.phase_seconds:g} s of inner steps per outer step, the nodes weighted "
                     "by the inner steps each trained (diloco.phase = time)")
    for line in filter(None, lines):
        t.metrics.print(line)
