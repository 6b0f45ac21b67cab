"""Named fault points: the one place where tests, `prime-simulate --fault` and the chaos run inject failures.

Production code marks a fault point with one call, `faults.hit(NAME, at)`,
which does nothing unless a fault was armed for that point; the points, their
triggers and what they may do are declared here and nowhere else. A fault is
armed by a spec, from the environment variable PRIME_FAULTS (comma-separated;
every process of a node inherits it) or in-process with `arm()`:

    POINT@AT[=ACTION]

    train.after_step@8                    exit with status 17 after inner step 8, as if killed
                                          (checkpoint writes finished first)
    train.before_step@22=stall:5          pause 5 s before inner step 22 (heartbeats keep running)
    train.before_step@17=hold:/tmp/go     wait before inner step 17 until the file /tmp/go exists
    allreduce.inside@8                    SIGKILL inside the cross-node all-reduce of outer step 8
    allreduce.inside@file:/tmp/die        SIGKILL inside the first all-reduce that starts after
                                          /tmp/die exists
    transfer.serve@0.4                    SIGKILL after serving 40% of the outer state to a joiner
    tokenize.after_shard@2                exit with status 17 once prime-tokenize has finished 2 shards
    ring.send@5000                        flip one bit of the byte at payload offset 5000 of
                                          everything this process's ring sends (after sealing)

AT is the point's counter (an inner step, an outer step, a fraction of the
state, a byte offset) or `file:PATH` (the first time the point is reached
after PATH exists). Whether AT must equal the counter or only be reached is
the point's (POINTS). Every spec is parsed and checked in `parse()`, with an
error that names the spec and lists what the point accepts.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["ENV", "POINTS", "Fault", "FaultSpecError", "parse", "arm", "disarm", "armed", "hit", "standing",
           "describe", "parse_node_fault", "HOLD_MAX_S"]

ENV = "PRIME_FAULTS"
"""Comma-separated fault specs armed in every process that inherits the environment."""

LEGACY_EXIT_ENV = "PRIME_FAULT_EXIT_AFTER_STEP"
"""Older spelling of `train.after_step@N` (kept for scripts that set it)."""

HOLD_MAX_S = 300.0
"""The longest a `hold` waits for its file: a node left behind by a crashed test does not wait forever."""

EXIT_STATUS = 17
"""Status of the `exit` action (what a test sees from a process that "died")."""


@dataclass(frozen=True)
class Point:
    doc: str
    """Where the point is and what its counter AT counts."""
    actions: tuple
    """The actions allowed here; the first is the default."""
    reached: bool
    """True: fires once the counter reaches AT (>=, a fraction or a byte count); False: when it equals AT."""


POINTS: dict[str, Point] = {
    "train.before_step": Point("before inner step AT, inside its time (with time phases: the AT-th inner step of "
                               "the launch; elastic nodes: the inner optimizer's step hook)",
                               ("kill", "stall", "hold", "exit"), False),
    "train.after_step": Point("after inner step AT and its outer step and checkpoint (the trainer's loop)",
                              ("exit", "kill"), False),
    "allreduce.inside": Point("inside the cross-node all-reduce of outer step AT (elastic sync), after it started",
                              ("kill",), False),
    "transfer.serve": Point("while serving the outer state to a joiner, once a fraction AT of it was sent",
                            ("kill",), True),
    "tokenize.after_shard": Point("prime-tokenize, once AT shards are written and recorded (an interruption)",
                                  ("exit", "kill"), False),
    "ring.send": Point("the ring's sender, at payload byte offset AT of everything it sends", ("corrupt",), True),
}

# action -> does it take an argument (and which)
_ACTION_ARG = {"kill": None, "exit": "status", "stall": "seconds", "hold": "path", "corrupt": None}


class FaultSpecError(ValueError):
    """A fault spec that cannot be armed (the message names it and says what is accepted)."""


@dataclass(frozen=True)
class Fault:
    """One armed fault: at point `point`, when its counter matches `at` (or `path` exists), do `action`."""

    point: str
    at: Optional[float]
    """The counter value (None: `file:` trigger)."""
    path: Optional[str]
    """The trigger file of `file:PATH` (None: a counter trigger)."""
    action: str
    arg: Optional[str]
    spec: str

    def matches(self, at: Optional[float]) -> bool:
        """Whether the point reached with counter `at` fires this fault."""
        if self.path is not None:
            return os.path.exists(self.path)
        if at is None:
            return False
        return at >= self.at if POINTS[self.point].reached else at == self.at

    @property
    def number(self) -> float:
        """The action's numeric argument (stall seconds, exit status)."""
        return float(self.arg)


