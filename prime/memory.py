"""The memory plan: what each process of a run needs on its GPU and in host memory, checked before the first step.

    plan = plan_memory(cfg, env, parts, diloco, host_procs=4)
    print(plan.describe())          # one block: every item, per process and for the host
    plan.check()                    # MemoryPlanError naming the settings to change when it cannot fit

A run that does not fit is refused before training, with the settings that would
make it fit (diloco.fragments, diloco.outer_state_device, diloco.overlap,
train.activation_checkpointing, train.micro_batch_size, checkpoint.async_save),
rather than ended by the kernel's OOM killer. Host memory is counted for every
process that shares the host (several nodes simulated on one machine share it),
and checkpoints are planned too: an asynchronous save stages a copy of the
model, the optimizer and the outer state in host memory; when that copy does not
fit, the plan saves synchronously (no staging copy; training waits for the
write) and says so.

The GPU figures are estimates from the shapes (weights, gradients and AdamW
state of the local shard, FSDP2's gathered layers, activations of one
micro-batch with or without activation checkpointing, the logits and their
gradient) plus DiLoCo's exact buffers; the host figures are exact for the outer
state and the staging, with a fixed allowance for the runtime. The run prints
the measured peaks beside the plan at the end (RunMemory).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from typing import Optional

import torch

from prime.codecs import CODECS, DENSE_START
from prime.comm.ring import segment_values
from prime.metrics import human_bytes
from prime.ops import INT8_HEADER_BYTES, fp4_bytes, num_blocks
from prime.sparse import keep_for_density, payload_bytes

__all__ = ["MemoryPlan", "MemoryPlanError", "plan_memory", "host_memory_bytes", "RUNTIME_HOST_BYTES",
           "peak_host_bytes", "training_gpu_items", "auto_margin_bytes"]

GIB = 1 << 30
RUNTIME_HOST_BYTES = 4 * GIB
"""Host memory of one training process on a GPU before any state: the interpreter, torch, the CUDA libraries and
context (~3 GiB measured on the GPU hosts), with room for the data loader."""
RUNTIME_HOST_BYTES_CPU = GIB
"""The same for a CPU-only process (about 0.5 GiB measured here)."""
CUDA_CONTEXT_BYTES = GIB
"""GPU memory the CUDA context, NCCL and the ring's device staging take before any tensor."""
GPU_SLACK_FRACTION = 0.05
"""Of the card, kept free for temporaries the estimate does not name."""
ALLOCATOR_FRACTION = 0.10
"""What torch's caching allocator reserves beyond the tensors it holds, as a share of them. Calibrated on H200s
(benchmarks/RESULTS.md, "Streaming fragments and the 10B model"): peak reserved against the named tensors was
+7% for the 10B synchronous step, +9% for 1B on 2 x 2 GPUs, +10% for 10B with overlap (two streams allocate)."""


class MemoryPlanError(ValueError):
    """The run cannot fit its GPU or its host's memory (the message names the settings to change)."""


