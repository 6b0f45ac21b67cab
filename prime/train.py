"""prime-train: the training entry point. Parse the config, build the Trainer, train, close.

    torchrun --nproc-per-node 8 -m prime.train --config configs/10B.toml \\
        --node-rank 0 --num-nodes 2 --store-addr 10.0.0.1:29600

One torchrun per node; `prime-train --help` lists every config field.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    """Runs one process of a training job; returns the exit status (0 ok, 2 bad config, 3 stopped on an error)."""
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


def _destroy_process_group() -> None:
    """A Trainer that failed to build may leave the node's process group behind: destroy it before exiting."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