def _accepted(name: str) -> str:
    p = POINTS[name]
    acts = ", ".join(a + (f":{_ACTION_ARG[a].upper()}" if _ACTION_ARG[a] else "") for a in p.actions)
    return f"{name}@AT (AT: {p.doc}; or file:PATH) with ={acts} (default {p.actions[0]})"


def describe() -> str:
    """Every fault point and what it accepts, one per line (for --help and error messages)."""
    return "\n".join("  " + _accepted(n) for n in POINTS)


def _parse_one(spec: str) -> Fault:
    text = spec.strip()
    name, sep, rest = text.partition("@")
    if not sep or not rest:
        raise FaultSpecError(f"fault spec {spec!r}: expected POINT@AT[=ACTION], e.g. allreduce.inside@8. "
                             f"Points:\n{describe()}")
    if name not in POINTS:
        raise FaultSpecError(f"fault spec {spec!r}: no fault point {name!r}; the points are:\n{describe()}")
    point = POINTS[name]
    when, _, action_text = rest.partition("=")
    at, path = None, None
    if when.startswith("file:"):
        path = when[len("file:"):]
        if not path:
            raise FaultSpecError(f"fault spec {spec!r}: file: needs a path")
        if "corrupt" in point.actions:
            raise FaultSpecError(f"fault spec {spec!r}: {name} is armed from the start: give a byte offset")
    else:
        try:
            at = float(when)
            if not math.isfinite(at):
                raise ValueError(when)
        except ValueError:
            raise FaultSpecError(f"fault spec {spec!r}: AT must be a number or file:PATH, got {when!r}; "
                                 f"accepted: {_accepted(name)}") from None
        if at < 0 or (not point.reached and at != int(at)):
            raise FaultSpecError(f"fault spec {spec!r}: AT of {name} must be "
                                 + ("a number >= 0" if point.reached else "a whole number >= 0") + f", got {when!r}")
    action, _, arg = (action_text or point.actions[0]).partition(":")
    if action not in point.actions:
        raise FaultSpecError(f"fault spec {spec!r}: {name} cannot {action!r}; accepted: {_accepted(name)}")
    need = _ACTION_ARG[action]
    if need is None and arg:
        raise FaultSpecError(f"fault spec {spec!r}: action {action} takes no argument, got {arg!r}")
    if action == "exit" and not arg:
        arg = str(EXIT_STATUS)
    if need is not None and not arg:
        raise FaultSpecError(f"fault spec {spec!r}: action {action} needs {need.upper()} ({action}:{need.upper()})")
    if need in ("seconds", "status"):
        try:
            v = float(arg)
            if not math.isfinite(v):
                raise ValueError(arg)
        except ValueError:
            raise FaultSpecError(f"fault spec {spec!r}: {action} takes a finite number ({need}), got {arg!r}") from None
        if v < 0 or (need == "status" and (v != int(v) or not 0 < v < 256)):
            raise FaultSpecError(f"fault spec {spec!r}: {action}:{arg} is out of range")
    return Fault(name, at, path, action, arg or None, text)


