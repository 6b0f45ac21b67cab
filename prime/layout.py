"""The flat layout of an outer state, where its buffers live, and the walk over them in pieces.

For the parameters a process holds (the local shard of each FSDP2 DTensor, or
the whole tensor of a plain module), an outer state keeps flat fp32 buffers,
each parameter starting a new codec block, so that no block of the all-reduce
spans two parameters (FlatLayout: offsets, sizes, ranges of a pipelined step).

Two places matter: where the buffers live (the *home*: `device`) and where the
arithmetic runs (the *work device*: the parameters' device). Work buffers (the
pseudo-gradient, the start point of overlap) are always made on the work device.

    "gpu"   home on the parameters' GPU: every pass is a GPU kernel over the buffers
    "cpu"   home in CPU memory (pinned when the parameters are on a GPU). On a GPU model
            every pass *streams* the home buffers through the GPU in pieces
            (_PIPE_CHUNK values), double-buffered on side streams (FlatLayout._walk)
    "auto"  "gpu" when the home buffers fit in the GPU's free memory less what training
            will still allocate and a margin for activations (AUTO_GPU_MARGIN_BYTES),
            else "cpu"; logged. prime.memory plans the whole run.

prime.outer.OuterState adds the buffers themselves and the passes of the outer
step over this layout.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

import torch

from prime.parallelize import local_shard

__all__ = ["FlatLayout", "OUTER_STATE_DEVICES", "AUTO_GPU_MARGIN_BYTES", "AUTO_GPU_MARGIN_FRACTION",
           "pending_training_bytes", "resolve_device", "choose_device", "staging_bytes", "pass_piece",
           "pass_buffer_bytes", "pinned_zeros"]

logger = logging.getLogger("prime.outer")

# Piece of the passes over the flat buffers on the CPU: large enough to amortize the per-op
# overhead, small enough that the temporaries stay in L2/L3 cache.
_CHUNK = 1 << 20
# Piece of the passes on a GPU, resident or streamed: 16M values (64 MiB, ~1.2 ms of PCIe at
# 55 GB/s) per copy, so that a streamed pass starts computing after the first piece has landed,
# and 8 kernels of 16M values each run at full bandwidth.
_PIPE_CHUNK = 1 << 24
# int8_error_sq / inspect on a GPU: one kernel per 64M values; the chunk only bounds temporaries.
_GPU_CHUNK = 1 << 26
# Staging slots of a streamed pass: the piece being computed on, the next one coming in, and the
# previous one going back out.
_SLOTS = 3

OUTER_STATE_DEVICES = ("cpu", "gpu", "auto")
AUTO_GPU_MARGIN_BYTES = 8 << 30
AUTO_GPU_MARGIN_FRACTION = 0.15
"""device="auto" puts the outer state on the GPU when its buffers fit in the memory that is free there now (the
driver's free memory plus what torch's allocator holds unused), less what training will still allocate that does
not exist yet (gradients, the inner optimizer's state: `pending_bytes`), less a margin for activations, temporaries
and fragmentation of max(AUTO_GPU_MARGIN_BYTES, AUTO_GPU_MARGIN_FRACTION of the card). The state is built when
DiLoCo is, after the model and the inner optimizer exist but before the first step, so gradients and AdamW's
moments are usually still to come. The 1B model on an 80 GB H100 (fp32 weights 5 GB, gradients and AdamW 15 GB to
come, margin 12 GB) keeps its 5 buffers of eager overlap (30 GB) on the GPU; a fixed third of the card (the rule
before) sent them to the CPU, costing 1.5-2.2 s per outer step (benchmarks/RESULTS.md)."""


def inspect_piece(on_gpu: bool) -> int:
    """Values per piece of a norm or error pass (outer.OuterState.inspect, int8_error_sq): on a GPU one kernel per
    64M values, the piece only bounding temporaries; on the CPU a pass's cache-sized piece."""
    return _GPU_CHUNK if on_gpu else _CHUNK


def pass_piece(on_gpu: bool) -> int:
    """Values per piece of a pass over the flat buffers (and per cut of a pipelined step's ranges)."""
    return _PIPE_CHUNK if on_gpu else _CHUNK


def pass_buffer_bytes(on_gpu: bool, streamed: bool) -> int:
    """Work-device bytes the passes keep beside the work buffers: three temporaries of a piece, and for a
    streamed state _SLOTS staging slots of two pieces each."""
    return 4 * ((_SLOTS * 2 if streamed else 0) + 3) * pass_piece(on_gpu)


def pending_training_bytes(params: list, local_tensors: list, inner_optimizer=None) -> int:
    """GPU memory training will still allocate for these parameters that does not exist yet: a gradient per
    parameter whose .grad is None, and the inner optimizer's state for each parameter it has none for yet (torch
    optimizers make it at the first step): 2 tensors of the parameter's size for Adam-like optimizers (and any
    optimizer not known here), 1 for SGD with momentum, 0 for plain SGD."""
    per_param = 0
    if inner_optimizer is not None:
        per_param = 2
        if isinstance(inner_optimizer, torch.optim.SGD):
            per_param = 1 if any(g.get("momentum", 0) for g in inner_optimizer.param_groups) else 0
    total = 0
    for p, t in zip(params, local_tensors):
        if t.device.type != "cuda":
            continue
        size = t.numel() * t.element_size()
        if p.grad is None:
            total += size
        if inner_optimizer is not None and not inner_optimizer.state.get(p):
            total += per_param * size
    return total


def resolve_device(device: str, local_tensors: list, buffers: int, pending_bytes: int = 0) -> torch.device:
    """Where the outer state's `buffers` flat fp32 buffers go, for parameters whose local shards are
    `local_tensors` (see OuterState's `device`); `pending_bytes`: GPU memory training will still allocate
    (pending_training_bytes), counted by "auto" (see AUTO_GPU_MARGIN_BYTES). "auto" logs its choice."""
    return choose_device(device, local_tensors, buffers, pending_bytes)[0]


def choose_device(device: str, local_tensors: list, buffers: int, pending_bytes: int = 0,
                  numel: Optional[int] = None, margin: Optional[int] = None) -> tuple:
    """resolve_device, and the choice in words (one line). `numel`: values per buffer (default: the tensors');
    `margin`: GPU memory "auto" keeps free for activations and the like (default: AUTO_GPU_MARGIN_BYTES's
    rule; the trainer passes its memory plan's estimate)."""
    if device not in OUTER_STATE_DEVICES:
        raise ValueError(f"outer_state_device must be 'cpu', 'gpu' or 'auto', got {device!r}")
    cuda = [t.device for t in local_tensors if t.device.type == "cuda"]
    if device == "cpu" or (device == "auto" and not cuda):
        return torch.device("cpu"), f"outer state on the CPU (outer_state_device {device!r})"
    if not cuda:
        raise ValueError("outer_state_device = 'gpu' needs the model's parameters on a GPU; they are on the CPU "
                         "(use 'cpu' or 'auto')")
    dev = cuda[0]
    if device == "gpu":
        return dev, f"outer state on {dev} (outer_state_device 'gpu')"
    numel = sum(t.numel() for t in local_tensors) if numel is None else numel
    need = buffers * 4 * numel
    total = torch.cuda.get_device_properties(dev).total_memory
    free, _ = torch.cuda.mem_get_info(dev)
    cached = max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))  # torch holds it, unused
    if margin is None:
        margin = max(AUTO_GPU_MARGIN_BYTES, int(AUTO_GPU_MARGIN_FRACTION * total))
    room = free + cached - pending_bytes - margin
    chosen = dev if need <= room else torch.device("cpu")
    gib = 1 << 30
    why = (f"outer_state_device auto: {'gpu' if chosen.type == 'cuda' else 'cpu'} ({buffers} buffers need "
           f"{need / gib:.1f} GiB; {dev} has {(free + cached) / gib:.1f} GiB free now, {pending_bytes / gib:.1f} GiB more "
           f"to come for gradients, optimizer state and work buffers, {margin / gib:.1f} GiB kept for activations: "
           f"room {room / gib:.1f} GiB)")
    logger.info(why)
    return chosen, why


