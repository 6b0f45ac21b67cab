"""Overlap policies: how a fragment's next inner steps start while its average is in flight.

With overlap (docs/overlap.md, "Overlapping the all-reduce") the average of a
fragment's outer step k runs in the background during the next inner steps and
is applied `overlap_steps` inner steps later. A policy decides the parts that
differ from scheme to scheme; the outer weights and momentum only ever receive
averages, in order, whatever the policy, so every node holds the same bits:

    eager            whether the next inner steps start from a start point of this node's own
                     (a work buffer) rather than from the outer weights
    scale()          the factor of the local pseudo-gradient in the lookahead (None: 1)
    next_start()     at a phase boundary, once the previous average is applied: the start point
    keep             once the average lands mid-phase: the share of the start point's offset the
                     local weights keep (None: all of it is corrected)
    adapt()          what the policy learns from the applied average

One class per scheme, registered in SCHEMES by name: a new scheme is a class here
and one line in SCHEMES. Each Fragment holds its own policy (eager-adaptive keeps
its alpha per fragment).

The passes over the outer state that only overlap runs (the lookahead, the shift
once an average lands mid-phase, eager-merge's stand-in) are OverlapPasses, mixed
into prime.outer.OuterState.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from prime.update import NesterovUpdate

__all__ = ["OverlapPolicy", "Delayed", "Eager", "EagerAdaptive", "EagerMerge", "SCHEMES", "make_policy",
           "MERGE_ALPHA", "STAND_IN_OTHERS", "stand_in_share", "OverlapPasses"]

STAND_IN_OTHERS = 0.5
"""eager-merge with overlap_steps < inner_steps: the weight of the local pseudo-gradient as a stand-in for the
other nodes' part of the average (stand_in_share()). Measured in benchmarks/RESULTS.md, "Overlap at longer
phases: the stand-in share"."""

MERGE_ALPHA = 0.5
"""eager-merge: the share of the start point's offset (start - outer weights) that the local weights keep when
the average arrives. 1/2 is Streaming DiLoCo's mixing factor, and the value that keeps the node's offset
from growing whatever fraction c in [0, 1] of it the inner steps undo (the offset of the next start is
-lr (1 + mu) (c - 1/2) times this one, plus fresh noise: a gain below 1 while lr (1 + mu) < 2); measured in
benchmarks/RESULTS.md, "Overlap: the eager-merge scheme"."""


def stand_in_share(nodes: int) -> float:
    """eager-merge with overlap_steps < inner_steps: the next start is the lookahead of this share of the local
    pseudo-gradient: its own part of the average, 1/nodes, in full, and the other nodes' part, 1 - 1/nodes,
    estimated by STAND_IN_OTHERS times it (a noisy local estimate, shrunk). The common lag this leaves is
    corrected by the shift after overlap_steps. One node: 1, the synchronous outer step."""
    return 1.0 / nodes + (1.0 - 1.0 / nodes) * STAND_IN_OTHERS