def parse(text: str) -> list[Fault]:
    """Parses comma-separated fault specs; raises FaultSpecError naming the first bad one."""
    return [_parse_one(s) for s in text.split(",") if s.strip()]


# -- what this process has armed -------------------------------------------------------

_lock = threading.Lock()
_armed: Optional[list[Fault]] = None  # None: not read from the environment yet
_fired: set = set()


def _from_env() -> list[Fault]:
    out = parse(os.environ.get(ENV, ""))
    legacy = os.environ.get(LEGACY_EXIT_ENV, "").strip()
    if legacy and legacy != "0":
        out += parse(f"train.after_step@{legacy}")
    return out


def armed(point: Optional[str] = None) -> list[Fault]:
    """The faults armed in this process (at `point` only, if given). Reads PRIME_FAULTS on first use."""
    global _armed
    with _lock:
        if _armed is None:
            _armed = _from_env()
        return [f for f in _armed if point is None or f.point == point]


def arm(spec: str) -> list[Fault]:
    """Arms faults in this process (in addition to PRIME_FAULTS); returns them. For in-process tests."""
    new = parse(spec)
    armed()
    with _lock:
        _armed.extend(new)
    return new


def disarm() -> None:
    """Forgets every armed fault (PRIME_FAULTS is read again on next use)."""
    global _armed
    with _lock:
        _armed = None
        _fired.clear()


def hit(point: str, at: Optional[float] = None, *, log: Optional[Callable[[str], None]] = None,
        before_exit: Optional[Callable[[], None]] = None) -> Optional[Fault]:
    """Marks fault point `point`, reached with counter `at`: runs the action of the first armed fault that
    matches (each fault fires once). Returns the fault whose action returned (stall, hold), None when
    nothing fired. `before_exit` runs before an `exit` (e.g. wait for checkpoint writes)."""
    assert point in POINTS, point
    faults = [f for f in armed(point) if f.action != "corrupt"]
    if not faults:
        return None
    for f in faults:
        if f.spec + f"#{id(f)}" in _fired or not f.matches(at):
            continue
        _fired.add(f.spec + f"#{id(f)}")
        say = log or (lambda m: print(m, file=sys.stderr, flush=True))
        if f.action == "kill":
            line = f"fault {f.spec}: SIGKILL at {point} {at if at is not None else ''}".rstrip()
            say(line)
            if log is not None:  # also where a launcher sees it whatever the process logs (prime-simulate)
                print(line, file=sys.stderr, flush=True)
            time.sleep(0.01)  # let the line out
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "exit":
            if before_exit is not None:
                before_exit()
            say(f"fault {f.spec}: exiting as if killed (status {int(f.number)})")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(f.number))
        elif f.action == "stall":
            say(f"fault {f.spec}: stalling {f.number:g} s at {point} {at}")
            time.sleep(f.number)
        elif f.action == "hold":
            say(f"fault {f.spec}: holding at inner step {at} until {f.arg} exists")
            deadline = time.monotonic() + HOLD_MAX_S
            while not os.path.exists(f.arg) and time.monotonic() < deadline:
                time.sleep(0.05)
            say(f"fault {f.spec}: released at inner step {at}")
        return f
    return None


def standing(point: str, action: str) -> Optional[Fault]:
    """The first fault armed at `point` with `action` that the caller applies itself from the start (ring.send's
    corrupt: the byte offset goes to the C++ sender), or None."""
    assert point in POINTS and action in POINTS[point].actions, (point, action)
    return next((f for f in armed(point) if f.action == action), None)


def parse_node_fault(text: str) -> tuple[Optional[int], str]:
    """`prime-simulate --fault [R=]SPEC`: (node rank R, or None for every node; the checked SPEC)."""
    head, sep, rest = text.partition("=")
    rank = None
    if sep and head.isdigit():
        rank, text = int(head), rest
    parse(text)  # raises FaultSpecError naming what is wrong
    return rank, text
