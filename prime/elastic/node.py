"""ElasticSync: how DiLoCo averages across nodes when peers may die, leave or join at any time.

The outer step is DiLoCo's (prime/diloco.py); this is the prime.sync.Sync that
averages its pseudo-gradient:

1. the node arrives (its pseudo-gradient is ready) and waits for the plan of
   the outer step: the members that arrived, minus the dead (no heartbeat),
   minus those that missed the barrier, plus joiners that hold the previous
   outer step's state (Membership.attempt: one call per attempt);
2. the members build a ring in plan order and average their pseudo-gradients
   (a joiner takes part with zeros: then the ring sums and every node divides
   by the number of contributors, one fp32 division, the same bits everywhere);
3. each member reports how its all-reduce went, and one outcome is decided for
   all: commit when every live member succeeded, else retry with the survivors
   (a new ring, a recomputed pseudo-gradient) - the outer step that a failure
   interrupted is finished by the nodes that are left, nothing is lost but
   the dead node's inner steps since the previous outer step;
4. on commit every member applies the same outer update (DiLoCo) and serves
   the new state to joiners (committed()).

A joiner (or an evicted node) downloads the newest committed state from a
live member (transfer.py) into DiLoCo's outer states (every fragment's: prime.
outer_states.OuterStates) while the others train, says it is ready, and is
admitted at the next outer step, which it takes part in without contributing:
DiLoCo calls rejoin() for it, on its main thread, before its first inner step
(a joiner) or when an average reports Evicted (a prime.sync.LeftBehind; also
from an average running in the background with overlap); prime/elastic/join.py
holds that part. See docs/elastic.md.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch

from prime.elastic.membership import (Attempt, Evicted, JobFinished, JoinError, Membership, MembershipError, Plan,
                                      reduce_op)
from prime import faults
from prime.elastic.join import Joining, JoinInfo, store_errors
from prime.elastic.transfer import StateServer, state_digest
from prime.sync import OuterSyncError, SyncResult, all_local, is_comm_error, node_local_group, work_stats

__all__ = ["ElasticSync", "ElasticReport", "JoinInfo"]


@dataclass
class ElasticReport:
    """What an elastic outer step did beyond OuterStepResult (its `details`)."""

    joined: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    """[id, reason] of the nodes dropped at this outer step."""
    wait_s: float = 0.0
    """From this node's arrival to the plan (waiting for the slowest node, or for the timeout of a dead one)."""
    recovery_s: Optional[float] = None
    """When the outer step lost a node: from the first failure this node saw (or its arrival, if the plan
    already dropped the node) to the commit. None when nothing failed."""
    digest: Optional[str] = None
    """SHA-256 of the outer weights and momentum after the step (elastic digest on)."""
    rejoined: Optional[JoinInfo] = None
    """Set when this node joined at this outer step (a new node, or back after an eviction): the trainer
    must take the new step and data slot."""


class _RingBuilder(threading.Thread):
    """Builds a Ring on a thread, so that the caller can give up on it when a member dies meanwhile."""

    def __init__(self, factory: Callable[[], object]):
        super().__init__(daemon=True, name="prime-elastic-ring")
        self._factory = factory
        self._lock = threading.Lock()
        self.abandoned = False
        self.ring = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            ring = self._factory()
        except BaseException as e:  # reported to the caller
            self.error = e
            return
        with self._lock:
            if self.abandoned:
                ring.close()
            else:
                self.ring = ring

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            if self.ring is not None:
                self.ring.close()
                self.ring = None