@dataclass
class MemoryPlan:
    """Bytes per process on the GPU and in host memory, item by item, against the budgets."""

    gpu: list = field(default_factory=list)
    """[(what, bytes)] on this process's GPU (empty on a CPU run)."""
    host: list = field(default_factory=list)
    """[(what, bytes)] of this process in host memory."""
    gpu_budget: Optional[int] = None
    """Bytes usable on this process's GPU (None: no GPU)."""
    host_budget: int = 0
    """Bytes of host memory for all processes of this host."""
    host_start: int = 0
    """Bytes of this process in host memory while it starts, when that is more than the runtime: a GPU process of a
    job whose nodes run different numbers of processes initializes the whole model on the CPU before it shards it
    (prime.builders), freed before the first step. 0: nothing beyond the runtime."""
    host_procs: int = 1
    """Processes that share this host's memory (each needs about `host`)."""
    checkpoint: str = ""
    """How checkpoints are saved: "async", "blocking", or "" (no checkpoint.dir)."""
    notes: list = field(default_factory=list)
    """Lines printed under the plan (choices it made)."""
    remedies: list = field(default_factory=list)
    """Settings that would make a plan that does not fit fit, most effective first."""

    @property
    def gpu_bytes(self) -> int:
        return sum(b for _, b in self.gpu)

    @property
    def host_bytes(self) -> int:
        return sum(b for _, b in self.host)

    @property
    def host_peak(self) -> int:
        """The most this process holds in host memory: in training, or while it starts (host_start)."""
        return max(self.host_bytes, self.host_start)

    def fits_gpu(self) -> bool:
        return self.gpu_budget is None or self.gpu_bytes <= self.gpu_budget

    def fits_host(self) -> bool:
        return self.host_peak * self.host_procs <= self.host_budget

    def fits(self) -> bool:
        return self.fits_gpu() and self.fits_host()

    def describe(self) -> str:
        """The plan as one block of lines."""
        def items(xs):
            return " + ".join(f"{what} {b / GIB:.1f}" for what, b in xs if b >= GIB / 20) or "nothing"

        lines = ["memory plan (GiB, per process):"]
        if self.gpu_budget is not None:
            lines.append(f"  GPU: {items(self.gpu)} = {self.gpu_bytes / GIB:.1f} of {self.gpu_budget / GIB:.1f} usable"
                         f" ({'fits' if self.fits_gpu() else 'DOES NOT FIT'})")
        start = f"; at start {self.host_start / GIB:.1f} (the whole model initialized on the CPU, then sharded)" \
            if self.host_start > self.host_bytes else ""
        lines.append(f"  host: {items(self.host)} = {self.host_bytes / GIB:.1f}{start}; x {self.host_procs} process(es)"
                     f" on this host = {self.host_peak * self.host_procs / GIB:.1f} of {self.host_budget / GIB:.1f}"
                     f" ({'fits' if self.fits_host() else 'DOES NOT FIT'})")
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)

    def peaks(self, device: torch.device) -> str:
        """The measured peaks of this process beside the plan (one line)."""
        line = f"memory: host peak {peak_host_bytes() / GIB:.1f} GiB of this process (plan {self.host_peak / GIB:.1f})"
        if device.type == "cuda":
            from prime.comm.ring import device_buffer_bytes

            reserved = torch.cuda.max_memory_reserved(device)
            index = device.index if device.index is not None else torch.cuda.current_device()
            ring = device_buffer_bytes(index)
            line += f", GPU peak {(reserved + ring) / GIB:.1f} GiB"
            if ring:  # (the ring's own cudaMalloc'd buffers: torch's statistics do not see them)
                line += f" ({reserved / GIB:.1f} reserved by torch, {human_bytes(ring)} the ring's buffers)"
            else:
                line += " reserved"
            line += f" (plan {self.gpu_bytes / GIB:.1f})"
        return line

    def check(self) -> None:
        """Raises MemoryPlanError naming what does not fit and the settings to change."""
        if self.fits():
            return
        short = []
        if not self.fits_gpu():
            short.append(f"the GPU needs {self.gpu_bytes / GIB:.1f} GiB of {self.gpu_budget / GIB:.1f} usable")
        if not self.fits_host():
            short.append(f"host memory needs {self.host_peak * self.host_procs / GIB:.1f} GiB "
                         f"({self.host_procs} process(es) x {self.host_peak / GIB:.1f}) of {self.host_budget / GIB:.1f}")
        fix = "; ".join(self.remedies) or "a smaller model or more GPUs per node (train.fsdp shards over them)"
        raise MemoryPlanError(f"this run does not fit: {' and '.join(short)}. Change: {fix}. "
                              f"(memory.check = false starts anyway.)\n{self.describe()}")


def host_memory_bytes() -> int:
    """This host's memory for the job: the cgroup limit when one is set, else MemTotal."""
    limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
            if v.isdigit() and int(v) < 1 << 60:
                limit = int(v)
                break
        except OSError:
            continue
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(total, limit) if limit else total


