"""A fragment's synchronous outer step, pipelined in pieces.

A synchronous outer step of a large fragment is cut into pieces (OuterState.ranges,
about prime.fragments.SYNC_PIECE_VALUES values each): every piece's
pseudo-gradient is computed and handed to the ring as soon as it is ready, and
every piece's update is applied as soon as its average is back, while later
pieces are still on the wire (a sync that can: Sync.average_pieces). Only the
first piece's preparation and the last piece's update are left on the critical
path beside the wire. A sync that cannot pipeline (elastic membership) gets the
pieces in one all-reduce, as does a fragment small enough to be one piece.

A step that fails part way keeps the pieces it applied (PipelinedStep.done):
the next attempt, also after a resume, does the rest.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from prime.outer import OuterState

__all__ = ["PipelinedStep", "PIPELINE_DEPTH"]

PIPELINE_DEPTH = 3
"""Pieces of a pipelined synchronous outer step prepared and not yet applied at once (each its own work buffer):
the piece being applied, the one on the wire and the next, queued; 3 x 512 MiB at most on the GPU instead of
the fragment's whole pseudo-gradient."""


class PipelinedStep:
    """The synchronous outer steps of one fragment's OuterState (module docstring). `settings`: the fragments'
    shared FragmentSettings (the sync, the pseudo-gradient buffers, the error measurement, check_finite)."""

    def __init__(self, state: OuterState, settings):
        self.state, self.s = state, settings
        self.done = 0
        """Pieces of a pipelined synchronous outer step already applied when it failed part way (0 otherwise):
        the next attempt (also after a resume) does the rest."""
        self._slots: Optional[torch.Tensor] = None  # the pipelined step's piece buffers

    @torch.no_grad()
    def run(self, pieces: int, inner_step: int, outer_step: int, weighing=None) -> tuple:
        """A synchronous outer step, pipelined in `pieces` pieces when there are several; weighing: a token-
        weighted average (prime.weights.Weighing; None: equal weights). Returns (SyncResult, timings dict, norm,
        own error)."""
        st, s = self.state, self.s
        st.ensure_taken()
        t0 = time.perf_counter()
        ranges = st.ranges(pieces)
        sq, first, own_sq = [0.0], [None], [0.0]
        measure_own = s.own_error_pass()
        feedback = st.residual is not None
        scale = weighing.scale if weighing is not None else 1.0
        dense = s.dense(outer_step)  # a sparse codec's dense start: the average applied as it is
        weights, weigh_s = None, 0.0
        pipelined = s.sync.pipelined and len(ranges) > 1
        if pipelined and weighing is not None:  # every node's count before the first piece's apply()
            weights = weighing.of(s.sync.weigh(weighing.trained, outer_step=outer_step))
            weigh_s = time.perf_counter() - t0  # an exchange across nodes: a wait for the others, timed as one
        if pipelined:  # PIPELINE_DEPTH buffers of the longest piece, reused in turn
            width = max(hi - lo for lo, hi in ranges)
            slots = self._piece_slots(width)
            buffer = lambda j: slots[j % PIPELINE_DEPTH][: ranges[j][1] - ranges[j][0]]  # noqa: E731
            base = None
        else:
            base = s.grads.take()
            buffer = lambda j: base[ranges[j][0] : ranges[j][1]]  # noqa: E731

        def prepare(j: int) -> None:
            lo, hi = ranges[j]
            q = st.pseudo_gradient(buffer(j), lo=lo, hi=hi, at=lo)
            finite = math.isfinite(q)
            if measure_own and finite and hi > lo:
                own_sq[0] += st.int8_error_sq(buffer(j))
            if scale != 1.0:  # a weighted contribution (prime.weights), before the residual is added
                buffer(j).mul_(scale)
            if feedback:  # the residual is committed at apply(), once this piece's average is back
                st.compensate(buffer(j), lo=lo, hi=hi, at=lo)
            sq[0] += q
            s.check_finite(finite, outer_step)
            if first[0] is None:
                first[0] = time.perf_counter() - t0 - weigh_s

        def apply(j: int) -> None:
            lo, hi = ranges[j]
            if weights is not None:
                buffer(j).mul_(weights.factor)
            if feedback:
                st.commit_residual(lo, hi, scale)
                st.add_to_residual(s.sync.take_dropped(buffer(j)), lo, hi)
            st.update(buffer(j), load=True, lo=lo, hi=hi, at=lo, dense=dense)
            self.done = j + 1

        try:
            if pipelined:
                r = s.sync.average_pieces(ranges, outer_step=outer_step, inner_step=inner_step, buffer=buffer,
                                          prepare=prepare, apply=apply, start=self.done,
                                          window=PIPELINE_DEPTH)
                u_last = s.sync.last_apply_s
            else:  # one all-reduce (elastic membership, or a fragment small enough)
                r, u_last = self._one_allreduce(ranges, base, buffer, prepare, inner_step, outer_step, scale,
                                                weighing)
            self.done = 0
            if pipelined:
                r.weights = weights
                r.allreduce_s += weigh_s
        finally:
            s.grads.give(base)
        timings = {"prepare_s": first[0] or 0.0, "update_s": u_last}
        norm = math.sqrt(sq[0]) if sq[0] >= 0 else float("nan")
        own = (math.sqrt(own_sq[0]) / norm if norm > 0 else 0.0) if measure_own else None
        return r, timings, norm, own

    def _one_allreduce(self, ranges: list, base: torch.Tensor, buffer, prepare, inner_step: int,
                       outer_step: int, scale: float = 1.0, weighing=None) -> tuple:
        """The pieces not yet done in one all-reduce over `base`: each prepared, averaged, then applied. Returns
        (SyncResult, seconds of the update)."""
        st, s = self.state, self.s
        feedback = st.residual is not None
        todo = range(self.done, len(ranges))
        lo, hi = ranges[todo[0]][0], ranges[-1][1]
        for j in todo:
            prepare(j)

        def recompute(_):
            for j in todo:
                st.pseudo_gradient(buffer(j), lo=ranges[j][0], hi=ranges[j][1], at=ranges[j][0])
                if scale != 1.0:
                    buffer(j).mul_(scale)
                if feedback:
                    st.compensate(buffer(j), lo=ranges[j][0], hi=ranges[j][1], at=ranges[j][0])

        if weighing is None:
            r = s.sync.average(base[lo:hi], outer_step=outer_step, inner_step=inner_step, recompute=recompute)
        else:  # a token-weighted average: the contributors' counts come back with it
            r = s.sync.average(base[lo:hi], outer_step=outer_step, inner_step=inner_step, recompute=recompute,
                               trained=weighing.trained)
            r.weights = weighing.of(r.counts)
        u0 = time.perf_counter()
        if not r.joined:  # (a node that joined holds the job's state already: OuterStates.admit)
            if r.weights is not None:
                base[lo:hi].mul_(r.weights.factor)
            s.sync.applying(r)
            if feedback and r.contributed:
                st.commit_residual(lo, hi, scale)
                st.add_to_residual(s.sync.take_dropped(base[lo:hi]), lo, hi)
            elif feedback:  # this node's pseudo-gradient is not in the average: it lost nothing to the codec
                st.reset_residual()
            k = r.outer_step if r.outer_step is not None else outer_step  # (the job's, where the sync moved it)
            st.update(base[lo:hi], load=True, lo=lo, hi=hi, at=lo, dense=s.dense(k))
        return r, time.perf_counter() - u0

    def _piece_slots(self, width: int) -> list:
        """PIPELINE_DEPTH work buffers of `width` values for a pipelined synchronous step (kept)."""
        if self._slots is None or self._slots.numel() < PIPELINE_DEPTH * width:
            self._slots = torch.zeros(PIPELINE_DEPTH * width, dtype=torch.float32, device=self.state.work_device)
        return [self._slots[i * width : (i + 1) * width] for i in range(PIPELINE_DEPTH)]
