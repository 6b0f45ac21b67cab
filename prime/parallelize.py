"""FSDP2 wrapping of the model inside one node (and the per-block options that must come before it).

Order matters and follows torchtitan: activation checkpointing wraps each
block, torch.compile compiles each block, then `fully_shard` shards each block
and finally the root (embedding, final norm, output). The model file knows
nothing of this.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["parallelize", "local_shard"]


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: the local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def parallelize(
    model: nn.Module,
    *,
    device_type: str,
    fsdp: bool,
    bf16: bool,
    activation_checkpointing: bool = False,
    compile: bool = False,
    world_size: Optional[int] = None,
) -> nn.Module:
    """Applies activation checkpointing, compile and FSDP2 to `model.layers` and the root, in place.

    With `fsdp`, parameters become DTensors sharded over the default process
    group (the node's processes). `bf16` casts parameters to bf16 for compute
    while the sharded master weights and the gradient reduce-scatter stay fp32.
    Returns the model (the same object).
    """
    layers = model.layers
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(layers):
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if compile:
        for block in layers:
            block.compile()  # in place: parameter names stay the same, so checkpoints do too
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        n = world_size or dist.get_world_size()
        mesh = init_device_mesh(device_type, (n,), mesh_dim_names=("fsdp",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        last = len(layers) - 1
        for i, block in enumerate(layers):
            # The last block is re-gathered by the backward right away: keeping it unsharded saves one all-gather.
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < last)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model