def peak_host_bytes() -> int:
    """This process's peak resident memory (pinned buffers included), from getrusage."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _activation_bytes(args, micro_batch: int, seq: int, checkpointing: bool, layers_sharded: bool) -> int:
    """Activations of one micro-batch (bf16 on a GPU): with activation checkpointing the input of every block plus
    one block's activations and their gradients while it is recomputed; without, every block's. Then the logits
    (bf16), their fp32 copy for the loss and the fp32 gradient of that."""
    tokens = micro_batch * seq
    kv = args.dim * args.n_kv_heads // args.n_heads
    # per token in one block: norms' outputs (2 x dim, fp32 inside), q, k, v, attention output, its projection,
    # the residual, w1 and w3 outputs, their SwiGLU product, w2's output; bf16, plus the fp32 norm upcasts
    per_token = 2 * (2 * args.dim + args.dim + 2 * kv + 3 * args.dim + 3 * args.ffn_dim) + 4 * 2 * args.dim
    block = tokens * per_token
    if checkpointing:
        acts = args.n_layers * tokens * args.dim * 2 + 2 * block
    else:
        acts = args.n_layers * block
    # bf16 logits, their fp32 copy for the loss, log-softmax's fp32 output, and the fp32 and bf16 gradients
    logits = tokens * args.vocab_size * (2 + 4 + 4 + 4 + 2)
    return acts + logits


def training_gpu_items(cfg, env, parts) -> list:
    """[(what, bytes)] of training itself on this process's GPU (no DiLoCo): the local shard's fp32 weights,
    gradients and AdamW moments, FSDP2's gathered layers, its fp32 unsharded gradients under grad_accum, and the
    activations with the logits."""
    from prime.parallelize import local_shard

    params = list(parts.model.parameters())
    local = sum(local_shard(p.detach()).numel() for p in params)
    full = sum(p.numel() for p in params)
    args = parts.args
    bf16 = cfg.train.mixed_precision in ("bf16", "auto")
    embed = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    layer = (full - embed) / max(1, args.n_layers)
    items = [("weights", 4 * local), ("gradients", 4 * local), ("AdamW", 8 * local)]
    if env.fsdp:
        items.append(("gathered layers", int((2 if bf16 else 4) * (2 * layer + embed))))
        if cfg.train.grad_accum > 1:
            # FSDP2 without gradient sync (every micro-batch but the last) keeps the unsharded gradients, upcast
            # to the fp32 reduce dtype, of the whole model on every process
            items.append(("unsharded gradients (grad_accum)", 4 * full))
    items.append(("activations", _activation_bytes(args, cfg.train.micro_batch_size, cfg.data.seq_len,
                                                   cfg.train.activation_checkpointing, env.fsdp)))
    return items


def auto_margin_bytes(cfg, env, parts) -> int:
    """For diloco.outer_state_device = "auto": GPU memory to keep free beyond the gradients and optimizer state
    still to come (which the rule counts itself): the gathered layers, FSDP2's unsharded gradients, the
    activations, the allocator's share, the CUDA context and the slack of the plan."""
    items = training_gpu_items(cfg, env, parts)
    total = torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else 0
    rest = sum(b for what, b in items if what not in ("weights", "gradients", "AdamW"))
    return int(rest + ALLOCATOR_FRACTION * sum(b for _, b in items)) + CUDA_CONTEXT_BYTES + int(GPU_SLACK_FRACTION * total)


@dataclass
class _OuterBuffers:
    """DiLoCo's bytes in one process, as the plan counts them (all 0 without an outer step)."""

    frags: list
    home: int = 0
    """Outer weights + momentum (+ the residual with error feedback), fp32."""
    home_name: str = ""
    home_gpu: bool = False
    work: int = 0
    staging: int = 0
    ring_values: int = 0
    """Values of the largest all-reduce one ring runs (a pipelined synchronous step: of one piece)."""
    ring_host: int = 0
    """The ring's host staging."""
    device_reduce: bool = False
    """The ring runs its codec on the GPU (a CUDA build of prime._C); else it stages CUDA tensors through pinned
    host memory and codes them on the CPU."""
    ranks: int = 1
    """Ranks of the ring (the nodes)."""
    rings_here: int = 1
    """Rings this process takes part in (prime.shares: a DiLoCo on each, their outer steps side by side)."""
    outer_numel: int = 0
    largest: int = 0


