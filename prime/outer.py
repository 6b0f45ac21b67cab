"""The outer state: flat fp32 outer weights and momentum of one process's share of a model (or of a fragment).

    state = OuterState(model.parameters(), block_size=64)
    state.take()                      # outer weights := the model's current weights
    ...                               # inner steps move the model away
    g = state.new_buffer()
    state.pseudo_gradient(g)          # g = outer - local
    ...                               # average g across nodes (prime.sync)
    state.update(g, load=True)        # outer Nesterov step; local weights := outer weights

For the parameters this process holds (the local shard of each FSDP2
DTensor, or the whole tensor of a plain module), the outer weights and
momentum are flat fp32 buffers, each parameter starting a new codec block, so
that no int8 block of the all-reduce spans two parameters.

Two places matter: where the outer weights and momentum live (`device`, the
state's *home*) and where the arithmetic runs (the *work device*: the
parameters' device). Work buffers (the pseudo-gradient, the start point of
overlap) are always made on the work device, so on a GPU model the all-reduce
reduces on the GPU and only int8 bytes cross PCIe.

    "gpu"   home on the parameters' GPU: every pass is a GPU kernel over the buffers
    "cpu"   home in CPU memory (pinned when the parameters are on a GPU). On a GPU model
            every pass *streams* the home buffers through the GPU in pieces
            (_PIPE_CHUNK values), double-buffered on side streams: a piece is copied
            in, computed on by the same GPU kernels as "gpu", and (for the update)
            copied back, while the next piece crosses PCIe the other way. The host CPU
            does no per-element arithmetic; only piece copies cross PCIe.
    "auto"  "gpu" when the home buffers fit in the GPU's free memory less what training
            will still allocate and a margin for activations (AUTO_GPU_MARGIN_BYTES),
            else "cpu"; logged (prime.outer). prime.memory plans the whole run.

With error feedback (prime/feedback.py) a third home buffer, the residual,
lives beside the outer weights and momentum (the same home, streamed the same
way): compensate() turns the pseudo-gradient into the node's contribution,
commit_residual() writes what it lost once the average is back.

The passes of an outer step: one over the parameters for the pseudo-gradient
and its squared norm (pseudo_gradient), then after the average one update pass
(update, with the copy into the model fused in). With overlap (prime/diloco.py)
a lookahead pass computes the next start point without touching the momentum.
Each pass may cover a flat range [lo, hi) only (a piece of a pipelined outer
step: prime.fragments), cut at `ranges()`.

The default update is Nesterov SGD written as separate elementwise multiplies
and adds, each one IEEE fp32 rounding with no fused multiply-add, so every
node computes the same bits from the same average on any CPU:

    momentum = mu * momentum + g
    update   = g + mu * momentum     (Nesterov) or momentum
    outer   -= lr * update

torch.optim.SGD gives the same values up to the last bit, but it may fuse
`a + mu * b` where the CPU has FMA, and nodes with different CPUs would then
drift apart. The same sequence of single-rounding torch kernels runs on the
GPU (one kernel per operation, so nothing can be contracted into an FMA across
them), and the CPU, the GPU and the streamed state give the same bits
(tests/test_outer_gpu.py): nodes stay identical whichever device each keeps its
outer state on.

An `optimizer_factory` replaces this update by any torch optimizer over the
outer parameters (one fp32 tensor per model parameter, viewing the flat buffer,
on the home device, where it also runs); its bits then depend on torch's
kernels, which are identical only on the same torch build and instruction set.
"""

from __future__ import annotations

import hashlib
import logging
import math
import weakref
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from prime.feedback import compensate
from prime.ops import DEFAULT_BLOCK_SIZE
from prime.parallelize import local_shard

__all__ = ["OuterState", "OuterOptimizerFactory", "OUTER_STATE_DEVICES", "AUTO_GPU_MARGIN_BYTES",
           "AUTO_GPU_MARGIN_FRACTION", "pending_training_bytes", "resolve_device", "choose_device",
           "staging_bytes", "home_buffer_count"]

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

logger = logging.getLogger("prime.outer")


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


