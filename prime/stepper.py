"""The engine of DiLoCo: the outer steps of its fragments, run on their schedule.

After every inner step, `OuterSteps.tick()` advances every fragment, applies the
averages due midway (overlap), and runs the outer step of each fragment whose
sync is due: synchronously, or started behind the next inner steps (overlap).
When the sync finds this node out of the job (prime.sync.LeftBehind, or a
joiner's first outer step) it rejoins: the job's state replaces whatever was in
flight and every counter takes the job's position. `finish()` ends training
with every node's weights identical.

DiLoCo (prime/diloco.py) is the facade users hold; it owns the hooks, the
arguments and the checkpoint, and hands every step to this.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

from prime.fragments import Fragment, FragmentSchedule, FragmentSettings, OuterStepResult
from prime.sync import LeftBehind, OuterSyncError, Sync, SyncResult

__all__ = ["OuterSteps", "agree_finite", "ring_error", "outer_step_result"]


class OuterSteps:
    """The counters of a DiLoCo and the outer steps of its fragments.

    fragments:   the fragments (prime.fragments.Fragment), empty on a single node
    schedule:    when each fragment syncs
    sync:        the averager (None: a single node; tick() then only counts)
    settings:    what the fragments share (its `overlap` is switched off for the final syncs)
    fingerprint: () -> (weights hash, settings hash, numel), what check_replicas() compares across nodes
    """

    def __init__(self, fragments: list, schedule: FragmentSchedule, sync: Optional[Sync],
                 settings: Optional[FragmentSettings], *, overlap: bool, measure_compression_error: bool,
                 check_replicas: bool, fingerprint: Callable[[], tuple]):
        self.fragments, self.schedule, self.sync, self.settings = fragments, schedule, sync, settings
        self.overlap = overlap
        """True while averages run behind the inner steps (False during finish()'s final syncs)."""
        self.measure_compression_error = measure_compression_error
        self.check_pending = check_replicas and sync is not None
        """True when the next outer step first compares the replicas (at the first one, and after a load)."""
        self._fingerprint = fingerprint
        self.inner_step = 0  # inner steps taken in total
        self.outer_step = 0  # outer steps completed (every fragment's counted)
        self.result: Optional[OuterStepResult] = None
        self._since_sync_single = 0  # a single node's count (it has no fragments)
        self.step_weight = 1
        """What one inner step of this node counts in a token-weighted average (prime.shares: its processes, when
        nodes run different numbers)."""

    @property
    def since_sync(self) -> int:
        """Inner steps since the last outer step (with fragments: since the oldest fragment's last one)."""
        return max((f.since_sync for f in self.fragments), default=self._since_sync_single)

    @since_sync.setter
    def since_sync(self, value: int) -> None:
        for f in self.fragments:
            f.since_sync = value
        self._since_sync_single = value

    def state_dict(self) -> dict:
        """The counters and each fragment's part (DiLoCo.state_dict)."""
        return {"inner_step": self.inner_step, "outer_step": self.outer_step, "since_sync": self.since_sync,
                "fragments": [f.state_dict() for f in self.fragments]}

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(), or the layout one-fragment runs wrote before (the part at the top level)."""
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
        if self.sync is not None:
            self.check_pending = True  # verify all nodes resumed the same state before the next outer step

    def abandon(self, wait: bool = True) -> tuple:
        """Ends the averages in flight without applying them (DiLoCo.close): each is waited for rather than
        having the ring pulled from under it (the peers would see a dead node); wait=False leaves one that does
        not end within 0.5 s to its daemon thread. Returns (the first failure, its outer step) or (None, None)."""
        error, step = None, None
        for f in self.fragments:
            flight = f._inflight
            e = f.abandon(wait)
            if e is not None and error is None:
                error, step = e, flight.outer_step
        return error, step

    def tick(self) -> OuterStepResult:
        """One inner step was taken: the averages due are applied, then the syncs due run."""
        self.inner_step += 1
        if self.sync is None:
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

    @property
    def steps_to_sync(self) -> int:
        """Steps of the schedule until the next fragment's outer step is due (at least 1; a single node has none:
        a large number)."""
        if self.sync is None or not self.fragments:
            return 1 << 62
        return max(1, min(f.phase - f.since_sync for f in self.fragments))

    def trained(self) -> None:
        """This node trained one inner step (what its weight in a token-weighted average counts)."""
        for f in self.fragments:
            f.trained += self.step_weight

    def idle(self) -> OuterStepResult:
        """An inner step that did not move the schedule (time phases): nothing is due."""
        self.result = OuterStepResult(False, self.inner_step, self.outer_step)
        return self.result

    def sync_now(self) -> OuterStepResult:
        """An outer step now: of every fragment that is due, or of every fragment when none is."""
        due = [f for f in self.fragments if f.sync_due()] or list(self.fragments)
        try:
            return self._sync_fragments(due)
        except LeftBehind as e:
            return self._rejoin(e.reason)

    def owes(self) -> bool:
        """True when some fragment's outer step is due and has not run."""
        return self.sync is not None and any(f.sync_due() for f in self.fragments)

    def check_replicas(self) -> None:
        """Compares this node's fingerprint with every other node's (ReplicaMismatchError when one differs)."""
        self.sync.verify(self._fingerprint(), outer_step=self.outer_step + 1)
        self.check_pending = False

    def _sync_fragments(self, due: list) -> OuterStepResult:
        if self.sync.must_join:  # a node that joins a running job: its first outer step is the join
            return self._rejoin("new node")
        result = None
        for f in due:
            result = self._sync_one(f)
        return result

    def _rejoin(self, reason: str) -> OuterStepResult:
        """This node is (back) in the job through the sync: averages in flight and eager start points are
        dropped (the job's state replaces them), the sync downloads the job's state and applies the admitting
        outer step (SyncResult.joined), and every counter takes the job's position. On the caller's (main)
        thread: the model's weights change here."""
        t0 = time.perf_counter()
        for f in self.fragments:
            f.abandon()  # (an average that raised LeftBehind has ended; its result is not applied)
            f.forget_flight_state()
        r = self.sync.rejoin(reason, outer_step=self.outer_step + 1)
        self.inner_step, self.outer_step = r.inner_step, r.outer_step
        self.check_pending = False  # the state is the job's, downloaded
        for f in self.fragments:
            f.outer_step, f.since_sync = self.schedule.position(f.index, self.inner_step)
        self.sync.committed(r)
        f = self.fragments[self.schedule.fragment_of(r.outer_step)]
        return self._result(f, r, t0, {"prepare_s": 0.0, "update_s": 0.0}, 0.0, None)

    def _sync_one(self, f: Fragment) -> OuterStepResult:
        t0 = time.perf_counter()
        if self.check_pending:
            if self.overlap:
                for other in self.fragments:
                    other.drain()
            self.check_replicas()
        k = self.outer_step + 1
        if self.overlap:
            r, times, norm, err, applied = f.sync_overlapped(self.inner_step, k)
            self.outer_step += 1
            return self._result(f, r, t0, times, norm, self._ring_error(r, err) if r else err, overlapped=True,
                                wait_s=times["wait_s"], applied_outer_step=applied,
                                dense=applied is not None and self.schedule.dense(applied))
        r, times, norm, err = f.sync(self.inner_step, k)
        self.outer_step = k if r.outer_step is None else r.outer_step
        if len(self.fragments) == 1:
            f.outer_step = self.outer_step
        if r.inner_step is not None and r.inner_step != self.inner_step:
            # A sync that moved this node to the job's step, where fragment f just synced: every other fragment
            # is as far from its own sync as the schedule puts it from f's (one fragment: since_sync 0).
            self.inner_step = r.inner_step
            H = self.schedule.inner_steps
            for g in self.fragments:
                g.since_sync = (self.schedule.offset(f.index) - self.schedule.offset(g.index)) % H
                g.outer_step = max(g.outer_step, 1)  # past its first, shorter phase
        self.sync.committed(r)
        return self._result(f, r, t0, times, norm if r.contributed else 0.0,
                            self._ring_error(r, err) if r.contributed else None,
                            dense=self.schedule.dense(self.outer_step))

    def finish(self) -> list:
        """The end of training (DiLoCo.finish): the averages in flight applied, the fragments with inner steps
        not yet averaged synced once more, synchronously. Returns the outer steps it ran."""
        try:
            for f in self.fragments:
                f.drain()
        except LeftBehind as e:
            self._rejoin(e.reason)
        results = []
        overlap, self.overlap = self.overlap, False  # the last syncs are synchronous
        self.settings.overlap = False
        try:
            for f in self.fragments:
                if f.since_sync == 0:  # synced at the last step: its average is applied, the model gets it
                    if f.state.taken:
                        f._give_start()
                        f.state.load_into_model()
                elif len(self.fragments) > 1:  # (one fragment: the steps after its last outer step stay local)
                    if f.start is not None:  # ended before its average was due: the shift it would have made
                        f.apply_midway()
                    remaining = f.phase - f.since_sync  # steps to its next outer step on the schedule
                    results.append(self._sync_one(f))
                    f.early = f.s.inner_steps - remaining  # its next phase ends there (Fragment.early)
        finally:
            self.overlap, self.settings.overlap = overlap, overlap
        return results

    def _ring_error(self, r: SyncResult, own: Optional[float]) -> Optional[float]:
        return ring_error(r, own) if self.measure_compression_error else None

    def _result(self, f: Fragment, r: Optional[SyncResult], t0: float, times: dict, norm: float,
                comp_err: Optional[float], **extra) -> OuterStepResult:
        return outer_step_result(f, r, inner_step=self.inner_step, outer_step=self.outer_step,
                                 fragments=len(self.fragments), outer_s=time.perf_counter() - t0, times=times,
                                 norm=norm, compression_error=comp_err, **extra)


def agree_finite(sync: Sync, finite: bool, outer_step: int) -> None:
    """Raises OuterSyncError on every process of the node when the pseudo-gradient of one is not finite."""
    if not sync.agree(finite):
        raise OuterSyncError(
            f"outer step {outer_step}: the pseudo-gradient is not finite "
            f"({'here' if not finite else 'on another process of this node'}): inner training diverged; "
            "lower optim.lr or resume from an earlier checkpoint"
        )


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
        details=r.details if r is not None else None, weights=r.weights if r is not None else None,
        fragment=f.index, fragments=fragments, share=f.share, pieces=f.pieces, **extra)
