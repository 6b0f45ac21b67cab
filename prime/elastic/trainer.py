"""The Trainer's elastic parts (prime/trainer.py calls these when elastic.enabled).

Kept here so that the trainer reads the same with or without elastic nodes:
building the membership and the ElasticSync that the trainer hands to DiLoCo,
the data slots, starting (or joining) before the first inner step, and taking
the job's position after a (re)join.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta
from typing import Optional

__all__ = ["build_elastic_sync", "slot_loader", "start_elastic", "on_join"]


def _say(trainer, msg: str) -> None:
    log = getattr(trainer, "log", None)
    if log is not None:
        log.print(msg)
    elif trainer.is_logger:
        print(msg, flush=True)  # before the metrics logger exists (registration)


def _record(trainer, **fields) -> None:
    log = getattr(trainer, "log", None)
    if log is not None:
        log.record("membership", getattr(trainer, "step", 0), **fields)


def build_elastic_sync(trainer):
    """Membership (own store connections under prime/<run_id>/elastic) and the ElasticSync of this node.

    The sync's test hooks (stall, hold) run before each inner optimizer step."""
    import torch.distributed as dist

    from prime.elastic.membership import Membership
    from prime.elastic.node import ElasticSync

    cfg = trainer.cfg
    d, e, n = cfg.diloco, cfg.elastic, cfg.nodes

    def store_factory():
        raw = dist.TCPStore(n.store_host, n.store_port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=d.timeout_s))
        return dist.PrefixStore(f"prime/{n.run_id}/elastic", raw)

    membership = Membership(
        store_factory, node_rank=n.node_rank, initial_nodes=n.num_nodes, run_id=n.run_id,
        heartbeat_interval_s=e.heartbeat_interval_s, heartbeat_timeout_s=e.heartbeat_timeout_s,
        barrier_timeout_s=e.barrier_timeout_s,
        # a live member reports within the ring's formation and all-reduce limits
        report_timeout_s=2 * d.timeout_s + e.heartbeat_timeout_s,
        max_attempts=e.max_attempts, min_nodes=e.min_nodes,
        log=lambda msg: _say(trainer, msg), record=lambda **f: _record(trainer, **f),
    )
    sync = ElasticSync(
        membership, ring_timeout_s=d.timeout_s, streams=d.streams or None,
        max_rate=d.max_rate_mbit * 1e6 / 8 if d.max_rate_mbit else None,
        transfer_max_rate=e.transfer_max_rate_mbit * 1e6 / 8, transfer_timeout_s=e.transfer_timeout_s,
        join_timeout_s=e.join_timeout_s, start_timeout_s=d.timeout_s, total_steps=cfg.train.steps,
        digest=e.digest, slot_state_fn=lambda: trainer.loader.state_dict(),
    )
    trainer.optimizer.register_step_pre_hook(lambda *_: sync.before_inner_step(trainer.diloco.inner_step + 1))
    return sync


def slot_loader(trainer, slot: int):
    """The data of slot s is shard s mod num_nodes (split among the node's P processes: local rank g reads
    part g); slots past num_nodes read it in another order."""
    from prime.data import ShardedLoader

    cfg, n, p, g = trainer.cfg, trainer.num_nodes, trainer.local_world, trainer.local_rank
    return ShardedLoader(
        trainer.source, cfg.data.seq_len, cfg.train.micro_batch_size, shard=(slot % n) * p + g,
        num_shards=n * p, seed=cfg.train.seed + 7919 * (slot // n), vocab_size=trainer.model_args.vocab_size,
    )


def start_elastic(trainer) -> Optional[object]:
    """Before the first inner step: initial nodes serve their state, joiners join (an outer step, returned).

    Returns the OuterStepResult (did_sync False for initial nodes), or None when the job already ended."""
    from prime.diloco import OuterStepResult
    from prime.elastic.membership import JobFinished

    # SIGTERM (prime-simulate, schedulers) becomes SystemExit, so that close() tells the others at once.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    diloco, sync = trainer.diloco, trainer.elastic_sync
    if not sync.is_joiner:
        sync.start(diloco.outer_step, diloco.inner_step)
        return OuterStepResult(False, diloco.inner_step, diloco.outer_step)
    try:
        return diloco.sync()
    except JobFinished as e:
        _say(trainer, f"elastic: {e}; nothing to do")
        return None


def on_join(trainer, info) -> None:
    """Takes the job's position: inner step, data slot and its position, fresh inner optimizer moments.

    The inner AdamW state is per node (each node's moments follow its own
    gradients), so there is no shared one to copy: a joiner starts with empty
    moments, as the job's nodes did at step 0 (docs/elastic.md)."""
    trainer.step = info.step
    trainer.loader = slot_loader(trainer, info.slot)
    if info.slot_state is not None:
        trainer.loader.load_state_dict(info.slot_state)
    trainer.optimizer.state.clear()
