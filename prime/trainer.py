"""The Trainer: builds everything from a Config and runs the inner loop; DiLoCo does the outer steps.

One process per device, one torchrun per node. Inside a node the processes
share the model through FSDP2 (gloo on CPU, NCCL on GPU). Between nodes there
is no process group at all: local rank g of every node joins ring g
(prime.comm.Ring), which carries that rank's shard of the pseudo-gradient; a
node with G devices therefore uses G parallel links. The rings meet through a
TCPStore hosted by node 0's first process.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.nn.functional as F

from prime.checkpoint import CheckpointError, Checkpointer
from prime.comm import store_keys as keys
from prime.config import Config
from prime.data import ShardedLoader, load_source
from prime.diloco import DiLoCo, OuterSyncError, ReplicaMismatchError
from prime.metrics import MetricsLogger, human_bytes, mean, peak_flops, plot_losses
from prime.model import Transformer
from prime.parallelize import local_shard, parallelize

__all__ = ["Trainer", "lr_at", "TrainingStopped", "TrainingDiverged"]

# Test hook: after this inner step, wait for checkpoint writes and exit at once
# with status 17, as a killed process would (the resume test uses it).
_FAULT_ENV = "PRIME_FAULT_EXIT_AFTER_STEP"


class TrainingStopped(RuntimeError):
    """Training stopped on an error that a checkpoint and a restart can get past (message says what to do)."""


class TrainingDiverged(TrainingStopped):
    """The loss, the gradient norm or the weights stopped being finite; nothing of that state was saved."""


def lr_at(step: int, total: int, lr: float, warmup: int, decay: int, min_ratio: float) -> float:
    """Warmup-stable-decay: linear warmup over `warmup` steps, flat, then linear decay to min_ratio * lr over the last `decay` steps."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    decay_start = total - decay
    if decay > 0 and step > decay_start:
        frac = min(1.0, (step - decay_start) / decay)
        return lr * (1.0 - (1.0 - min_ratio) * frac)
    return lr


