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

ElasticSync holds its parts: LocalRanks (local_ranks.py: local rank 0 decides
for the node's processes), ElasticRings (rings.py: the ring of an attempt),
OuterStepAttempts (attempts.py: steps 1-3) and the StateServer (transfer.py);
final.py compares the final weights at the end of the run.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from prime import faults
from prime.elastic.agreement import UNCHECKED
from prime.elastic.attempts import ElasticReport, OuterStepAttempts
from prime.elastic.final import final_agreement
from prime.elastic.join import Joining, JoinInfo, store_errors
from prime.elastic.local_ranks import LocalRanks
from prime.elastic.membership import Evicted, Membership, Plan
from prime.elastic.rings import ElasticRings
from prime.elastic.transfer import StateServer, joiner_min_rate, state_digest
from prime.sync import OuterSyncError, SyncResult, all_local, dropped_on_device

__all__ = ["ElasticSync", "ElasticReport", "JoinInfo"]


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
    transfer_timeout_s: a joiner gives up on a source silent for this long, or late with a frame by this long
                   plus its size at 64 KiB/s (prime/elastic/transfer.py)
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
    weighs = True
    """average(trained=) carries every member's count on the attempt's own ring (time phases' token weights)."""
    sparse = True
    """The topk codec: each committed attempt's dropped part goes to this node's residual (take_dropped)."""

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
        self.local = LocalRanks(local_group)  # the node's processes: local rank 0 decides for the node
        self.local_world, self.local_rank = self.local.world, self.local.rank
        self.membership = membership
        self.transfer_timeout_s, self.join_timeout_s = transfer_timeout_s, join_timeout_s
        self.transfer_min_rate = joiner_min_rate(transfer_max_rate)  # the job's servers' cap: every node's
        self.total_steps, self.digest, self.slot_state_fn = total_steps, digest, slot_state_fn
        self.listen_when_stale = listen_when_stale
        self.quant_error = quant_error
        self._sources: list = []
        self._state = None  # the OuterStates of every fragment, from bind()
        self._dropped: dict = {}  # topk: buffer address -> what this node's owner selections dropped (take_dropped)
        self.agree_group = self.local.group  # agree() on the main thread: the node's group, kept when the background
        # average gets a group of its own (use_from_background)
        self._settings: dict = {}
        self.codec, self.block_size, self.inner_steps = "int8", 64, 1  # from bind()
        self._committed: Optional[Plan] = None
        self._check_start = False  # an initial node's first outer step sends its fingerprints (verify()), or UNCHECKED
        self._pending: Optional[tuple] = None  # (plan, outcome, contributed) between average() and committed()
        self._joining = None  # the join that average() admitted (join.py), completed in committed()
        def register() -> tuple:
            membership.register(start_timeout_s)
            return membership.node_id, membership.genesis, membership.secret, membership.launch

        # local rank 0 registers for the node; its error (no launch answered, the job ended) is every process's
        who = self.local.lead(register, None, lambda _: None)
        if self.local_rank > 0:
            membership.attach(*who, local_rank=self.local_rank)
        self.node_id = membership.node_id
        self.rings = ElasticRings(membership, timeout_s=ring_timeout_s, streams=streams, max_rate=max_rate,
                                  quant_error=quant_error)
        self.attempts = OuterStepAttempts(membership, self.local, self.rings)
        from prime.comm.rendezvous import resolve_addresses

        bind, advertise = resolve_addresses(membership.store, None, None)
        self.server = StateServer(membership.secret, membership.job, self.node_id, bind_addr=bind,
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

    @property
    def is_leader(self) -> bool:
        """True on the process that takes part in the membership for its node (local rank 0)."""
        return self.local.is_leader

    @property
    def group(self):
        """The gloo group of the node's processes for the average's own agreements (None: a single process)."""
        return self.local.group

    @property
    def ring(self):
        """This process's current ring (None between attempts that could not keep one)."""
        return self.rings.ring

    def _last_outer_at(self) -> Optional[int]:
        """The inner step of the job's last scheduled outer step (None: open-ended). Once the job committed it,
        there is no outer step left to admit a joiner at: the nodes only finish their inner steps (and, with
        fragments, the final syncs of the fragments)."""
        if self.total_steps is None:
            return None
        return self._state.schedule.last_step(self.total_steps)

    def _publish_state(self, outer_step: int, inner_step: int) -> None:
        self.server.publish(outer_step, self._state.published(), {"inner_step": inner_step, "settings": self._settings})

    # -- set-up by DiLoCo ------------------------------------------------------------

    def bind(self, states, settings: dict) -> None:
        """Called by DiLoCo: the outer states to serve and to download into (prime.outer_states.OuterStates),
        and the settings a joiner must share."""
        states.tensors()  # refuses an outer state a joiner could not download (a custom outer optimizer)
        self._state = states
        self._settings = {k: settings[k] for k in ("inner_steps", "outer_lr", "outer_momentum", "nesterov", "codec",
                                                   "block_size", "shapes", "numel")}
        for name in ("keep", "keep_average", "feedback_decay"):  # topk's counts; a residual's decay other than 1
            if settings.get(name) is not None:
                self._settings[name] = settings[name]
        if settings.get("fragments", 1) > 1:  # the layout of the state and the order of the outer steps
            self._settings["fragments"] = settings["fragments"]
        if settings.get("dense_outer_steps"):  # a sparse codec's dense start: which outer steps send int8
            self._settings["dense_outer_steps"] = settings["dense_outer_steps"]
        self.codec, self.block_size, self.inner_steps = settings["codec"], settings["block_size"], settings["inner_steps"]
        self.rings.codec, self.rings.block_size, self.rings.keep = self.codec, self.block_size, settings.get("keep")
        self.rings.keep_average = settings.get("keep_average")
        self.rings.dense = states.schedule.dense
        if settings.get("weights", "equal") != "equal":  # token weights: every member sends its count
            self._settings["weights"] = settings["weights"]
            self.attempts.weighs = True

    def weigh(self, trained: int, *, outer_step: int) -> list:
        raise OuterSyncError(f"outer step {outer_step}: internal: elastic averages are not pipelined; their counts "
                             "come with average(trained=)")

    def take_dropped(self, buf: torch.Tensor) -> Optional[torch.Tensor]:
        """topk: what this node's selections as an owner dropped in the committed attempt of buf's average (in
        the units of the contributions: it goes into this node's residual, to be sent in a later round)."""
        return self._dropped.pop(buf.data_ptr(), None)

    def use_from_background(self) -> None:
        """Overlap: average() runs on a background thread while the main thread trains and agrees on
        finiteness in the node's group; the average's own agreements (local rank 0's decisions, the node's
        combined result) then go through a gloo group of their own, so that the two threads' collectives
        never interleave on one group. Every process of the node calls this at the same point."""
        self.local.use_own_group()

    def start(self, outer_step: int, inner_step: int) -> None:
        """Initial nodes: serve the starting state (call after a checkpoint was loaded, with DiLoCo's counters).
        Joiners: nothing (DiLoCo joins them at their first sync(): must_join)."""
        if self.membership.genesis:
            self._state.ensure_taken()
            self._committed = self.membership.genesis_plan(outer_step, inner_step)
            self._publish_state(outer_step, inner_step)
            self._check_start = True

    def agree(self, ok: bool) -> bool:
        """True when `ok` holds on every process of this node."""
        return all_local(self.agree_group, ok)

    def verify(self, fingerprint: tuple, *, outer_step: int) -> None:
        """An initial node, before its first outer step since the start (DiLoCo's check_replicas): the
        fingerprints of the node's processes (weights hash, settings hash, numel) go with the node's arrival
        at that outer step, and every member of its plan compares them (prime.elastic.agreement): all raise
        ReplicaMismatchError, before the all-reduce, when any two initial nodes differ. Nothing later, and
        nothing on a joiner: it downloads the job's state, and checks the job's settings then."""
        if not self._check_start:
            return
        self._check_start = False
        every = self.local.gather([int(x) for x in fingerprint], group=self.agree_group)
        if self.local.is_leader:
            self.membership.start_fingerprint = (outer_step, every)

    # -- fault points on the inner steps ------------------------------------------------

    def before_inner_step(self, step: int) -> None:
        """Fault point train.before_step (prime.faults: stall, hold, kill) before inner step `step`; the
        heartbeat and the state server keep running meanwhile."""
        faults.hit("train.before_step", step, log=lambda msg: self.membership.log(msg, event="fault", at=step))

    # -- the outer step ------------------------------------------------------------------

    @torch.no_grad()
    def average(self, g: torch.Tensor, *, outer_step: int, inner_step: int,
                recompute: Callable[[torch.Tensor], None], trained: Optional[int] = None) -> SyncResult:
        """Averages with whoever is alive. Raises Evicted (a prime.sync.LeftBehind) when this node is not part
        of the outer step (too slow, or cut off): DiLoCo then calls rejoin() on its main thread."""
        k = outer_step
        if self._committed is None:
            if not self.is_joiner:
                raise RuntimeError("call start() (initial nodes) before training")
            raise Evicted("new node")  # DiLoCo joins a joiner before its first average (must_join)
        arrived = time.monotonic()
        if self._check_start:  # an initial node's first average without verify(): its check_replicas is false
            self._check_start = False
            if self.local.is_leader:
                self.membership.start_fingerprint = (k, UNCHECKED)  # the others' check names it
        try:
            with store_errors(k):
                return self._boundary(k, g, inner_step, since=arrived, recompute=recompute, trained=trained)
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
                  first_plan: Optional[Plan] = None, listen: bool = False,
                  trained: Optional[int] = None) -> SyncResult:
        """Attempts outer step k until an outcome commits (OuterStepAttempts.run); g then holds the average,
        committed() completes it. With token weights every member sends its count (trained; 0: a node that
        joins) on the attempt's ring before the average. Raises Evicted."""
        result, self._pending = self.attempts.run(k, g, inner_step, prev=self._committed, since=since,
                                                  recompute=recompute, first_plan=first_plan, listen=listen,
                                                  trained=(trained or 0) if self.attempts.weighs else None)
        dropped, self.rings.dropped = self.rings.dropped, None  # (topk) the committed attempt's
        if dropped is not None:
            self._dropped[g.data_ptr()] = dropped_on_device(dropped, g)
        return result

    def applying(self, result: SyncResult) -> None:
        """The outer update follows: stop serving the state it overwrites (sessions still reading go on from a
        copy). With overlap this comes a while after the average: until then the state before it is served."""
        self.server.retract()
        self._state.changed(result.outer_step)

    def committed(self, result: SyncResult) -> None:
        """After the outer update: serve the new state, publish the commit and the data position, tidy the store."""
        k = result.outer_step
        plan, outcome, contributed = self._take_commit(k)
        self._publish_state(k, plan.step)
        slot_state = self.slot_state_fn() if contributed and self.slot_state_fn is not None else None
        if self.group is not None:  # one data position per local rank, published by local rank 0
            every = self.local.gather(slot_state)
            slot_state = {"local": every} if contributed and self.slot_state_fn is not None else None
        self._record_commit(k, plan, outcome, slot_state)
        report: ElasticReport = result.details
        if self.digest:
            report.digest = state_digest(self._state.tensors())
        if self._joining is not None:
            report.rejoined = self._joined(result)

    def _take_commit(self, k: int) -> tuple:
        """(plan, outcome, contributed) of the average of outer step k, now this node's newest commit."""
        plan, outcome, contributed = self._pending
        self._pending = None
        self._committed = Plan(k=k, attempt=plan.attempt, members=list(outcome.members),
                               contributors=list(outcome.members),
                               slots={str(i): plan.slot_of(i) for i in outcome.members}, step=plan.step)
        self.slot = plan.slot_of(self.node_id)
        return plan, outcome, contributed

    def _record_commit(self, k: int, plan: Plan, outcome, slot_state: Optional[dict]) -> None:
        """Local rank 0 records the commit in the store (for joiners); every process tidies its keys."""
        if self.is_leader:
            self.membership.commit(plan, outcome, slot_state)
        else:
            self.membership.tidy(k)

    # -- the end of the run -------------------------------------------------------------

    def final_agreement(self, publish: Callable[[str], None], read: Callable[[int], Optional[str]], digest: str,
                        timeout_s: float) -> tuple[list, list]:
        """Compares this node's final weights digest with the other members of the last committed outer step
        (prime.elastic.final.final_agreement): (ids holding the same digest, ids that differ), or (None, [])
        when this node is not a member of the job's newest committed outer step. Call before close()."""
        return final_agreement(self.membership, self._committed, publish, read, digest, timeout_s)

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the job cleanly (the others drop this node at once), stops the state server and the ring.

        The leave is announced before the state server closes, so that joiners
        stop choosing this node as a source before its port goes away."""
        try:
            self.rings.drop()
            last = self._last_outer_at() if self._state is not None else None
            if self.local.is_leader and self._committed is not None and last is not None \
                    and self._committed.step >= last:
                self.membership.mark_ended(self._committed.step)  # a joiner that starts now has nothing to do
        finally:
            try:
                self.membership.leave()
            finally:
                self.server.close()