def _outer_buffers(cfg, env, diloco) -> _OuterBuffers:
    from prime.layout import pass_buffer_bytes
    from prime.outer import home_buffer_count

    frags = getattr(diloco, "fragments", []) or []
    if not frags:
        return _OuterBuffers(frags)
    on_gpu = env.device.type == "cuda"
    b = _OuterBuffers(frags, outer_numel=sum(f.state.numel for f in frags),
                      largest=max(f.state.numel for f in frags), home_gpu=frags[0].state.device.type == "cuda",
                      work=diloco.work_bytes, rings_here=len(getattr(diloco, "members", None) or [diloco]))
    feedback = bool(getattr(diloco, "error_feedback", False))  # a third home buffer: the residual
    b.home = home_buffer_count(feedback) * 4 * b.outer_numel
    b.home_name = "outer weights + momentum" + (" + error-feedback residual" if feedback else "")
    b.staging = b.rings_here * pass_buffer_bytes(on_gpu, frags[0].state.streamed)
    # the ring's pinned host staging: the int8 payload of this rank's chunk of the largest all-reduce, sent and
    # received (a pipelined synchronous step all-reduces pieces of about SYNC_PIECE_VALUES)
    b.ring_values = b.largest // max(f.pieces for f in frags)
    nodes = b.ranks = max(1, env.num_nodes)
    b.device_reduce = on_gpu and ring_reduces_on_gpu()
    if cfg.diloco.codec == "topk" and b.device_reduce:
        # the sparse codec on the GPU: only the records cross to the host (pinned), those this rank sends and
        # those it receives, under a tenth of a byte a value
        topk, settings, chunk = CODECS["topk"], cfg.diloco.outer_settings(), cfg.diloco.resolved_block_size()
        ring_host = int(b.ring_values * (topk.bytes_per_value(chunk, settings["density"])
                                         + topk.bytes_per_value(chunk, settings["average_density"])))
    elif cfg.diloco.codec == "topk":
        # the sparse codec on the CPU: the owner sums its chunk and decodes its selection (4 bytes a value of its
        # 1/N each), and what the rank's selections of the other chunks drop waits for the collective's end
        # (4 bytes a value of the other (N - 1)/N)
        ring_host = 4 * b.ring_values + int(2 * 4 * b.ring_values / nodes) + int(4 * b.ring_values * (nodes - 1) / nodes)
    else:
        ring_host = _int8_ring_host(b.ring_values, nodes, cfg.diloco.resolved_block_size()) if on_gpu else 0
    if on_gpu and cfg.diloco.dense_outer_steps:  # a sparse codec's first outer steps go dense, as int8
        ring_host += _int8_ring_host(b.ring_values, nodes, DENSE_START[1])
    if on_gpu and not b.device_reduce:  # staged: pinned copies of the all-reduce's input and of its result
        ring_host += 8 * b.ring_values
    b.ring_host = b.rings_here * ring_host
    return b


def ring_reduces_on_gpu() -> bool:
    """Whether rings reduce CUDA tensors on their GPU (prime.comm.ring.reduces_on_gpu: a CUDA build of prime._C);
    False without prime._C."""
    from prime.comm.ring import reduces_on_gpu

    try:
        return reduces_on_gpu()
    except RuntimeError:  # no prime._C (the run itself says so, once it builds a ring)
        return False


def _int8_ring_host(values: int, nodes: int, block: int) -> int:
    """The ring's pinned host staging of an int8 all-reduce of `values` on the GPU: the payload of this rank's
    chunk (a payload's int8 scales take 2 bytes)."""
    return int(2 * values / nodes * (1 + 2 / block))


RING_SLOT_MIN_BYTES = 256
"""The least a slot of the ring's CUDA context holds (CudaContext::device_buffer)."""
_RING_FLAGS_BYTES = 64
"""kFlags: the collective's flags and error sums (held as RING_SLOT_MIN_BYTES)."""


def _slots(*sizes: int) -> int:
    """Bytes of the ring context's slots of these sizes (each at least RING_SLOT_MIN_BYTES)."""
    return sum(max(RING_SLOT_MIN_BYTES, s) for s in sizes)


def _dense_ring_gpu(values: int, block: int, codec: str = "int8", segment: Optional[int] = None,
                    ranks: int = 2) -> int:
    """The ring's own GPU buffers (its CUDA context's slots, grow-only; csrc/ring/wire_codec_cuda.cu) after an
    all-reduce of `values` with a dense codec: int8 or fp4 in blocks of `block`, or "none" (fp32 values). The
    result's image, gathered on the device (kImageQ: its codes or values; kImageS: an fp32 scale a block), and a
    segment's worth (`segment` values, default the ring's): the received payload (kUploadIn) and the encoded one
    (kOut) with fp32 scales, int8's packed wire scales (kPackedScales), the flags (kFlags), and the fp32 sum
    (kAcc) where it is used: blocks above 1024 (no fused kernel) or a direct schedule's owner adding several
    contributions (more than 2 ranks)."""
    if values <= 0:
        return 0
    seg = min(values, segment_values() if segment is None else segment)
    if codec == "none":
        sizes = [4 * values, 4 * seg, 4 * seg]
    else:
        codes = fp4_bytes if codec == "fp4" else int
        payload = codes(seg) + 4 * num_blocks(seg, block)
        sizes = [codes(values), 4 * num_blocks(values, block), payload, payload]
        if codec == "int8":
            sizes.append(INT8_HEADER_BYTES + num_blocks(seg, block))
    if ranks > 2 or (codec != "none" and block > 1024):
        sizes.append(4 * seg)
    return _slots(_RING_FLAGS_BYTES, *sizes)


