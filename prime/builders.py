"""The functions that build a training run's components from a Config (the Trainer calls them in this order).

    env = build_environment(cfg)                                   # prime/runtime.py
    parts = build_model_and_optimizer(cfg, env)                    # model (FSDP2 inside the node) + inner AdamW
    data = build_data(cfg, env, parts.args.vocab_size)             # this process's data slot
    metrics = build_metrics(cfg, env, parts, data)                 # log lines, records, accounting
    diloco, nodes = build_outer_step(cfg, env, parts, data, metrics)   # DiLoCo over a fixed ring or elastic nodes
    checkpoints = build_checkpoints(cfg, env, parts, data, diloco)     # None without checkpoint.dir
    plan = build_memory_plan(cfg, env, parts, diloco, nodes, checkpoints, say)   # refuses a run that cannot fit

Each builder takes what the ones before it built and nothing else, so each can
be called (and tested) on its own.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from prime.checkpoint import Checkpointer, TrainCheckpoints, manifest_key
from prime.config import Config
from prime.data import ShardedLoader, TokenSource, load_source
from prime.diloco import DiLoCo
from prime.memory import MemoryPlan, MemoryPlanError, auto_margin_bytes, plan_memory
from prime.metrics import RunMetrics, peak_flops
from prime.model import Transformer
from prime.parallelize import parallelize
from prime.runtime import Environment
from prime.shares import DiLoCoRings

__all__ = ["ModelAndOptimizer", "TrainData", "build_model_and_optimizer", "build_data", "build_metrics",
           "build_outer_step", "build_checkpoints", "build_memory_plan"]


@dataclass
class ModelAndOptimizer:
    """The model of this process (sharded inside the node when FSDP2 is on) and its inner optimizer."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    args: Any
    """The prime.model.ModelArgs the model was built from."""
    autocast: Any
    """Context of the forward pass: bf16 autocast without FSDP (FSDP's MixedPrecisionPolicy does it otherwise)."""

    def numel(self) -> int:
        """Values of the whole model (not of this process's shard)."""
        return sum(p.numel() for p in self.model.parameters())

    def describe(self, cfg: Config, env: Environment, peak: Optional[float]) -> str:
        a = self.args
        peak_s = f"{peak / 1e12:.0f} TFLOP/s per device" if peak else "n/a (set metrics.peak_tflops)"
        return (f"model {cfg.model.name}: {a.num_params() / 1e6:.2f}M parameters, "
                f"{a.flops_per_token(cfg.data.seq_len) / 1e6:.1f} MFLOP/token at seq_len {cfg.data.seq_len}; "
                f"device {env.device.type} x {env.local_world}{' (FSDP2)' if env.fsdp else ''}; peak {peak_s}")


def build_model_and_optimizer(cfg: Config, env: Environment) -> ModelAndOptimizer:
    """The Transformer of cfg.model, initialized from train.seed (the same on every node and process), wrapped
    by prime.parallelize, and AdamW over it (weight decay on matrices only)."""
    args = cfg.model.args()
    torch.manual_seed(cfg.train.seed)  # the same on every node and process: identical initial weights
    mp = cfg.train.mixed_precision
    bf16 = mp == "bf16" or (mp == "auto" and env.device.type == "cuda")
    # On a GPU each process initializes its own shards on the device (the meta device first: no process ever
    # holds the whole model in memory), with values that depend on the sharding. Nodes that run different
    # numbers of processes (prime.shares) must start from the same values: each initializes the whole model on
    # the CPU first, as on a CPU run, and shards it from there (the whole model in host memory for a while).
    whole_first = env.device.type == "cpu" or (env.shares is not None and env.shares.uneven)
    if whole_first:
        model = Transformer(args)  # initialized here, then sharded: the same values whatever the sharding
    else:
        with torch.device("meta"):
            model = Transformer(args)
    parallelize(
        model, device_type=env.device.type, fsdp=env.fsdp, bf16=bf16,
        activation_checkpointing=cfg.train.activation_checkpointing, compile=cfg.train.compile,
    )
    if env.device.type == "cuda" and whole_first:
        model.to(env.device)  # (FSDP2 moved its shards already)
    elif env.device.type == "cuda":
        model.to_empty(device=env.device)
        torch.manual_seed(cfg.train.seed)
        model.init_weights(buffer_device=env.device)
    autocast = (torch.autocast(env.device.type, dtype=torch.bfloat16) if bf16 and not env.fsdp
                else contextlib.nullcontext())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norm weights
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=env.device.type == "cuda" or None,
    )
    return ModelAndOptimizer(model, optimizer, args, autocast)