OuterOptimizerFactory = Callable[[list], torch.optim.Optimizer]
"""outer_optimizer(params) -> a torch optimizer over `params`: one fp32 nn.Parameter per model
parameter (the local shard's shape, on the outer state's home device), in model.parameters() order. Its .grad
is the averaged pseudo-gradient."""


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

    def write(self, src: torch.Tensor, add: bool = False) -> None:
        """Parameter values of this piece := (or +=) the first n values of `src` (on the parameter's device)."""
        src = src[: self.n]
        if self.t.is_contiguous():
            dst = self.t.view(-1)[self.a : self.a + self.n]
            dst.add_(src) if add else dst.copy_(src, non_blocking=True)
        else:
            self.t.add_(src.view_as(self.t)) if add else self.t.copy_(src.view_as(self.t), non_blocking=True)


def _pseudo_gradient_piece(p: _Piece, anchor: torch.Tensor, g: torch.Tensor, sq: torch.Tensor) -> None:
    """g = anchor - the parameter's values of piece p (one fp32 subtraction; padding 0); sq += ||g||^2."""
    torch.sub(anchor[: p.n], p.values(), out=g[: p.n])
    g[p.n :].zero_()
    sq.add_(torch.dot(g[: p.n], g[: p.n]).double())


def _lookahead_piece(out, m, w, g, mu, lr, nesterov, scale, tmp, tmp2, tmp3) -> None:
    """out = the outer weights update() would make of (w, m) from g (fp32(g * scale) with a scale), leaving w and
    m as they are: update()'s operations in its order, each rounded once."""
    if scale is not None:
        g = torch.mul(g, scale, out=tmp3[: g.numel()])
    mm = tmp[: g.numel()]
    torch.mul(m, mu, out=mm)
    mm.add_(g)  # the momentum update() would store
    if nesterov:
        t = tmp2[: g.numel()]
        torch.mul(mm, mu, out=t)
        t.add_(g)
    else:
        t = mm
    t.mul_(lr)
    torch.sub(w, t, out=out)



def home_buffer_count(error_feedback: bool) -> int:
    """Flat fp32 buffers of the layout an outer state keeps in its home: outer weights and momentum, and with
    error feedback the residual."""
    return 2 + bool(error_feedback)


