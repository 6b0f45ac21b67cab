"""Stopping on a signal: SIGTERM, SIGINT and SIGHUP end every process of a job cleanly and in bounded time.

    signals = StopSignals(grace_s=30, line=...)    # prime/train.py, every training process of every kind of node
    signals.install()
    try:
        ...                                        # build, train, close
    except Stopped as s:                           # raised by the handler, in the main thread
        signals.report(s.signum)                   # the one stop line
        return s.code                              # 128 + the signal's number: 143, 130, 129

    die_with_parent()                              # first thing in a process a launcher started

What each piece guarantees (docs/stopping.md):

  StopSignals   The first of the three signals raises Stopped in the main thread wherever it
                is (an inner step, a wait for an all-reduce, a join): the trainer's close()
                then finishes the checkpoint write in flight and closes the rings, so the other
                nodes see a CommError at once. Nothing new is saved. The main thread may be
                inside C++ for longer than the grace (a ring forming, a store wait, a gloo
                collective): a watchdog thread, woken by the signal itself (set_wakeup_fd, which
                the C-level handler writes to even then), ends the process with the same status
                once the grace has passed, after printing the stop line.
  die_with_parent
                On Linux, a process started by prime-simulate or by torchrun asks the kernel for
                SIGKILL when its parent ends (PR_SET_PDEATHSIG), and checks that its parent is
                still the expected one (it may have ended before the request was made). So a
                SIGKILLed prime-simulate takes its torchruns with it, and a torchrun its workers.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

__all__ = ["SIGNALS", "ENV_PARENT", "Stopped", "StopSignals", "exit_status", "exit_now", "signal_name",
           "die_with_parent", "resume_hint"]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a job cleanly."""

ENV_PARENT = "PRIME_PARENT_PID"
"""Set by a launcher (prime-simulate, python -m prime.torchrun) to its own pid in the environment of what it starts:
the child dies with it (die_with_parent) and rewrites the variable with its own pid for its children."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_status(signum: int) -> int:
    """The status a process stopped by `signum` exits with: 128 + its number (the shell's convention)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Stopped(SystemExit):
    """Raised by the stop handler in the main thread. A SystemExit, so that no `except Exception` on the way
    swallows it; its code is the exit status (128 + the signal's number)."""

    def __init__(self, signum: int):
        super().__init__(exit_status(signum))
        self.signum = int(signum)


class StopSignals:
    """The stop handler of one process: SIGTERM, SIGINT and SIGHUP raise Stopped once, a watchdog bounds the rest.

    grace_s:  how long the process may take to stop after the first signal; then the watchdog prints the stop
              line (if nobody did) and ends the process with os._exit(128 + the signal's number)
    line:     line(signum, late) -> the stop line (late: the grace ran out)
    out:      where the line goes (default: stderr)

    Only the first signal raises; later ones (a launcher and torchrun may both forward one) are ignored, so that
    they do not interrupt the teardown the first one started. install() must run in the main thread."""

    def __init__(self, grace_s: float, line: Callable[[int, bool], str], out=None):
        self.grace_s = float(grace_s)
        self.line = line
        self.out = out
        self.signum: Optional[int] = None
        """The first stop signal received (None: none yet)."""
        self._reported = threading.Lock()
        self._said = False
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None

    def install(self) -> None:
        """Sets the handlers and starts the watchdog thread (a daemon)."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)  # set_wakeup_fd wants a non-blocking fd
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="prime-stop-watchdog", daemon=True).start()

    def _on_signal(self, signum, frame) -> None:
        # Runs in the main thread between two bytecodes (or when a C++ call returns to Python).
        if self.signum is not None:
            return  # already stopping
        self.signum = signum
        raise Stopped(signum)

    def _watch(self) -> None:
        while True:
            try:
                data = self._wake_r.recv(64)
            except OSError:
                return
            if not data:
                return
            got = [b for b in data if b in {int(s) for s in SIGNALS}]
            if got:
                break
        # Woken by the C-level handler even when the main thread sits in C++ (its Python handler runs later).
        signum = self.signum if self.signum is not None else got[0]
        threading.Event().wait(self.grace_s)
        # The line and the flush on a thread of their own: a write into a pipe that nobody reads any more
        # must not keep the process alive.
        last_words = threading.Thread(target=lambda: (self.report(signum, late=True), _where(), _flush()),
                                      daemon=True)
        last_words.start()
        last_words.join(timeout=2.0)
        os._exit(exit_status(signum))

    def report(self, signum: int, late: bool = False) -> None:
        """Prints the stop line once (the main thread after a clean stop, or the watchdog after the grace)."""
        with self._reported:
            if self._said:
                return
            self._said = True
        try:
            print(self.line(signum, late), file=self.out or sys.stderr, flush=True)
        except (OSError, ValueError):  # the launcher is gone (a broken pipe) or the stream is closed
            pass


def _where() -> None:
    """Every thread's Python stack on stderr: where a process still stopping after the grace was stuck."""
    import faulthandler

    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr closed or not a real file: nothing to say it on
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def exit_now(status: int) -> None:
    """Ends the process with `status` after flushing its output and logs, without the interpreter's teardown.

    For a process that has closed everything of its own: the teardown of torch's modules costs seconds on a
    small CPU (2-3 s measured on 2 cores) that a stopping job should not spend, and runs into torch's own
    threads (prime/train.py, _end_process)."""
    import logging

    _flush()
    logging.shutdown()
    os._exit(status)


def resume_hint(checkpoint_dir: str, resume: bool, steps: Optional[list] = None) -> str:
    """How to resume a stopped run, for the stop line. steps: this node's complete checkpoints (None: not known)."""
    if not checkpoint_dir:
        return "no checkpoint dir configured: the progress of this run is lost (set checkpoint.dir to resume next time)"
    if steps is not None and not steps:
        return (f"no checkpoint was written yet in {checkpoint_dir}: running the same command again starts from "
                "step 0 (checkpoint.every sets how often one is)")
    where = f"the newest checkpoint in {checkpoint_dir}" + (f" (on this node: step {steps[-1]})" if steps else "")
    if resume:
        return f"resume: run the same command again (checkpoint.resume = true picks up {where})"
    return f"resume: run the same command again with --checkpoint.resume true (it picks up {where})"


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it ends (prctl PR_SET_PDEATHSIG).

    Only for a process started by a launcher that asks for it: $PRIME_PARENT_PID names the expected parent
    (prime-simulate, python -m prime.torchrun), or torchrun started it ($TORCHELASTIC_RUN_ID: its parent is the
    torchrun agent). A process started by hand is left alone (nohup must keep it running). If the parent ended
    before the request took effect, this process is already an orphan: it exits at once with 137 (as if killed).
    Then $PRIME_PARENT_PID is set to this process, for what it starts."""
    expected = os.environ.get(ENV_PARENT)
    by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if not sys.platform.startswith("linux") or not (expected or by_torchrun):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        ok = False
    if ok:
        # The kernel watches the parent from now on; the parent checked here may have ended before.
        want = int(expected) if expected and expected.isdigit() else parent
        if os.getppid() != want or os.getppid() == 1:
            print(f"prime: the process that started this one (pid {want}) has ended; exiting", file=sys.stderr,
                  flush=True)
            os._exit(exit_status(signal.SIGKILL))
    os.environ[ENV_PARENT] = str(os.getpid())