class ElasticSync(Joining):
    """The prime.sync.Sync of one single-process node of an elastic job (see the module docstring).

        sync = ElasticSync(membership, ring_timeout_s=60)
        diloco = prime.DiLoCo(model, opt, sync, inner_steps=100)
        if sync.is_joiner:
            result = diloco.sync()        # download the job's state, admitted at the next outer step
        else:
            sync.start(diloco.outer_step, diloco.inner_step)   # serve the state to joiners

    membership:    a Membership (not yet registered); this constructor registers
                   the node and starts its heartbeat and its state server
    ring_timeout_s, streams, max_rate: the rings' settings (prime.comm.Ring)
    transfer_max_rate: bytes/s cap when serving the state to a joiner (0: none)
    transfer_timeout_s: a joiner gives up on a source silent for this long
    join_timeout_s: a joiner gives up when not admitted within this long
    total_steps:   the job's last inner step (a joiner that arrives after it exits)
    digest:        hash the outer state after every outer step (for checks)
    slot_state_fn: returns the data position to publish at each outer step

    An outer step whose result has `details.rejoined` set made this node join
    (again, after an eviction): the caller continues from result.inner_step
    with the data slot in details.rejoined. DiLoCo does not close a sync it
    was given: call close() to leave the job.
    """

    pipelined = False
    background = True
    keeps_input = True
    """A retry after this node's own all-reduce worked (another member failed) needs its input back."""

    def __init__(
        self,
        membership: Membership,
        *,
        ring_timeout_s: float = 300.0,
        streams: Optional[int] = None,
        max_rate: Optional[float] = None,
        transfer_max_rate: float = 0.0,
        transfer_timeout_s: float = 60.0,
        join_timeout_s: float = 600.0,
        start_timeout_s: float = 60.0,
        total_steps: Optional[int] = None,
        digest: bool = False,
        slot_state_fn: Optional[Callable[[], dict]] = None,
        local_group=None,
        listen_when_stale: bool = True,
        quant_error: bool = True,
    ):
        import torch.distributed as dist

        # The node's processes (one torchrun per node): local rank 0 takes part in the membership for the
        # node; every local rank g keeps ring g with local rank g of the other members and serves shard g.
        group = node_local_group(local_group)
        self.local_world = dist.get_world_size(group) if group is not None else 1
        self.local_rank = dist.get_rank(group) if group is not None else 0
        self.group = group if self.local_world > 1 else None
        self.agree_group = self.group
        self._src = dist.get_global_rank(group, 0) if self.group is not None else 0
        self.membership = membership
        self.ring_timeout_s, self.streams, self.max_rate = ring_timeout_s, streams, max_rate
        self.transfer_timeout_s, self.join_timeout_s = transfer_timeout_s, join_timeout_s
        self.total_steps, self.digest, self.slot_state_fn = total_steps, digest, slot_state_fn
        self.listen_when_stale = listen_when_stale
        self.quant_error = quant_error
        self._sources: list = []
        self.ring = None
        self._link_history: dict = {}  # what the rings so far measured of the links (Ring.link_history)
        self._state = None  # the OuterStates of every fragment, from bind()
        self.agree_group = None  # agree() on the main thread; self.group may become the background's own
        self._settings: dict = {}
        self.codec, self.block_size, self.inner_steps = "int8", 64, 1  # from bind()
        self._ring_members: Optional[list] = None
        self._ring_k: Optional[int] = None  # the outer step last committed through self.ring
        self._committed: Optional[Plan] = None
        self._pending: Optional[tuple] = None  # (plan, outcome, contributed) between average() and committed()
        self._joining: Optional[dict] = None  # the join that average() admitted, completed in committed()
        if self.local_rank == 0:
            membership.register(start_timeout_s)
        who = self._share((membership.node_id, membership.genesis, membership.secret))
        if self.local_rank > 0:
            membership.attach(*who, local_rank=self.local_rank)
        self.node_id = membership.node_id
        from prime.comm.rendezvous import resolve_addresses

        bind, advertise = resolve_addresses(membership.store, None, None)
        self.server = StateServer(membership.secret, membership.run_id, self.node_id, bind_addr=bind,
                                  advertise_addr=advertise, max_rate=transfer_max_rate, timeout_s=transfer_timeout_s,
                                  log=lambda m: membership.log(m, event="serve"))
        membership.publish_address(self.server.address)
        self.slot = self.node_id if membership.genesis else -1

    # -- who we are ----------------------------------------------------------------

    @property
    def is_joiner(self) -> bool:
        """True when this node must join before training (it was not one of the initial nodes)."""
        return not self.membership.genesis

    @property
    def must_join(self) -> bool:
        """True until a joiner was admitted: DiLoCo then calls rejoin() before anything else."""
        return self._committed is None and self.is_joiner

    @property
    def world_size(self) -> int:
        """Nodes in the newest outer step this node committed (1 before the first)."""
        return len(self._committed.members) if self._committed is not None else 1

    @property
    def reports_quant_error(self) -> bool:
        """True when the rings measure their own quantization error (quant_error)."""
        return self.quant_error

    def _last_outer_at(self) -> Optional[int]:
        """The inner step of the job's last scheduled outer step (None: open-ended). Once the job committed it,
        there is no outer step left to admit a joiner at: the nodes only finish their inner steps (and, with
        fragments, the final syncs of the fragments)."""
        if self.total_steps is None:
            return None
        return self._state.schedule.last_step(self.total_steps)

    def _publish_state(self, outer_step: int, inner_step: int) -> None:
        self.server.publish(outer_step, self._state.published(), {"inner_step": inner_step, "settings": self._settings})

    def bind(self, states, settings: dict) -> None:
        """Called by DiLoCo: the outer states to serve and to download into (prime.outer_states.OuterStates),
        and the settings a joiner must share."""
        states.tensors()  # refuses an outer state a joiner could not download (a custom outer optimizer)
        self._state = states
        self._settings = {k: settings[k] for k in ("inner_steps", "outer_lr", "outer_momentum", "nesterov", "codec",
                                                   "block_size", "shapes", "numel")}
        if settings.get("fragments", 1) > 1:  # the layout of the state and the order of the outer steps
            self._settings["fragments"] = settings["fragments"]
        self.codec, self.block_size, self.inner_steps = settings["codec"], settings["block_size"], settings["inner_steps"]

    def use_from_background(self) -> None:
        """Overlap: average() runs on a background thread while the main thread trains and agrees on
        finiteness in the node's group; the average's own agreements (local rank 0's decisions, the node's
        combined result) then go through a gloo group of their own, so that the two threads' collectives
        never interleave on one group. Every process of the node calls this at the same point."""
        if self.group is None:
            return
        import torch.distributed as dist

        if self.group is not dist.group.WORLD:
            raise ValueError("overlap on an elastic node of several processes needs the node's group to be the "
                             "default group (one torchrun per node), so that a group of its own can be made for the "
                             "background average")
        self.group = dist.new_group(backend="gloo")
    def start(self, outer_step: int, inner_step: int) -> None:
        """Initial nodes: serve the starting state (call after a checkpoint was loaded, with DiLoCo's counters).
        Joiners: nothing (DiLoCo joins them at their first sync(): must_join)."""
        if self.membership.genesis:
            self._state.ensure_taken()
            self._committed = self.membership.genesis_plan(outer_step, inner_step)
            self._publish_state(outer_step, inner_step)

    def agree(self, ok: bool) -> bool:
        """True when `ok` holds on every process of this node."""
        return all_local(self.agree_group, ok)

    # -- the node's processes agree (local rank 0 decides for the node) ------------------------

    @property
    def is_leader(self) -> bool:
        """True on the process that takes part in the membership for its node (local rank 0)."""
        return self.local_rank == 0

    def _share(self, obj):
        """Local rank 0's `obj`, on every process of the node (a small gloo broadcast; a no-op alone)."""
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def _gather(self, obj) -> list:
        """`obj` of every process of the node, in local-rank order."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.local_world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _lead(self, fn: Callable[[], object], k: int, g: Optional[torch.Tensor] = None):
        """Runs fn() on local rank 0 and returns its value (or raises its exception) on every process of
        the node. Meanwhile the other processes run the all-reduce of every plan local rank 0 hands them
        (("plan", plan) from _node_allreduce), on their own ring."""
        if self.group is None:
            return fn()
        if self.is_leader:
            try:
                v = fn()
            except BaseException as e:
                self._share(("raise", _portable(e, k)))
                raise
            self._share(("ok", v))
            return v
        while True:
            kind, v = self._share(None)
            if kind == "plan":
                t0 = time.monotonic()
                res = self._allreduce_plan(k, v, g)
                self._combine(res)
                self._own = (res, t0, time.monotonic() - t0)
            elif kind == "raise":
                raise v
            else:
                return v

    def _combine(self, res: tuple) -> tuple:
        """The node's result of one attempt from each process's own (ok, error, blame, stats): it worked
        only when every local rank's ring did."""
        if self.group is None:
            return res
        every = self._gather(tuple(res[:3]))
        bad = [(g, e, b) for g, (ok, e, b) in enumerate(every) if not ok]
        if not bad:
            return res
        blame = next((b for _, _, b in bad if b != -1), -1)
        return False, "; ".join(f"local rank {g}: {e}" for g, e, _ in bad), blame, res[3]

    def _node_allreduce(self, k: int, plan: Plan, g: torch.Tensor):
        """Local rank 0's all-reduce of an attempt: hands the plan to the node's other processes, runs its
        own ring, and reports the node's combined result to the membership."""
        self._share(("plan", plan))
        t0 = time.monotonic()
        res = self._allreduce_plan(k, plan, g)
        self._own = (res, t0, time.monotonic() - t0)
        return self._combine(res)

    def _attempt(self, k: int, attempt: int, *, prev: Plan, prev_outcome, step: int, since: float,
                 plan: Optional[Plan], g: torch.Tensor, listen: bool = False) -> Attempt:
        """One attempt of outer step k on every process of the node (Membership.attempt on local rank 0).
        ok, error and stats are this process's own ring's: a process whose all-reduce worked restores its
        input before a retry, whatever the node's other rings did."""
        m = self.membership
        self._own = None
        t0 = time.monotonic()
        a = self._lead(lambda: m.attempt(k, attempt, prev=prev, prev_outcome=prev_outcome, step=step, since=since,
                                         plan=plan, allreduce=lambda p: self._node_allreduce(k, p, g),
                                         listen=listen), k, g)
        if self._own is None:  # assert: the plan names this node (else Evicted was raised)
            raise MembershipError(f"internal: outer step {k}: no all-reduce ran for the plan")
        (ok, err, _, stats), planned_at, ar_s = self._own
        return Attempt(plan=a.plan, outcome=a.outcome, ok=bool(ok), error=str(err), stats=stats or {},
                       planned_at=planned_at, wait_s=planned_at - t0, allreduce_s=ar_s)

    def verify(self, fingerprint: tuple, *, outer_step: int) -> None:
        """Nothing: a joiner checks the job's settings when it downloads, and the digests show divergence."""

    # -- fault points on the inner steps ------------------------------------------------

    def before_inner_step(self, step: int) -> None:
        """Fault point train.before_step (prime.faults: stall, hold, kill) before inner step `step`; the
        heartbeat and the state server keep running meanwhile."""
        faults.hit("train.before_step", step, log=lambda msg: self.membership.log(msg, event="fault", at=step))

    # -- the outer step ------------------------------------------------------------------

    @torch.no_grad()
    def average(self, g: torch.Tensor, *, outer_step: int, inner_step: int,
                recompute: Callable[[torch.Tensor], None]) -> SyncResult:
        """Averages with whoever is alive. Raises Evicted (a prime.sync.LeftBehind) when this node is not part
        of the outer step (too slow, or cut off): DiLoCo then calls rejoin() on its main thread."""
        k = outer_step
        if self._committed is None:
            if not self.is_joiner:
                raise RuntimeError("call start() (initial nodes) before training")
            raise Evicted("new node")  # DiLoCo joins a joiner before its first average (must_join)
        arrived = time.monotonic()
        try:
            with store_errors(k):
                return self._boundary(k, g, inner_step, since=arrived, recompute=recompute)
        except Evicted as e:
            self.membership.log(f"evicted at outer step {k}: {e.reason}; joining again", event="evicted", k=k,
                                reason=e.reason)
            raise

    def rejoin(self, reason: str, *, outer_step: int) -> SyncResult:
        """Brings this node (a joiner, or one evicted) into the job on the caller's thread: downloads the
        job's state into every fragment's outer state, takes part in the admitting outer step without
        contributing, applies it and loads the model (OuterStates.admit). The result has joined=True."""
        return self._join(reason, outer_step)

    def _boundary(self, k: int, g: torch.Tensor, inner_step: int, *, since: float,
                  recompute: Optional[Callable[[torch.Tensor], None]] = None,
                  first_plan: Optional[Plan] = None, listen: bool = False) -> SyncResult:
        """Attempts outer step k until an outcome commits; g then holds the average. Raises Evicted."""
        m = self.membership
        me = self.node_id
        plan = first_plan
        prev, outcome = self._committed, None
        attempt = plan.attempt if plan is not None else 0
        first_failure: Optional[float] = None
        stats, ar_s, wait_s = {}, 0.0, 0.0
        lost: list = []
        while True:
            a = self._attempt(k, attempt, prev=prev, prev_outcome=outcome, step=inner_step,
                              since=since if attempt == 0 else time.monotonic(), plan=plan, g=g, listen=listen)
            plan, outcome, ok, err, st = a.plan, a.outcome, a.ok, a.error, a.stats
            wait_s, ar_s = wait_s + a.wait_s, ar_s + a.allreduce_s
            contributes = me in plan.contributors
            if plan.evicted:
                lost += plan.evicted
                if first_failure is None:
                    first_failure = since if attempt == 0 else a.planned_at
            if not ok and first_failure is None:
                first_failure = a.planned_at + a.allreduce_s
            if outcome.commit:
                if me not in outcome.members:
                    raise Evicted(f"outer step {k} committed without this node's result ({err or 'it was late'})")
                if outcome.missing:  # died after its data went through: the average has it, the node is out
                    lost += outcome.missing
                    m.log(f"outer step {k} committed by nodes {outcome.members}; " + "; ".join(
                        f"node {i} evicted: {w} (its pseudo-gradient is in the average)" for i, w in outcome.missing),
                        event="commit_without", k=k, members=outcome.members, missing=outcome.missing)
                stats = st
                if self.ring is not None:
                    self._ring_k = k
                break
            self._drop_ring()
            if first_failure is None:
                first_failure = time.monotonic()
            lost += outcome.missing
            m.log(f"outer step {k} attempt {plan.attempt} failed ("
                  + "; ".join([f"node {i}: {e}" for i, e in outcome.failed.items()]
                              + [f"node {i}: {w}" for i, w in outcome.missing]) + ")",
                  event="attempt_failed", k=k, attempt=plan.attempt, failed=outcome.failed, missing=outcome.missing)
            if outcome.give_up:
                raise OuterSyncError(outcome.give_up)
            if me not in outcome.members:
                raise Evicted(f"left out of the retry of outer step {k}")
            if contributes and ok and recompute is not None:
                recompute(g)  # our all-reduce had worked: restore our own input
            prev, plan, attempt = plan, None, plan.attempt + 1
        _, divisor = reduce_op(plan)
        if divisor != 1:
            g.div_(divisor)  # the sum over the contributors -> their average
        self._pending = (plan, outcome, contributes)
        return SyncResult(
            members=list(outcome.members), contributors=len(plan.contributors), attempts=plan.attempt + 1,
            allreduce_s=ar_s, stats=stats, contributed=contributes, outer_step=k, inner_step=plan.step,
            details=ElasticReport(joined=list(plan.joined), evicted=[list(x) for x in lost], wait_s=wait_s,
                                  recovery_s=None if first_failure is None else time.monotonic() - first_failure),
        )

    def applying(self, result: SyncResult) -> None:
        """The outer update follows: stop serving the state it overwrites (sessions still reading go on from a
        copy). With overlap this comes a while after the average: until then the state before it is served."""
        self.server.retract()
        self._state.changed(result.outer_step)

    def committed(self, result: SyncResult) -> None:
        """After the outer update: serve the new state, publish the commit and the data position, tidy the store."""
        m = self.membership
        plan, outcome, contributed = self._pending
        self._pending = None
        k = result.outer_step
        self._committed = Plan(k=k, attempt=plan.attempt, members=list(outcome.members),
                               contributors=list(outcome.members),
                               slots={str(i): plan.slot_of(i) for i in outcome.members}, step=plan.step)
        self.slot = plan.slot_of(self.node_id)
        self._publish_state(k, plan.step)
        slot_state = self.slot_state_fn() if contributed and self.slot_state_fn is not None else None
        if self.group is not None:  # one data position per local rank, published by local rank 0
            every = self._gather(slot_state)
            slot_state = {"local": every} if contributed and self.slot_state_fn is not None else None
        if self.is_leader:
            m.commit(plan, outcome, slot_state)
        else:
            m.tidy(k)
        report: ElasticReport = result.details
        if self.digest:
            report.digest = state_digest(self._state.tensors())
        if self._joining is not None:
            report.rejoined = self._joined(result)

    def _log_plan(self, plan: Plan) -> None:
        if plan.attempt == 0 and not plan.joined and not plan.evicted:
            return  # the same members as before: nothing to say
        parts = []
        if plan.joined:
            parts.append(f"joined: {plan.joined}")
        for i, why in plan.evicted:
            parts.append(f"node {i} evicted: {why}")
        self.membership.log(
            f"outer step {plan.k} attempt {plan.attempt}: nodes {plan.members} ({'; '.join(parts) or 'retry'}), "
            f"decided by node {plan.by} at {_wall(plan.time)}",
            event="plan", k=plan.k, attempt=plan.attempt, members=plan.members, joined=plan.joined,
            evicted=plan.evicted, by=plan.by, decided_at=plan.time)

    # -- one all-reduce attempt --------------------------------------------------------

    def _allreduce_plan(self, k: int, plan: Plan, g: torch.Tensor):
        """The all-reduce of one attempt (Membership.attempt calls it once the plan is known)."""
        self._log_plan(plan)
        if self.node_id not in plan.contributors:
            g.zero_()  # a joiner receives the average without adding to it
        return self._allreduce_once(k, plan, g, reduce_op(plan)[0])

    def _make_ring(self, k: int, attempt: int, members: list):
        from prime.comm import Ring

        rank = members.index(self.node_id)
        store, job_id = self.membership.ring_store(k, attempt, rank)
        kwargs = {"timeout": timedelta(seconds=self.ring_timeout_s), "secret": self.membership.secret,
                  "job_id": job_id, "quant_error": self.quant_error}
        if self.streams:
            kwargs["streams"] = self.streams
        if self.max_rate:
            kwargs["max_rate"] = self.max_rate
        # What the earlier rings measured of the links: the new members' order is planned with it.
        kwargs["link_history"] = self._link_history
        return Ring(store, rank, len(members), **kwargs)

    def _dead_member(self, members: list) -> Optional[int]:
        return next((i for i in members if self.membership.gone(i)), None)

    def _allreduce_once(self, k: int, plan: Plan, g: torch.Tensor, op: str):
        """One attempt: (ok, error message, blamed node or -1, stats). Gives up early when a member dies."""
        members = plan.members
        if len(members) == 1:
            self._drop_ring()
            return True, "", -1, {}
        # The ring of outer step k-1 serves again only when every member holds it: the same members
        # committed k-1 through it, and nobody joins now (a joiner, or a node back from an eviction,
        # has none). Otherwise a fresh ring under a fresh name.
        reuse = (self.ring is not None and self._ring_members == members and self._ring_k == k - 1
                 and plan.attempt == 0 and not plan.joined)
        if not reuse:
            self._drop_ring()
            builder = _RingBuilder(lambda: self._make_ring(k, plan.attempt, members))
            builder.start()
            while builder.is_alive():
                dead = self._dead_member(members)
                if dead is not None:
                    builder.abandon()
                    return False, f"node {dead} died while the ring was forming", dead, {}
                builder.join(timeout=0.02)
            if builder.error is not None:
                e = builder.error
                if not is_comm_error(e):
                    raise e
                return False, str(e), _blame(e, members, self.node_id), {}
            self.ring, self._ring_members = builder.ring, list(members)
        ring = self.ring
        self._ring_k = None  # set again once this outer step commits through it
        try:
            work = ring.all_reduce(g, op=op, codec=self.codec, block_size=self.block_size)
            faults.hit("allreduce.inside", k, log=self.membership.log)
            while not work.is_completed():
                dead = self._dead_member(members)
                if dead is not None:
                    self._drop_ring()  # the others see "closed" at once; everyone reports and retries
                    return False, f"node {dead} died during the all-reduce", dead, {}
                time.sleep(0.005)
            work.wait()
            return True, "", -1, work_stats(work)
        except Exception as e:
            if not is_comm_error(e):
                raise
            self._drop_ring()
            return False, str(e), _blame(e, members, self.node_id), {}

    def _drop_ring(self) -> None:
        if self.ring is not None:
            self._link_history = getattr(self.ring, "link_history", dict)()  # for the next ring's order
            try:
                self.ring.close()
            except Exception:  # already broken; closing is best effort
                pass
        self.ring, self._ring_members, self._ring_k = None, None, None

    # -- the end of the run -------------------------------------------------------------

    def final_agreement(self, publish: Callable[[str], None], read: Callable[[int], Optional[str]], digest: str,
                        timeout_s: float) -> tuple[list, list]:
        """Compares this node's final weights digest with the other members of the last committed outer step.

        publish(digest) writes this node's (signed) record; read(node id) returns a
        member's digest or None. Waits for every member of the last commit that is still
        alive (a member that died, or left without a digest, is not waited for) up to
        timeout_s. Returns (ids holding the same digest, this node included; ids that
        differ), or (None, []) when this node is not a member of the job's newest committed outer step
        (evicted, and the job ended before it got back in): nothing to compare with. Call before close():
        a node that has left is no longer waited for."""
        latest = self.membership.latest_committed()
        if self._committed is None or (latest is not None and int(latest["k"]) > self._committed.k):
            self.membership.log("not a member of the job's last outer step: no final weights to compare",
                                event="final")
            return None, []
        publish(digest)
        members = list(self._committed.members)
        same, differ = [self.node_id], []
        waiting = [i for i in members if i != self.node_id]
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                got = read(i)
                if got is not None:
                    (same if got == digest else differ).append(i)
                    waiting.remove(i)
                elif self.membership.gone(i):
                    waiting.remove(i)  # died (or left without a digest) after the last commit
            if waiting:
                time.sleep(0.05)
        if waiting:
            self.membership.log(f"final weights: no digest from node(s) {waiting} within {timeout_s:g} s",
                                event="final", missing=waiting)
        return sorted(same), sorted(differ)

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the job cleanly (the others drop this node at once), stops the state server and the ring.

        The leave is announced before the state server closes, so that joiners
        stop choosing this node as a source before its port goes away."""
        try:
            self._drop_ring()
        finally:
            try:
                self.membership.leave()
            finally:
                self.server.close()


def _portable(e: BaseException, k: int) -> BaseException:
    """An exception of local rank 0 as the node's other processes raise it (they must stop, or join, alike)."""
    import torch.distributed as dist

    if isinstance(e, (Evicted, JobFinished, JoinError, OuterSyncError)):
        return e
    if isinstance(e, dist.DistError):
        return MembershipError(f"outer step {k}: the job's store is unreachable from local rank 0 ({e})")
    return MembershipError(f"outer step {k}: local rank 0 of this node failed: {type(e).__name__}: {e}")


def _blame(e: BaseException, members: list, me: int) -> int:
    """The node a ring error points at, as a node id (-1: none).

    A failure this rank saw itself (lost connection, timeout, corrupt frame,
    failed handshake) names the neighbour involved. A failure relayed from
    another rank ("peer_failed") names only the rank that noticed first, which
    is usually not the culprit: no blame."""
    if getattr(e, "kind", "") == "peer_failed":
        return -1
    r = getattr(e, "peer", -1)
    if isinstance(r, int) and 0 <= r < len(members) and members[r] != me:
        return members[r]
    return -1


def _wall(t: float) -> str:
    from prime.elastic.membership import wall

    return wall(t)
