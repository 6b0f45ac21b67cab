"""The processes of one elastic node (one torchrun per node): local rank 0 decides for the node.

Local rank 0 takes part in the membership for the node; every local rank g
keeps ring g with local rank g of the other members and serves shard g of the
state. The other processes learn local rank 0's decisions (and its errors)
through small gloo collectives of the node's group; alone, every call here is a
no-op.
"""

from __future__ import annotations

from typing import Callable, Optional

from prime.elastic.membership import Evicted, JobFinished, JoinError, MembershipError
from prime.sync import OuterSyncError, ReplicaMismatchError, node_local_group

__all__ = ["LocalRanks"]


class LocalRanks:
    """The processes of this node: who leads, and how the others follow (see the module docstring).

    local_group: the node's process group (prime.sync.node_local_group picks the default)."""

    def __init__(self, local_group=None):
        import torch.distributed as dist

        group = node_local_group(local_group)
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.group = group if self.world > 1 else None
        self._src = dist.get_global_rank(group, 0) if self.group is not None else 0

    @property
    def is_leader(self) -> bool:
        """True on the process that takes part in the membership for its node (local rank 0)."""
        return self.rank == 0

    def use_own_group(self) -> None:
        """Moves these collectives to a gloo group of their own (for an average on a background thread, while
        the main thread uses the node's group). Every process of the node calls it at the same point."""
        if self.group is None:
            return
        import torch.distributed as dist

        if self.group is not dist.group.WORLD:
            raise ValueError("overlap on an elastic node of several processes needs the node's group to be the "
                             "default group (one torchrun per node), so that a group of its own can be made for the "
                             "background average")
        self.group = dist.new_group(backend="gloo")

    def share(self, obj):
        """Local rank 0's `obj`, on every process of the node (a small gloo broadcast; a no-op alone)."""
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def gather(self, obj, group=None) -> list:
        """`obj` of every process of the node, in local-rank order (over `group`, another of the node's groups,
        when given)."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=group if group is not None else self.group)
        return out

    def lead(self, fn: Callable[[], object], k: Optional[int], follow: Callable[[object], None]):
        """Runs fn() on local rank 0 and returns its value (or raises its exception) on every process of
        the node. Meanwhile the other processes call follow(plan) for every plan local rank 0 hands them
        (hand_out(), from within fn). k: the outer step, for the other processes' errors (None: the
        registration)."""
        if self.group is None:
            return fn()
        if self.is_leader:
            try:
                v = fn()
            except BaseException as e:
                self.share(("raise", _portable(e, k)))
                raise
            self.share(("ok", v))
            return v
        while True:
            kind, v = self.share(None)
            if kind == "plan":
                follow(v)
            elif kind == "raise":
                raise v
            else:
                return v

    def hand_out(self, plan) -> None:
        """Local rank 0, within lead(): the other processes run follow(plan) now."""
        self.share(("plan", plan))

    def combine(self, res: tuple) -> tuple:
        """The node's result of one attempt from each process's own (ok, error, blame, stats): it worked
        only when every local rank's ring did."""
        if self.group is None:
            return res
        every = self.gather(tuple(res[:3]))
        bad = [(g, e, b) for g, (ok, e, b) in enumerate(every) if not ok]
        if not bad:
            return res
        blame = next((b for _, _, b in bad if b != -1), -1)
        return False, "; ".join(f"local rank {g}: {e}" for g, e, _ in bad), blame, res[3]


def _portable(e: BaseException, k: Optional[int]) -> BaseException:
    """An exception of local rank 0 as the node's other processes raise it (they must stop, or join, alike).
    k: the outer step it was at (None: the node's registration)."""
    import torch.distributed as dist

    if isinstance(e, (Evicted, JobFinished, JoinError, OuterSyncError, ReplicaMismatchError)):
        return e
    where = f"outer step {k}" if k is not None else "registration"
    if isinstance(e, dist.DistError):
        return MembershipError(f"{where}: the job's store is unreachable from local rank 0 ({e})")
    return MembershipError(f"{where}: local rank 0 of this node failed: {type(e).__name__}: {e}")
