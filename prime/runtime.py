"""The environment of one training process: device, the node's process group, the cross-node store.

    env = build_environment(cfg)     # validates torchrun's variables, picks the device, joins the node's group
    ...
    env.close(failed=False)          # last: every local rank leaves the process group together

One torchrun per node: its processes share the model through FSDP2 (gloo on
CPU, NCCL on GPU) and nothing else. Nodes meet only through the TCPStore that
node 0's first process hosts (or an external one, for elastic jobs); the rings
between nodes are built later, by the outer step (prime/builders.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch

from prime.config import Config

__all__ = ["Environment", "build_environment"]


@dataclass
class Environment:
    """Where this process runs and whom it can talk to."""

    device: torch.device
    """This process's device (cuda:<local rank> or cpu)."""
    local_rank: int
    """Rank of this process on its node (torchrun's LOCAL_RANK)."""
    local_world: int
    """Processes on this node."""
    node_rank: int
    """This node's rank in the job (nodes.node_rank; a joining elastic node's is >= num_nodes)."""
    num_nodes: int
    """Nodes the job starts with (nodes.num_nodes)."""
    fsdp: bool
    """The model is sharded across the node's processes with FSDP2."""
    store: Optional[Any] = None
    """The cross-node TCPStore under prime/<run_id> (None: a single node, nothing to meet)."""
    shares: Optional[Any] = None
    """The rings this process takes part in, with which rows (prime.shares.Shares: nodes.procs)."""
    connect: Optional[Any] = None
    """connect() -> a new connection to the cross-node store, under the same prefix (a TCPStore client serializes
    its calls: a thread blocked waiting for a key holds it, so rings built side by side each need their own)."""

    @property
    def is_logger(self) -> bool:
        """The node's local rank 0 prints and writes the metrics."""
        return self.local_rank == 0

    @property
    def has_local_group(self) -> bool:
        """True when the node's processes share a torch.distributed process group."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def local_group(self):
        """The node's process group (None: no group, this process alone)."""
        import torch.distributed as dist

        return dist.group.WORLD if self.has_local_group else None

    def new_local_group(self):
        """A new gloo group of the node's processes (None without a group); collective: every local rank calls it."""
        import torch.distributed as dist

        return dist.new_group(backend="gloo") if self.has_local_group else None

    def local_sum(self, values: list[float]) -> list[float]:
        """Sums small values over the node's processes (a CPU collective: every process must call it)."""
        if not self.has_local_group:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def from_first(self, values: list) -> list:
        """The node's first process's small values on every process of the node (a CPU collective: every process
        must call it)."""
        if not self.has_local_group:
            return values
        return self.local_sum([float(v) for v in values] if self.local_rank == 0 else [0.0] * len(values))

    def close(self, failed: bool = False) -> None:
        """Leaves the node's process group. Call last, after everything that uses the group or the store."""
        if not self.has_local_group:
            return
        import torch.distributed as dist

        if not failed:
            # every local rank leaves gloo together: a rank that tears down its
            # process group while a peer still uses it can abort that peer
            dist.barrier()
        dist.destroy_process_group()


def local_wait_s(cfg: Config) -> float:
    """How long a node's processes (or a one-process node's rings) wait for each other in an agreement: a ring may
    retry, so every attempt's timeout, and 600 s beside."""
    return 600 + (cfg.diloco.retries + 2) * cfg.diloco.timeout_s


def _pick_device(want: str, local_rank: int, local_world: int) -> torch.device:
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is 'cuda' but torch sees no GPU; use train.device = 'cpu' or 'auto'")
    if not (want == "cuda" or (want == "auto" and torch.cuda.is_available())):
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} has no GPU of its own: this node runs {local_world} processes "
            f"but sees {torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run one process per GPU or train.device = 'cpu'"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def build_environment(cfg: Config) -> Environment:
    """Checks torchrun's variables against the config, picks the device, joins the node's process group
    (when the model is sharded) and connects to the cross-node store (when there are other nodes).

    Raises ValueError naming the setting when the launch and the config do not fit together."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    world = int(os.environ.get("WORLD_SIZE", str(local_world)))
    if world != local_world:
        raise ValueError(
            f"WORLD_SIZE ({world}) is not LOCAL_WORLD_SIZE ({local_world}): start one torchrun per node "
            "(--nnodes 1); nodes are joined by the DiLoCo ring (--node-rank/--num-nodes), not by torchrun"
        )
    elastic = cfg.elastic.enabled
    device = _pick_device(cfg.train.device, local_rank, local_world)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    fsdp = cfg.train.fsdp == "on" or (cfg.train.fsdp == "auto" and local_world > 1)
    if local_world > 1 and not fsdp:
        raise ValueError(
            f"train.fsdp is 'off' but this node runs {local_world} processes: replicas inside a node "
            "are not supported; use train.fsdp = 'on' (or 'auto') or one process per node"
        )
    import torch.distributed as dist

    if fsdp and not dist.is_initialized():
        # CPU collectives always go through gloo (DiLoCo's small agreements, async checkpoints).
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        # Local collectives may wait while a ring retries: allow for every attempt.
        wait = timedelta(seconds=local_wait_s(cfg))
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=wait)
        else:  # fsdp = 'on' in a single process without torchrun
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=wait)
    from prime.shares import Shares

    shares = Shares.of(cfg.nodes.procs, cfg.nodes.num_nodes, cfg.nodes.node_rank, local_rank, local_world)
    env = Environment(device, local_rank, local_world, cfg.nodes.node_rank, cfg.nodes.num_nodes, fsdp, shares=shares)
    if env.num_nodes > 1 or elastic:
        # node 0's first process hosts the store (unless an elastic job hosts it outside), everyone else connects
        n = cfg.nodes
        is_master = env.node_rank == 0 and local_rank == 0 and not (elastic and cfg.elastic.external_store)
        timeout = timedelta(seconds=cfg.diloco.timeout_s)
        if is_master:
            # Listening on the store's address only (torch's own server listens on every
            # interface): a job on one host, whose secret may be drawn into the store, keeps
            # the store on loopback (docs/security.md).
            from prime.comm.rendezvous import host_store

            raw = host_store(n.store_host, n.store_port, timeout=timeout, any_if_not_local=True)
        else:
            raw = dist.TCPStore(n.store_host, n.store_port, is_master=False, timeout=timeout, wait_for_workers=False)
        env.store = dist.PrefixStore(f"prime/{n.run_id}", raw)
        env.connect = lambda: dist.PrefixStore(f"prime/{n.run_id}", dist.TCPStore(
            n.store_host, n.store_port, is_master=False, timeout=timeout, wait_for_workers=False))
    return env
