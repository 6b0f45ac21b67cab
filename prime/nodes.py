"""How this node takes part in the job: the component the trainer's loop calls after each outer step.

    nodes = FixedNodes(cfg, env)               # or prime.elastic.trainer.ElasticNodes(...)
    diloco = DiLoCo(model, opt, nodes.sync, ...)
    nodes.attach(diloco)
    result = nodes.start()                     # before the first inner step (may run an outer step)
    ...
    decision = nodes.after_outer(result)       # the loop's one call, after every outer step
    ...
    nodes.host_processes(); nodes.nodes_that_do_not_fit(fits)   # the memory plan (prime/memory.py)
    nodes.launch_scope()                       # before a resume: this launch's name in the agreement's keys
    nodes.finish(model)                        # after the last step: final-weights agreement
    nodes.close(); nodes.release()             # at the end, before the process group goes

Two implementations of the same small interface (`Nodes`): a fixed set of
nodes on rings (FixedNodes, here) and elastic membership
(prime.elastic.trainer.ElasticNodes). Everything that differs between the two
-- the Sync given to DiLoCo, what happens before the first inner step, taking
the job's position after a (re)join, the errors that end a run, the final
check and the release of the store -- lives behind it, so the trainer's loop
has no branch on the kind of job.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional, Protocol

import torch

from prime.codecs import CODECS
from prime.comm import store_keys as keys
from prime.config import Config
from prime.diloco import DiLoCo, OuterStepResult, ReplicaMismatchError
from prime.parallelize import local_shard
from prime.runtime import Environment, local_wait_s
from prime.shares import MemberGroup, Shares, each
from prime.sync import RingSync, checks_differ, node_local_group

__all__ = ["Nodes", "AfterOuter", "FixedNodes", "signed_records", "final_weights_digest"]


@dataclass
class AfterOuter:
    """What the nodes component decided after an outer step."""

    rejoined_at: Optional[int] = None
    """Set when this node (re)joined the job at this outer step: the inner step it continues from (its data
    and inner optimizer were already moved to the job's position)."""
    note: str = ""
    """Appended to the outer step's log line."""
    fields: dict = field(default_factory=dict)
    """Added to the outer step's metrics record."""


class Nodes(Protocol):
    """The trainer's view of the job's nodes (see the module docstring)."""

    sync: Optional[object]
    """The prime.sync.Sync that DiLoCo averages through (None: a single node)."""
    records: Optional[object]
    """Signed store records of the trainer (resume agreement), None without a store."""
    resumes: bool
    """False when this node must not load a checkpoint (an elastic joiner downloads the job's state)."""
    multi_node: bool
    """True when the summary reports bytes sent between nodes."""
    stop_errors: tuple
    """Exceptions that stop the run (reported like a failed outer step)."""
    finished_errors: tuple
    """Exceptions that end this node's run cleanly (the job ended without it)."""

    def attach(self, diloco: DiLoCo) -> None:
        """Called once by the builder with the DiLoCo built over `sync`."""

    def describe(self) -> Optional[str]:
        """A line for the start of the run (None: nothing to say)."""

    def start(self) -> Optional[OuterStepResult]:
        """Before the first inner step. Returns an outer step it ran (did_sync may be False), or None when the
        job already ended without this node."""

    def meet(self) -> None:
        """Time phases, after the launch's first inner step (it compiles and warms caches, for times that differ
        from node to node): returns once every node called it, so that their phase clocks start together. A job
        whose nodes come and go (elastic) does not meet: a joiner's clock takes the job's step when it joins."""

    def after_outer(self, result: OuterStepResult) -> AfterOuter:
        """After every outer step (also one that start() ran): what the trainer must take over."""

    def finish(self, model: torch.nn.Module) -> dict:
        """After the last step: checks the final weights across nodes; returns fields for the summary."""

    def host_processes(self) -> int:
        """This job's processes sharing this host's memory (the memory plan counts them)."""

    def nodes_that_do_not_fit(self, fits: bool) -> list:
        """The nodes whose memory plan does not fit, given this process's answer (the same list everywhere)."""

    def launch_scope(self) -> str:
        """A name of this launch that every node agrees on (the resume agreement's keys carry it)."""

    def close(self) -> None:
        """Releases the rings and leaves the job (the others drop this node at once)."""

    def release(self) -> None:
        """At the very end of a run that did not fail: the store's host waits until nobody needs it."""


@torch.no_grad()
def final_weights_digest(model: torch.nn.Module, diloco: DiLoCo) -> tuple[str, str]:
    """(blake2b of this process's final weights, what they are). The weights agree bit for bit across nodes
    only right after an outer step, so after a run whose last step is not one this hashes the outer weights."""
    synced = not diloco.distributed or diloco.since_sync == 0
    shard = getattr(diloco, "shard", None) or local_shard  # (the rows of one ring: prime.shares)
    h = hashlib.blake2b(digest_size=16)
    if synced:
        for p in model.parameters():
            h.update(shard(p.detach()).float().cpu().contiguous().numpy().tobytes())
    else:
        h.update(diloco.outer_weights().numpy().tobytes())
    return h.hexdigest(), "weights" if synced else "outer weights (the run did not end on an outer step)"


def final_agreement_result(env, say, node, what: str, digest: str, differ, nodes: int) -> dict:
    """The end of a final-weights comparison, fixed or elastic: raises ReplicaMismatchError naming the nodes
    whose digest differs, else says (on the logging process) that all `nodes` agree."""
    if differ:
        raise ReplicaMismatchError(f"node {node}: final {what} differ from node(s) {sorted(differ)} "
                                   f"(blake2b {digest} here)")
    if env.is_logger:
        say(f"final {what} identical on all {nodes} nodes: blake2b {digest}"
            + (f" (local rank {env.local_rank})" if env.local_world > 1 else ""))
    return {"weights_digest": digest}


def host_identity() -> str:
    """This machine, as the processes on it see it: host name and boot id (two machines with one name differ)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def signed_records(cfg: Config, store, secret: bytes):
    """The trainer's own store records (resume agreement, final digests, finish), signed under the job secret:
    the store has no credentials, so nothing read from it is trusted unsigned (docs/security.md)."""
    from prime.comm.signed_store import SignedKV, SignedStore

    return SignedKV(SignedStore(store, secret, f"trainer/{cfg.nodes.run_id}"), cfg.diloco.timeout_s)


class FixedNodes:
    """A fixed set of nodes: local rank g of every node averages on ring g, rebuilt after a failure.

    One node alone (num_nodes 1) has no sync: DiLoCo then only counts steps."""

    resumes = True
    stop_errors = ()
    finished_errors = ()

    def __init__(self, cfg: Config, env: Environment, say: Callable[[str], None] = print):
        self.cfg, self.env, self.say = cfg, env, say
        self.multi_node = env.num_nodes > 1
        self.shares = env.shares or Shares([env.local_world] * env.num_nodes, env.node_rank, env.local_rank)
        """The rings this process takes part in (prime.shares: several on a one-process node beside larger ones)."""
        self.diloco: Optional[DiLoCo] = None
        self.sync = self.records = None
        self.syncs: dict = {}
        """ring -> the RingSync of each ring this process takes part in (`sync` is the first)."""
        self._last_ring: dict = {}  # ring -> its newest Ring: its link measurements seed the next one's order
        self._stores: dict = {}  # ring -> its own store connection, when this process is on several rings
        self._closed = False
        self._launch: Optional[str] = None  # launch_scope(), once drawn
        self._checks: Optional[list] = None  # every node's diloco.check_replicas, drawn with the launch
        self._pool = None  # a process on several rings: their exchanges run at once on its threads
        self.group: Optional[MemberGroup] = None
        """The agreement of this process's rings when it takes part in several (prime.shares)."""
        if not self.multi_node:
            return
        # The first ring at once (tagged "start"); after a failure RingSync builds the next from make_ring.
        group = node_local_group(env.local_group())
        if len(self.shares.mine) > 1:
            # A one-process node on every ring: the rings agree on failures as a node's processes do, and every
            # exchange runs on all of them at once (prime.shares)
            group = self.group = MemberGroup(len(self.shares.mine), local_wait_s(cfg))
            self._pool = concurrent.futures.ThreadPoolExecutor(len(self.shares.mine), thread_name_prefix="prime-rings")
        for g in self.shares.mine:
            if len(self.shares.mine) > 1:  # rings built side by side, each with its own connection (Environment)
                self._stores[g] = env.connect() if env.connect is not None else env.store
            self.syncs[g] = RingSync(None, ring_factory=functools.partial(self.make_ring, ring=g),
                                     retries=cfg.diloco.retries, local_group=group)
        self.sync = self.syncs[self.shares.mine[0]]
        self._job_secret = self._secret()
        self.records = signed_records(cfg, env.store, self._job_secret)

    def _secret(self) -> bytes:
        """$PRIME_RING_SECRET, else (one host only) drawn by node 0's first process and shared through the store."""
        from prime.comm import rendezvous

        timeout_s = self.cfg.diloco.timeout_s
        _, advertise = rendezvous.resolve_addresses(self.env.store, None, None)
        first = self.env.node_rank == 0 and self.env.local_rank == 0
        return rendezvous.shared_secret(self.env.store, keys.TRAINER_NS, 0 if first else 1, None,
                                        time.monotonic() + timeout_s, int(timeout_s * 1000), advertise)

    def make_ring(self, tag: str, ring: Optional[int] = None):
        """Attempt `tag` of ring `ring` (default: this local rank's): joins the process of every node that takes
        part in it (prime.shares; local rank g of every node when nodes are equal), a fresh rendezvous per tag."""
        if self._closed:  # an all-reduce in flight failed because close() closed its ring: no retry
            raise RuntimeError(f"ring {tag}: not built, the nodes component is closed (the process is stopping)")
        try:
            from prime.comm import Ring
        except ImportError as e:
            raise RuntimeError(f"prime.comm.Ring is not available ({e}); build the extension: make build") from None
        import torch.distributed as dist

        d, g = self.cfg.diloco, self.env.local_rank if ring is None else ring
        store = dist.PrefixStore(f"ring/{g}/{tag}", self._stores.get(g, self.env.store))
        kwargs = {"timeout": timedelta(seconds=d.timeout_s), "job_id": f"{self.cfg.nodes.run_id}/{g}/{tag}",
                  "quant_error": d.compression_error and CODECS[d.codec].lossy}  # DiLoCo's compression_error
        if d.streams:
            kwargs["streams"] = d.streams
        if d.max_rate_mbit:
            kwargs["max_rate"] = d.max_rate_mbit * 1e6 / 8  # bytes per second
        # What the ring before measured of the links (rates, round trips): the next one plans its order with it.
        kwargs["link_history"] = self._last_ring[g].link_history() if g in self._last_ring else {}
        self._last_ring[g] = Ring(store, self.env.node_rank, self.env.num_nodes, **kwargs)
        return self._last_ring[g]

    def attach(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    def host_processes(self) -> int:
        """This job's processes on this host (the memory plan counts them): every process records its host in
        the store (signed), then counts the records naming the same host. Without a store, this node's."""
        env = self.env
        if self.records is None:
            return env.local_world
        me = host_identity()
        self.records.set(keys.host_of(env.node_rank, env.local_rank), me)
        hosts = [self.records.get(keys.host_of(n, g)).decode() for n in range(env.num_nodes)
                 for g in self.shares.processes(n)]
        return sum(1 for h in hosts if h == me)

    def launch_scope(self) -> str:
        """A name for this launch that every process of every node agrees on and no earlier launch had: each
        node's first process draws 48 random bits, shares them in the node, and every ring exchanges the nodes'
        draws (authenticated and fresh, unlike a record in the store, which a stranger could replay). The resume
        agreement's and the outcomes' keys carry it. Drawn at the first call (every process makes it at the same
        point: the resume, else start()). Empty on a single node."""
        if self.sync is None:
            return ""
        if self._launch is None:
            self._launch = self._draw_launch()
        return self._launch

    def _draw_launch(self) -> str:
        import secrets

        env = self.env
        # With the draw goes whether the node checks replicas: start() stops every node alike when they differ
        # (the check is an exchange every node must take part in)
        mine = [secrets.randbits(16) for _ in range(3)] + [int(self.cfg.diloco.check_replicas)] \
            if env.local_rank == 0 else [0, 0, 0, 0]
        node_draw = [int(v) for v in env.local_sum([float(v) for v in mine])]
        tables = self._on_every_ring(lambda sync: sync.exchange(node_draw))  # the same table on every ring
        self._checks = [bool(row[3]) for row in tables[0]]
        return hashlib.blake2b(repr(tables[0]).encode(), digest_size=8).hexdigest()

    def _same_checks(self) -> None:
        """Raises ReplicaMismatchError on every node when some nodes check replicas and others do not (the
        nodes' diloco.check_replicas, exchanged with the launch's draw)."""
        checks = self._checks
        if checks is None or len(set(checks)) < 2:
            return
        off = [n for n, c in enumerate(checks) if not c]
        on = [n for n, c in enumerate(checks) if c]
        raise ReplicaMismatchError(f"node {self.env.node_rank}: {checks_differ(off, on)}")

    def nodes_that_do_not_fit(self, fits: bool) -> list:
        """Every node tells (through the store) whether all its processes' memory plans fit; returns the nodes
        whose plan does not (the same list on every process of every node)."""
        env = self.env
        node_fits = env.local_sum([0.0 if fits else 1.0])[0] == 0
        if self.records is None:
            return [] if node_fits else [env.node_rank]
        if env.local_rank == 0:
            self.records.set(keys.memory_plan(env.node_rank), "ok" if node_fits else "no")
        return [n for n in range(env.num_nodes) if self.records.get(keys.memory_plan(n)).decode() != "ok"]

    def describe(self) -> Optional[str]:
        if not self.multi_node:
            return None
        d = self.cfg.diloco
        o, chunk = d.outer_settings(), d.resolved_block_size()
        sparse = ""
        if o["density"] is not None:  # topk: the values kept per chunk, of each contribution and of the averages
            from prime.sparse import keep_for_density

            kept = [keep_for_density(o[name], chunk) for name in ("density", "average_density")]
            sparse = f" ({kept[0]} / {kept[1]} of every {chunk} values, residual decay {o['feedback_decay']:g})"
            dense = d.dense_outer_steps
            if dense:
                sparse += f", the first {dense} outer step{'s' if dense > 1 else ''} of each fragment dense (int8)"
        return (f"DiLoCo: node {self.env.node_rank} of {self.env.num_nodes}, outer step every {d.inner_steps} inner "
                f"steps, codec {d.codec}{sparse}, outer lr {o['outer_lr']:g} momentum {o['outer_momentum']:g}"
                f"{' nesterov' if d.nesterov and o['outer_momentum'] else ''}")

    def start(self) -> Optional[OuterStepResult]:
        """Checks that every node holds the same weights and settings; runs the outer step that a checkpoint
        written after a failed outer step still owes."""
        d = self.diloco
        if self.multi_node:  # every all-reduce from here on is applied on every node or on none
            self._agree_through_store()
            self._same_checks()
        if d.distributed and self.cfg.diloco.check_replicas:
            d.check_replicas()
        if d.owes_outer_step():
            return d.sync()
        return OuterStepResult(False, d.inner_step, d.outer_step)

    def _agree_through_store(self) -> None:
        from prime.outcomes import StoreOutcomes

        env, launch = self.env, self.launch_scope()
        for g, sync in self.syncs.items():
            connect = env.connect if env.connect is not None else (lambda g=g: self._stores.get(g, env.store))
            sync.agree_through(StoreOutcomes(connect, self._job_secret, self.cfg.nodes.run_id, f"{launch}/g{g}",
                                             node=env.node_rank, nodes=env.num_nodes,
                                             timeout_s=self.cfg.diloco.timeout_s))

    def meet(self) -> None:
        """Every node's processes exchange one number over their ring (authenticated, like every exchange)."""
        step = self.diloco.outer_step + 1
        self._on_every_ring(lambda sync: sync.exchange([0], outer_step=step))

    def _on_every_ring(self, call: Callable) -> list:
        """call(sync) for the sync of every ring of this process (at once when there are several)."""
        if self._pool is None:
            return [call(sync) for sync in self.syncs.values()]
        return each(self._pool, call, list(self.syncs.values()), self.group)

    def after_outer(self, result: OuterStepResult) -> AfterOuter:
        return AfterOuter()

    def finish(self, model: torch.nn.Module) -> dict:
        """Compares the hash of this process's final weights with the same local rank of every other node
        (through the store); raises ReplicaMismatchError when any node differs."""
        if not (self.diloco.distributed and self.cfg.diloco.check_replicas):
            return {}
        env = self.env
        # Per ring (local rank g of every node when nodes are equal): the rows it carries agree on every node.
        members = getattr(self.diloco, "members", [self.diloco])
        digests = {g: final_weights_digest(model, m) for g, m in zip(self.shares.mine, members)}
        for g, (digest, _) in digests.items():
            self.records.set(keys.final_digest(g, env.node_rank), digest)
        differ = set()
        for g, (digest, _) in digests.items():
            others = [self.records.get(keys.final_digest(g, n)).decode() for n in range(env.num_nodes)]
            differ |= {n for n, d in enumerate(others) if d != digest}
        digest, what = digests[self.shares.mine[0]]
        if len(digests) > 1:
            digest = hashlib.blake2b(repr(sorted(d for d, _ in digests.values())).encode(), digest_size=16).hexdigest()
        return final_agreement_result(env, self.say, env.node_rank, what, digest, sorted(differ), env.num_nodes)

    def close(self) -> None:
        self._closed = True
        for sync in self.syncs.values():
            sync.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def release(self) -> None:
        """Every process records that it is done with the store; its host (node 0, process 0) waits for all."""
        if self.records is None:
            return
        env = self.env
        self.records.set(keys.finished(env.node_rank, env.local_rank), "done")
        if env.node_rank == 0 and env.local_rank == 0:
            # One signed record per process (a counter anyone could `add` to would let a stranger end the wait).
            waiting = [keys.finished(n, g) for n in range(env.num_nodes) for g in self.shares.processes(n)]
            deadline = time.monotonic() + self.cfg.diloco.timeout_s
            while waiting and time.monotonic() < deadline:
                waiting = [k for k, v in zip(waiting, self.records.records.get_many(waiting)) if v != "done"]
                if waiting:
                    time.sleep(0.05)
