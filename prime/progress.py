"""Progress a person can watch: a bar with rate and ETA on a terminal, plain lines in logs.

    bar = Progress(total=10_000, unit="steps", stream=sys.stdout)
    bar.update(450, rate="12.3k tok/s", extra="loss 4.12")   # redraws the bar line in place
    bar.write("outer 4 (step 450) | all-reduce 1.2 s ...")     # a line above the bar
    bar.status("outer step 5: averaging over the ring")       # shown at the bar's end until the next update
    bar.close()

On a terminal (`stream.isatty()`, or interactive=True) the bar is one line
redrawn with a carriage return, at most `redraw_s` apart, and write() clears it,
prints the line and draws it again. Otherwise nothing is redrawn: write() prints
the line, and update() prints a plain progress line at most every `every_s`
seconds (0: never), so CI logs and files get whole lines only.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

__all__ = ["Progress", "format_duration", "format_count", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (a closed or odd stream counts as not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def format_duration(seconds: Optional[float]) -> str:
    """83 -> '1m23s', 7384 -> '2h03m'; None or not finite -> '?'."""
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def format_count(n: float) -> str:
    """1234 -> '1.2k', 5.6e6 -> '5.6M' (three significant digits at most)."""
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


class Progress:
    """One progress bar over `total` units (steps, bytes, ...); see the module docstring."""

    def __init__(self, total: float, *, unit: str = "", stream: Optional[TextIO] = None,
                 interactive: Optional[bool] = None, every_s: float = 30.0, redraw_s: float = 0.1,
                 width: int = 24, label: str = "", fmt: Callable[[float], str] = format_count,
                 start: float = 0.0):
        self.total, self.unit, self.label, self.fmt = max(float(total), 0.0), unit, label, fmt
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = is_terminal(self.stream) if interactive is None else interactive
        self.every_s, self.redraw_s, self.width = every_s, redraw_s, width
        self.done = self._start_done = float(start)
        self._t0 = time.monotonic()
        self._last_draw = -1e18
        self._last_line = self._t0  # plain lines: the first after every_s
        self._fields: dict = {}
        self._status = ""
        self._shown = False  # a bar line is on the screen (interactive only)
        self._drawn = ""
        self.closed = False

    # -- what the bar says ------------------------------------------------------------------

    def eta_s(self) -> Optional[float]:
        """Seconds left at the average rate since the start (None before any progress)."""
        moved = self.done - self._start_done
        if moved <= 0 or self.total <= 0:
            return None
        return (self.total - self.done) * (time.monotonic() - self._t0) / moved

    def bar(self) -> str:
        """The text of the bar line (without carriage return)."""
        frac = min(1.0, self.done / self.total) if self.total > 0 else 0.0
        fill = int(round(frac * self.width))
        parts = [f"{self.label + ' ' if self.label else ''}{self.fmt(self.done)}/{self.fmt(self.total)}"
                 f"{' ' + self.unit if self.unit else ''} [{'#' * fill}{'.' * (self.width - fill)}] {100 * frac:3.0f}%"]
        parts += [str(v) for v in self._fields.values() if v]
        if self.done < self.total:
            parts.append(f"ETA {format_duration(self.eta_s())}")
        if self._status:
            parts.append(self._status)
        return " | ".join(parts)

    # -- drawing ------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (ValueError, OSError):  # the stream went away (a closed pipe): progress is not worth a crash
            self.closed = True

    def _draw(self) -> None:
        self._drawn = self.bar()
        self._emit("\r\x1b[2K" + self._drawn)
        self._shown = True
        self._last_draw = time.monotonic()

    def update(self, done: float, force: bool = False, **fields) -> None:
        """Moves the bar to `done`; `fields` (name=text) are shown after it in the order first given."""
        if self.closed:
            return
        self.done = float(done)
        self._fields.update(fields)
        self._status = ""
        now = time.monotonic()
        if self.interactive:
            if force or now - self._last_draw >= self.redraw_s or self.done >= self.total:
                self._draw()
        elif self.every_s > 0 and (force or now - self._last_line >= self.every_s):
            self._last_line = now
            self._emit(self.bar() + "\n")

    def status(self, text: str) -> None:
        """Shows `text` at the end of the bar now (interactive) until the next update(); plain: nothing."""
        if self.closed:
            return
        self._status = text
        if self.interactive:
            self._draw()

    def write(self, line: str) -> None:
        """Prints `line` (above the bar on a terminal)."""
        if self.closed:
            try:
                print(line, file=self.stream, flush=True)
            except (ValueError, OSError):
                pass
            return
        if self.interactive and self._shown:
            self._emit("\r\x1b[2K" + line + "\n")
            self._draw()
        else:
            self._emit(line + "\n")

    def close(self) -> None:
        """Leaves the final bar on its own line (interactive); no more drawing after this."""
        if self.closed:
            return
        if self.interactive and self._shown:
            final = self.bar()
            self._emit("\n" if final == self._drawn else "\r\x1b[2K" + final + "\n")
        self.closed = True
