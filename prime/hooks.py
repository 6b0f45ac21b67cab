"""The inner optimizer's step hooks that drive a DiLoCo (prime.diloco).

The pre-hook runs before every inner step: it lets DiLoCo take the outer weights
from the model at the first one (weights loaded after construction are kept),
and, outside `with diloco:`, checks that DiLoCo.step() was not forgotten. Inside
`with diloco:` a post-hook counts every inner step for DiLoCo. A step with lr 0
in every group, as torch.distributed.checkpoint takes to initialize optimizer
state (torch's _init_optim_state), changes nothing and is not an inner step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["InnerStepHooks"]


class InnerStepHooks:
    """before():  runs before every inner step (DiLoCo: take the outer weights if not yet taken)
    count():      runs after every inner step once attach()ed (DiLoCo: the step's bookkeeping and outer step)"""

    def __init__(self, optimizer: Optional[torch.optim.Optimizer], *, before: Callable[[], None],
                 count: Callable[[], None]):
        self.optimizer, self._before, self._count = optimizer, before, count
        self.unstepped = 0
        """Inner steps since the last count (outside `with diloco:`, DiLoCo.step() resets it)."""
        self._post = None
        self._pre = optimizer.register_step_pre_hook(self._before_step) if optimizer is not None else None

    @property
    def attached(self) -> bool:
        """True inside `with diloco:`, where the optimizer's post-hook counts the inner steps."""
        return self._post is not None

    def attach(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("`with DiLoCo(...)` needs the inner optimizer, whose step hook drives the outer "
                               "steps; without one, call step() after every inner step")
        if self._post is None:
            self._post = self.optimizer.register_step_post_hook(self._after_step)

    def remove(self) -> None:
        for h in (self._pre, self._post):
            if h is not None:
                h.remove()
        self._pre = self._post = None

    def _is_inner_step(self) -> bool:
        return any(float(g.get("lr", 1.0)) != 0.0 for g in self.optimizer.param_groups)

    def _after_step(self, *_) -> None:
        if self._is_inner_step():
            self._count()

    def _before_step(self, *_) -> None:
        if not self._is_inner_step():
            return
        self._before()
        if self._post is None and self.unstepped >= 1:
            raise RuntimeError(
                "the inner optimizer stepped twice without DiLoCo.step() in between, so no outer step would ever "
                "run: call diloco.step() after every inner_optimizer.step(), or use `with diloco:` to let the "
                "optimizer's step hook do it")
        self.unstepped += 1