def _topk_ring_gpu(values: int, chunk: int, keep: int, keep_average: int, segment: Optional[int] = None,
                   own_dropped: bool = True) -> int:
    """The ring's own GPU buffers after a topk all-reduce of `values` (csrc/ring/wire_codec_sparse_cuda.cu): the
    final records of the whole tensor (kImageQ), what this rank's selections dropped, fp32 (kDropped: with
    Ring.all_reduce's `residual`; with its `dropped`, DiLoCo's way, the caller's tensor holds them instead:
    own_dropped False), and a segment's worth (`segment` values, default the ring's): a received record
    (kUploadIn), the encoded one, a contribution's or the average's (kOut), the fp32 sum (kAcc), the average's
    selection decoded (kDecoded) and the flags (kFlags)."""
    if values <= 0:
        return 0
    seg = min(values, segment_values() if segment is None else segment)
    sent, average = payload_bytes(seg, chunk, keep), payload_bytes(seg, chunk, keep_average)
    sizes = [payload_bytes(values, chunk, keep_average), sent, max(sent, average), 4 * seg, 4 * seg, _RING_FLAGS_BYTES]
    return _slots(*sizes) + (_slots(4 * values) if own_dropped else 0)


def plan_memory(cfg, env, parts, diloco, host_procs: int = 1, *, gpu_total: Optional[int] = None,
                host_total: Optional[int] = None) -> MemoryPlan:
    """The memory plan of this process (see the module docstring). `host_procs`: processes sharing this host;
    `gpu_total`, `host_total`: the budgets (default: memory.gpu_gib / memory.host_gib, else detected)."""
    m = cfg.memory
    plan = MemoryPlan(host_procs=max(1, host_procs))
    outer = _outer_buffers(cfg, env, diloco)
    if env.device.type == "cuda":
        budget = gpu_total if gpu_total is not None else (
            int(m.gpu_gib * GIB) if m.gpu_gib else torch.cuda.get_device_properties(env.device).total_memory)
        plan.gpu_budget = int(budget * (1 - GPU_SLACK_FRACTION)) - CUDA_CONTEXT_BYTES
        plan.gpu += training_gpu_items(cfg, env, parts) + _outer_gpu_items(cfg, outer)
        plan.gpu.append(("allocator cache", int(ALLOCATOR_FRACTION * plan.gpu_bytes)))
    plan.host_budget = plan_host_budget(plan, m, host_total)
    _plan_host(plan, cfg, env, parts, diloco, outer)
    _plan_checkpoints(plan, cfg, parts, outer)
    _add_remedies(plan, cfg, diloco, outer)
    return plan


def _outer_gpu_items(cfg, outer: _OuterBuffers) -> list:
    """[(what, bytes)] of DiLoCo on this process's GPU."""
    if not outer.frags:
        return []
    items = [(outer.home_name, outer.home)] if outer.home_gpu else []
    items += [("outer work buffers", outer.work), ("outer staging", outer.staging)]
    if not outer.device_reduce:  # the ring stages through the host and codes there (_outer_buffers)
        return items
    block = cfg.diloco.resolved_block_size()
    if cfg.diloco.codec == "topk":
        # what the selections dropped (Ring.all_reduce's `dropped`, filled on the device as the collective runs),
        # and the ring's own: the final records and a segment's buffers
        settings = cfg.diloco.outer_settings()
        keep, keep_average = (keep_for_density(settings[k], block) for k in ("density", "average_density"))
        items.append(("ring: the dropped part", outer.rings_here * 4 * outer.ring_values))
        items.append(("ring buffers", outer.rings_here * _topk_ring_gpu(outer.ring_values, block, keep,
                                                                        keep_average, own_dropped=False)))
        if cfg.diloco.dense_outer_steps:  # the int8 buffers of the dense start stay in the ring's cache after it
            # (both codecs grow the same slots: their sum is an upper bound)
            dense = _dense_ring_gpu(outer.ring_values, min(DENSE_START[1], block), DENSE_START[0],
                                    ranks=outer.ranks)
            items.append(("ring buffers (dense start)", outer.rings_here * dense))
    else:  # the image of the result (codes and scales) and a segment's buffers
        dense = _dense_ring_gpu(outer.ring_values, block, cfg.diloco.codec, ranks=outer.ranks)
        items.append(("ring buffers", outer.rings_here * dense))
    return items


