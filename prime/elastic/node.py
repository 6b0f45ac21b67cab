"""ElasticDiLoCo: DiLoCo's outer step for a node whose peers may die, leave or join at any time.

The inner steps are DiLoCo's (prime/diloco.py); what changes is the outer step:

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
4. on commit every member applies the same outer update and serves the new
   state to joiners.

A joiner (or an evicted node) downloads the newest committed state from a
live member (transfer.py) while the others train, says it is ready, and is
admitted at the next outer step (join()). See docs/elastic.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch import nn

from prime.diloco import DiLoCo, OuterStepResult, OuterSyncError, work_stats
from prime.elastic.membership import Evicted, JoinError, Membership, MembershipError, Plan, reduce_op
from prime.elastic.transfer import FAULT_ENV, StateServer, TransferError, fault_specs, fetch_state, state_digest

__all__ = ["ElasticDiLoCo", "ElasticStepResult", "JoinInfo"]

# The longest a "hold" test hook (FAULT_ENV) waits for its file.
HOLD_MAX_S = 300.0


@dataclass
class JoinInfo:
    """What a node got when it was admitted (first join or a rejoin after an eviction)."""

    outer_step: int
    """The outer step at which it was admitted (its state is the committed state after it)."""
    step: int
    """Inner step count of the job at that outer step: continue from here."""
    slot: int
    """Data slot assigned to this node."""
    slot_state: Optional[dict]
    """Data position the slot's previous owner published (None: a new slot)."""
    download_s: float
    """Time of the state download (all attempts)."""
    download_bytes: int
    join_s: float
    """From the start of the join to the commit of the admitting outer step."""
    sources: list = field(default_factory=list)
    """[node id, first byte, end byte] of every stretch downloaded."""
    downloads: int = 1
    """Downloads needed (more than 1 when the job moved on before this node was admitted)."""
    reason: str = ""
    """Why the node (re)joined: "new node" or the eviction reason."""


@dataclass
class ElasticStepResult(OuterStepResult):
    """OuterStepResult plus the membership of the outer step."""

    members: list = field(default_factory=list)
    """Nodes that committed this outer step (ring order)."""
    contributors: int = 0
    """Nodes whose pseudo-gradient is in the average."""
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
    """Set when this node had been evicted and joined again: the trainer must take the new step and slot."""


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


