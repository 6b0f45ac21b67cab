"""How DiLoCo lays out its outer state: the cut into fragments, where the outer state lives, the work buffers.

One decision for the whole model: the outer weights and momentum of every
fragment beside the work buffers of the largest one (prime/outer.py
choose_device). Each fragment gets its OuterState and its place in the schedule
(prime/fragments.py); one fragment is the whole model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from prime.fragments import PIPELINE_DEPTH, BufferPool, Fragment, FragmentSchedule, FragmentSettings, \
    split_fragments, sync_pieces
from prime.layout import pass_piece
from prime.outer import OuterState, choose_device, home_buffer_count, pending_training_bytes, staging_bytes
from prime.overlap import SCHEMES

__all__ = ["FragmentPlan", "OuterUpdate", "plan_fragments", "work_buffers"]


@dataclass
class OuterUpdate:
    """The outer update every fragment's OuterState runs (prime/outer.py)."""

    lr: float
    momentum: float
    nesterov: bool
    optimizer: Optional[Callable] = None


@dataclass
class FragmentPlan:
    fragments: list = field(default_factory=list)
    """The fragments, each with its OuterState (one: the whole model)."""
    groups: list = field(default_factory=list)
    """The parameter indices of each fragment."""
    placement: str = ""
    """Where the outer state lives and why, in one line."""
    work_bytes: int = 0
    """Bytes of the work buffers (pseudo-gradients, overlap start points) at most, on the work device."""
    settings: Optional[FragmentSettings] = None
    """What the fragments share (the sync, the codec, overlap, the buffer pools)."""


def work_buffers(schedule: FragmentSchedule, overlap: bool, overlap_scheme: str, overlap_steps: int) -> tuple:
    """(pseudo-gradient buffers, start buffers) of the largest fragment's size kept at most on the work device:
    one pseudo-gradient synchronously; with overlap the one in flight and (over a whole phase) the next, and the
    start point of eager schemes."""
    if not overlap:
        return 1, 0
    whole_phase = schedule.fragments == 1 and overlap_steps >= schedule.inner_steps
    return (2 if whole_phase else 1), (1 if SCHEMES[overlap_scheme].eager else 0)


def plan_fragments(named: list, inner_optimizer, *, schedule: FragmentSchedule, sync, device: str,
                   update: OuterUpdate, codec: str, block_size: int, error_feedback: bool,
                   feedback_keep: Optional[int] = None, feedback_decay: float = 1.0,
                   measure_compression_error: bool, overlap: bool, overlap_scheme: str, overlap_steps: int,
                   margin: Optional[int], check_finite: Callable[[bool, int], None],
                   weights: str = "equal", shard: Optional[Callable] = None,
                   rings: Optional[int] = None) -> FragmentPlan:
    """Cuts the named parameters into schedule.fragments fragments, places their outer state (device "cpu",
    "gpu" or "auto") and builds each fragment with its OuterState. With overlap, the sync must already be set up
    for the background (use_from_background), so that keeps_input is known. `shard`: the part of each parameter
    the plan holds (None: the local shard); `rings`: the rings the model is cut across (None: this node's
    processes), which sets how many pieces a synchronous step is pipelined in."""
    from prime.parallelize import local_shard

    P = schedule.fragments
    names, params = [n for n, _ in named], [p for _, p in named]
    groups = split_fragments(names, [p.numel() for p in params], P) if P > 1 else [list(range(len(params)))]
    shard = local_shard if shard is None else shard
    locals_ = [shard(p.detach()) for p in params]
    frag_numel = [sum(-(-locals_[i].numel() // block_size) * block_size for i in idx) for idx in groups]
    on_gpu = any(t.device.type == "cuda" for t in locals_)
    pieces = [1 if overlap else sync_pieces(sum(params[i].numel() for i in idx), rings or _local_world()) for idx in groups]
    plan = FragmentPlan(groups=groups)
    if overlap:
        grads, starts = work_buffers(schedule, overlap, overlap_scheme, overlap_steps)
        keep = 1 if sync.keeps_input else 0  # the input kept for a retry (prime.sync keeps_input)
        plan.work_bytes = (grads + starts + keep) * 4 * max(frag_numel)
    else:  # the largest pseudo-gradient, or PIPELINE_DEPTH pieces of it when pipelined (a piece is cut at a pass
        # piece, so it may be up to one pass piece longer than its share)
        chunk = pass_piece(on_gpu)
        plan.work_bytes = max(4 * (n if k == 1 else PIPELINE_DEPTH * min(n, -(-n // k) + chunk))
                              for n, k in zip(frag_numel, pieces))
    buffers = home_buffer_count(error_feedback)
    if device == "auto":
        pending = pending_training_bytes(params, locals_, inner_optimizer) if on_gpu else 0
        pending += plan.work_bytes + staging_bytes(False, on_gpu) if on_gpu else 0
        home, plan.placement = choose_device("auto", locals_, buffers, pending, numel=sum(frag_numel), margin=margin)
        device = "gpu" if home.type == "cuda" else "cpu"
    else:
        home, plan.placement = choose_device(device, locals_, buffers, numel=sum(frag_numel))
    work = next((t.device for t in locals_ if t.device.type == "cuda"), torch.device("cpu"))
    plan.settings = FragmentSettings(
        sync=sync, inner_steps=schedule.inner_steps, codec=codec, measure_compression_error=measure_compression_error,
        overlap=overlap, overlap_scheme=overlap_scheme, overlap_steps=overlap_steps, fragments=P,
        grads=BufferPool(max(frag_numel), work), starts=BufferPool(max(frag_numel), work),
        keep_input=overlap and sync.keeps_input, nodes=lambda: sync.world_size, check_finite=check_finite,
        weights=weights, dense=schedule.dense)
    model_numel = sum(p.numel() for p in params) or 1
    for p, idx in enumerate(groups):
        st = OuterState([params[i] for i in idx], block_size=block_size, outer_lr=update.lr,
                        outer_momentum=update.momentum, nesterov=update.nesterov, optimizer_factory=update.optimizer,
                        device=device, error_feedback=codec if error_feedback else None,
                        feedback_keep=feedback_keep, feedback_decay=feedback_decay, shard=shard)
        share = sum(params[i].numel() for i in idx) / model_numel
        plan.fragments.append(Fragment(p, st, schedule.offset(p), plan.settings, share, pieces[p]))
    return plan


def _local_world() -> int:
    """Processes of this node (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