def _plan_host(plan: MemoryPlan, cfg, env, parts, diloco, outer: _OuterBuffers) -> None:
    """This process's host memory before checkpoints: the runtime, its start, the outer state and staging."""
    on_gpu = env.device.type == "cuda"
    plan.host.append(("runtime", RUNTIME_HOST_BYTES if on_gpu else RUNTIME_HOST_BYTES_CPU))
    shares = getattr(env, "shares", None)
    if on_gpu and shares is not None and shares.uneven:  # the whole model in fp32 on the CPU first (builders)
        plan.host_start = RUNTIME_HOST_BYTES + 4 * sum(p.numel() for p in parts.model.parameters())
    if not outer.frags:
        return
    if not outer.home_gpu:
        plan.host.append((outer.home_name + (" (pinned)" if on_gpu else ""), outer.home))
    if outer.ring_host:
        plan.host.append(("ring staging" + (" (pinned)" if on_gpu else ""), outer.ring_host))
    states = getattr(diloco, "states", None)
    if cfg.elastic.enabled and outer.home_gpu and states is not None:  # what joiners are served from
        plan.host.append(("elastic state mirror (pinned)", states.mirror_bytes()))


def _plan_checkpoints(plan: MemoryPlan, cfg, parts, outer: _OuterBuffers) -> None:
    """How checkpoints are saved (plan.checkpoint) and what that stages in host memory: asynchronously when the
    staging fits beside the rest, else synchronously."""
    if not cfg.checkpoint.dir:
        return
    from prime.parallelize import local_shard

    local = sum(local_shard(p.detach()).numel() for p in parts.model.parameters())  # this process's shard
    home, home_gpu = outer.home, outer.home_gpu
    state = 12 * local  # weights + AdamW, fp32
    outer_copy = home  # state_dict's copy (GPU home) or the async clone (CPU home)
    async_need = state + outer_copy + (home if home_gpu else 0)
    blocking_need = (home if home_gpu else 0)  # the copy to the host of a GPU-resident outer state
    if cfg.checkpoint.async_save and (plan.host_bytes + async_need) * plan.host_procs <= plan.host_budget:
        plan.checkpoint = "async"
        plan.host.append(("checkpoint staging (async save)", async_need))
        return
    plan.checkpoint = "blocking"
    if blocking_need:
        plan.host.append(("checkpoint copy of the outer state", blocking_need))
    if cfg.checkpoint.async_save:
        plan.notes.append(f"checkpoints: saved synchronously (training waits for each write): an async save "
                          f"would stage {async_need / GIB:.1f} GiB more per process, which this host cannot hold")


def _add_remedies(plan: MemoryPlan, cfg, diloco, outer: _OuterBuffers) -> None:
    """What would help a plan that does not fit, each naming the setting (plan.remedies)."""
    frags, work, home_gpu = outer.frags, outer.work, outer.home_gpu
    P = len(frags) or 1
    if not plan.fits_gpu():
        if frags and work >= GIB and (P == 1 or outer.largest > outer.outer_numel // (2 * P)):
            plan.remedies.append(f"diloco.fragments (now {P}: the outer work buffers shrink with it)")
        if frags and home_gpu:
            plan.remedies.append("diloco.outer_state_device = 'cpu' (the outer weights and momentum in host memory, "
                                 "streamed through the GPU)")
        if frags and diloco.overlap and work >= GIB:
            plan.remedies.append("diloco.overlap = false (a synchronous outer step is pipelined in pieces, with "
                                 "buffers of three pieces)")
        if not cfg.train.activation_checkpointing:
            plan.remedies.append("train.activation_checkpointing = true")
        if cfg.train.micro_batch_size > 1:
            plan.remedies.append(f"train.micro_batch_size (now {cfg.train.micro_batch_size}; raise train.grad_accum "
                                 "to keep the batch)")
    if not plan.fits_host():
        if frags and not home_gpu:
            plan.remedies.append("diloco.outer_state_device = 'gpu' or 'auto' (the outer state on the GPU, if it has "
                                 "room)")
        if plan.checkpoint == "async":
            plan.remedies.append("checkpoint.async_save = false")
        if plan.host_start * plan.host_procs > plan.host_budget:
            plan.remedies.append("the same nodes.procs on every node (each process then initializes only its shard, "
                                 "on its GPU)")
        plan.remedies.append("fewer processes on this host")


def plan_host_budget(plan: MemoryPlan, m, host_total: Optional[int]) -> int:
    if host_total is not None:
        return host_total
    return int(m.host_gib * GIB) if m.host_gib else host_memory_bytes()
