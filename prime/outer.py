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
momentum are flat fp32 buffers in CPU memory (pinned when the parameters are
on a GPU), each parameter starting a new codec block, so that no int8 block of
the all-reduce spans two parameters.

The default update is Nesterov SGD written as separate elementwise multiplies
and adds, each one IEEE fp32 rounding with no fused multiply-add, so every
node computes the same bits from the same average on any CPU:

    momentum = mu * momentum + g
    update   = g + mu * momentum     (Nesterov) or momentum
    outer   -= lr * update

torch.optim.SGD gives the same values up to the last bit, but it may fuse
`a + mu * b` where the CPU has FMA, and nodes with different CPUs would then
drift apart. An `optimizer_factory` replaces this update by any torch
optimizer over the outer parameters (one fp32 CPU tensor per model parameter,
viewing the flat buffer); its bits then depend on torch's CPU kernels, which
are identical only on the same torch build and CPU instruction set.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from prime.parallelize import local_shard

__all__ = ["OuterState", "OuterOptimizerFactory"]

# Chunk of the elementwise passes over the flat buffers: large enough to amortize
# the per-op overhead, small enough that the temporary stays in L2/L3 cache.
_CHUNK = 1 << 20

OuterOptimizerFactory = Callable[[list], torch.optim.Optimizer]
"""outer_optimizer(params) -> a torch optimizer over `params`: one fp32 CPU nn.Parameter per model
parameter (the local shard's shape), in model.parameters() order. Its .grad is the averaged pseudo-gradient."""


class OuterState:
    """Outer weights, momentum (or a torch outer optimizer) and the pseudo-gradient buffer, flat fp32 on the CPU.

    params:            the model's parameters (FSDP2 DTensors or plain tensors)
    block_size:        codec block size; every parameter starts a new block
    outer_lr, outer_momentum, nesterov: the default outer update
    optimizer_factory: replaces the default update (see OuterOptimizerFactory)
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
        pin = self.on_gpu and torch.cuda.is_available()
        self.outer = torch.zeros(off, dtype=torch.float32, pin_memory=pin)
        """The outer weights (padding: 0)."""
        self.grad = torch.zeros(off, dtype=torch.float32, pin_memory=pin)
        """Work buffer of the pseudo-gradient; after the all-reduce, its average."""
        self.taken = False
        """True once the outer weights hold something (take(), load_state_dict() or a download)."""
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.momentum: Optional[torch.Tensor] = None
        if optimizer_factory is None:
            self.momentum = torch.zeros(off, dtype=torch.float32)
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

    def _locals(self) -> list:
        # Looked up on every copy: a parameter whose tensor was replaced (load_state_dict(assign=True)) is followed.
        return [local_shard(p.detach()) for p in self.params]

    def _views(self, flat: torch.Tensor):
        for t, off in zip(self._locals(), self.offsets):
            yield t, flat[off : off + t.numel()]

    @torch.no_grad()
    def gather(self, dst: torch.Tensor) -> None:
        """Copies the local parameter values into the flat buffer `dst` (device -> host); padding := 0."""
        ends = self.offsets[1:] + [self.numel]
        for (t, view), off, end in zip(self._views(dst), self.offsets, ends):
            view.copy_(t.reshape(-1), non_blocking=True)
            dst[off + t.numel() : end].zero_()  # a buffer a failed all-reduce scrambled gets clean padding too
        if self.on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies must land before the CPU reads dst

    @torch.no_grad()
    def scatter(self, src: torch.Tensor) -> None:
        """Copies the flat buffer `src` into the local parameters (host -> device)."""
        for t, view in self._views(src):
            t.copy_(view.view_as(t), non_blocking=True)
        if self.on_gpu:
            torch.cuda.synchronize()  # src is pinned host memory that the next outer step rewrites

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
    def pseudo_gradient(self, g: torch.Tensor) -> None:
        """g = outer - local (padding stays 0 - 0 = 0)."""
        self.gather(g)
        torch.sub(self.outer, g, out=g)

    @torch.no_grad()
    def inspect(self, g: torch.Tensor, compression_error: bool) -> tuple[float, Optional[float]]:
        """L2 norm of g and, when asked, the relative L2 error of its int8 quantize/dequantize round trip."""
        from prime import ops

        sq = err = 0.0
        bs = self.block_size
        chunk = (_CHUNK // bs) * bs or bs  # whole blocks, as the ring cuts them
        for s in range(0, g.numel(), chunk):
            c = g[s : s + chunk]
            sq += float(torch.dot(c, c).double() if c.numel() else 0.0)
            if compression_error and math.isfinite(sq):
                q, scales = ops.quantize_int8(c, bs, check_finite=False)
                d = ops.dequantize_int8(q, scales, bs)
                d.sub_(c)
                err += float(torch.dot(d, d))
        norm = math.sqrt(sq)
        if not compression_error:
            return norm, None
        return norm, (math.sqrt(err) / norm if norm > 0 else 0.0)

    @torch.no_grad()
    def update(self, g: torch.Tensor) -> None:
        """The outer step on the CPU fp32 outer weights, from the averaged pseudo-gradient g."""
        if self.optimizer is not None:
            if g is not self.grad:
                self.grad.copy_(g)
            self.optimizer.step()
            return
        mu, lr = self.mu, self.lr
        tmp = torch.empty(min(_CHUNK, g.numel()), dtype=torch.float32)
        for s in range(0, g.numel(), _CHUNK):
            gc, mc, wc = g[s : s + _CHUNK], self.momentum[s : s + _CHUNK], self.outer[s : s + _CHUNK]
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

    def load_into_model(self) -> None:
        """Local weights := outer weights."""
        self.scatter(self.outer)

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
        return int.from_bytes(hashlib.blake2b(self.outer.numpy().data, digest_size=8).digest(), "little")

    def tensors(self) -> list:
        """The flat state a joining node must download (outer weights and momentum)."""
        if self.optimizer is not None:
            raise ValueError("a custom outer_optimizer keeps its state per parameter; elastic joins need the "
                             "default outer update (outer_optimizer=None)")
        return [self.outer, self.momentum]

    def state_dict(self) -> dict:
        """Outer weights and momentum (or the outer optimizer's state), CPU tensors."""
        self.ensure_taken()
        sd = {"outer": self.outer, "numel": self.numel}
        if self.optimizer is None:
            sd["momentum"] = self.momentum
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
