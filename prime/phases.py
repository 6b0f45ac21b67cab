"""Time phases: a node's clock of nominal steps (diloco.phase = "time", docs/heterogeneous.md).

In steps mode each inner step is one step of DiLoCo's schedule. In time mode
the schedule runs on nominal steps of `phase_seconds / inner_steps` seconds
each, read off this node's clock: a node twice as fast trains two inner steps
per nominal step, a node twice as slow passes two nominal steps per inner step
(DiLoCo.step(nominal_steps=0) and DiLoCo.advance()). Every node's phase then
takes the same time, and the outer step weights each node's pseudo-gradient by
the inner steps it trained (prime.weights).

The clock reads wall time from the end of the launch's first inner step, where
the nodes meet (Nodes.meet: that step compiles, for a time that differs between
nodes; elastic nodes do not meet, a joiner's clock takes the job's step). After
a synchronous outer step, which every node leaves at the same moment, it
restarts at the nominal step it reached. With overlap it is never moved: a wait
for an average in flight is phase time, so every node keeps the one schedule
and a transient on one node (a recompile, a late step) is not carried into
later phases.

An inner step that would end past the next outer step's time is not started:
the node goes to that outer step at once; unless the node trained no step
since its last outer step, so that a node whose steps are longer than the time
between two outer steps, or one behind its schedule, still trains one each
time. A node behind its schedule passes one outer step at a time, with an inner
step between, unless its steps are longer than the time between two outer
steps (keeps_up): it then passes every outer step due, as one step each would
leave it further behind at every one. The run's first step (compiling) predicts
nothing. The prediction of a step's time is the median of the node's last
STEP_HISTORY steps.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, Optional

__all__ = ["PhaseClock", "STEP_HISTORY"]

STEP_HISTORY = 8
"""Inner-step times the prediction of the next one is the median of."""


class PhaseClock:
    """The nominal steps a node's phase time has passed.

    inner_steps:   H, nominal steps per phase
    phase_seconds: seconds of phase time per phase
    clock:         the time source (time.perf_counter; tests pass their own)
    warmup:        the run's first inner step predicts nothing (it compiles and warms caches); False for a clock
                   whose every step takes its own time (a virtual clock)
    agree:         agree(values) -> the node's first process's values, on every process of the node (a node of
                   several processes (FSDP2) must take the same decisions: each reads its own clock, and one that
                   started an inner step while another passed the step would wait for it forever). None: alone
    """

    def __init__(self, inner_steps: int, phase_seconds: float, clock: Callable[[], float] = time.perf_counter,
                 warmup: bool = True, agree: Optional[Callable[[list], list]] = None):
        if inner_steps < 1 or not phase_seconds > 0:
            raise ValueError(f"a phase needs inner_steps >= 1 and phase_seconds > 0, got {inner_steps}, "
                             f"{phase_seconds}")
        self.step_s = phase_seconds / inner_steps
        """Seconds of phase time per nominal step."""
        self._clock = clock
        self._origin = clock()
        self._steps: deque = deque(maxlen=STEP_HISTORY)
        self._first = warmup  # the run's first inner step (compiling, warming caches) predicts nothing
        self._since_outer = False  # an inner step was trained since the last outer step
        self._agree = agree

    def start(self, nominal: int) -> None:
        """The clock reads `nominal` steps now (the run's start, a resume, after a synchronous outer step)."""
        self._origin = self._clock() - nominal * self.step_s

    def reached(self) -> int:
        """Nominal steps the clock has passed."""
        return int(self._node([math.floor((self._clock() - self._origin) / self.step_s + 1e-9)])[0])

    def _node(self, values: list) -> list:
        """The node's first process's values (this process's alone)."""
        return values if self._agree is None else self._agree(values)

    def stepped(self, seconds: float) -> None:
        """An inner step took `seconds` (what the next one is predicted from; not the run's first, which compiles
        and warms caches)."""
        if not self._first:
            self._steps.append(seconds)
        self._first = False
        self._since_outer = True

    def outer(self) -> None:
        """An outer step ran (any fragment's)."""
        self._since_outer = False

    def predicted(self) -> float:
        """The next inner step's predicted time (0 before the first)."""
        return statistics.median(self._steps) if self._steps else 0.0

    def keeps_up(self, steps: int) -> bool:
        """True when an inner step is predicted to take no longer than `steps` nominal steps (the time to the next
        outer step): a node behind its schedule then trains one inner step per outer step while it catches up;
        one whose steps are longer passes every outer step due instead, or it would fall further behind at each."""
        return bool(self._node([float(self.predicted() <= steps * self.step_s)])[0])

    def fits_before(self, nominal: int) -> bool:
        """True when an inner step started now is predicted to end by nominal step `nominal`'s time, or when no
        inner step was trained since the last outer step: a node whose steps are longer than the time between
        two outer steps (a slow node, streaming fragments) still trains one step each time, late, instead of
        none ever."""
        if not self._since_outer:
            return True
        return bool(self._node([float(self._clock() + self.predicted() <= self._origin + nominal * self.step_s)])[0])