class TrainData:
    """This process's data: a loader over the data slot of its node.

    Slot s of a job that started with N nodes reads shard s mod N, split
    between the node's P processes (local rank g reads shard (s mod N) P + g of
    N P; with nodes of different process counts P_n, shard P_0 + ... + P_(s-1)
    + g of P_0 + ... + P_(N-1)); slots past N (elastic joiners) read the same
    shards in another order. A fixed job's node r has slot r, so every process
    reads data no other reads.
    """

    def __init__(self, cfg: Config, source: TokenSource, vocab_size: int, env: Environment, slot: int):
        self.cfg, self.source, self.vocab_size = cfg, source, vocab_size
        self.local_rank, self.local_world, self.num_slots = env.local_rank, env.local_world, env.num_nodes
        shares = env.shares
        self.procs = list(shares.procs[:env.num_nodes]) if shares is not None else [env.local_world] * env.num_nodes
        """Processes of each node of the job's start (the data's shards are theirs)."""
        self.tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len * cfg.train.grad_accum * env.local_world
        """Tokens of one inner step of the node (all its processes)."""
        self.loader = self.use_slot(slot)

    def use_slot(self, slot: int, state: Optional[dict] = None) -> ShardedLoader:
        """Moves to data slot `slot`, at position `state` (None: its start); returns the new loader."""
        n, c = self.num_slots, self.cfg
        self.slot = slot
        self.loader = ShardedLoader(
            self.source, c.data.seq_len, c.train.micro_batch_size,
            shard=sum(self.procs[:slot % n]) + self.local_rank, num_shards=sum(self.procs),
            seed=c.train.seed + 7919 * (slot // n), vocab_size=self.vocab_size,
        )
        if state is not None:
            self.loader.load_state_dict(state)
        return self.loader

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.next_batch()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def describe(self) -> str:
        ld = self.loader
        return (f"data {self.source.description}; shard {ld.shard} of {ld.num_shards} ({ld.windows_per_epoch} "
                f"sequences per epoch); {self.tokens_per_step} tokens per step per node")


def build_data(cfg: Config, env: Environment, vocab_size: int) -> TrainData:
    """The token source of cfg.data and this process's loader (node r starts in data slot r mod num_nodes)."""
    source = load_source(cfg.data.source, cfg.data.path, cfg.data.bin_dtype)
    return TrainData(cfg, source, vocab_size, env, slot=env.node_rank % env.num_nodes)


def build_metrics(cfg: Config, env: Environment, parts: ModelAndOptimizer, data: TrainData) -> RunMetrics:
    """The run's metrics (not yet opened: RunMetrics.open once the resume step is known)."""
    outer = cfg.diloco.outer_settings()
    return RunMetrics(
        out_dir=cfg.metrics.out_dir, node_rank=env.node_rank, is_logger=env.is_logger, local_world=env.local_world,
        num_nodes=env.num_nodes, total_steps=cfg.train.steps, log_every=cfg.metrics.log_every,
        tokens_per_step=data.tokens_per_step,
        flops_per_token=parts.args.flops_per_token(cfg.data.seq_len),
        peak=peak_flops(env.device, cfg.metrics.peak_tflops), local_sum=env.local_sum,
        codec=cfg.diloco.codec, block_size=cfg.diloco.resolved_block_size(), inner_steps=cfg.diloco.inner_steps,
        model_numel=parts.numel(), density=outer["density"], average_density=outer["average_density"],
        step_weights=env.shares.step_weights if env.shares is not None and env.shares.uneven else None,
    )


def build_outer_step(cfg: Config, env: Environment, parts: ModelAndOptimizer, data: TrainData,
                     metrics: RunMetrics) -> tuple[DiLoCo, Any]:
    """DiLoCo over the nodes component: a fixed set of nodes on rings (prime.nodes.FixedNodes), or elastic
    membership (prime.elastic.trainer.ElasticNodes). Returns (diloco, nodes)."""
    d = cfg.diloco
    outer = d.outer_settings()  # the codec's defaults where unset
    if cfg.elastic.enabled:
        from prime.elastic.trainer import ElasticNodes

        nodes = ElasticNodes(cfg, env, parts.optimizer, data, metrics)
    else:
        from prime.nodes import FixedNodes

        nodes = FixedNodes(cfg, env, say=metrics.print)
    shares = getattr(nodes, "shares", None)  # the rings of this process (prime.shares; elastic nodes are equal)
    uneven = shares is not None and shares.uneven
    if uneven:  # a node's share of an average is its tokens, and its FSDP2 shards are the rows each ring carries
        shares.check(list(parts.model.named_parameters()))

    def make(sync, **extra):
        return DiLoCo(
            parts.model, parts.optimizer, sync,
            inner_steps=d.inner_steps, nesterov=d.nesterov, **outer,
            codec=d.codec, block_size=d.resolved_block_size(), measure_compression_error=d.compression_error,
            # elastic: the initial nodes compare at their first outer step (ElasticSync.verify); joiners download
            check_replicas=d.check_replicas, overlap=d.overlap,
            overlap_scheme=d.overlap_scheme, overlap_steps=d.overlap_steps or None,
            outer_state_device=d.outer_state_device, fragments=d.fragments, error_feedback=d.error_feedback,
            dense_outer_steps=d.dense_outer_steps,
            weights="tokens" if d.phase == "time" or uneven else "equal",
            auto_margin_bytes=auto_margin_bytes(cfg, env, parts) if env.device.type == "cuda" else None, **extra)

    if uneven and nodes.sync is not None:
        extra = {"rings": shares.rings, "step_weight": shares.step_weight}
        if len(shares.mine) > 1:  # a one-process node beside larger ones: one DiLoCo per ring, over its rows
            diloco = DiLoCoRings([make(nodes.syncs[g], shard=shares.view(g), **extra) for g in shares.mine],
                                 shares.mine, nodes.group)
        else:
            diloco = make(nodes.sync, **extra)
    else:
        diloco = make(nodes.sync)
    nodes.attach(diloco)
    return diloco, nodes


def build_checkpoints(cfg: Config, env: Environment, parts: ModelAndOptimizer, data: TrainData,
                      diloco: DiLoCo, say=None) -> Optional[TrainCheckpoints]:
    """The run's checkpoints under checkpoint.dir (None when it is not set). checkpoint.every without
    checkpoint.dir writes nothing: the node's logging process says so in one line (`say`, default stderr)."""
    c = cfg.checkpoint
    if not c.dir:
        if c.every and env.is_logger:
            line = (f"prime-train: warning: checkpoint.every = {c.every} but checkpoint.dir is not set: no checkpoint "
                    "is written; set checkpoint.dir to save them (or checkpoint.every = 0)")
            if say is None:
                print(line, file=sys.stderr, flush=True)
            else:
                say(line)
        return None
    checkpointer = Checkpointer(c.dir, env.node_rank, env.local_rank, env.local_world,
                                process_group=env.new_local_group(), keep=c.keep, async_save=c.async_save,
                                key=manifest_key())
    return TrainCheckpoints(checkpointer, parts.model, parts.optimizer, data, diloco, env.local_sum)


def build_memory_plan(cfg: Config, env: Environment, parts: ModelAndOptimizer, diloco: DiLoCo, nodes,
                      checkpoints: Optional[TrainCheckpoints], say=print) -> MemoryPlan:
    """The memory plan of this process (prime/memory.py), printed by the node's logging process; checkpoints are
    saved synchronously when their async staging would not fit. Raises MemoryPlanError on every process of every
    node when some node's plan does not fit (unless memory.check is false)."""
    procs = cfg.memory.host_procs or nodes.host_processes()
    plan = plan_memory(cfg, env, parts, diloco, procs)
    if checkpoints is not None and plan.checkpoint == "blocking":
        checkpoints.checkpointer.async_save = False
    if env.is_logger:
        say(plan.describe())
    bad = nodes.nodes_that_do_not_fit(plan.fits() or not cfg.memory.check)
    if bad:
        if not plan.fits() and cfg.memory.check:
            plan.check()  # the reason here, with the settings to change
        raise MemoryPlanError(f"the memory plan of node(s) {bad} does not fit (their log says why and what to change); "
                              "this node stops with them")
    return plan