class OverlapPolicy:
    """A scheme of overlap (see the module docstring). `settings`: the fragments' shared FragmentSettings
    (inner_steps, overlap_steps, nodes())."""

    name = ""
    eager = True
    """The next inner steps start from a start point of this node's own (a work buffer): the lookahead of its
    pseudo-gradient. Needs the default outer update; may land its average mid-phase (overlap_steps <
    inner_steps)."""
    keep: Optional[float] = None
    alpha = 1.0
    """The weight of the local pseudo-gradient in the lookahead (eager-adaptive learns it; 1 otherwise)."""

    def __init__(self, settings):
        self.s = settings

    def scale(self) -> Optional[float]:
        """The factor of the local pseudo-gradient in the lookahead (None: 1)."""
        return None

    def next_start(self, frag, g: torch.Tensor, sq: float) -> None:
        """At a phase boundary, after the previous average (if any) was applied to the outer weights: the point
        the next inner steps start from, written into the model. g: this step's pseudo-gradient (about to be
        sent), sq: its squared norm. Eager: the lookahead of the stand-in."""
        st = frag.state
        src = g
        if frag.start is None:
            frag.start = frag.s.starts.take()[: st.numel]
        else:
            src = self.stand_in(frag, g)
        st.lookahead(src, frag.start, load=True, scale=self.scale(), dense=frag.dense_now)
        self.seen(sq)

    def stand_in(self, frag, g: torch.Tensor) -> torch.Tensor:
        """The stand-in for the average at a boundary where the previous start point is known (default: g)."""
        return g

    def seen(self, sq: float) -> None:
        """This node's pseudo-gradient's squared norm of the outer step just started."""

    def adapt(self, a_sq: float) -> None:
        """The squared norm of the average just applied."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def reset(self) -> None:
        """A node that (re)joins: nothing learned from averages of its own."""


class Delayed(OverlapPolicy):
    """The next inner steps start from the outer weights as they are, without the average in flight: that
    average can only land at a phase boundary."""

    name = "delayed"
    eager = False

    def next_start(self, frag, g: torch.Tensor, sq: float) -> None:
        frag._give_start()  # the model was loaded with the outer weights when the average was applied


class Eager(OverlapPolicy):
    """The next inner steps start from the outer update the local pseudo-gradient would give (it stands in for
    the average)."""

    name = "eager"


class EagerAdaptive(OverlapPolicy):
    """eager, with the local pseudo-gradient shrunk by alpha = ||a||^2 / ||d||^2 of the previous outer step,
    clamped to [1/nodes, 1]: with nodes' pseudo-gradients d_r = mu + e_r (e_r independent, of variance s^2), the
    least-squares weight of d_r as an estimate of their mean is (|mu|^2 + s^2/n) / (|mu|^2 + s^2) =
    E||a||^2 / E||d_r||^2."""

    name = "eager-adaptive"

    def __init__(self, settings):
        super().__init__(settings)
        self.alpha = 1.0
        self._last_sq: Optional[float] = None

    def scale(self) -> Optional[float]:
        return None if self.alpha == 1.0 else self.alpha

    def seen(self, sq: float) -> None:
        self._last_sq = sq

    def adapt(self, a_sq: float) -> None:
        if not self._last_sq or not math.isfinite(a_sq):
            return
        self.alpha = min(1.0, max(1.0 / self.s.nodes(), a_sq / self._last_sq))

    def state_dict(self) -> dict:
        return {"alpha": self.alpha}

    def load_state_dict(self, sd: dict) -> None:
        self.alpha = float(sd.get("alpha", 1.0))

    def reset(self) -> None:
        self.alpha, self._last_sq = 1.0, None


class EagerMerge(OverlapPolicy):
    """eager, but when the average arrives the local weights keep MERGE_ALPHA of their start point's offset from
    the outer weights (Streaming DiLoCo's merge), so that the next start does not echo the part of the offset
    that the inner steps already undid; with overlap_steps < inner_steps the start is the lookahead of
    stand_in_share() of the local pseudo-gradient (the shift after overlap_steps corrects the lag)."""

    name = "eager-merge"
    keep = 1.0 - MERGE_ALPHA

    def scale(self) -> Optional[float]:
        # Over the whole phase no shift follows that would correct the lag of a shrunk stand-in: measured
        # worse, so the stand-in stays whole there.
        if self.s.overlap_steps >= self.s.inner_steps:
            return None
        share = stand_in_share(self.s.nodes())
        return None if share == 1.0 else share

    def stand_in(self, frag, g: torch.Tensor) -> torch.Tensor:
        # overlap_steps = inner_steps: the average arrived at this boundary. The local weights, merged, would be
        # x + (1 - alpha)(w - s): their pseudo-gradient from w is d - alpha (s - w).
        return frag.state.merge_stand_in(frag.start, g, MERGE_ALPHA)


SCHEMES = {cls.name: cls for cls in (EagerMerge, Eager, EagerAdaptive, Delayed)}
"""Every overlap scheme by its name (diloco.overlap_scheme); the first is the default."""


def make_policy(name: str, settings) -> OverlapPolicy:
    """The policy of scheme `name` (ValueError naming the schemes when there is none)."""
    if name not in SCHEMES:
        raise ValueError(f"overlap_scheme must be one of {', '.join(SCHEMES)}, got {name!r}")
    return SCHEMES[name](settings)


# -- the passes over the outer state that only overlap runs ------------------------------------


class OverlapPasses:
    """The passes of prime.outer.OuterState that only overlap runs, each one walk over its home buffers (the
    outer weights `outer`, the momentum `momentum`) with its default update `rule` (prime.update): none of them
    changes the outer weights or the momentum."""

    def _lookahead_rule(self, dense: bool = False) -> NesterovUpdate:
        if self.optimizer is not None:
            raise ValueError("lookahead needs the default outer update (outer_optimizer=None)")
        return self.dense_rule if dense else self.rule

    @torch.no_grad()
    def lookahead(self, g: torch.Tensor, out: torch.Tensor, *, load: bool = False,
                  scale: Optional[float] = None, dense: bool = False) -> None:
        """out = the outer weights update(g, dense=dense) would give, without changing the weights or the
        momentum (g and out are work buffers; out may be g). `load`: also copy `out` into the model. `scale`: use
        fp32(g * scale) in place of g.

        The same operations in the same order as update(), so lookahead(g) and update(g) agree bit for bit."""
        rule = self._lookahead_rule(dense)
        tmp, tmp2, tmp3 = self._scratch(3)

        def body(p, mc, wc, gc, oc):
            rule.lookahead(oc, mc, wc, gc, scale, tmp, tmp2, tmp3)
            if load:
                p.write(oc)

        self._walk(body, home=(self.momentum, self.outer), work=(g, out))

    @torch.no_grad()
    def pseudo_gradient_and_lookahead(self, g: torch.Tensor, out: torch.Tensor, *, scale: Optional[float] = None,
                                      dense: bool = False) -> float:
        """pseudo_gradient(g) from the outer weights, then lookahead(g, out, load=True, scale=scale, dense=dense),
        in one pass over the home buffers (the same operations, so the same bits as the two passes). Returns
        ||g||^2."""
        rule = self._lookahead_rule(dense)
        tmp, tmp2, tmp3 = self._scratch(3)
        sq = torch.zeros((), dtype=torch.float64, device=g.device)

        def body(p, mc, wc, gv, oc):
            p.subtract_from(wc, gv)  # pseudo_gradient()'s operations
            sq.add_(torch.dot(gv[: p.n], gv[: p.n]).double())
            rule.lookahead(oc, mc, wc, gv, scale, tmp, tmp2, tmp3)
            p.write(oc)

        self._walk(body, home=(self.momentum, self.outer), work=(g, out))
        return float(sq)

    @torch.no_grad()
    def shift_to_outer(self, start: torch.Tensor, keep: Optional[float] = None) -> None:
        """Overlap, once the average in flight is applied: start := (outer weights - start) [* keep], and the
        local weights += start (each operation rounded once): the local weights move by what their start point
        missed (eager-merge keeps only `keep` of it). `start` (a work buffer) then holds the shift."""

        def body(p, wc, sc):
            torch.sub(wc, sc, out=sc)  # what the start point missed
            if keep is not None:
                sc.mul_(keep)
            p.write(sc, add=True)

        self._walk(body, home=(self.outer,), work=(start,))

    @torch.no_grad()
    def merge_stand_in(self, s: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
        """eager-merge at a boundary: s := g - alpha (s - outer weights), each operation rounded once (s, g: work
        buffers). Returns s."""

        def body(p, wc, sc, gc):
            torch.sub(sc, wc, out=sc)  # the start point's offset from the new outer weights
            sc.mul_(alpha)
            torch.sub(gc, sc, out=sc)

        self._walk(body, home=(self.outer,), work=(s, g))
        return s