class ElasticDiLoCo(DiLoCo):
    """DiLoCo for one single-process node of an elastic job (see the module docstring).

    membership:    a Membership (not yet registered); this constructor registers
                   the node and starts its heartbeat and its state server
    ring_timeout_s, streams, max_rate: the rings' settings (prime.comm.Ring)
    transfer_max_rate: bytes/s cap when serving the state to a joiner (0: none)
    transfer_timeout_s: a joiner gives up on a source silent for this long
    join_timeout_s: a joiner gives up when not admitted within this long
    total_steps:   the job's last inner step (a joiner that arrives after it exits)
    digest:        hash the outer state after every outer step (for checks)
    slot_state_fn: returns the data position to publish at each outer step
    Other arguments as DiLoCo.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Optional[torch.optim.Optimizer],
        membership: Membership,
        *,
        inner_steps: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        codec: str = "int8",
        block_size: int = 256,
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
        measure_compression_error: bool = True,
    ):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("elastic training runs one process per node; this node runs "
                             f"{dist.get_world_size()} (use --nproc-per-node 1, or turn elastic off)")
        super().__init__(model, inner_optimizer, None, inner_steps=inner_steps, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, nesterov=nesterov, codec=codec, block_size=block_size,
                         retries=0, measure_compression_error=measure_compression_error, check_replicas=False)
        self.distributed = True  # the ring comes and goes with the membership
        self._build_buffers()
        self.membership = membership
        self.ring_timeout_s, self.streams, self.max_rate = ring_timeout_s, streams, max_rate
        self.transfer_timeout_s, self.join_timeout_s = transfer_timeout_s, join_timeout_s
        self.total_steps, self.digest, self.slot_state_fn = total_steps, digest, slot_state_fn
        self._ring_members: Optional[list] = None
        self._ring_k: Optional[int] = None  # the outer step last committed through self.ring
        self._committed: Optional[Plan] = None
        self._faults = fault_specs()
        self.node_id = membership.register(start_timeout_s)
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
        """True when this node must join() before training (it was not one of the initial nodes)."""
        return not self.membership.genesis

    def _last_outer_at(self) -> Optional[int]:
        """The inner step of the job's last outer step (None: open-ended). Once the job committed it,
        there is no outer step left to admit a joiner at: the nodes only finish their inner steps."""
        if self.total_steps is None:
            return None
        return self.total_steps // self.inner_steps * self.inner_steps

    def _settings(self) -> dict:
        return {"inner_steps": self.inner_steps, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "nesterov": self.nesterov, "codec": self.codec, "block_size": self.block_size,
                "shapes": [list(t.shape) for t in self._locals], "numel": self.numel}

    def _publish_state(self) -> None:
        self.server.publish(self.outer_step, [self._outer, self._momentum],
                            {"inner_step": self.inner_step, "settings": self._settings()})

    def start(self) -> None:
        """Initial nodes: serve the starting state (call after a checkpoint was loaded). Joiners: nothing."""
        if self.membership.genesis:
            self._committed = self.membership.genesis_plan(self.outer_step, self.inner_step)
            self._publish_state()

    # -- the outer step ------------------------------------------------------------------

    def step(self) -> OuterStepResult:
        """Call after every inner optimizer step; runs an outer step every inner_steps steps (see sync())."""
        for spec in self._faults:  # test hooks (FAULT_ENV)
            if spec.startswith("stall:"):  # "stall:<step>:<seconds>": a slow node
                at, secs = spec.split(":")[1:]
                if self.inner_step + 1 == int(at):
                    time.sleep(float(secs))
            elif spec.startswith("hold:"):  # "hold:<step>:<path>": wait at that step until the file exists
                _, at, path = spec.split(":", 2)
                if self.inner_step + 1 == int(at):
                    self._hold(int(at), path)
        return super().step()

    def _hold(self, at: int, path: str) -> None:
        """Test hook: pauses at inner step `at` (heartbeat and state server running) until `path` exists.

        Lets a test keep the job at a known outer step while a joiner starts,
        whatever the speed of the machine. Gives up after HOLD_MAX_S, so that a
        node left behind by a crashed test does not wait forever."""
        self.membership.log(f"test hook {FAULT_ENV}: holding at inner step {at} until {path} exists",
                            event="hold", at=at)
        deadline = time.monotonic() + HOLD_MAX_S
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.membership.log(f"test hook {FAULT_ENV}: released at inner step {at}", event="hold", at=at)

    @torch.no_grad()
    def sync(self) -> ElasticStepResult:
        """Runs an outer step with whoever is alive. Returns the result; result.rejoined is set when this
        node had been evicted (too slow, or cut off) and joined again with the job's newer state."""
        t0 = time.perf_counter()
        if self._committed is None:
            raise RuntimeError("call start() (initial nodes) or join() (joiners) before training")
        g = self._grad
        self._pseudo_gradient(g)
        norm, comp_err = self._inspect(g)
        if not (norm == norm and norm != float("inf")):
            raise OuterSyncError(f"outer step {self.outer_step + 1}: the pseudo-gradient is not finite: inner "
                                 "training diverged; lower optim.lr or resume from an earlier checkpoint")
        k = self.outer_step + 1
        arrived = time.monotonic()
        try:
            with _store_errors(k):
                r = self._boundary(k, g, contributor=True, since=arrived)
        except Evicted as e:
            self.membership.log(f"evicted at outer step {k}: {e.reason}; joining again", event="evicted", k=k,
                                reason=e.reason)
            info = self.join(reason=e.reason)
            return ElasticStepResult(did_sync=True, inner_step=self.inner_step, outer_step=self.outer_step,
                                     outer_s=time.perf_counter() - t0, rejoined=info,
                                     members=list(self._committed.members))
        r.outer_s = time.perf_counter() - t0
        r.pseudo_grad_norm, r.compression_error = norm, comp_err
        return r

    def _boundary(self, k: int, g: torch.Tensor, *, contributor: bool, since: float,
                  first_plan: Optional[Plan] = None) -> ElasticStepResult:
        """Attempts outer step k until an outcome commits; applies the update. Raises Evicted."""
        m = self.membership
        me = self.node_id
        plan = first_plan
        prev, outcome = self._committed, None
        attempt = plan.attempt if plan is not None else 0
        first_failure: Optional[float] = None
        stats, ar_s, wait_s = {}, 0.0, 0.0
        lost: list = []
        while True:
            a = m.attempt(k, attempt, prev=prev, prev_outcome=outcome, step=self.inner_step,
                          since=since if attempt == 0 else time.monotonic(), plan=plan,
                          allreduce=lambda p: self._allreduce_plan(k, p, g))
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
            if contributes and ok:
                self._pseudo_gradient(g)  # our all-reduce had worked: restore our own input
            prev, plan, attempt = plan, None, plan.attempt + 1
        _, divisor = reduce_op(plan)
        if divisor != 1:
            g.div_(divisor)  # the sum over the contributors -> their average
        was_joiner = not contributes
        self.server.retract()
        self._outer_update(g)
        self._scatter(self._outer)
        self.outer_step, self.inner_step, self.since_sync = k, plan.step, 0
        self._committed = Plan(k=k, attempt=plan.attempt, members=list(outcome.members),
                               contributors=list(outcome.members),
                               slots={str(i): plan.slot_of(i) for i in outcome.members}, step=plan.step)
        self.slot = plan.slot_of(me)
        self._publish_state()
        m.commit(plan, outcome, self.slot_state_fn() if not was_joiner and self.slot_state_fn is not None else None)
        return ElasticStepResult(
            did_sync=True, inner_step=self.inner_step, outer_step=self.outer_step, numel=self.numel,
            allreduce_s=ar_s, bytes_sent=stats.pop("bytes_sent", None),
            bytes_received=stats.pop("bytes_received", None), attempts=plan.attempt + 1, ring_stats=stats,
            members=list(outcome.members), contributors=len(plan.contributors), joined=list(plan.joined),
            evicted=[list(x) for x in lost], wait_s=wait_s,
            recovery_s=None if first_failure is None else time.monotonic() - first_failure,
            digest=state_digest([self._outer, self._momentum]) if self.digest else None,
        )

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
                  "job_id": job_id}
        if self.streams:
            kwargs["streams"] = self.streams
        if self.max_rate:
            kwargs["max_rate"] = self.max_rate
        return Ring(store, rank, len(members), **kwargs)

    def _dead_member(self, members: list) -> Optional[int]:
        return next((i for i in members if self.membership.gone(i)), None)

    def _allreduce_once(self, k: int, plan: Plan, g: torch.Tensor, op: str):
        """One attempt: (ok, error message, blamed node or -1, stats). Gives up early when a member dies."""
        from prime.diloco import _is_comm_error

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
                if not _is_comm_error(e):
                    raise e
                return False, str(e), _blame(e, members, self.node_id), {}
            self.ring, self._ring_members = builder.ring, list(members)
        ring = self.ring
        self._ring_k = None  # set again once this outer step commits through it
        try:
            work = ring.all_reduce(g, op=op, codec=self.codec, block_size=self.block_size)
            if any(f == f"allreduce:{k}" or (f.startswith("allreduce-after:") and os.path.exists(f.split(":", 1)[1]))
                   for f in self._faults):
                time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)  # test hook (FAULT_ENV): die inside the all-reduce
            while not work.is_completed():
                dead = self._dead_member(members)
                if dead is not None:
                    self._drop_ring()  # the others see "closed" at once; everyone reports and retries
                    return False, f"node {dead} died during the all-reduce", dead, {}
                time.sleep(0.005)
            work.wait()
            return True, "", -1, work_stats(work)
        except Exception as e:
            if not _is_comm_error(e):
                raise
            self._drop_ring()
            return False, str(e), _blame(e, members, self.node_id), {}

    def _drop_ring(self) -> None:
        if self.ring is not None:
            try:
                self.ring.close()
            except Exception:  # already broken; closing is best effort
                pass
        self.ring, self._ring_members, self._ring_k = None, None, None

    # -- joining -------------------------------------------------------------------------

    def join(self, reason: str = "new node") -> JoinInfo:
        """Downloads the newest committed state from a live member and takes part in the next outer step.

        Blocks until admitted (the others keep training meanwhile). Returns what
        the trainer needs to continue: the job's inner step, the data slot and
        its position. Raises JobFinished when the job ended first, JoinError
        when it cannot join (no peer, wrong secret, another configuration),
        MembershipError when the store is unreachable."""
        with _store_errors(self.outer_step + 1):
            return self._join(reason)

    def _join(self, reason: str) -> JoinInfo:
        m = self.membership
        t0 = time.monotonic()
        downloads, dl_s, dl_bytes, sources = 0, 0.0, 0, []
        settings = self._settings()

        def check_meta(meta: dict) -> Optional[str]:
            theirs = meta.get("settings", {})
            diff = sorted(k for k in set(settings) | set(theirs) if settings.get(k) != theirs.get(k))
            if diff:
                return ("the running job's settings differ from this node's in " + ", ".join(
                    f"{k} (job {theirs.get(k)!r}, here {settings.get(k)!r})" for k in diff)
                    + ": start this node with the job's config")
            return None

        while True:
            self._drop_ring()
            self.server.retract()  # our buffers are about to be overwritten
            try:
                res = fetch_state([self._outer, self._momentum], lambda: m.live_sources(self._last_outer_at()),
                                  secret=m.secret, job=m.run_id,
                                  my_id=self.node_id, check_meta=check_meta, timeout_s=self.transfer_timeout_s,
                                  give_up_s=self.join_timeout_s, log=lambda msg: m.log(msg, event="download"))
            except TransferError as e:
                raise JoinError(f"node {self.node_id} could not download the job's state: {e}") from None
            downloads += 1
            dl_s += res.seconds
            dl_bytes += sum(b - a for _, a, b in res.segments)
            sources += res.segments
            s = res.step
            self.outer_step, self.inner_step, self.since_sync = s, int(res.meta["inner_step"]), 0
            m.log(f"downloaded the state after outer step {s} ({res.total_bytes / 2**20:.1f} MiB, digest "
                  f"{res.digest[:16]}) in {res.seconds:.2f} s from " + ", ".join(
                      f"node {i} [{a}, {b})" for i, a, b in res.segments), event="downloaded", outer_step=s,
                  seconds=res.seconds, bytes=res.total_bytes, segments=res.segments, failures=res.failures)
            m.set_ready(s)
            plan = m.await_admission(s, self._last_outer_at(), self.join_timeout_s)
            if plan is None:
                if time.monotonic() - t0 > self.join_timeout_s:
                    raise JoinError(
                        f"node {self.node_id} could not catch up with the job within {self.join_timeout_s:g} s "
                        f"(elastic.join_timeout_s): {downloads} downloads of {res.total_bytes / 2**20:.0f} MiB took "
                        f"{dl_s / downloads:.1f} s each, and every time the job had moved past the state by then. "
                        "A join needs a download shorter than one outer step (H inner steps): use a faster link, "
                        "a larger diloco.inner_steps, or an unthrottled source (elastic.transfer_max_rate_mbit)")
                m.log(f"the job committed outer step {s + 1} before this node was admitted; downloading again",
                      event="stale", outer_step=s)
                continue
            self._grad.zero_()
            try:
                r = self._boundary(s + 1, self._grad, contributor=False, since=time.monotonic(), first_plan=plan)
            except Evicted as e:
                m.log(f"not admitted at outer step {s + 1}: {e.reason}; trying again", event="stale")
                continue
            m.clear_ready()
            info = JoinInfo(outer_step=r.outer_step, step=r.inner_step, slot=self.slot,
                            slot_state=m.read_slot(self.slot), download_s=dl_s, download_bytes=dl_bytes,
                            join_s=time.monotonic() - t0, sources=sources, downloads=downloads, reason=reason)
            m.log(f"joined at outer step {r.outer_step} (inner step {r.inner_step}, data slot {self.slot}) with "
                  f"nodes {r.members}: join took {info.join_s:.2f} s, download {dl_s:.2f} s"
                  + (f", digest {r.digest[:16]}" if r.digest else ""),
                  event="joined", outer_step=r.outer_step, inner_step=r.inner_step, slot=self.slot, join_s=info.join_s,
                  download_s=dl_s, download_bytes=dl_bytes, members=r.members, digest=r.digest)
            self.last_join_result = r
            return info

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


class _store_errors:
    """Turns a failed store call into MembershipError: without the store no outer step can be agreed on."""

    def __init__(self, k: int):
        self.k = k

    def __enter__(self):
        return self

    def __exit__(self, tp, e, tb):
        import torch.distributed as dist

        if e is not None and isinstance(e, dist.DistError):
            raise MembershipError(
                f"outer step {self.k}: the job's store is unreachable ({e}); no outer step can be agreed on "
                "without it. Restart the store (python -m prime.elastic.store, or node 0), then every node: they "
                "resume from the newest checkpoint they all have."
            ) from e
        return False


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
