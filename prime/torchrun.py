"""python -m prime.torchrun: torchrun with prime's stop rules (docs/stopping.md); the same arguments as torchrun.

    python -m prime.torchrun --nnodes 1 --nproc-per-node 8 -m prime.train --config configs/10B.toml ...

prime-simulate starts every node with it. It runs torchrun's own main in this
process and changes three things at its edges, none inside:

  - Started with $PRIME_PARENT_PID (prime-simulate sets it), it dies with that
    process, and its workers die with it, even when either is SIGKILLed
    (prime.stop.die_with_parent). Plain torchrun's workers die with it too
    (prime.train does the same under any torchrun).
  - Stopped by SIGTERM, SIGINT or SIGHUP, torchrun forwards the signal to its
    workers and waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s,
    then SIGKILL); this then exits with 128 + the signal's number instead of a
    traceback of torchrun's SignalException.
  - A worker that failed printed its own error (a config error, the stop line,
    a traceback): this says in one line which worker and with what status, and
    exits with that status (128 + N for a worker killed by signal N), instead
    of torchrun's ChildFailedError traceback and report.
"""

from __future__ import annotations

import sys

from prime import stop

__all__ = ["main"]


def main(argv=None) -> int:
    """Runs torchrun with `argv` (default sys.argv[1:]); returns the exit status (see the module docstring)."""
    status = _run(sys.argv[1:] if argv is None else argv)
    if argv is None:  # the workers are gone, and torchrun closed its agent: skip torch's teardown (about 1 s)
        stop.exit_now(status)
    return status


def _run(argv: list[str]) -> int:
    stop.die_with_parent()  # first: a launcher that ends (even by SIGKILL) takes this process and its workers along
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.main(argv)
    except SignalException as e:  # torchrun has stopped its workers already
        return stop.exit_status(e.sigval)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        code = failure.exitcode
        status = stop.exit_status(-code) if code < 0 else code if 0 < code < 256 else 1
        how = f"killed by {stop.signal_name(-code)}" if code < 0 else f"exited with status {code}"
        print(f"prime.torchrun: worker local rank {failure.local_rank} (pid {failure.pid}) {how}; "
              f"the node stops with status {status}", file=sys.stderr, flush=True)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