class Trainer:
    """Owns the model, the inner optimizer, the data, DiLoCo, checkpoints and metrics of one process."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._init_processes()
        self._init_model()
        self._init_data()
        self._init_diloco()
        self._init_records()
        try:
            self._init_checkpoints()
        except CheckpointError:
            # Every process of every node stops here alike (see Checkpointer.choose_resume_step):
            # leave the store, the rings and the process groups in order.
            self.close()
            raise
        # Opened last: a resumed run keeps the curve up to its checkpoint and appends to it.
        m = cfg.metrics
        self.log = MetricsLogger(
            m.out_dir, self.node_rank, enabled=self.is_logger, tensorboard=m.tensorboard, wandb=m.wandb,
            wandb_project=m.wandb_project, config=cfg.to_dict(), resume_step=self.resumed_from,
        )

    # -- construction ------------------------------------------------------------

    def _init_processes(self) -> None:
        cfg = self.cfg
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        world = int(os.environ.get("WORLD_SIZE", str(self.local_world)))
        if world != self.local_world:
            raise ValueError(
                f"WORLD_SIZE ({world}) is not LOCAL_WORLD_SIZE ({self.local_world}): start one torchrun per node "
                "(--nnodes 1); nodes are joined by the DiLoCo ring (--node-rank/--num-nodes), not by torchrun"
            )
        self.node_rank, self.num_nodes = cfg.nodes.node_rank, cfg.nodes.num_nodes
        self.elastic = cfg.elastic.enabled
        if self.elastic and self.local_world > 1:
            raise ValueError(
                f"elastic.enabled needs one process per node, this node runs {self.local_world}: use "
                "--nproc-per-node 1 (several GPUs per node are not supported by elastic training yet)"
            )
        want = cfg.train.device
        if want == "cuda" and not torch.cuda.is_available():
            raise ValueError("train.device is 'cuda' but torch sees no GPU; use train.device = 'cpu' or 'auto'")
        self.device = torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")
        if self.device.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"local rank {self.local_rank} has no GPU of its own: this node runs {self.local_world} processes "
                    f"but sees {torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run one process per GPU or train.device = 'cpu'"
                )
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.fsdp = cfg.train.fsdp == "on" or (cfg.train.fsdp == "auto" and self.local_world > 1)
        if self.local_world > 1 and not self.fsdp:
            raise ValueError(
                f"train.fsdp is 'off' but this node runs {self.local_world} processes: replicas inside a node "
                "are not supported; use train.fsdp = 'on' (or 'auto') or one process per node"
            )
        import torch.distributed as dist

        self.dist = dist
        if self.fsdp and not dist.is_initialized():
            # CPU collectives always go through gloo (DiLoCo's small agreements, async checkpoints).
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            # Local collectives may wait while a ring retries: allow for every attempt.
            wait = timedelta(seconds=600 + (cfg.diloco.retries + 2) * cfg.diloco.timeout_s)
            if "MASTER_ADDR" in os.environ:
                dist.init_process_group(backend, timeout=wait)
            else:  # fsdp = 'on' in a single process without torchrun
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
        self.is_logger = self.local_rank == 0
        # The cross-node store: node 0's first process hosts it, everyone else connects.
        self.store = None
        if self.num_nodes > 1 or self.elastic:
            host, port = cfg.nodes.store_host, cfg.nodes.store_port
            is_master = self.node_rank == 0 and self.local_rank == 0 and not (self.elastic and cfg.elastic.external_store)
            raw = dist.TCPStore(
                host, port, is_master=is_master, timeout=timedelta(seconds=cfg.diloco.timeout_s),
                wait_for_workers=False,
            )
            self.store = dist.PrefixStore(f"prime/{cfg.nodes.run_id}", raw)

    def _init_model(self) -> None:
        cfg = self.cfg
        self.model_args = args = cfg.model.args()
        torch.manual_seed(cfg.train.seed)  # the same on every node and process: identical initial weights
        bf16 = cfg.train.mixed_precision == "bf16" or (cfg.train.mixed_precision == "auto" and self.device.type == "cuda")
        if self.device.type == "cuda":
            with torch.device("meta"):  # no process ever holds the whole model in memory
                model = Transformer(args)
        else:
            model = Transformer(args)  # initialized here, then sharded: the same values whatever the sharding
        parallelize(
            model, device_type=self.device.type, fsdp=self.fsdp, bf16=bf16,
            activation_checkpointing=cfg.train.activation_checkpointing, compile=cfg.train.compile,
        )
        if self.device.type == "cuda":
            model.to_empty(device=self.device)
            torch.manual_seed(cfg.train.seed)
            model.init_weights(buffer_device=self.device)
        self.model = model
        # Without FSDP, bf16 compute comes from autocast; FSDP's MixedPrecisionPolicy does it otherwise.
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 and not self.fsdp else contextlib.nullcontext()
        )
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]  # norm weights
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=self.device.type == "cuda" or None,
        )
        self.flops_per_token = args.flops_per_token(cfg.data.seq_len)
        self.peak = peak_flops(self.device, cfg.metrics.peak_tflops)

    def _init_data(self) -> None:
        cfg = self.cfg
        self.source = load_source(cfg.data.source, cfg.data.path, cfg.data.bin_dtype)
        if self.elastic:  # data slot = node rank for initial nodes; a joiner gets its slot when admitted
            from prime.elastic.trainer import slot_loader

            self.loader = slot_loader(self, self.node_rank % self.num_nodes)
        else:
            self.loader = ShardedLoader(
                self.source, cfg.data.seq_len, cfg.train.micro_batch_size,
                shard=self.node_rank * self.local_world + self.local_rank, num_shards=self.num_nodes * self.local_world,
                seed=cfg.train.seed, vocab_size=self.model_args.vocab_size,
            )
        self.tokens_per_step = cfg.train.micro_batch_size * cfg.data.seq_len * cfg.train.grad_accum * self.local_world

    def _make_ring(self, tag: str):
        """Ring `tag` of this local rank: joins local rank g of every node (a fresh rendezvous per tag)."""
        try:
            from prime.comm import Ring
        except ImportError as e:
            raise RuntimeError(f"prime.comm.Ring is not available ({e}); build the extension: make build") from None
        d = self.cfg.diloco
        g = self.local_rank
        store = self.dist.PrefixStore(f"ring/{g}/{tag}", self.store)
        kwargs = {"timeout": timedelta(seconds=d.timeout_s), "job_id": f"{self.cfg.nodes.run_id}/{g}/{tag}"}
        if d.streams:
            kwargs["streams"] = d.streams
        if d.max_rate_mbit:
            kwargs["max_rate"] = d.max_rate_mbit * 1e6 / 8  # bytes per second
        return Ring(store, self.node_rank, self.num_nodes, **kwargs)

    def _init_diloco(self) -> None:
        d = self.cfg.diloco
        # Elastic: the ElasticSync averages; otherwise DiLoCo builds a ring sync from _make_ring
        # (its first ring at once, tagged "start") when there are other nodes.
        self.elastic_sync = None
        ring = {}
        if self.elastic:
            from prime.elastic.trainer import build_elastic_sync

            self.elastic_sync = build_elastic_sync(self)
        elif self.num_nodes > 1:
            ring = dict(ring_factory=self._make_ring, retries=d.retries,
                        local_group=self.dist.group.WORLD if self.dist.is_initialized() else None)
        self.diloco = DiLoCo(
            self.model, self.optimizer, self.elastic_sync,
            inner_steps=d.inner_steps, outer_lr=d.outer_lr, outer_momentum=d.outer_momentum, nesterov=d.nesterov,
            codec=d.codec, block_size=d.block_size, measure_compression_error=d.compression_error,
            check_replicas=d.check_replicas and not self.elastic, **ring,
        )
        if self.elastic:
            self.model_numel = sum(p.numel() for p in self.model.parameters())
            self.dp_bytes_per_step = 0.0  # set per outer step from its members (_after_outer)
            return
        # Per node, what one outer step would cost data parallelism: a ring all-reduce of fp32
        # gradients every inner step (see prime/metrics.py).
        n = self.num_nodes
        self.model_numel = sum(p.numel() for p in self.model.parameters())
        self.dp_bytes_per_step = 2 * (n - 1) / n * 4 * self.model_numel if n > 1 else 0.0

    def _init_records(self) -> None:
        """The trainer's own store records (resume agreement, final digests, finish), signed under the job secret:
        the store has no credentials, so nothing read from it is trusted unsigned (docs/security.md)."""
        self.records = None
        if self.store is None:
            return
        from prime.comm import rendezvous
        from prime.comm.signed_store import SignedKV, SignedStore

        timeout_s = self.cfg.diloco.timeout_s
        if self.elastic_sync is not None:
            secret = self.elastic_sync.membership.secret
        else:  # $PRIME_RING_SECRET, else (one host only) drawn by node 0's first process
            _, advertise = rendezvous.resolve_addresses(self.store, None, None)
            first = self.node_rank == 0 and self.local_rank == 0
            secret = rendezvous.shared_secret(self.store, keys.TRAINER_NS, 0 if first else 1, None,
                                              time.monotonic() + timeout_s, int(timeout_s * 1000), advertise)
        self.records = SignedKV(SignedStore(self.store, secret, f"trainer/{self.cfg.nodes.run_id}"), timeout_s)

    def _init_checkpoints(self) -> None:
        cfg = self.cfg
        self.step = 0
        self.ckpt = None
        resumed_from = None
        if cfg.checkpoint.dir:
            pg = self.dist.new_group(backend="gloo") if self.dist.is_initialized() else None
            self.ckpt = Checkpointer(
                cfg.checkpoint.dir, self.node_rank, self.local_rank, self.local_world, process_group=pg,
                keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save,
            )
            if cfg.checkpoint.resume and not (self.elastic and self.elastic_sync.is_joiner):  # a joiner downloads
                # Verified against its manifest on every node first; raises CheckpointError everywhere when none is intact.
                log = (lambda msg: print(msg, flush=True)) if self.is_logger else None  # the metrics log opens later
                step = self.ckpt.choose_resume_step(self.records, self.node_rank, self.num_nodes,
                                                    publish=self.local_rank == 0, log=log)
                if step is not None:
                    extra = self.ckpt.load(step, self.model, self.optimizer)
                    self.loader.load_state_dict(extra["data"])
                    self.diloco.load_state_dict(extra["diloco"])
                    torch.set_rng_state(extra["rng"])
                    self.step = int(extra["step"])
                    resumed_from = step
        self.resumed_from = resumed_from

    # -- the loop ----------------------------------------------------------------

    def _describe(self) -> None:
        c, a = self.cfg, self.model_args
        peak = f"{self.peak / 1e12:.0f} TFLOP/s per device" if self.peak else "n/a (set metrics.peak_tflops)"
        self.log.print(
            f"model {c.model.name}: {a.num_params() / 1e6:.2f}M parameters, {self.flops_per_token / 1e6:.1f} MFLOP/token "
            f"at seq_len {c.data.seq_len}; device {self.device.type} x {self.local_world}"
            f"{' (FSDP2)' if self.fsdp else ''}; peak {peak}"
        )
        self.log.print(
            f"data {self.source.description}; shard {self.loader.shard} of {self.loader.num_shards} "
            f"({self.loader.windows_per_epoch} sequences per epoch); {self.tokens_per_step} tokens per step per node"
        )
        if self.elastic:
            d = c.diloco
            self.log.print(
                f"elastic DiLoCo: node {self.elastic_sync.node_id} "
                f"({'joiner' if self.elastic_sync.is_joiner else 'initial node'}), "
                f"{self.num_nodes} initial nodes, outer step every {d.inner_steps} inner steps, codec {d.codec}"
            )
        elif self.num_nodes > 1:
            d = c.diloco
            self.log.print(
                f"DiLoCo: node {self.node_rank} of {self.num_nodes}, outer step every {d.inner_steps} inner steps, "
                f"codec {d.codec}, outer lr {d.outer_lr} momentum {d.outer_momentum}{' nesterov' if d.nesterov else ''}"
            )
        if self.resumed_from is not None:
            self.log.print(f"resumed from the checkpoint of step {self.resumed_from}")

    def _local_sum(self, values: list[float]) -> list[float]:
        """Sums small values over the node's processes (a CPU collective; every process must call it)."""
        if not self.dist.is_initialized():
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    def _save(self, block: bool = False) -> None:
        """Checkpoints the current state; raises TrainingDiverged instead when it is not finite."""
        if self.ckpt is None:
            return
        if not self._state_is_finite():
            raise TrainingDiverged(
                f"step {self.step}: the weights or the optimizer state are not finite; they were not saved as a "
                f"checkpoint. {self._restart_hint()}"
            )
        extra = {"step": self.step, "data": self.loader.state_dict(), "diloco": self.diloco.state_dict(),
                 "rng": torch.get_rng_state()}
        self.ckpt.save(self.step, self.model, self.optimizer, extra, block=block)

    @torch.no_grad()
    def _state_is_finite(self) -> bool:
        """Whether this node's weights and AdamW moments are all finite (a local collective: every process calls it)."""
        tensors = [local_shard(p.detach()) for p in self.model.parameters()]
        tensors += [local_shard(t) for st in self.optimizer.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1]
        ok = bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True
        return self._local_sum([0.0 if ok else 1.0])[0] == 0

    def _restart_hint(self) -> str:
        if self.ckpt is None:
            return "No checkpoint.dir was set, so the progress of this run is lost."
        self.ckpt.wait()  # a save in flight is of a state from before the divergence
        done = self.ckpt.complete_steps()
        if not done:
            return "No checkpoint was written before; fix the setting and start again."
        return (f"The newest checkpoint is of step {done[-1]} under {self.cfg.checkpoint.dir}: fix the setting and "
                "restart every node with the same command to resume from it.")

    def _diverged(self, loss: float, gnorm: float) -> None:
        """Stops the run (every process of the node alike) naming the step and the setting that likely caused it."""
        c = self.cfg
        d = self.diloco
        after_outer = d.distributed and getattr(d, "since_sync", 1) == 0 and getattr(d, "outer_step", 0) > 0
        if after_outer:
            likely = (f"diloco.outer_lr ({c.diloco.outer_lr}) too high: the outer step just before this inner step "
                      "made the weights diverge")
        elif self.resumed_from is not None and self.step == self.resumed_from + 1:
            likely = (f"the checkpoint of step {self.resumed_from} that this run resumed from (its state is not "
                      f"finite), or optim.lr ({c.optim.lr}) too high")
        elif self.step == 1 and self.resumed_from is None:
            likely = ("the model or its precision (model.*, train.mixed_precision): the first step diverged before "
                      "any update")
        else:
            likely = f"optim.lr ({c.optim.lr}) too high (or optim.warmup_steps ({c.optim.warmup_steps}) too short)"
        raise TrainingDiverged(
            f"step {self.step}: the loss is {loss} and the gradient norm {gnorm}: training diverged; likely cause: "
            f"{likely}. Nothing of this state was saved. {self._restart_hint()}"
        )

    def train_step(self) -> tuple[float, float]:
        """One inner step (forward/backward over grad_accum micro-batches, clip, AdamW). Returns (loss, grad norm) tensors."""
        cfg = self.cfg
        accum = cfg.train.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            inputs, targets = self.loader.next_batch()
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            if self.fsdp:
                # Reduce-scatter gradients only after the last micro-batch (costs memory for unsharded grads).
                self.model.set_requires_gradient_sync(micro == accum - 1)
            with self.autocast:
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / accum
            loss.backward()
            loss_sum += loss.detach()
        if cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm

    def train(self) -> dict:
        """Runs the inner steps up to train.steps, with outer steps, logging and checkpoints. Returns the summary."""
        cfg = self.cfg
        self._describe()
        fault_step = int(os.environ.get(_FAULT_ENV, "0") or 0)
        self.losses: list[tuple[int, float]] = []
        self.step_s: list[float] = []  # inner-step times, for the summary's medians
        self.total_sent = 0.0
        self.sent_measured = True
        self.total_dp = 0.0
        self.compute_s = 0.0
        self._phase_compute = 0.0
        self._phase_t0 = time.perf_counter()
        t_start = time.perf_counter()
        try:
            if self.elastic:
                from prime.elastic.trainer import start_elastic

                result = start_elastic(self)  # initial nodes serve their state; a joiner joins (an outer step)
                if result is None:
                    return self._summary(time.perf_counter() - t_start)  # the job ended before this node got in
                self._rejoined(result)
            if self.diloco.distributed:
                if cfg.diloco.check_replicas and not self.elastic:  # elastic: joiners check a digest instead
                    self.diloco.check_replicas()
                if self.diloco.since_sync >= cfg.diloco.inner_steps:
                    # The checkpoint was written after a failed outer step: do that outer step first.
                    result = self.diloco.sync()
                    if not self._rejoined(result):
                        self._after_outer(result)
            while self.step < cfg.train.steps:
                self.step += 1
                lr = lr_at(self.step, cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.decay_steps,
                           cfg.optim.min_lr_ratio)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                t0 = time.perf_counter()
                loss, gnorm = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()  # honest step times; the loss is read below anyway
                step_s = time.perf_counter() - t0
                self.compute_s += step_s
                self._phase_compute += step_s
                # The norm is of the node's whole gradient (the same on every process): when it is
                # not finite, every process stops here, before a poisoned state reaches the ring.
                gnorm = float(gnorm)
                if not math.isfinite(gnorm):
                    self._diverged(float(loss), gnorm)
                result = self.diloco.step()
                if self._rejoined(result):  # elastic: evicted, now back at the job's step
                    continue
                show = self.step % cfg.metrics.log_every == 0 or self.step in (1, cfg.train.steps) or result.did_sync
                node_loss = self._log_step(float(loss), gnorm, lr, step_s, show)
                if not math.isfinite(node_loss):  # the node's mean: every process sees the same value
                    self._diverged(node_loss, gnorm)
                if result.did_sync:
                    self._after_outer(result)
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
                    self._save()
                if fault_step and self.step == fault_step:
                    if self.ckpt is not None:
                        self.ckpt.wait()
                    self.log.print(f"{_FAULT_ENV}={fault_step}: exiting as if killed")
                    sys.stdout.flush()
                    os._exit(17)
        except self._finished_errors() as e:  # elastic: evicted, and the job ended before this node got back in
            self.log.print(f"elastic: {e}; stopping")
        except (OuterSyncError, ReplicaMismatchError, *self._stop_errors()) as e:
            if isinstance(e, OuterSyncError) and self.ckpt is not None:
                try:
                    self._save(block=True)
                    where = (f" Checkpoint of step {self.step} saved under {cfg.checkpoint.dir}: restart every node "
                             "with the same command to resume.")
                except TrainingDiverged as d:  # e.g. a pseudo-gradient that is not finite
                    raise TrainingDiverged(f"{e}. {d}") from e
            elif isinstance(e, OuterSyncError):
                where = " No checkpoint.dir was set, so the progress of this run is lost."
            else:
                where = ""
            raise TrainingStopped(f"{e}{where}") from e
        if self.ckpt is not None:
            self._save(block=True)
        wall = time.perf_counter() - t_start
        summary = self._summary(wall)
        if self.diloco.distributed and not self.elastic and self.cfg.diloco.check_replicas:
            summary["weights_digest"] = self._check_final_weights()
        return summary

    @torch.no_grad()
    def _check_final_weights(self) -> str:
        """Hashes this process's final weights and compares the hash with the same local rank
        of every other node (through the store). Returns the hash; raises ReplicaMismatchError
        when any node differs. The weights agree bit for bit only right after an outer step,
        so a run whose last step is not one compares the outer weights instead."""
        import hashlib

        outer = self.diloco.state_dict().get("outer")
        synced = self.diloco.since_sync == 0 or outer is None
        h = hashlib.blake2b(digest_size=16)
        if synced:
            for p in self.model.parameters():
                h.update(local_shard(p.detach()).float().cpu().contiguous().numpy().tobytes())
        else:
            h.update(outer.numpy().tobytes())
        digest = h.hexdigest()
        what = "weights" if synced else "outer weights (the run did not end on an outer step)"
        self.records.set(keys.final_digest(self.local_rank, self.node_rank), digest)
        others = [self.records.get(keys.final_digest(self.local_rank, n)).decode() for n in range(self.num_nodes)]
        differ = [n for n, d in enumerate(others) if d != digest]
        if differ:
            raise ReplicaMismatchError(f"node {self.node_rank}: final {what} differ from node(s) {differ} "
                                       f"(blake2b {digest} here)")
        if self.is_logger:
            self.log.print(f"final {what} identical on all {self.num_nodes} nodes: blake2b {digest}"
                           + (f" (local rank {self.local_rank})" if self.local_world > 1 else ""))
        return digest

    def _stop_errors(self) -> tuple:
        if not self.elastic:
            return ()
        from prime.elastic import JoinError, MembershipError

        return (JoinError, MembershipError)

    def _finished_errors(self) -> tuple:
        if not self.elastic:
            return ()
        from prime.elastic import JobFinished

        return (JobFinished,)

    def _rejoined(self, result) -> bool:
        """Elastic: True when this node joined at this outer step (logged here); it continues from the job's
        step with its data slot and fresh AdamW moments."""
        info = getattr(result.details, "rejoined", None)
        if info is None:
            return False
        from prime.elastic.trainer import on_join

        on_join(self, info)
        self._phase_compute = 0.0
        self._after_outer(result)
        return True

    def _log_step(self, loss: float, gnorm: float, lr: float, step_s: float, show: bool) -> float:
        """Records every step in the JSONL file; prints the line when `show`. Returns the node's mean loss."""
        loss = self._local_sum([loss])[0] / self.local_world
        tok_s = self.tokens_per_step / step_s
        mfu = self.flops_per_token * tok_s / (self.peak * self.local_world) if self.peak else None
        self.losses.append((self.step, loss))
        self.step_s.append(step_s)
        mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        if show:
            self.log.print(
                f"step {self.step:>6}/{self.cfg.train.steps} | loss {loss:.4f} | lr {lr:.2e} | grad {gnorm:.3f} | "
                f"{tok_s / 1e3:.1f}k tok/s | MFU {mfu_s} | {step_s * 1e3:.0f} ms"
            )
        self.log.record("step", self.step, loss=loss, lr=lr, grad_norm=gnorm, tokens_per_s=tok_s, mfu=mfu,
                        step_s=step_s, tokens=self.step * self.tokens_per_step)
        return loss

    def _after_outer(self, r) -> None:
        """Logs one outer step: all-reduce time and bytes (summed over the node's processes), error, utilization."""
        n = len(r.members) or self.num_nodes
        if self.elastic:  # what data parallelism among this outer step's nodes would have sent
            self.dp_bytes_per_step = 2 * (n - 1) / n * 4 * self.model_numel
        measured = r.bytes_sent is not None
        if measured:
            sent = float(r.bytes_sent)
        else:  # estimate a ring all-reduce of the wire format: 2 (N-1)/N of the encoded buffer
            per_value = (1 + 4 / self.cfg.diloco.block_size) if self.cfg.diloco.codec == "int8" else 4
            sent = 2 * (n - 1) / n * r.numel * per_value
        measured = self._local_sum([1.0 if measured else 0.0])[0] == self.local_world
        sent, ar_s = self._local_sum([sent, r.allreduce_s])
        ar_s /= self.local_world
        err = r.compression_error
        dp = self.dp_bytes_per_step * self.cfg.diloco.inner_steps
        self.total_sent += sent
        self.sent_measured &= measured
        self.total_dp += dp
        now = time.perf_counter()
        wall = now - self._phase_t0
        util = self._phase_compute / wall if wall > 0 else float("nan")
        self._phase_t0, self._phase_compute = now, 0.0
        err_s = f"{100 * err:.2f}%" if err is not None else "n/a"
        self.log.print(
            f"outer {r.outer_step} (step {self.step}) | all-reduce {ar_s:.2f} s, outer step {r.outer_s:.2f} s | "
            f"sent {human_bytes(sent)}{'' if measured else ' (est.)'} vs {human_bytes(dp)} for data parallel | "
            f"int8 error {err_s} | pseudo-grad norm {r.pseudo_grad_norm:.3f} | utilization {100 * util:.1f}%"
            + (f" | {r.attempts} attempts" if r.attempts > 1 else "")
            + (f" | nodes {len(r.members)}" if self.elastic else "")
            + (f" | recovery {r.details.recovery_s:.2f} s" if getattr(r.details, "recovery_s", None) is not None else "")
        )
        extra = {}
        if self.elastic:
            e = r.details
            extra = dict(nodes=len(r.members), members=r.members, contributors=r.contributors, joined=e.joined,
                         evicted=e.evicted, wait_s=e.wait_s, recovery_s=e.recovery_s, digest=e.digest,
                         time=time.time())
        self.log.record("outer", self.step, outer_step=r.outer_step, allreduce_s=ar_s, outer_s=r.outer_s,
                        prepare_s=getattr(r, "prepare_s", None), update_s=getattr(r, "update_s", None),
                        bytes_sent=sent, bytes_measured=measured, dp_bytes=dp, compression_error=err,
                        pseudo_grad_norm=r.pseudo_grad_norm, utilization=util, attempts=r.attempts, **extra,
                        **r.ring_stats)

    _WARMUP_STEPS = 3  # compilation, allocator warm-up and the first outer step's buffers

    def _median_rates(self) -> Optional[tuple[float, Optional[float]]]:
        """(tokens/s per node, MFU) at the median inner-step time, warm-up steps excluded; None if too few steps."""
        times = sorted(self.step_s[self._WARMUP_STEPS:])
        if not times:
            return None
        tok_s = self.tokens_per_step / times[len(times) // 2]
        return tok_s, (self.flops_per_token * tok_s / (self.peak * self.local_world) if self.peak else None)

    def _summary(self, wall: float) -> dict:
        k = max(1, min(10, len(self.losses) // 5))
        first_step, first = self.losses[0] if self.losses else (0, float("nan"))
        last = mean(l for _, l in self.losses[-k:])
        util = self.compute_s / wall if wall > 0 else float("nan")
        s = {"node": self.node_rank, "steps": self.step, "first_step": first_step, "first_loss": first,
             "last_loss": last, "bytes_sent": self.total_sent, "bytes_measured": self.sent_measured,
             "dp_bytes": self.total_dp, "utilization": util, "wall_s": wall, "outer_steps": self.diloco.outer_step}
        rate = self._median_rates()
        if rate:
            s["median_tokens_per_s"], s["median_mfu"] = rate
        self.log.record("summary", self.step, **{k2: v for k2, v in s.items() if k2 != "node"})
        if self.is_logger:
            lines = [f"summary (node {self.node_rank}): {self.step} steps in {wall:.1f} s, "
                     f"loss {first:.3f} at step {first_step} -> {last:.3f} (mean of the last {k} steps)"]
            if self.num_nodes > 1 or self.elastic:
                ratio = self.total_dp / self.total_sent if self.total_sent else float("nan")
                lines.append(
                    f"  {self.diloco.outer_step} outer steps sent {human_bytes(self.total_sent)}"
                    f"{'' if self.sent_measured else ' (estimated)'}; data parallel would have sent "
                    f"{human_bytes(self.total_dp)} ({ratio:.0f}x more)"
                )
            lines.append(f"  compute utilization {100 * util:.1f}% (inner-step time / wall time)")
            if rate:
                tok_s, mfu = rate
                lines.append(f"  median inner step (first {self._WARMUP_STEPS} excluded): {tok_s / 1e3:.1f}k tok/s per node"
                             + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ""))
            self.log.print("\n".join(lines))
        return s

    def close(self, failed: bool = False) -> None:
        """Finishes checkpoint writes, closes rings and logs, writes the plot (node 0), releases the store.

        After a failure (`failed`) the store's host does not wait for the other nodes."""
        # Teardown order: checkpoint writer, rings (DiLoCo / elastic sync), logs, store;
        # then barrier and destroy_process_group, last and whatever failed before them.
        try:
            if self.ckpt is not None:
                self.ckpt.close()
        finally:
            try:
                self.diloco.close()
                if getattr(self, "elastic_sync", None) is not None:
                    self.elastic_sync.close()  # leaves the job: the others drop this node at once
                if hasattr(self, "log"):  # absent when the constructor stopped (CheckpointError)
                    self.log.close()
                if hasattr(self, "log") and self.cfg.metrics.plot and self.is_logger and self.node_rank == 0:
                    path = plot_losses(self.cfg.metrics.out_dir, os.path.join(self.cfg.metrics.out_dir, "loss.png"))
                    if path:
                        print(f"loss plot: {path}", flush=True)
                if not failed:
                    self._release_store()
            except BaseException:
                failed = True  # the other local ranks may never reach the barrier
                raise
            finally:
                if self.dist.is_initialized():
                    if not failed:
                        # every local rank leaves gloo together: a rank that tears down its
                        # process group while a peer still uses it can abort that peer
                        self.dist.barrier()
                    self.dist.destroy_process_group()

    def _release_store(self) -> None:
        """The store's host (node 0, process 0) waits until every process is done with it before exiting."""
        if self.store is None:
            return
        if self.elastic:
            if self.node_rank == 0 and not self.cfg.elastic.external_store:
                self.elastic_sync.membership.wait_all_gone(self.cfg.diloco.timeout_s)
            return
        if getattr(self, "records", None) is None:  # the constructor stopped before the records were set up
            return
        self.records.set(keys.finished(self.node_rank, self.local_rank), "done")
        if self.node_rank == 0 and self.local_rank == 0:
            # One signed record per process (a counter anyone could `add` to would let a stranger end the wait).
            waiting = [keys.finished(n, g) for n in range(self.num_nodes) for g in range(self.local_world)]
            deadline = time.monotonic() + self.cfg.diloco.timeout_s
            while waiting and time.monotonic() < deadline:
                waiting = [k for k, v in zip(waiting, self.records.records.get_many(waiting)) if v != "done"]
                if waiting:
                    time.sleep(0.05)
