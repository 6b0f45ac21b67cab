"""ElasticNodes: the trainer's nodes component for an elastic job (prime.nodes.Nodes; docs/elastic.md).

The trainer's loop is the same with or without elastic nodes: it hands
`nodes.sync` to DiLoCo and calls `nodes.after_outer(result)` after every outer
step. Everything elastic lives here: the membership and the ElasticSync,
serving the state (initial nodes) or joining (joiners) before the first inner
step, and, when this node (re)joins, moving its data to the assigned slot and
starting its inner optimizer's moments afresh.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch

from prime.codecs import CODECS
from prime.comm import store_keys as keys
from prime.config import Config
from prime.diloco import DiLoCo, OuterStepResult
from prime.elastic.membership import JobFinished, JoinError, Membership, MembershipError
from prime.elastic.node import ElasticSync
from prime.nodes import AfterOuter, final_agreement_result, final_weights_digest, signed_records
from prime.runtime import Environment

__all__ = ["ElasticNodes"]


class ElasticNodes:
    """This node's part in an elastic job: the membership, its ElasticSync, and what a (re)join changes.

    data:     the trainer's TrainData (prime.builders): its position is published at every outer step,
              and it moves to the assigned data slot when this node (re)joins
    metrics:  the trainer's RunMetrics: membership events are printed and recorded there

    The sync's test hooks (stall, hold) run before each inner optimizer step."""

    multi_node = True
    stop_errors = (JoinError, MembershipError)
    finished_errors = (JobFinished,)

    def __init__(self, cfg: Config, env: Environment, optimizer: torch.optim.Optimizer, data, metrics):
        import torch.distributed as dist

        self.cfg, self.env, self.optimizer, self.data, self.metrics = cfg, env, optimizer, data, metrics
        self.diloco: Optional[DiLoCo] = None
        d, e, n = cfg.diloco, cfg.elastic, cfg.nodes

        def store_factory():  # the membership's own store connections, under prime/<run_id>/elastic
            raw = dist.TCPStore(n.store_host, n.store_port, is_master=False, wait_for_workers=False,
                                timeout=timedelta(seconds=d.timeout_s))
            return dist.PrefixStore(f"prime/{n.run_id}/elastic", raw)

        self.membership = Membership(
            store_factory, node_rank=n.node_rank, initial_nodes=n.num_nodes, run_id=n.run_id,
            heartbeat_interval_s=e.heartbeat_interval_s, heartbeat_timeout_s=e.heartbeat_timeout_s,
            barrier_timeout_s=e.barrier_timeout_s,
            # a live member reports within the ring's formation and all-reduce limits
            report_timeout_s=2 * d.timeout_s + e.heartbeat_timeout_s,
            max_attempts=e.max_attempts, min_nodes=e.min_nodes,
            log=metrics.print, record=self._record,
            fresh_store=not e.external_store,  # node 0's first process hosts the store: it made it just now
        )
        from prime.trainer import NothingToDo, TrainingStopped

        try:  # registers: takes the live launch's name (or founds one) and a node id
            self.sync = ElasticSync(
                self.membership, ring_timeout_s=d.timeout_s, streams=d.streams or None,
                max_rate=d.max_rate_mbit * 1e6 / 8 if d.max_rate_mbit else None,
                transfer_max_rate=e.transfer_max_rate_mbit * 1e6 / 8, transfer_timeout_s=e.transfer_timeout_s,
                join_timeout_s=e.join_timeout_s, start_timeout_s=d.timeout_s, total_steps=cfg.train.steps,
                digest=e.digest, slot_state_fn=data.state_dict,
                quant_error=d.compression_error and CODECS[d.codec].lossy,  # the ring measures compression_error
            )
        except JobFinished as err:
            raise NothingToDo(f"elastic: {err}") from err
        except (JoinError, MembershipError) as err:
            raise TrainingStopped(f"elastic: this node could not register: {err}") from err
        optimizer.register_step_pre_hook(lambda *_: self.sync.before_inner_step(self.diloco.inner_step + 1))
        self.records = signed_records(cfg, env.store, self.membership.secret)
        self.resumes = not self.sync.is_joiner  # a joiner downloads the job's state instead

    def _record(self, **fields) -> None:
        self.metrics.record("membership", self.diloco.inner_step if self.diloco is not None else 0, **fields)

    def attach(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    def describe(self) -> Optional[str]:
        d = self.cfg.diloco
        return (f"elastic DiLoCo: node {self.sync.node_id} ({'joiner' if self.sync.is_joiner else 'initial node'}), "
                f"{self.env.num_nodes} initial nodes, outer step every {d.inner_steps} inner steps, codec {d.codec}")

    def start(self) -> Optional[OuterStepResult]:
        """Initial nodes serve their (possibly resumed) state; a joiner joins, which is an outer step.
        Returns None when the job ended before this node got in."""
        d = self.diloco
        if self.sync.is_joiner:
            try:
                return d.sync()
            except JobFinished as e:
                self.metrics.print(f"elastic: {e}; nothing to do")
                return None
        self.sync.start(d.outer_step, d.inner_step)
        if d.owes_outer_step():  # the checkpoint was written after a failed outer step: do it first
            return d.sync()
        return OuterStepResult(False, d.inner_step, d.outer_step)

    def meet(self) -> None:
        """Elastic nodes do not meet after their first inner step: members come and go, and a joiner's phase clock
        takes the job's step when it joins (prime.nodes.Nodes.meet)."""

    def host_processes(self) -> int:
        """Elastic nodes come and go: the memory plan counts this node's processes (memory.host_procs says more)."""
        return self.env.local_world

    def launch_scope(self) -> str:
        """This launch's name for the resume agreement: the one every node of the launch took (its records live
        under it; prime.elastic.launch)."""
        return self.membership.launch

    def nodes_that_do_not_fit(self, fits: bool) -> list:
        """Elastic nodes decide alone: [this node] when one of its processes' plans does not fit."""
        return [] if self.env.local_sum([0.0 if fits else 1.0])[0] == 0 else [self.env.node_rank]

    def after_outer(self, result: OuterStepResult) -> AfterOuter:
        """Reports the membership of the outer step; when this node (re)joined at it, takes the job's position:
        its data slot and that slot's position, and fresh inner optimizer moments. The inner AdamW state is
        per node (each node's moments follow its own gradients), so there is none to copy: a joiner starts
        with empty moments, as the job's nodes did at step 0 (docs/elastic.md)."""
        e = result.details
        if e is None:  # overlap: this outer step's average is in flight, and none was applied at this call
            return AfterOuter(fields=dict(time=time.time()))
        decision = AfterOuter(
            note=f" | nodes {len(result.members)}"
            + (f" | recovery {e.recovery_s:.2f} s" if e.recovery_s is not None else ""),
            fields=dict(nodes=len(result.members), members=result.members, contributors=result.contributors,
                        joined=e.joined, evicted=e.evicted, wait_s=e.wait_s, recovery_s=e.recovery_s,
                        digest=e.digest, digest_step=_digest_step(result), time=time.time()),
        )
        info = e.rejoined
        if info is not None:
            self.data.use_slot(info.slot, info.slot_state)
            self.optimizer.state.clear()
            decision.rejoined_at = info.step
        return decision

    def finish(self, model: torch.nn.Module) -> dict:
        """Compares the hash of this process's final weights with the same local rank of the members of the
        job's last outer step (prime.elastic.node.ElasticSync.final_agreement); raises ReplicaMismatchError
        when any differs. A node that is not a member of that outer step has nothing to compare with."""
        if not self.cfg.diloco.check_replicas:
            return {}
        env, r, launch = self.env, self.records, self.membership.launch
        digest, what = final_weights_digest(model, self.diloco)
        me = self.sync.node_id
        same, differ = self.sync.final_agreement(  # node ids repeat in every launch: the keys carry its name
            lambda d: r.set(keys.final_digest(env.local_rank, me, launch), d),
            lambda i: r.records.get(keys.final_digest(env.local_rank, i, launch)), digest, self.cfg.diloco.timeout_s)
        # Local rank 0 leaves for the node (close()), and another node stops waiting for a node that left: every
        # process of this node has its digest compared before it does.
        self.sync.local.gather(None)
        if same is None:
            return {"weights_digest": digest}
        return final_agreement_result(env, self.metrics.print, me, what, digest, differ, len(same))

    def close(self) -> None:
        """Leaves the job: the others drop this node at once."""
        self.sync.close()

    def release(self) -> None:
        """Node 0 hosts the store (unless it is external): it waits until every node has left."""
        if self.env.node_rank == 0 and not self.cfg.elastic.external_store:
            self.membership.wait_all_gone(self.cfg.diloco.timeout_s)


def _digest_step(result: OuterStepResult) -> int:
    """The outer step whose state the digest is of: the one this call applied (with overlap, the average that
    arrived; a joiner's admitting step), which nodes compare."""
    if result.overlapped:
        return result.applied_outer_step if result.applied_outer_step is not None else result.outer_step - 1
    return result.outer_step
