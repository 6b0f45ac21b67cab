"""Nodes that run different numbers of processes: which rings a process takes part in, with which rows.

    shares = Shares.of(cfg, env)          # nodes.procs = "2,1": node 0 runs 2 processes, node 1 one
    shares.rings                           # R = 2 rings, the most processes any node runs
    shares.mine                            # the rings this process takes part in: [g] or, on a 1-process node, all
    shares.view(g)                         # shard(p) -> the rows of parameter p that ring g carries

With every node running P processes, ring g joins local rank g of every node,
and each carries that rank's FSDP2 shard: rows chunk g of P of every
parameter's dim 0 (FSDP2 cuts dim 0 as torch.chunk does: chunks of ceil(d / P)
rows, the last ones shorter or empty).

When nodes run different numbers of processes, there are R rings, R the most
processes any node runs, and ring g carries rows chunk g of R of every
parameter:
- a node of R processes takes part as before: local rank g on ring g, with its
  FSDP2 shard;
- a node of one process holds every parameter whole and takes part in every
  ring, each over the rows that ring carries (dim-0 views of its parameters):
  one DiLoCo per ring (DiLoCoRings below, which the trainer sees as one),
  whose all-reduces run side by side, as the R processes of the other nodes
  run theirs.
So every ring still joins one process of every node, over the same rows: the
bytes each node sends are those of R-process nodes (all rings together), and
the average is bit-identical on every node. Other counts (a node of 2
processes beside one of 4) are refused: its processes' FSDP2 shards would each
take part in two rings, whose agreements over the node's process group could
interleave.

A node of R processes trains R times the tokens of a one-process node per inner
step, so the outer step weighs each node's pseudo-gradient by its tokens
(DiLoCo(weights="tokens", step_weight=processes / the fewest any node runs)),
in steps phases too (docs/heterogeneous.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from prime.parallelize import local_shard

__all__ = ["Shares", "parse_procs", "chunk_rows", "DiLoCoRings", "MemberGroup", "combine_results", "each"]


def parse_procs(text: str, num_nodes: int, field: str = "nodes.procs") -> list:
    """"2,1" -> [2, 1]: the processes of each node, one number per node (or one for every node). Raises ValueError
    naming `field`."""
    try:
        procs = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{field} must be comma-separated process counts, one per node (e.g. '2,1'), got "
                         f"{text!r}") from None
    if len(procs) == 1:
        procs = procs * num_nodes
    if len(procs) != num_nodes:
        raise ValueError(f"{field} gives {len(procs)} process counts for {num_nodes} nodes: give one per node "
                         f"(or one for all), got {text!r}")
    if any(p < 1 for p in procs):
        raise ValueError(f"{field}: every node runs at least one process, got {text!r}")
    rings = max(procs)
    if any(p not in (1, rings) for p in procs):
        raise ValueError(f"{field} = {text!r}: each node runs either the most processes of any node ({rings}) or "
                         f"one (a node of one process takes part in every ring, with the rows each carries)")
    return procs


def chunk_rows(d: int, chunks: int, i: int) -> tuple:
    """Rows [a, b) of chunk i when d rows are cut into `chunks` as torch.chunk (and FSDP2's sharding) cuts them:
    chunks of ceil(d / chunks) rows, the last ones shorter or empty."""
    c = -(-d // chunks) if d else 0
    return min(i * c, d), min((i + 1) * c, d)


@dataclass
class Shares:
    """Which rings this process takes part in (see the module docstring)."""

    procs: list
    """Processes of each node."""
    node_rank: int
    local_rank: int

    @classmethod
    def of(cls, procs_text: str, num_nodes: int, node_rank: int, local_rank: int, local_world: int) -> "Shares":
        """From nodes.procs ("" : every node runs this node's processes); checks this node's launch against it."""
        # (an elastic joiner's node_rank is >= num_nodes; elastic nodes are equal)
        procs = parse_procs(procs_text, num_nodes) if procs_text else [local_world] * max(num_nodes, node_rank + 1)
        if procs[node_rank] != local_world:
            raise ValueError(f"nodes.procs = {procs_text!r} gives node {node_rank} {procs[node_rank]} process(es), "
                             f"but it was launched with {local_world} (torchrun --nproc-per-node)")
        return cls(procs, node_rank, local_rank)

    @property
    def rings(self) -> int:
        """R: rings of the job, the most processes any node runs."""
        return max(self.procs)

    @property
    def uneven(self) -> bool:
        """True when nodes run different numbers of processes."""
        return len(set(self.procs)) > 1

    @property
    def mine(self) -> list:
        """The rings this process takes part in: its local rank's, or every ring on a one-process node of an uneven
        job."""
        if self.procs[self.node_rank] == 1 and self.rings > 1:
            return list(range(self.rings))
        return [self.local_rank]

    @property
    def step_weights(self) -> list:
        """What one inner step of each node counts in a token-weighted average: its processes over the fewest any
        node runs (1 when nodes are equal)."""
        return [p // math.gcd(*self.procs) for p in self.procs]

    @property
    def step_weight(self) -> int:
        """This node's step weight (step_weights)."""
        return self.step_weights[self.node_rank]

    def processes(self, node: int) -> range:
        """Local ranks of node `node`."""
        return range(self.procs[node])

    def view(self, ring: int) -> Callable:
        """shard(p) -> the rows of parameter p that ring `ring` carries, in this process's tensor (a view)."""
        if self.mine == [self.local_rank]:
            return local_shard
        R = self.rings

        def rows(p: torch.Tensor) -> torch.Tensor:
            t = local_shard(p)
            if t.dim() == 0:
                raise ValueError("a 0-dimensional parameter cannot be cut into rows for the rings of nodes that run "
                                 "different numbers of processes")
            a, b = chunk_rows(t.shape[0], R, ring)
            return t[a:b]

        return rows

    def check(self, named: list) -> None:
        """On a node of R processes, checks that each parameter's local shard is the rows the ring expects
        (FSDP2 cuts dim 0 as chunk_rows does); raises ValueError naming the first that is not."""
        if not self.uneven or len(self.mine) > 1:
            return
        R, g = self.rings, self.local_rank
        for name, p in named:
            full = p.shape[0] if p.dim() else 0
            a, b = chunk_rows(full, R, g)
            got = local_shard(p.detach()).shape[0] if p.dim() else 0
            if got != b - a:
                raise ValueError(f"parameter {name}: local rank {g} holds {got} of its {full} rows, but ring {g} "
                                 f"carries rows {a}..{b} (nodes of {self.procs} processes need FSDP2's dim-0 shards)")


class MemberGroup:
    """The rings of a one-process node agree on failures as the processes of a node do (prime.sync.all_local: a
    ring that failed anywhere on the node is retried on every ring of it, so that the node never applies an
    average on one ring that the other nodes retry). The members, threads of one process, call all_min(ok) at the
    same points; each gets the MIN of all (the AND of bools). `background`: the twin the averages behind overlap
    agree through (their threads run beside the members' own, as a node's background all-reduce has a gloo group
    of its own)."""

    def __init__(self, n: int, timeout_s: float, twin: bool = True):
        self.n, self.timeout_s = n, timeout_s
        self._cv = threading.Condition()
        self._flags: list = []
        self._gen, self._result = 0, True
        self._aborted = ""
        self.background = MemberGroup(n, timeout_s, twin=False) if twin else None

    def abort(self, why: str) -> None:
        """A member failed outside the agreement: the others waiting in it (or coming to it) raise at once."""
        with self._cv:
            self._aborted = why
            self._cv.notify_all()
        if self.background is not None:
            self.background.abort(why)

    def all_min(self, ok):
        """The least of the members' values (bools: whether every member's holds; small integers: their MIN)."""
        with self._cv:
            if self._aborted:
                raise RuntimeError(f"another ring of this node failed: {self._aborted}")
            gen = self._gen
            self._flags.append(ok if isinstance(ok, int) else bool(ok))
            if len(self._flags) == self.n:
                self._result, self._flags, self._gen = min(self._flags), [], gen + 1
                self._cv.notify_all()
            elif not self._cv.wait_for(lambda: self._gen != gen or self._aborted, self.timeout_s):
                raise RuntimeError(f"the rings of this node: {len(self._flags)} of {self.n} reached their agreement "
                                   f"within {self.timeout_s:.0f} s (a ring's thread stopped)")
            if self._gen == gen:
                raise RuntimeError(f"another ring of this node failed: {self._aborted}")
            return self._result


def combine_results(results: list):
    """One OuterStepResult from those of the rings a process took part in (the same outer step on each): values
    and bytes add up, times are the longest (the rings ran side by side), norms add in squares."""
    first = results[0]
    if len(results) == 1:
        return first

    def total(name):
        vals = [getattr(r, name) for r in results]
        return None if any(v is None for v in vals) else sum(vals)

    norms = [r.pseudo_grad_norm for r in results]
    norm = math.sqrt(sum(n * n for n in norms))
    errors = [r.compression_error for r in results]
    error = None
    if all(e is not None for e in errors) and norm > 0:
        error = math.sqrt(sum((e * n) ** 2 for e, n in zip(errors, norms))) / norm
    longest = {k: max(getattr(r, k) for r in results) for k in ("allreduce_s", "outer_s", "prepare_s", "update_s",
                                                                  "wait_s")}
    return dataclasses.replace(first, numel=sum(r.numel for r in results), bytes_sent=total("bytes_sent"),
                               bytes_received=total("bytes_received"), pseudo_grad_norm=norm,
                               compression_error=error, attempts=max(r.attempts for r in results), **longest)


def each(pool, call: Callable, items: list, group: "MemberGroup | None" = None) -> list:
    """call(item) for every item at once on `pool`'s threads; the first error is raised once all of them ended.
    `group`: the items' agreement, aborted at the first error so that the others do not wait in it."""
    futures = [pool.submit(call, x) for x in items]
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = next((f for f in done if f.exception() is not None), None)
    if failed is not None and group is not None:
        group.abort(f"{type(failed.exception()).__name__}: {failed.exception()}")
    if failed is not None:  # the first failure, not the others' consequences of it, once all of them ended
        concurrent.futures.wait(futures)
        raise failed.exception()
    return [f.result() for f in futures]  # (none failed: FIRST_EXCEPTION waited for all of them)


def _of_first(name: str) -> property:
    """DiLoCoRings' view of an attribute its members share (their settings, and their schedule, which steps
    together): the first member's."""
    return property(lambda self: getattr(self.members[0], name), doc=f"The first member's {name}.")


class DiLoCoRings:
    """The DiLoCo of a process on several rings (a one-process node beside nodes of R): one DiLoCo per ring, each
    over the rows that ring carries, stepped together; their all-reduces run side by side on threads. The trainer,
    the nodes component, checkpoints and the memory plan see one DiLoCo."""

    def __init__(self, members: list, rings: list, group: "MemberGroup | None" = None):
        self.members, self.rings = list(members), list(rings)
        """One DiLoCo per ring of `rings`."""
        self.group = group
        """The members' agreement on failures (aborted when one fails outside it)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.members), thread_name_prefix="prime-rings")
        self.work_bytes = sum(m.work_bytes for m in self.members)
        """The members' work buffers: their averages are in flight together."""

    # -- what the members share: their settings, and their schedule, which steps together --------

    distributed = _of_first("distributed")
    inner_steps = _of_first("inner_steps")
    codec = _of_first("codec")
    block_size = _of_first("block_size")
    keep = _of_first("keep")
    error_feedback = _of_first("error_feedback")
    weights = _of_first("weights")
    placement = _of_first("placement")
    schedule = _of_first("schedule")
    overlap_scheme = _of_first("overlap_scheme")
    overlap_steps = _of_first("overlap_steps")
    measure_compression_error = _of_first("measure_compression_error")
    states = _of_first("states")
    overlap = _of_first("overlap")
    inner_step = _of_first("inner_step")
    outer_step = _of_first("outer_step")
    since_sync = _of_first("since_sync")
    steps_to_sync = _of_first("steps_to_sync")
    result = _of_first("result")
    resume_changes = _of_first("resume_changes")

    @property
    def fragments(self) -> list:
        return [f for m in self.members for f in m.fragments]

    def settings(self) -> dict:
        return self.members[0].settings()

    def owes_outer_step(self) -> bool:
        return any(m.owes_outer_step() for m in self.members)

    # -- the steps: every member, side by side ----------------------------------------------

    def _each(self, call: Callable) -> list:
        """call(member) on every member at once (their rings agree on failures: MemberGroup)."""
        return each(self._pool, call, self.members, self.group)

    def step(self, nominal_steps: int = 1):
        if self.steps_to_sync > 1 or not self.distributed:  # nothing due: no threads
            return combine_results([m.step(nominal_steps) for m in self.members])
        return combine_results(self._each(lambda m: m.step(nominal_steps)))

    def advance(self):
        return combine_results(self._each(lambda m: m.advance()))

    def sync(self):
        return combine_results(self._each(lambda m: m.sync()))

    def finish(self) -> list:
        return [combine_results(list(rs)) for rs in zip(*self._each(lambda m: m.finish()))]

    def reset_outer(self) -> None:
        for m in self.members:
            m.reset_outer()

    # -- consistency and state ------------------------------------------------------------

    def weights_hash(self) -> int:
        """The hash of the first ring's outer weights: what a node of several processes records too (metrics'
        outer_hash comes from its first process, on ring 0), so that the nodes' records compare."""
        return self.members[0].weights_hash()

    def outer_weights(self) -> torch.Tensor:
        return torch.cat([m.outer_weights() for m in self.members])

    def check_replicas(self) -> None:
        self._each(lambda m: m.check_replicas())  # each ring compares with its processes, all at once

    def state_dict(self) -> dict:
        return {"rings": {g: m.state_dict() for g, m in zip(self.rings, self.members)}}

    def load_state_dict(self, sd: dict) -> None:
        if "rings" not in sd or sorted(sd["rings"]) != sorted(self.rings):
            have = sorted(sd["rings"]) if "rings" in sd else "one ring's"
            raise ValueError(f"the checkpoint holds the outer state of rings {have}; this process takes part in "
                             f"rings {self.rings} (nodes.procs must be the same as when it was saved)")
        for g, m in zip(self.rings, self.members):
            m.load_state_dict(sd["rings"][g])

    def close(self, wait: bool = True) -> None:
        error = None
        for m in self.members:
            try:
                m.close(wait=wait)
            except Exception as e:  # close every member; the first error wins
                error = error or e
        self._pool.shutdown(wait=wait)
        if error is not None:
            raise error