def staging_bytes(home_on_gpu: bool, on_gpu: bool) -> int:
    """GPU memory a streamed outer state keeps for its staging slots (0 when its home is its work device)."""
    return 0 if home_on_gpu or not on_gpu else _SLOTS * 2 * 4 * _PIPE_CHUNK


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: CUDA may be gone already
        pass


def pinned_zeros(numel: int) -> torch.Tensor:
    """A zeroed fp32 CPU tensor of exactly `numel` values, page-locked for asynchronous copies.

    Not pin_memory=True: torch's caching host allocator rounds every pinned block up to a power of two, so the
    20 GB buffers of a 10B model's shard would pin 32 GB each. Here the pages of an ordinary allocation are
    registered with CUDA (cudaHostRegister), exactly its size, and unregistered when the tensor is freed;
    where registering fails, pin_memory=True it is (with its rounding)."""
    t = torch.empty(numel, dtype=torch.float32)
    nbytes = numel * 4
    if nbytes:
        ptr = t.data_ptr()
        try:
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        except Exception as e:  # no CUDA runtime bindings
            err = e
        if err not in (0, None) and not (hasattr(err, "value") and err.value == 0):
            logger.warning("cudaHostRegister of %d bytes failed (%s): pinning with pin_memory=True", nbytes, err)
            return torch.zeros(numel, dtype=torch.float32, pin_memory=True)
        weakref.finalize(t, _unregister, ptr)  # before its memory goes back (the tensor owns it)
    return t.zero_()


