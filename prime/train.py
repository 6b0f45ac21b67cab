"""prime-train: the training entry point. Parse the config, build the Trainer, train, close.

    torchrun --nproc-per-node 8 -m prime.train --config configs/10B.toml \\
        --node-rank 0 --num-nodes 2 --store-addr 10.0.0.1:29600

One torchrun per node; `prime-train --help` lists every config field.
"""

from __future__ import annotations

import sys
from typing import Optional

from prime import stop


def main(argv=None) -> int:
    """Runs one process of a training job; returns the exit status: 0 ok, 2 bad config, 3 stopped on an error,
    128 + N stopped by signal N (143 SIGTERM, 130 SIGINT, 129 SIGHUP; docs/stopping.md).

    Run as a program (argv None: `prime-train`, `python -m prime.train`), it dies with the launcher that started
    it, stops cleanly on those signals, and ends the process itself once everything is closed (see _end_process).
    In-process callers (argv given) keep their own signal handlers."""
    if argv is None:
        stop.die_with_parent()  # first: a launcher that ends (even by SIGKILL) takes this process with it
    status = _run(argv)
    if argv is None:
        _end_process(status)
    return status


def _run(argv) -> int:
    from prime.config import config_from_argv

    try:
        cfg = config_from_argv(argv)
    except ValueError as e:
        print(f"prime-train: error: {e}", file=sys.stderr)
        return 2

    from prime.checkpoint import CheckpointError
    from prime.trainer import NothingToDo, Trainer, TrainingStopped

    run = _Run(cfg)
    if argv is None:
        run.signals = stop.StopSignals(cfg.train.stop_grace_s, run.stop_line)
        run.signals.install()
    try:
        try:
            run.trainer = Trainer(cfg)
        except (ValueError, FileNotFoundError) as e:
            print(f"prime-train: error: {e}", file=sys.stderr)
            _destroy_process_group()
            return 2
        except CheckpointError as e:  # the Trainer closed itself
            print(f"prime-train: stopped: {e}", file=sys.stderr)
            return 3
        except TrainingStopped as e:  # the nodes could not start (an elastic node found no launch to take part in)
            print(f"prime-train: stopped: {e}", file=sys.stderr)
            _destroy_process_group()
            return 3
        except NothingToDo as e:
            print(f"prime-train: {e}; nothing to do", file=sys.stderr)
            _destroy_process_group()
            return 0
        failed = True
        try:
            run.trainer.train()
            failed = False
        except TrainingStopped as e:
            print(f"prime-train: stopped: {e}", file=sys.stderr)
            return 3
        finally:
            run.close(failed)
        return 0
    except stop.Stopped as s:  # a signal: wherever it came, the Trainer (if built) has closed
        run.signals.report(s.signum)
        return s.code


class _Run:
    """What the stop line needs to know of this process's run: its config, its Trainer once built, and what the
    stop abandoned."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.trainer = None
        self.signals: Optional[stop.StopSignals] = None
        self.abandoned: Optional[str] = None

    def close(self, failed: bool) -> None:
        """trainer.close(); while stopping on a signal, an error of the teardown is printed, not raised (the stop
        line and the status say what happened)."""
        stopping = self.signals is not None and self.signals.signum is not None
        try:
            self.abandoned = self.trainer.close(failed=failed, stopping=stopping)
        except Exception as e:
            if not stopping:
                raise
            print(f"prime-train: while stopping: {type(e).__name__}: {e}", file=sys.stderr)

    def stop_line(self, signum: int, late: bool) -> str:
        """The one line a process prints when a signal stopped it: the signal, the inner step, how to resume."""
        cfg, trainer = self.cfg, self.trainer
        where = f"at inner step {trainer.step}" if trainer is not None else "before the first inner step"
        if self.abandoned:
            where += f" ({self.abandoned})"
        if late:
            where += f" (still stopping after train.stop_grace_s = {cfg.train.stop_grace_s:g} s: ended there)"
        steps = None  # this node's complete checkpoints (on disk: a write in flight has finished or never will)
        if trainer is not None and trainer.checkpoints is not None:
            steps = trainer.checkpoints.checkpointer.complete_steps()
        return f"prime-train: stopped by {stop.signal_name(signum)} {where}; " + stop.resume_hint(
            cfg.checkpoint.dir, cfg.checkpoint.resume, steps)


def _end_process(status: int) -> None:
    """Ends the process with `status` without the interpreter's teardown (stop.exit_now), output flushed.

    By now the Trainer has closed everything of ours in order (checkpoint writer joined,
    rings closed: their C++ threads joined, tests/test_ring_exit.py; store released; a
    barrier; process groups destroyed; metric sinks closed; see Trainer.close). Two
    reasons to skip the teardown that would follow:

    - It costs about 1 s of a small CPU (0.8-1.4 s measured on 2 cores: torch's modules),
      paid by every launch and, stopped by a signal, out of the launcher's grace.
    - torch's threads may still run: the gloo backend of the node's group stays
      referenced past destroy_process_group() (FSDP2's DTensor specs sit in torch's
      sharding-propagation caches, one of them in C++, and hold the DeviceMesh, which
      holds the group), so its two `pt_gloo_runloop` workers and its `gloo_tcp_loop` I/O
      thread run until the process ends. A plain-torch FSDP2 script with no PRIME code
      leaves the same three. We saw `terminate called without an active exception` on
      local rank 1 of a 2-process launch about once in 15 runs: one of these threads
      meeting the interpreter's finalization or the C++ static destructors. os._exit
      leaves them nothing to meet.
    """
    stop.exit_now(status)


def _destroy_process_group() -> None:
    """A Trainer that failed to build may leave the node's process group behind: destroy it before exiting."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