class OuterState:
    """Outer weights and momentum (or a torch outer optimizer), flat fp32.

    params:            the model's parameters (FSDP2 DTensors or plain tensors), or a fragment's
    block_size:        codec block size; every parameter starts a new block
    outer_lr, outer_momentum, nesterov: the default outer update
    optimizer_factory: replaces the default update (see OuterOptimizerFactory)
    device:            "cpu", "gpu" or "auto": the home of the outer weights and momentum (module docstring)
    extra_buffers:     work buffers beyond the pseudo-gradient that the caller will ask new_buffer() for;
                       counted by device="auto"
    inner_optimizer:   the inner optimizer, if any: device="auto" counts the state it will still make
                       (pending_training_bytes)
    stream:            stream the home buffers through the work device in staged pieces (None: exactly when
                       they live on another device than the parameters; True on a CPU model runs the
                       streamed passes with CPU staging, for tests)
    error_feedback:    the codec ("int8" or "fp4") whose error this node feeds back (prime.feedback): a third home
                       buffer, the residual, beside the outer weights and momentum; None: no error feedback
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        optimizer_factory: Optional[OuterOptimizerFactory] = None,
        device: str = "cpu",
        extra_buffers: int = 0,
        inner_optimizer: Optional[torch.optim.Optimizer] = None,
        stream: Optional[bool] = None,
        pending_bytes: int = 0,
        error_feedback: Optional[str] = None,
    ):
        self.params = list(params)
        self.feedback_codec = error_feedback
        """The codec whose quantization error this node feeds back (prime.feedback), or None."""
        self.home_buffers = home_buffer_count(error_feedback is not None)
        """Flat fp32 buffers of the layout in the state's home: outer weights, momentum and the residual."""
        self.block_size = block_size
        self.lr, self.mu, self.nesterov = outer_lr, outer_momentum, nesterov
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
        self.outer = self._home_buffer()
        """The outer weights (padding: 0)."""
        self._grad: Optional[torch.Tensor] = None
        self.taken = False
        """True once the outer weights hold something (take(), load_state_dict() or a download)."""
        self.residual: Optional[torch.Tensor] = self._home_buffer() if error_feedback is not None else None
        """Error feedback: what this node's contributions lost to the codec so far (padding: 0; None: off)."""
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.momentum: Optional[torch.Tensor] = None
        if optimizer_factory is None:
            self.momentum = self._home_buffer()
        else:
            # nn.Parameters that alias the flat buffer: the optimizer's in-place updates land in self.outer.
            self._opt_grad = torch.zeros(off, dtype=torch.float32, device=self.device)
            self.outer_params = [nn.Parameter(self.outer[o : o + n].view(s))
                                 for o, n, s in zip(self.offsets, self.sizes, self.shapes)]
            for p, o, n, s in zip(self.outer_params, self.offsets, self.sizes, self.shapes):
                p.grad = self._opt_grad[o : o + n].view(s)
            self.optimizer = optimizer_factory(self.outer_params)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}")

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
        return [local_shard(p.detach()) for p in self.params]

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

    # -- the outer step's parts --------------------------------------------------

    def take(self) -> None:
        """Outer weights := the model's current weights (momentum and optimizer state are kept)."""
        self.gather(self.outer)
        self.taken = True

    def ensure_taken(self) -> None:
        """take() unless the outer weights already hold something."""
        if not self.taken:
            self.take()

    @torch.no_grad()
    def pseudo_gradient(self, g: torch.Tensor, anchor: Optional[torch.Tensor] = None, lo: int = 0,
                        hi: Optional[int] = None, at: int = 0) -> float:
        """g = anchor - local over [lo, hi) (anchor: the outer weights by default, else a work buffer; padding 0;
        `at`: g holds the values from flat value `at` on, e.g. a buffer of range [lo, hi) only with at = lo);
        returns the squared L2 norm of that part of g (float64 sums of fp32 dot products per piece; not
        bit-critical: it is reported and checked for finiteness only). One pass: the subtraction and the sum
        of squares run on each piece while it is hot."""
        sq = torch.zeros((), dtype=torch.float64, device=g.device)

        def body(p, a, gv):
            _pseudo_gradient_piece(p, a, gv, sq)

        if anchor is None:
            self._walk(body, home=(self.outer,), work=(g,), lo=lo, hi=hi, work_at=at)
        else:
            if at:
                raise ValueError("pseudo_gradient: an anchor buffer needs g of the whole layout (at = 0)")
            self._walk(body, work=(anchor, g), lo=lo, hi=hi)
        return float(sq)  # one host sync on a GPU

    @torch.no_grad()
    def int8_error_sq(self, g: torch.Tensor) -> float:
        """Sum of squares of the int8 round-trip error of g (quantize, dequantize, subtract), by whole codec
        blocks: a separate pass, for rings that do not report their own quantization error."""
        from prime import ops

        err = torch.zeros((), dtype=torch.float64, device=g.device)
        bs = self.block_size
        chunk = ((_GPU_CHUNK if g.is_cuda else _CHUNK) // bs) * bs or bs  # whole blocks, as the ring cuts them
        for s in range(0, g.numel(), chunk):
            c = g[s : s + chunk]
            q, scales = ops.quantize_int8(c, bs, check_finite=False)
            d = ops.dequantize_int8(q, scales, bs)
            d.sub_(c)
            err += torch.dot(d, d).double()
        return float(err)

    @torch.no_grad()
    def inspect(self, g: torch.Tensor, compression_error: bool) -> tuple[float, Optional[float]]:
        """L2 norm of g and, when asked, the relative L2 error of its int8 quantize/dequantize round trip."""
        sq = 0.0
        bs = _GPU_CHUNK if g.is_cuda else _CHUNK
        for s in range(0, g.numel(), bs):
            c = g[s : s + bs]
            sq += float(torch.dot(c, c).double())
        norm = math.sqrt(sq)
        if not compression_error:
            return norm, None
        if not math.isfinite(sq):
            return norm, float("nan")
        return norm, (math.sqrt(self.int8_error_sq(g)) / norm if norm > 0 else 0.0)

    @torch.no_grad()
    def update(self, g: torch.Tensor, *, load: bool = False, norm: bool = False, lo: int = 0,
               hi: Optional[int] = None, at: int = 0, shift: Optional[torch.Tensor] = None,
               keep: Optional[float] = None) -> Optional[float]:
        """The outer step on the fp32 outer weights over [lo, hi), from the averaged pseudo-gradient g (a work
        buffer holding the values from flat value `at` on; same bits on CPU, GPU and streamed). `load`: also copy
        the new outer weights into the model, piece by piece as they are computed. `shift`: in the same pass,
        shift_to_outer(shift, keep) with the new outer weights (overlap's midway step). `norm`: return the
        squared L2 norm of g (fp32 dot products per piece, summed in float64), else None."""
        sq = torch.zeros((), dtype=torch.float64, device=g.device) if norm else None
        if self.optimizer is not None:
            if lo != 0 or at != 0 or (hi is not None and hi != self.numel):
                raise ValueError("a custom outer_optimizer updates the whole state at once (no pipelined pieces)")
            self._opt_grad.copy_(g)
            self.optimizer.step()
            if load:
                self.scatter(self.outer)
            if norm:
                self._walk(lambda p, gv: sq.add_(torch.dot(gv, gv).double()), work=(g,))
            return float(sq) if norm else None
        mu, lr, nesterov = self.mu, self.lr, self.nesterov
        tmp = self._scratch(1)[0]

        def body(p, mc, wc, gc, *sc):
            t = tmp[: gc.numel()]
            mc.mul_(mu)
            mc.add_(gc)  # momentum = mu * momentum + g  (two roundings, never one FMA)
            if nesterov:
                torch.mul(mc, mu, out=t)
                t.add_(gc)  # update = g + mu * momentum
            else:
                t.copy_(mc)
            t.mul_(lr)
            wc.sub_(t)  # outer -= lr * update
            if norm:
                sq.add_(torch.dot(gc, gc).double())  # while gc is hot
            if load:
                p.write(wc)
            if sc:
                torch.sub(wc, sc[0], out=sc[0])  # shift_to_outer, while the new outer weights are hot
                if keep is not None:
                    sc[0].mul_(keep)
                p.write(sc[0], add=True)

        if shift is None:
            self._walk(body, home=(self.momentum, self.outer), work=(g,), write_home=True, lo=lo, hi=hi,
                       work_at=at)
        else:
            if at or load:
                raise ValueError("update(shift=...) covers whole-layout buffers and shifts instead of loading")
            self._walk(lambda p, mc, wc, gc, sc_: body(p, mc, wc, gc, sc_), home=(self.momentum, self.outer),
                       work=(g, shift), write_home=True, lo=lo, hi=hi)
        return float(sq) if norm else None

    @torch.no_grad()
    def lookahead(self, g: torch.Tensor, out: torch.Tensor, *, load: bool = False,
                  scale: Optional[float] = None) -> None:
        """out = the outer weights update(g) would give, without changing the weights or the momentum (g and out
        are work buffers; out may be g). `load`: also copy `out` into the model. `scale`: use fp32(g * scale) in
        place of g.

        The same operations in the same order as update(), so lookahead(g) and update(g) agree bit for bit."""
        if self.optimizer is not None:
            raise ValueError("lookahead needs the default outer update (outer_optimizer=None)")
        mu, lr, nesterov = self.mu, self.lr, self.nesterov
        tmp, tmp2, tmp3 = self._scratch(3)

        def body(p, mc, wc, gc, oc):
            _lookahead_piece(oc, mc, wc, gc, mu, lr, nesterov, scale, tmp, tmp2, tmp3)
            if load:
                p.write(oc)

        self._walk(body, home=(self.momentum, self.outer), work=(g, out))

    @torch.no_grad()
    def pseudo_gradient_and_lookahead(self, g: torch.Tensor, out: torch.Tensor, *, scale: Optional[float] = None) -> float:
        """pseudo_gradient(g) from the outer weights, then lookahead(g, out, load=True, scale=scale), in one
        pass over the home buffers (the same operations, so the same bits as the two passes). Returns ||g||^2."""
        if self.optimizer is not None:
            raise ValueError("lookahead needs the default outer update (outer_optimizer=None)")
        mu, lr, nesterov = self.mu, self.lr, self.nesterov
        tmp, tmp2, tmp3 = self._scratch(3)
        sq = torch.zeros((), dtype=torch.float64, device=g.device)

        def body(p, mc, wc, gv, oc):
            _pseudo_gradient_piece(p, wc, gv, sq)
            _lookahead_piece(oc, mc, wc, gv, mu, lr, nesterov, scale, tmp, tmp2, tmp3)
            p.write(oc)

        self._walk(body, home=(self.momentum, self.outer), work=(g, out))
        return float(sq)

    @torch.no_grad()
    def shift_to_outer(self, start: torch.Tensor, keep: Optional[float] = None) -> None:
        """Overlap, once the average in flight is applied: start := (outer weights - start) [* keep], and the
        local weights += start (each operation rounded once): the local weights move by what their start point
        missed (eager-merge keeps only `keep` of it). `start` (a work buffer) then holds the shift."""

        def body(p, wc, sc):
            torch.sub(wc, sc, out=sc)  # what the start point missed
            if keep is not None:
                sc.mul_(keep)
            p.write(sc, add=True)

        self._walk(body, home=(self.outer,), work=(start,))

    @torch.no_grad()
    def merge_stand_in(self, s: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
        """eager-merge at a boundary: s := g - alpha (s - outer weights), each operation rounded once (s, g: work
        buffers). Returns s."""

        def body(p, wc, sc, gc):
            torch.sub(sc, wc, out=sc)  # the start point's offset from the new outer weights
            sc.mul_(alpha)
            torch.sub(gc, sc, out=sc)

        self._walk(body, home=(self.outer,), work=(s, g))
        return s

    @torch.no_grad()
    def add_to_model(self, delta: torch.Tensor) -> None:
        """Local weights += delta (a work buffer of the layout), one fp32 rounding per value."""
        self._walk(lambda p, dc: p.write(dc, add=True), work=(delta,))

    @torch.no_grad()
    def compensate(self, g: torch.Tensor, *, lo: int = 0, hi: Optional[int] = None, at: int = 0,
                   commit: bool = False) -> None:
        """Error feedback on the pseudo-gradient g over [lo, hi) (a work buffer holding the values from flat value
        `at` on): g := dequantize(quantize(g + residual)), the contribution the ring will send without further loss
        (prime.feedback). `commit`: also residual := (g + residual) - that, in the same pass; without it the
        residual is left as it is (commit_residual() does it once the average is back)."""
        codec, bs = self.feedback_codec, self.block_size

        def body(p, ec, gc):
            compensate(gc, ec, codec, bs, commit)

        self._walk(body, home=(self.residual,), work=(g,), write_home=commit, lo=lo, hi=hi, work_at=at)

    @torch.no_grad()
    def commit_residual(self, lo: int = 0, hi: Optional[int] = None) -> None:
        """Error feedback, once the average of a synchronous outer step is back and before update() applies it:
        residual := what this node's contribution lost, over [lo, hi), recomputed from the outer weights, the
        local weights and the residual as they were when compensate() made the contribution (the same operations,
        so the same bits). Until now the residual was untouched, so that a failed average leaves it as it was."""
        codec, bs = self.feedback_codec, self.block_size
        tmp = self._scratch(1)[0]

        def body(p, wc, ec):
            t = tmp[: wc.numel()]
            torch.sub(wc[: p.n], p.values(), out=t[: p.n])  # pseudo_gradient()'s subtraction
            t[p.n :].zero_()
            compensate(t, ec, codec, bs, True)

        self._walk(body, home=(self.outer, self.residual), write_home=True, lo=lo, hi=hi)

    def reset_residual(self) -> None:
        """Error feedback: residual := 0 (a node that joins holds no contribution's error)."""
        if self.residual is not None:
            self.residual.zero_()

    def load_into_model(self, src: Optional[torch.Tensor] = None, lo: int = 0, hi: Optional[int] = None) -> None:
        """Local weights := outer weights (or `src`, a buffer of the same layout), over [lo, hi)."""
        self.scatter(self.outer if src is None else src, lo, hi)

    # -- identity and state ----------------------------------------------------------

    def settings(self) -> dict:
        """What every node must agree on for the outer step to mean the same everywhere."""
        if self.optimizer is None:
            opt = {"outer_lr": self.lr, "outer_momentum": self.mu, "nesterov": self.nesterov}
        else:
            opt = {"outer_optimizer": type(self.optimizer).__name__,
                   "outer_defaults": repr(sorted(self.optimizer.defaults.items()))}
        return {**opt, "block_size": self.block_size, "shapes": [list(s) for s in self.shapes], "numel": self.numel}

    def weights_hash(self) -> int:
        """64-bit hash of the outer weights' bytes."""
        self.ensure_taken()
        return int.from_bytes(hashlib.blake2b(self.outer.cpu().numpy().data, digest_size=8).digest(), "little")

    def tensors(self) -> list:
        """The flat state a joining node must download (outer weights and momentum)."""
        if self.optimizer is not None:
            raise ValueError("a custom outer_optimizer keeps its state per parameter; elastic joins need the "
                             "default outer update (outer_optimizer=None)")
        return [self.outer, self.momentum]

    def state_dict(self) -> dict:
        """Outer weights and momentum (or the outer optimizer's state): CPU tensors (copies when on a GPU; the
        buffers themselves when they live in CPU memory: they change only at this state's next outer step)."""
        self.ensure_taken()
        sd = {"outer": self.outer.cpu(), "numel": self.numel, "block_size": self.block_size}
        if self.optimizer is None:
            sd["momentum"] = self.momentum.cpu()
        else:
            sd["outer_optimizer"] = self.optimizer.state_dict()
        if self.residual is not None:
            sd["residual"] = self.residual.cpu()  # this node's own: it differs from node to node
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); a different layout raises ValueError."""
        if "block_size" in sd and int(sd["block_size"]) != self.block_size:
            # (every parameter starts a block: the layout depends on it)
            raise ValueError(
                f"the checkpoint's outer state was written with diloco.block_size = {int(sd['block_size'])}, this "
                f"run has {self.block_size}: set diloco.block_size = {int(sd['block_size'])} to resume it (unset, "
                "it is the codec's default: 64 for int8, 256 for fp4)"
            )
        if int(sd["numel"]) != self.numel:
            raise ValueError(
                f"the checkpoint's outer state has {sd['numel']} values but this process's shard needs "
                f"{self.numel}: resume with the same model, processes per node, diloco.fragments and "
                "diloco.block_size (unset, it is the codec's default: 64 for int8, 256 for fp4; a checkpoint that "
                "does not record it was written at 256 unless diloco.block_size was set)"
            )
        if (self.optimizer is None) != ("momentum" in sd):
            raise ValueError("the checkpoint's outer state was written with "
                             + ("the default outer update" if "momentum" in sd else "a custom outer_optimizer")
                             + ": resume with the same outer_optimizer setting")
        self.outer.copy_(sd["outer"])
        if self.optimizer is None:
            self.momentum.copy_(sd["momentum"])
        else:
            self.optimizer.load_state_dict(sd["outer_optimizer"])
        if self.residual is not None:
            if "residual" in sd:
                self.residual.copy_(sd["residual"])
            else:
                self.residual.zero_()
                logger.info("error feedback: the checkpoint holds no residual (written without error feedback); "
                            "starting from zero")
        elif "residual" in sd:
            logger.warning("the checkpoint holds an error-feedback residual but diloco.error_feedback is off here: "
                           "the residual is dropped")
        self.taken = True