class _Piece:
    """A piece of the flat layout: values [lo, hi) of the buffers, of which the first `n` belong to parameter
    tensor `t` from its value `a` on (the rest is the parameter's block padding)."""

    __slots__ = ("t", "a", "n", "lo", "hi")

    def __init__(self, t: torch.Tensor, a: int, n: int, lo: int, hi: int):
        self.t, self.a, self.n, self.lo, self.hi = t, a, n, lo, hi

    def values(self) -> torch.Tensor:
        """The parameter's values of this piece, flat (a view; a reshaped copy for a non-contiguous tensor,
        which is always one whole piece)."""
        return self.t.view(-1)[self.a : self.a + self.n] if self.t.is_contiguous() else self.t.reshape(-1)

    def subtract_from(self, anchor: torch.Tensor, out: torch.Tensor) -> None:
        """out := anchor - the parameter's values of this piece (one fp32 subtraction per value; padding 0), with
        anchor and out this piece's slices of flat buffers: the pseudo-gradient."""
        torch.sub(anchor[: self.n], self.values(), out=out[: self.n])
        out[self.n :].zero_()

    def write(self, src: torch.Tensor, add: bool = False) -> None:
        """Parameter values of this piece := (or +=) the first n values of `src` (on the parameter's device)."""
        src = src[: self.n]
        if self.t.is_contiguous():
            dst = self.t.view(-1)[self.a : self.a + self.n]
            dst.add_(src) if add else dst.copy_(src, non_blocking=True)
        else:
            self.t.add_(src.view_as(self.t)) if add else self.t.copy_(src.view_as(self.t), non_blocking=True)


