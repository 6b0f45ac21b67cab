"""Checkpoints: model and inner optimizer through torch.distributed.checkpoint, DiLoCo and data state per process.

Layout (one tree per node, as nodes usually do not share a file system):

    <dir>/node<r>/step_<000120>/
        .metadata, __*_*.distcp    model + inner AdamW (DCP: works with FSDP2 DTensors)
        rank<g>.pt                 this process's outer weights, outer momentum,
                                   DiLoCo counters, data position, step
        done_rank<g>               written last: the checkpoint of process g is complete

A step is complete on a node when every process of the node wrote its done
marker. Nodes agree on the newest step that all of them have (through the
cross-node store) before resuming, so a node that died mid-write does not
resume from a different step than the others.

Saving is asynchronous when asked: dcp.async_save stages (copies) the state to
CPU memory before returning, and a background thread writes it and the extra
state; only the copy stalls training. At most one save is in flight; the next
save waits for the previous one.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import re
import shutil
import warnings
from typing import Optional

import torch
from torch import nn

__all__ = ["Checkpointer", "agree_on_resume_step"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _clone_tree(obj):
    """A copy of nested dicts/lists whose tensors are cloned to CPU (so training can go on while it is written)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


class Checkpointer:
    """Saves and loads the checkpoints of one process (node `node_rank`, local rank `local_rank` of `local_world`)."""

    def __init__(
        self,
        root: str,
        node_rank: int,
        local_rank: int,
        local_world: int,
        *,
        process_group=None,
        keep: int = 2,
        async_save: bool = True,
    ):
        self.root = root
        self.node_dir = os.path.join(root, f"node{node_rank}")
        self.local_rank, self.local_world = local_rank, local_world
        self.pg, self.keep, self.async_save = process_group, keep, async_save
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prime-ckpt")
        self._pending: Optional[concurrent.futures.Future] = None
        os.makedirs(self.node_dir, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.node_dir, f"step_{step:08d}")

    # -- which checkpoints exist -------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps of this node whose every process finished writing, oldest first."""
        steps = []
        for path in glob.glob(os.path.join(self.node_dir, "step_*")):
            m = _STEP_DIR.match(os.path.basename(path))
            if m and all(os.path.exists(os.path.join(path, f"done_rank{g}")) for g in range(self.local_world)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    # -- saving ------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, *, block: bool = False) -> None:
        """Writes the checkpoint of `step`: model and optimizer through DCP, `extra` (a dict of CPU state) with torch.save.

        With async saving (and block=False) this returns once the state is copied;
        call wait() to know it is on disk.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()  # one save in flight at a time; also surfaces errors of the previous one
        path = self.step_dir(step)
        os.makedirs(path, exist_ok=True)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        extra = _clone_tree(extra)
        marker = os.path.join(path, f"done_rank{self.local_rank}")
        dist_kwargs = {"process_group": self.pg} if self.pg is not None else {"no_dist": True}

        with warnings.catch_warnings():
            # Without a process group DCP warns that it assumes a single process: that is what we asked for.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            if self.async_save and not block:
                dcp_future = dcp.async_save(state, checkpoint_id=path, **dist_kwargs)
                if hasattr(dcp_future, "upload_completion"):  # newer torch returns an AsyncSaveResponse
                    dcp_future = dcp_future.upload_completion
            else:
                dcp.save(state, checkpoint_id=path, **dist_kwargs)
                dcp_future = None

        def finish():
            if dcp_future is not None:
                dcp_future.result()
            tmp = os.path.join(path, f"rank{self.local_rank}.pt.tmp")
            torch.save(extra, tmp)
            os.replace(tmp, os.path.join(path, f"rank{self.local_rank}.pt"))  # atomic: never a half-written file
            with open(marker, "w") as f:
                f.write(f"{step}\n")
            if self.local_rank == 0:
                self._prune(step)

        self._pending = self._pool.submit(finish)
        if block or not self.async_save:
            self.wait()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is on disk; raises its error if it failed."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()

    def _prune(self, newest: int) -> None:
        if self.keep <= 0:
            return
        complete = [s for s in self.complete_steps() if s <= newest]
        for s in complete[: -self.keep]:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)

    # -- loading -----------------------------------------------------------------

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Restores model and optimizer in place from the checkpoint of `step`; returns this process's extra state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = self.step_dir(step)
        extra_path = os.path.join(path, f"rank{self.local_rank}.pt")
        if not os.path.exists(extra_path):
            raise FileNotFoundError(
                f"{extra_path} is missing: the checkpoint of step {step} was written by a node with fewer "
                "processes; resume with the same number of processes per node"
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dist_kwargs = {"process_group": self.pg} if self.pg is not None else {"no_dist": True}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, **dist_kwargs)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return torch.load(extra_path, map_location="cpu", weights_only=True)

    def close(self) -> None:
        """Waits for the save in flight and stops the writer thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def agree_on_resume_step(
    local_steps: list[int], store, node_rank: int, num_nodes: int, publish: bool, key: str = "ckpt"
) -> Optional[int]:
    """The newest step that every node has complete, or None.

    `store` is the cross-node store (None: one node); one process per node
    (`publish`) posts the node's list, every process reads all lists.
    """
    if store is None or num_nodes == 1:
        return local_steps[-1] if local_steps else None
    if publish:
        store.set(f"{key}/node{node_rank}", ",".join(str(s) for s in local_steps))
    common = set(local_steps)
    for r in range(num_nodes):
        raw = store.get(f"{key}/node{r}").decode()
        common &= {int(s) for s in raw.split(",") if s}
    return max(common) if common else None
