"""prime-train: the training entry point. Parse the config, build the Trainer, train, close.

    torchrun --nproc-per-node 8 -m prime.train --config configs/10B.toml \\
        --node-rank 0 --num-nodes 2 --store-addr 10.0.0.1:29600

One torchrun per node; `prime-train --help` lists every config field.
"""

from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    """Runs one process of a training job; returns the exit status (0 ok, 2 bad config, 3 stopped on an error).

    Run as a program (argv None: `prime-train`, `python -m prime.train`), it ends the process
    itself once everything is closed; see _end_process."""
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
    from prime.trainer import Trainer, TrainingStopped

    try:
        trainer = Trainer(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"prime-train: error: {e}", file=sys.stderr)
        _destroy_process_group()
        return 2
    except CheckpointError as e:  # the Trainer closed itself
        print(f"prime-train: stopped: {e}", file=sys.stderr)
        return 3
    failed = True
    try:
        trainer.train()
        failed = False
    except TrainingStopped as e:
        print(f"prime-train: stopped: {e}", file=sys.stderr)
        return 3
    finally:
        trainer.close(failed=failed)
    return 0


def _end_process(status: int) -> None:
    """Ends the process with `status` without the interpreter's teardown, when a process group was used.

    By now the Trainer has joined every thread it started (checkpoint writer, rings,
    heartbeats) and destroyed the process groups. But torch keeps the gloo backend of
    the node's group referenced past destroy_process_group() (FSDP2's DTensor state is
    cached in torch, in Python and C++), so its two worker threads and its TCP I/O thread
    still run; the interpreter's teardown and the C++ static destructors then ran beside
    them, which aborted local rank 1 of a 2-process launch now and then with `terminate
    called without an active exception` (issue 13). Everything of ours is flushed and
    closed: leave without that teardown.
    """
    import logging

    if not _backend_threads():
        return  # nothing of torch.distributed left running: a normal exit
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _backend_threads() -> list[str]:
    """Names of this process's gloo / NCCL threads (Linux; [] elsewhere)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(("gloo", "pt_gloo", "pt_nccl")):
            names.append(name)
    return names


def _destroy_process_group() -> None:
    """A Trainer that failed to build may leave the node's process group behind: destroy it before exiting."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