class FlatLayout:
    """The flat layout of `params` (each parameter padded to whole blocks of `block_size`), where its home
    buffers live (`device`, see the module docstring) and the walk over them in pieces.

    home_buffers:   flat buffers the state keeps in its home (counted by device="auto")
    extra_buffers:  work buffers beyond the pseudo-gradient the caller will ask new_buffer() for
    inner_optimizer, pending_bytes: what training will still allocate on the GPU (device="auto")
    stream:         stream the home buffers through the work device (None: exactly when they live on another
                    device than the parameters; True on a CPU model streams through CPU staging, for tests)
    shard:          shard(p) -> the part of parameter p this layout holds (default: the process's local shard;
                    prime.shares: rows of it, for a process that takes part in several rings)
    """

    def __init__(self, params, *, block_size: int, device: str = "cpu", home_buffers: int = 2,
                 extra_buffers: int = 0, inner_optimizer: Optional[torch.optim.Optimizer] = None,
                 stream: Optional[bool] = None, pending_bytes: int = 0, shard: Optional[Callable] = None):
        self.params = list(params)
        self.shard = local_shard if shard is None else shard
        """shard(p): the tensor of parameter p this layout holds (a view the passes read and write)."""
        self.block_size = block_size
        self.home_buffers = home_buffers
        locals_ = self._locals()
        self.shapes = [tuple(t.shape) for t in locals_]
        self.sizes = [t.numel() for t in locals_]
        self.offsets, off = [], 0
        for n in self.sizes:
            self.offsets.append(off)
            off += -(-n // block_size) * block_size  # round up: blocks never span two parameters
        self.numel = off
        """Length of the flat buffers: the local shards, each padded to whole blocks."""
        self.on_gpu = any(t.device.type == "cuda" for t in locals_)
        """True when the parameters are on a GPU (whatever the outer state's device)."""
        self.work_device = next((t.device for t in locals_ if t.device.type == "cuda"), torch.device("cpu"))
        """Where the arithmetic runs and work buffers live: the parameters' GPU, or the CPU."""
        if device == "auto":  # the home buffers; the work buffers are on the GPU in any case
            pending_bytes += pending_training_bytes(self.params, locals_, inner_optimizer)
            pending_bytes += (1 + extra_buffers) * 4 * self.numel if self.on_gpu else 0
        self.device, self.device_reason = choose_device(device, locals_, self.home_buffers, pending_bytes,
                                                        numel=self.numel)
        """Where the outer weights and momentum live (their home): the CPU, or the parameters' GPU; and why."""
        self.streamed = (self.device != self.work_device) if stream is None else bool(stream)
        """True when every pass streams the home buffers through the work device in staged pieces."""
        self._pin = self.on_gpu and self.device.type == "cpu" and torch.cuda.is_available()
        self._streams = None  # (copy-in, copy-out) side streams of a streamed GPU state, made on first use
        self._staging: Optional[torch.Tensor] = None  # _SLOTS x 2 staging pieces of a streamed state
        self._tmp: Optional[torch.Tensor] = None  # the passes' temporaries

    # -- layout ------------------------------------------------------------

    def _home_buffer(self) -> torch.Tensor:
        if self._pin:
            return pinned_zeros(self.numel)
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def new_buffer(self) -> torch.Tensor:
        """A zeroed flat fp32 work buffer of the layout, on the work device (the parameters' GPU or the CPU)."""
        return torch.zeros(self.numel, dtype=torch.float32, device=self.work_device)

    @property
    def grad(self) -> torch.Tensor:
        """A work buffer of the layout for the pseudo-gradient (made on first use)."""
        if self._grad is None:
            self._grad = self.new_buffer()
        return self._grad

    def _locals(self) -> list:
        # Looked up on every pass: a parameter whose tensor was replaced (load_state_dict(assign=True)) is followed.
        return [self.shard(p.detach()) for p in self.params]

    def _spans(self):
        """(local tensor, offset, padded end) of every parameter."""
        ends = self.offsets[1:] + [self.numel]
        return zip(self._locals(), self.offsets, ends)

    def _chunk(self) -> int:
        return _PIPE_CHUNK if self.work_device.type == "cuda" else _CHUNK

    def _pieces(self, chunk: Optional[int] = None) -> list:
        """The passes' pieces: (local tensor, flat offset, start, end within the tensor, padded end of the
        parameter on its last piece else None); parameters cut at `chunk` values (default _PIPE_CHUNK; whole
        when not contiguous)."""
        chunk = _PIPE_CHUNK if chunk is None else chunk
        out = []
        for t, off, end in self._spans():
            n = t.numel()
            step = chunk if t.is_contiguous() else max(n, 1)
            starts = list(range(0, n, step)) or [0]
            for i, a in enumerate(starts):
                out.append((t, off, a, min(n, a + step), end if i == len(starts) - 1 else None))
        return out

    def _pieces_in(self, lo: int, hi: int) -> list:
        """The pieces of flat range [lo, hi) (whole pieces: lo and hi fall on piece boundaries, see ranges())."""
        out = []
        for t, off, a, b, end in self._pieces(self._chunk()):
            plo, phi = off + a, (end if end is not None else off + b)
            if plo >= lo and phi <= hi and phi > plo:
                out.append(_Piece(t, a, b - a, plo, phi))
        return out

    def ranges(self, count: int) -> list:
        """The flat layout cut into exactly `count` consecutive ranges [lo, hi) of about numel / count values
        (empty ones at the end when there are fewer places to cut), at piece boundaries that are also codec
        block boundaries: the pieces of a pipelined outer step, each all-reduced on its own. The same on every
        node for the same shard, and as many on every process of a node."""
        block, target = self.block_size, self.numel / max(count, 1)
        cuts, lo = [], 0
        for t, off, a, b, end in self._pieces(self._chunk()):
            at = off + a
            if len(cuts) < count - 1 and at > lo and at % block == 0 and at >= target * (len(cuts) + 1):
                cuts.append((lo, at))
                lo = at
        cuts.append((lo, self.numel))
        while len(cuts) < count:
            cuts.append((self.numel, self.numel))
        return cuts

    # -- the piece walker ------------------------------------------------------

    def _scratch(self, k: int) -> list:
        """k temporaries on the work device as long as the longest piece (kept for the next pass)."""
        width = max((p.hi - p.lo for p in self._pieces_in(0, self.numel)), default=0)
        if self._tmp is None or self._tmp.numel() < 3 * width:
            self._tmp = torch.empty(3 * width, dtype=torch.float32, device=self.work_device)
        return [self._tmp[i * width : (i + 1) * width] for i in range(k)]

    def _copy_streams(self):
        if self._streams is None and self.work_device.type == "cuda":
            self._streams = (torch.cuda.Stream(device=self.work_device), torch.cuda.Stream(device=self.work_device))
        return self._streams

    def _slots(self, k: int, width: int) -> list:
        """Staging views for `k` home buffers of slot i, `width` values each."""
        need = _SLOTS * 2 * width
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(need, dtype=torch.float32, device=self.work_device)
        return [[self._staging[(2 * i + j) * width : (2 * i + j + 1) * width] for j in range(k)]
                for i in range(_SLOTS)]

    def _walk(self, fn, *, home=(), work=(), write_home=False, lo: int = 0, hi: Optional[int] = None,
              work_at: int = 0) -> None:
        """Calls fn(piece, *home views, *work views) for every piece of [lo, hi), in order, with every view on the
        work device: the work buffers' slices (a work buffer's value 0 is flat value `work_at`: a buffer of one
        range only), and the home buffers' slices themselves when they live there, else
        (streamed) staged copies of them, copied in ahead on a side stream and, with `write_home`, copied back
        after fn on another (one fp32 copy each way: the same bits). Returns once the home buffers hold the
        result."""
        hi = self.numel if hi is None else hi
        pieces = self._pieces_in(lo, hi)
        w = work_at

        if not self.streamed:
            for p in pieces:
                fn(p, *[b[p.lo : p.hi] for b in home], *[b[p.lo - w : p.hi - w] for b in work])
            return
        width = max((p.hi - p.lo for p in pieces), default=0)
        slots = self._slots(len(home), width)
        streams = self._copy_streams()
        if streams is None:  # a CPU state streamed through CPU staging (tests): the same steps, synchronously
            for p in pieces:
                staged = [s[: p.hi - p.lo] for s in slots[0]]
                for s, b in zip(staged, home):
                    s.copy_(b[p.lo : p.hi])
                fn(p, *staged, *[b[p.lo - w : p.hi - w] for b in work])
                if write_home:
                    for s, b in zip(staged, home):
                        b[p.lo : p.hi].copy_(s)
            return
        s_in, s_out = streams
        compute = torch.cuda.current_stream(self.work_device)
        s_in.wait_stream(compute)  # the inner steps' kernels and earlier passes come first
        landed, freed = [None] * len(pieces), [None] * _SLOTS

        def fetch(i: int) -> None:
            p, slot = pieces[i], i % _SLOTS
            with torch.cuda.stream(s_in):
                if freed[slot] is not None:
                    s_in.wait_event(freed[slot])  # the slot's previous piece has been used (and copied back)
                for s, b in zip(slots[slot], home):
                    s[: p.hi - p.lo].copy_(b[p.lo : p.hi], non_blocking=True)
                landed[i] = torch.cuda.Event()
                landed[i].record(s_in)

        for i in range(min(_SLOTS - 1, len(pieces))):
            fetch(i)
        for i, p in enumerate(pieces):
            if i + _SLOTS - 1 < len(pieces):
                fetch(i + _SLOTS - 1)
            slot = i % _SLOTS
            compute.wait_event(landed[i])
            staged = [s[: p.hi - p.lo] for s in slots[slot]]
            fn(p, *staged, *[b[p.lo - w : p.hi - w] for b in work])
            done = torch.cuda.Event()
            done.record(compute)
            if write_home:
                with torch.cuda.stream(s_out):
                    s_out.wait_event(done)
                    for s, b in zip(staged, home):
                        b[p.lo : p.hi].copy_(s, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(s_out)
            freed[slot] = done
        if write_home:
            s_out.synchronize()  # the home buffers hold the result before anyone reads them on the host
        compute.synchronize()  # the staging and the work buffers are settled (the next pass may rewrite them)

    # -- copies between the model and the buffers ----------------------------------

    @torch.no_grad()
    def gather(self, dst: torch.Tensor) -> None:
        """Copies the local parameter values into the flat buffer `dst` (home or work); padding := 0."""
        streams = self._copy_streams() if dst.device != self.work_device else None
        if streams is not None:
            streams[1].wait_stream(torch.cuda.current_stream(self.work_device))
        for p in self._pieces_in(0, self.numel):
            view = dst[p.lo : p.hi]
            if streams is not None:
                with torch.cuda.stream(streams[1]):
                    view[: p.n].copy_(p.values(), non_blocking=True)
            else:
                view[: p.n].copy_(p.values())
            view[p.n :].zero_()  # a buffer a failed all-reduce scrambled gets clean padding too
        if streams is not None:
            streams[1].synchronize()

    @torch.no_grad()
    def scatter(self, src: torch.Tensor, lo: int = 0, hi: Optional[int] = None) -> None:
        """Copies the flat buffer `src` (home or work) into the local parameters (range [lo, hi) only)."""
        hi = self.numel if hi is None else hi
        streams = self._copy_streams() if src.device != self.work_device else None
        compute = torch.cuda.current_stream(self.work_device) if streams is not None else None
        if streams is not None:
            streams[0].wait_stream(compute)
        for p in self._pieces_in(lo, hi):
            if streams is not None:
                with torch.cuda.stream(streams[0]):
                    p.write(src[p.lo : p.hi])
            else:
                p.write(src[p.lo : p.hi])
        if streams is not None:
            compute.wait_stream(streams[0])
            streams[0].synchronize()  # src may be rewritten as soon as this returns
