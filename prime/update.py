"""The outer update: how the outer weights move by the averaged pseudo-gradient.

The default update (NesterovUpdate) is Nesterov SGD written as separate
elementwise multiplies and adds, each one IEEE fp32 rounding with no fused
multiply-add, so every node computes the same bits from the same average on
any CPU:

    momentum = mu * momentum + g
    update   = g + mu * momentum     (Nesterov) or momentum
    outer   -= lr * update

torch.optim.SGD gives the same values up to the last bit, but it may fuse
`a + mu * b` where the CPU has FMA, and nodes with different CPUs would then
drift apart. The same sequence of single-rounding torch kernels runs on the
GPU (one kernel per operation, so nothing can be contracted into an FMA across
them), and the CPU, the GPU and the streamed state give the same bits
(tests/test_outer_gpu.py): nodes stay identical whichever device each keeps its
outer state on. Its lookahead (overlap) runs the same operations in the same
order without storing the momentum, so a lookahead and the update it foresees
agree bit for bit.

An `optimizer_factory` replaces this update by any torch optimizer over the
outer parameters (TorchOptimizerUpdate: one fp32 tensor per model parameter,
viewing the flat buffer, on the home device, where it also runs); its bits then
depend on torch's kernels, which are identical only on the same torch build and
instruction set.

Both know nothing of where the buffers live: prime.outer.OuterState walks its
flat buffers in pieces and runs NesterovUpdate on each piece, or hands the
whole average to TorchOptimizerUpdate.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["NesterovUpdate", "PlainAverage", "TorchOptimizerUpdate", "OuterOptimizerFactory"]


OuterOptimizerFactory = Callable[[list], torch.optim.Optimizer]
"""outer_optimizer(params) -> a torch optimizer over `params`: one fp32 nn.Parameter per model
parameter (the local shard's shape, on the outer state's home device), in model.parameters() order. Its .grad
is the averaged pseudo-gradient."""


class NesterovUpdate:
    """The default outer update on pieces of the flat buffers, each operation rounded once (module docstring).

    lr, mu:    the outer learning rate and momentum
    nesterov:  Nesterov's update (else plain momentum SGD)
    """

    def __init__(self, lr: float, mu: float, nesterov: bool):
        self.lr, self.mu, self.nesterov = lr, mu, nesterov

    def step(self, m: torch.Tensor, w: torch.Tensor, g: torch.Tensor, t: torch.Tensor) -> None:
        """Momentum m and outer weights w (pieces, changed in place) from the average g; t: a temporary of g's
        length."""
        mu = self.mu
        m.mul_(mu)
        m.add_(g)  # momentum = mu * momentum + g  (two roundings, never one FMA)
        if self.nesterov:
            torch.mul(m, mu, out=t)
            t.add_(g)  # update = g + mu * momentum
        else:
            t.copy_(m)
        t.mul_(self.lr)
        w.sub_(t)  # outer -= lr * update

    def lookahead(self, out, m, w, g, scale, tmp, tmp2, tmp3) -> None:
        """out = the outer weights step() would make of (w, m) from g (fp32(g * scale) with a scale), leaving w
        and m as they are: step()'s operations in its order, each rounded once (tmp, tmp2, tmp3: temporaries at
        least as long as g)."""
        mu, lr = self.mu, self.lr
        if scale is not None:
            g = torch.mul(g, scale, out=tmp3[: g.numel()])
        mm = tmp[: g.numel()]
        torch.mul(m, mu, out=mm)
        mm.add_(g)  # the momentum step() would store
        if self.nesterov:
            t = tmp2[: g.numel()]
            torch.mul(mm, mu, out=t)
            t.add_(g)
        else:
            t = mm
        t.mul_(lr)
        torch.sub(w, t, out=out)

    def settings(self) -> dict:
        """What every node must agree on for this update to mean the same everywhere."""
        return {"outer_lr": self.lr, "outer_momentum": self.mu, "nesterov": self.nesterov}


class PlainAverage:
    """The outer weights move by the average itself (outer -= g: outer lr 1, no momentum), the momentum left as
    it is: the update of a sparse codec's dense start (prime.fragments.FragmentSchedule.dense), whatever the
    configured update is. One rounding per value, the same on every device; the same call shapes as
    NesterovUpdate."""

    lr, mu, nesterov = 1.0, 0.0, False

    def step(self, m: torch.Tensor, w: torch.Tensor, g: torch.Tensor, t: torch.Tensor) -> None:
        w.sub_(g)

    def lookahead(self, out, m, w, g, scale, tmp, tmp2, tmp3) -> None:
        if scale is not None:
            g = torch.mul(g, scale, out=tmp3[: g.numel()])
        torch.sub(w, g, out=out)

    def settings(self) -> dict:
        return {"dense_update": "plain average"}


class TorchOptimizerUpdate:
    """A torch optimizer as the outer update, over one fp32 nn.Parameter per model parameter that views the flat
    outer weights (its in-place updates land in them), each with a .grad that views one flat buffer of the
    layout (the average is copied there).

    factory:                  the OuterOptimizerFactory
    outer:                    the flat outer weights (on the home device)
    offsets, sizes, shapes:   where each parameter sits in the flat layout
    device:                   the home device (where the optimizer runs)
    """

    def __init__(self, factory: OuterOptimizerFactory, outer: torch.Tensor, offsets: list, sizes: list,
                 shapes: list, device: torch.device):
        self.grad = torch.zeros(outer.numel(), dtype=torch.float32, device=device)
        self.params = [nn.Parameter(outer[o : o + n].view(s)) for o, n, s in zip(offsets, sizes, shapes)]
        for p, o, n, s in zip(self.params, offsets, sizes, shapes):
            p.grad = self.grad[o : o + n].view(s)
        self.optimizer = factory(self.params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}")

    def step(self, g: torch.Tensor) -> None:
        """The outer weights take one step of the optimizer from the average g (a buffer of the whole layout)."""
        self.grad.copy_(g)
        self.optimizer.step()

    def settings(self) -> dict:
        """What every node must agree on for this update to mean the same everywhere."""
        return {"outer_optimizer": type(self.optimizer).__name__,
                "outer_defaults": repr(sorted(self.optimizer.defaults.items()))}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)

