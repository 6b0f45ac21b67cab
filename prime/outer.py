"""The outer state: flat fp32 outer weights and momentum of one process's share of a model.

    state = OuterState(model.parameters(), block_size=256)
    state.take()                      # outer weights := the model's current weights
    ...                               # inner steps move the model away
    state.pseudo_gradient(state.grad) # grad = outer - local
    ...                               # average grad across nodes (prime.sync)
    state.update(state.grad)          # outer Nesterov step (or any torch optimizer)
    state.load_into_model()           # local weights := outer weights

For the parameters this process holds (the local shard of each FSDP2
DTensor, or the whole tensor of a plain module), the outer weights and
momentum are flat fp32 buffers, each parameter starting a new codec block, so
that no int8 block of the all-reduce spans two parameters. They live where
`device` says:

    "cpu"   CPU memory (pinned when the parameters are on a GPU); the copies to
            and from the GPU run on a side stream, one parameter at a time, so
            that the CPU works on one parameter while the next one crosses PCIe
    "gpu"   the parameters' GPU: every pass is a GPU kernel, nothing crosses PCIe
    "auto"  "gpu" when the parameters are on a GPU and the buffers fit in its free
            memory less what training will still allocate and a margin for
            activations (AUTO_GPU_MARGIN_BYTES), else "cpu"; logged (prime.outer)

The passes of an outer step: one over the parameters for the pseudo-gradient
and its squared norm (pseudo_gradient), then after the average one update pass
(update) and one copy back (load_into_model). With overlap (prime/diloco.py)
a lookahead pass computes the next start point without touching the momentum.

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
them), and the CPU and GPU give the same bits (tests/test_outer_gpu.py): nodes
stay identical whichever device each keeps its outer state on.

An `optimizer_factory` replaces this update by any torch
optimizer over the outer parameters (one fp32 tensor per model parameter,
viewing the flat buffer, on the outer state's device); its bits then depend on torch's CPU kernels, which
are identical only on the same torch build and CPU instruction set.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from prime.parallelize import local_shard

__all__ = ["OuterState", "OuterOptimizerFactory", "OUTER_STATE_DEVICES", "AUTO_GPU_MARGIN_BYTES",
           "AUTO_GPU_MARGIN_FRACTION", "pending_training_bytes", "resolve_device", "choose_device"]

# Chunk of the elementwise passes over the flat buffers on the CPU: large enough to amortize
# the per-op overhead, small enough that the temporary stays in L2/L3 cache.
_CHUNK = 1 << 20
# On a GPU one kernel per operation over 64M values (256 MiB) is already at full bandwidth;
# the chunk only bounds the temporaries' memory.
_GPU_CHUNK = 1 << 26
# Piece of the CPU state's copy pipeline (GPU <-> pinned memory): 16M values (64 MiB, ~3 ms of PCIe) per copy, so
# that the CPU pass starts after the first piece has landed, not after a whole embedding table (1 GB for 1B).
_PIPE_CHUNK = 1 << 24

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


def choose_device(device: str, local_tensors: list, buffers: int, pending_bytes: int = 0) -> tuple:
    """resolve_device, and the choice in words (one line)."""
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
    need = buffers * 4 * sum(t.numel() for t in local_tensors)
    total = torch.cuda.get_device_properties(dev).total_memory
    free, _ = torch.cuda.mem_get_info(dev)
    cached = max(0, torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))  # torch holds it, unused
    margin = max(AUTO_GPU_MARGIN_BYTES, int(AUTO_GPU_MARGIN_FRACTION * total))
    room = free + cached - pending_bytes - margin
    chosen = dev if need <= room else torch.device("cpu")
    gib = 1 << 30
    why = (f"outer_state_device auto: {'gpu' if chosen.type == 'cuda' else 'cpu'} ({buffers} buffers need "
           f"{need / gib:.1f} GiB; {dev} has {(free + cached) / gib:.1f} GiB free now, {pending_bytes / gib:.1f} GiB more "
           f"to come for gradients and optimizer state, {margin / gib:.1f} GiB kept for activations: room "
           f"{room / gib:.1f} GiB)")
    logger.info(why)
    return chosen, why

OuterOptimizerFactory = Callable[[list], torch.optim.Optimizer]
"""outer_optimizer(params) -> a torch optimizer over `params`: one fp32 nn.Parameter per model
parameter (the local shard's shape, on the outer state's device), in model.parameters() order. Its .grad is the
averaged pseudo-gradient."""


class OuterState:
    """Outer weights, momentum (or a torch outer optimizer) and the pseudo-gradient buffer, flat fp32.

    params:            the model's parameters (FSDP2 DTensors or plain tensors)
    block_size:        codec block size; every parameter starts a new block
    outer_lr, outer_momentum, nesterov: the default outer update
    optimizer_factory: replaces the default update (see OuterOptimizerFactory)
    device:            "cpu", "gpu" or "auto": where the buffers live (see the module docstring)
    extra_buffers:     buffers beyond the three (outer, momentum, grad) that the caller will ask
                       new_buffer() for; counted by device="auto"
    inner_optimizer:   the inner optimizer, if any: device="auto" counts the state it will still make
                       (pending_training_bytes)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        block_size: int = 256,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        optimizer_factory: Optional[OuterOptimizerFactory] = None,
        device: str = "cpu",
        extra_buffers: int = 0,
        inner_optimizer: Optional[torch.optim.Optimizer] = None,
    ):
        self.params = list(params)
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
        pending = pending_training_bytes(self.params, locals_, inner_optimizer) if device == "auto" else 0
        self.device, self.device_reason = choose_device(device, locals_, 3 + extra_buffers, pending)
        """Where the flat buffers live: the CPU, or the parameters' GPU; and why, in one line."""
        self._pin = self.on_gpu and self.device.type == "cpu" and torch.cuda.is_available()
        self._stream = None  # side stream of the CPU state's copies to and from the GPU (made on first use)
        self.outer = self.new_buffer()
        """The outer weights (padding: 0)."""
        self.grad = self.new_buffer()
        """Work buffer of the pseudo-gradient; after the all-reduce, its average."""
        self.taken = False
        """True once the outer weights hold something (take(), load_state_dict() or a download)."""
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.momentum: Optional[torch.Tensor] = None
        if optimizer_factory is None:
            self.momentum = torch.zeros(off, dtype=torch.float32, device=self.device)
        else:
            # nn.Parameters that alias the flat buffer: the optimizer's in-place updates land in self.outer.
            self.outer_params = [nn.Parameter(self.outer[o : o + n].view(s))
                                 for o, n, s in zip(self.offsets, self.sizes, self.shapes)]
            for p, o, n, s in zip(self.outer_params, self.offsets, self.sizes, self.shapes):
                p.grad = self.grad[o : o + n].view(s)
            self.optimizer = optimizer_factory(self.outer_params)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}")

    # -- layout ------------------------------------------------------------

    def new_buffer(self) -> torch.Tensor:
        """A zeroed flat fp32 buffer of the layout, on the outer state's device (pinned on the CPU when the
        parameters are on a GPU)."""
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device, pin_memory=self._pin)

    def _locals(self) -> list:
        # Looked up on every copy: a parameter whose tensor was replaced (load_state_dict(assign=True)) is followed.
        return [local_shard(p.detach()) for p in self.params]

    def _spans(self):
        """(local tensor, offset, padded end) of every parameter."""
        ends = self.offsets[1:] + [self.numel]
        return zip(self._locals(), self.offsets, ends)

    def _pieces(self) -> list:
        """The copy pipeline's pieces: (local tensor, flat offset, start, end within the tensor, padded end of the
        parameter on its last piece else None); parameters cut at _PIPE_CHUNK values (whole when not contiguous)."""
        out = []
        for t, off, end in self._spans():
            n = t.numel()
            step = _PIPE_CHUNK if t.is_contiguous() else max(n, 1)
            starts = list(range(0, n, step)) or [0]
            for i, a in enumerate(starts):
                out.append((t, off, a, min(n, a + step), end if i == len(starts) - 1 else None))
        return out

    @staticmethod
    def _piece_of(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Values a..b of t, flat: a view of t (whole pieces of non-contiguous tensors are a reshaped copy)."""
        return t.view(-1)[a:b] if t.is_contiguous() else t.reshape(-1)

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._gpu_device())
        return self._stream

    def _gpu_device(self) -> torch.device:
        return next(t.device for t in self._locals() if t.device.type == "cuda")

    def _piped(self) -> bool:
        """True when the buffers are in CPU memory and the parameters on a GPU: copies go through the side stream."""
        return self.on_gpu and self.device.type == "cpu" and torch.cuda.is_available()

    def _fetch(self, dst: torch.Tensor):
        """Yields (values, view, padding) per parameter: `view` is the parameter's span of dst, `values` a flat
        fp32 tensor on dst's device holding the parameter's current values (the parameter's own storage when it
        is already flat fp32 there, else `view` itself, filled by a copy), `padding` dst's tail of the
        parameter's last block.

        CPU state, GPU parameters: every device-to-host copy is queued at once on the side stream
        (after the inner steps' kernels), and each parameter is yielded as soon as its own copy has
        landed, so the caller's CPU pass over one parameter overlaps the copy of the next."""
        spans = list(self._spans())
        if not self._piped():
            for t, off, end in spans:
                view = dst[off : off + t.numel()]
                if t.device == dst.device and t.is_contiguous() and t.dtype == dst.dtype:
                    yield t.reshape(-1), view, dst[off + t.numel() : end]
                else:
                    view.copy_(t.reshape(-1))
                    yield view, view, dst[off + t.numel() : end]
            return
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        pieces, events = self._pieces(), []
        with torch.cuda.stream(stream):
            for t, off, a, b, _ in pieces:
                if t.device.type == "cuda":
                    dst[off + a : off + b].copy_(self._piece_of(t, a, b), non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record(stream)
                else:
                    events.append(None)
        for (t, off, a, b, end), ev in zip(pieces, events):
            view = dst[off + a : off + b]
            if ev is None:
                view.copy_(self._piece_of(t, a, b))
            else:
                ev.synchronize()  # this piece's bytes are in dst; later ones are still crossing PCIe
            pad = dst[off + t.numel() : end] if end is not None else dst[:0]
            yield view, view, pad

    @torch.no_grad()
    def gather(self, dst: torch.Tensor) -> None:
        """Copies the local parameter values into the flat buffer `dst`; padding := 0."""
        for values, view, pad in self._fetch(dst):
            if values is not view:
                view.copy_(values)
            pad.zero_()  # a buffer a failed all-reduce scrambled gets clean padding too

    @torch.no_grad()
    def scatter(self, src: torch.Tensor) -> None:
        """Copies the flat buffer `src` into the local parameters.

        CPU state, GPU parameters: host-to-device copies on the side stream; the compute stream waits
        for them, and this call returns once they are done (src is rewritten at the next outer step)."""
        if not self._piped():
            for t, off, _ in self._spans():
                t.copy_(src[off : off + t.numel()].view_as(t))
            return
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            for t, off, _ in self._spans():
                t.copy_(src[off : off + t.numel()].view_as(t), non_blocking=True)
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        stream.synchronize()

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
    def pseudo_gradient(self, g: torch.Tensor, anchor: Optional[torch.Tensor] = None) -> float:
        """g = anchor - local (anchor: the outer weights by default; padding 0); returns the squared L2 norm of g
        (float64 sums of fp32 dot products; not bit-critical: it is reported and checked for finiteness only).

        One pass per parameter: the subtraction and the sum of squares run on each parameter's
        values while they are hot (on the CPU state, while the next parameter is still crossing PCIe)."""
        anchor = self.outer if anchor is None else anchor
        sq = torch.zeros((), dtype=torch.float64, device=g.device)
        step = _GPU_CHUNK if g.is_cuda else _CHUNK
        off = 0
        for values, view, pad in self._fetch(g):
            off = view.storage_offset() - g.storage_offset()
            torch.sub(anchor[off : off + view.numel()], values, out=view)
            pad.zero_()
            for s in range(0, view.numel(), step):
                c = view[s : s + step]
                sq += torch.dot(c, c).double()
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

    def _chunks(self, *bufs: torch.Tensor, load: Optional[torch.Tensor] = None):
        """Chunks of the flat buffers, in order. With `load` (a buffer the chunks produce), each parameter is
        copied from `load` into the model as soon as the chunks covering it are done: on the CPU state of a GPU
        model, the host-to-device copy of one parameter then overlaps the CPU pass over the next."""
        n = bufs[0].numel()
        step = _GPU_CHUNK if bufs[0].is_cuda else _CHUNK
        piped = load is not None and self._piped()
        if piped:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            pieces, nxt = self._pieces(), 0
        for s in range(0, n, step):
            yield tuple(b[s : s + step] for b in bufs)
            if piped:
                with torch.cuda.stream(stream):
                    while nxt < len(pieces) and pieces[nxt][1] + pieces[nxt][3] <= s + step:
                        self._load_piece(pieces[nxt], load)
                        nxt += 1
        if load is None:
            return
        if piped:
            with torch.cuda.stream(stream):
                for piece in pieces[nxt:]:
                    self._load_piece(piece, load)
            torch.cuda.current_stream(stream.device).wait_stream(stream)
            stream.synchronize()  # `load` is rewritten at the next outer step
        else:
            self.scatter(load)

    def _load_piece(self, piece, src: torch.Tensor) -> None:
        """Queues the copy of one pipeline piece from `src` into the model (on the current stream)."""
        t, off, a, b, _ = piece
        if t.is_contiguous():
            t.view(-1)[a:b].copy_(src[off + a : off + b], non_blocking=True)
        else:
            t.copy_(src[off : off + t.numel()].view_as(t), non_blocking=True)

    @torch.no_grad()
    def update(self, g: torch.Tensor, *, load: bool = False, norm: bool = False) -> Optional[float]:
        """The outer step on the fp32 outer weights, from the averaged pseudo-gradient g (same bits on CPU and
        GPU). `load`: also copy the new outer weights into the model (overlapped with the update where it can).
        `norm`: return the squared L2 norm of g (fp32 dot products per chunk, summed in float64), else None."""
        sq = torch.zeros((), dtype=torch.float64, device=g.device) if norm else None
        if self.optimizer is not None:
            if g is not self.grad:
                self.grad.copy_(g)
            self.optimizer.step()
            if load:
                self.scatter(self.outer)
            if norm:
                for (gc,) in self._chunks(g):
                    sq += torch.dot(gc, gc).double()
            return float(sq) if norm else None
        mu, lr = self.mu, self.lr
        step = _GPU_CHUNK if g.is_cuda else _CHUNK
        tmp = torch.empty(min(step, g.numel()), dtype=torch.float32, device=g.device)
        for gc, mc, wc in self._chunks(g, self.momentum, self.outer, load=self.outer if load else None):
            t = tmp[: gc.numel()]
            mc.mul_(mu)
            mc.add_(gc)  # momentum = mu * momentum + g  (two roundings, never one FMA)
            if self.nesterov:
                torch.mul(mc, mu, out=t)
                t.add_(gc)  # update = g + mu * momentum
            else:
                t.copy_(mc)
            t.mul_(lr)
            wc.sub_(t)  # outer -= lr * update
            if norm:
                sq += torch.dot(gc, gc).double()  # while gc is hot
        return float(sq) if norm else None

    @torch.no_grad()
    def lookahead(self, g: torch.Tensor, out: torch.Tensor, *, load: bool = False,
                  scale: Optional[float] = None) -> None:
        """out = the outer weights update(g) would give, without changing the weights or the momentum.
        `load`: also copy `out` into the model. `scale`: use fp32(g * scale) in place of g.

        The same operations in the same order as update(), so lookahead(g) and update(g) agree bit for bit."""
        if self.optimizer is not None:
            raise ValueError("lookahead needs the default outer update (outer_optimizer=None)")
        mu, lr = self.mu, self.lr
        step = _GPU_CHUNK if g.is_cuda else _CHUNK
        tmp = torch.empty(min(step, g.numel()), dtype=torch.float32, device=g.device)
        tmp2 = torch.empty_like(tmp) if self.nesterov else None
        tmp3 = torch.empty_like(tmp) if scale is not None else None
        for gc, mc, wc, oc in self._chunks(g, self.momentum, self.outer, out, load=out if load else None):
            if scale is not None:
                gc = torch.mul(gc, scale, out=tmp3[: gc.numel()])
            m = tmp[: gc.numel()]
            torch.mul(mc, mu, out=m)
            m.add_(gc)  # the momentum update() would store
            if self.nesterov:
                t = tmp2[: gc.numel()]
                torch.mul(m, mu, out=t)
                t.add_(gc)
            else:
                t = m
            t.mul_(lr)
            torch.sub(wc, t, out=oc)

    @torch.no_grad()
    def add_to_model(self, delta: torch.Tensor) -> None:
        """Local weights += delta (a buffer of the layout), one fp32 rounding per value."""
        piped = self._piped()
        for t, off, _ in self._spans():
            d = delta[off : off + t.numel()].view_as(t)
            t.add_(d.to(t.device, non_blocking=piped) if d.device != t.device else d)
        if piped:
            torch.cuda.synchronize(self._gpu_device())  # delta is rewritten at the next outer step

    def load_into_model(self, src: Optional[torch.Tensor] = None) -> None:
        """Local weights := outer weights (or `src`, a buffer of the same layout)."""
        self.scatter(self.outer if src is None else src)

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
        """Outer weights and momentum (or the outer optimizer's state), CPU tensors (copies when on a GPU)."""
        self.ensure_taken()
        sd = {"outer": self.outer.cpu(), "numel": self.numel}
        if self.optimizer is None:
            sd["momentum"] = self.momentum.cpu()
        else:
            sd["outer_optimizer"] = self.optimizer.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); a different layout raises ValueError."""
        if int(sd["numel"]) != self.numel:
            raise ValueError(
                f"the checkpoint's outer state has {sd['numel']} values but this process's shard needs "
                f"{self.numel}: resume with the same model and processes per node"
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
        self.taken = True
