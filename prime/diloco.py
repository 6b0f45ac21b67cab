"""DiLoCo: the outer step. Pseudo-gradient, ring all-reduce, outer Nesterov SGD, sync cadence.

    model = ...; opt = torch.optim.AdamW(model.parameters(), ...)
    diloco = prime.DiLoCo(model, opt, ring, inner_steps=100)
    for batch in data:
        loss(model, batch).backward(); opt.step(); opt.zero_grad()
        result = diloco.step()          # every inner_steps steps: an outer step

Every `inner_steps` calls, for the parameters this process holds (the local
shard of each FSDP2 DTensor, or the whole tensor of a plain module):

    pseudo_gradient = outer_weights - local_weights          (fp32, on CPU)
    ring.all_reduce(pseudo_gradient, op="avg", codec=...)    (across nodes)
    momentum  = mu * momentum + pseudo_gradient
    update    = pseudo_gradient + mu * momentum   (Nesterov) or momentum
    outer_weights -= lr * update
    local_weights  = outer_weights

The outer weights and momentum are fp32 copies in CPU memory (pinned when the
parameters are on a GPU). The update is written as separate elementwise
multiplies and adds, each one IEEE fp32 rounding with no fused multiply-add,
so every node computes the same bits from the same all-reduce result (which
the ring makes bit-identical everywhere) on any CPU. torch.optim.SGD would
give the same values up to the last bit, but it may fuse `a + mu * b` where
the CPU has FMA, and nodes with different CPUs would then drift apart.

Failure: a CommError from the ring is retried `retries` times, each time on a
new ring from `ring_factory(tag)` (tag names the outer step and attempt, so
processes at different outer steps never meet in one ring), after every
process of the node agrees that the attempt failed. When no attempt works,
OuterSyncError is raised and the outer weights are left as they were: the
caller saves a checkpoint and stops. It never continues with replicas that
differ.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from prime.parallelize import local_shard

__all__ = ["DiLoCo", "OuterStepResult", "OuterSyncError", "ReplicaMismatchError", "work_stats"]

# Chunk of the elementwise passes over the flat buffers: large enough to amortize
# the per-op overhead, small enough that the temporary stays in L2/L3 cache.
_CHUNK = 1 << 20


class OuterSyncError(RuntimeError):
    """The pseudo-gradient all-reduce failed on every attempt; the outer weights were not changed."""


class ReplicaMismatchError(RuntimeError):
    """Nodes hold different outer weights or settings: they did not start from the same seed or checkpoint."""


@dataclass
class OuterStepResult:
    """What `DiLoCo.step()` did."""

    did_sync: bool
    """True when this call ran an outer step."""
    inner_step: int
    """Inner steps taken so far (this call included)."""
    outer_step: int
    """Outer steps completed so far."""
    numel: int = 0
    """Values all-reduced by this process (its shard, padded to whole codec blocks)."""
    allreduce_s: float = 0.0
    """Wall time of the ring all-reduce (all attempts)."""
    outer_s: float = 0.0
    """Wall time of the whole outer step: copies, all-reduce, outer update."""
    prepare_s: float = 0.0
    """Part of outer_s: device-to-host copy and pseudo-gradient, its norm and (when measured) its int8 error."""
    update_s: float = 0.0
    """Part of outer_s: Nesterov update of the outer weights and the host-to-device copy back."""
    bytes_sent: Optional[int] = None
    """Bytes this process sent on the ring, as the ring reports them (None: not reported)."""
    bytes_received: Optional[int] = None
    """Bytes this process received on the ring (None: not reported)."""
    compression_error: Optional[float] = None
    """int8 round-trip error of the local pseudo-gradient: ||deq(q(d)) - d|| / ||d|| (None: codec none or off)."""
    pseudo_grad_norm: float = 0.0
    """L2 norm of this process's local pseudo-gradient, before averaging."""
    attempts: int = 0
    """All-reduce attempts (1 when the first worked)."""
    ring_stats: dict = field(default_factory=dict)
    """Further timings the ring reports (quantize / wire / reduce seconds, ...)."""


_STAT_NAMES = {
    "bytes_sent": ("bytes_sent", "sent_bytes", "tx_bytes", "bytes_out"),
    "bytes_received": ("bytes_received", "bytes_recv", "recv_bytes", "rx_bytes", "bytes_in"),
    "quantize_s": ("quantize_s", "quantize_time_s", "time_quantize_s", "quantize_time", "quantize_seconds"),
    "wire_s": ("wire_s", "wait_s", "wire_time_s", "wire_time", "network_s"),
    "reduce_s": ("reduce_s", "reduce_time_s", "time_reduce_s", "reduce_time", "reduce_seconds", "dequantize_s"),
    "total_s": ("total_s", "elapsed_s", "time_s", "duration_s"),
}


def work_stats(work) -> dict:
    """Statistics of a finished ring Work as a dict with our names; absent ones are left out.

    Looks for each name among the Work's attributes and in `work.stats`
    (attribute, dict or method), so small changes of the ring's API do not
    break the trainer.
    """
    sources = [work]
    stats = getattr(work, "stats", None)
    if callable(stats):
        try:
            stats = stats()
        except TypeError:
            stats = None
    if stats is not None:
        sources.append(stats)
    out = {}
    for ours, candidates in _STAT_NAMES.items():
        for src in sources:
            for name in candidates:
                v = src.get(name) if isinstance(src, dict) else getattr(src, name, None)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[ours] = v
                    break
            if ours in out:
                break
    return out


def _comm_error_types() -> tuple:
    try:
        from prime.comm import CommError  # the real ring's error

        return (CommError,)
    except ImportError:
        return ()


def _is_comm_error(e: BaseException) -> bool:
    # Duck-typed as well, so rings from elsewhere (and test doubles) can signal a failed collective.
    return isinstance(e, _comm_error_types()) or type(e).__name__ == "CommError"


def _ring_rank_size(ring) -> tuple[Optional[int], Optional[int]]:
    rank = next((getattr(ring, a) for a in ("rank", "node_rank") if isinstance(getattr(ring, a, None), int)), None)
    size = next((getattr(ring, a) for a in ("world_size", "size") if isinstance(getattr(ring, a, None), int)), None)
    return rank, size


class DiLoCo:
    """Outer optimization across nodes for one process's share of a model.

    model:            a plain nn.Module or one sharded with FSDP2 `fully_shard`
                      (each process then handles only its local shards)
    inner_optimizer:  the optimizer of the inner steps; used to check that it
                      holds this model's parameters (build it after fully_shard)
    ring:             a prime.comm.Ring joining this process with its peers on
                      the other nodes (local rank g of every node), or None for
                      a single node: step() then only counts steps
    inner_steps:      H, inner steps between outer steps
    outer_lr, outer_momentum, nesterov: the outer SGD
    codec:            "int8" or "none" (exact fp32) for the all-reduce
    block_size:       int8 block size; each parameter starts a new block
    ring_factory:     ring_factory(tag) -> new Ring, used to retry after a
                      failure; None: no retries
    retries:          retries per outer step when ring_factory is given
    local_group:      process group of this node's processes, to agree on
                      failures (default: the default group when initialized)
    measure_compression_error: compute OuterStepResult.compression_error
    check_replicas:   compare weights and settings across nodes at the first
                      outer step (see check_replicas())
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: Optional[torch.optim.Optimizer],
        ring=None,
        *,
        inner_steps: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        codec: str = "int8",
        block_size: int = 256,
        ring_factory: Optional[Callable[[str], object]] = None,
        retries: int = 2,
        local_group=None,
        measure_compression_error: bool = True,
        check_replicas: bool = True,
    ):
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if outer_lr <= 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        if codec not in ("int8", "none"):
            raise ValueError(f"codec must be 'int8' or 'none', got {codec!r}")
        if block_size < 32 or block_size > 4096 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two from 32 to 4096, got {block_size}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.model = model
        self.params = [p for p in model.parameters()]
        if inner_optimizer is not None:
            ids = {id(p) for p in self.params}
            stray = sum(1 for g in inner_optimizer.param_groups for p in g["params"] if id(p) not in ids)
            if stray:
                raise ValueError(
                    f"the inner optimizer holds {stray} tensors that are not parameters of the model; "
                    "build the optimizer after fully_shard(), which replaces the parameters"
                )
        self.inner_optimizer = inner_optimizer
        self.ring = ring
        self.ring_factory = ring_factory
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, outer_lr, outer_momentum
        self.nesterov, self.codec, self.block_size, self.retries = nesterov, codec, block_size, retries
        self.measure_compression_error = measure_compression_error and codec == "int8"
        # Fixed at construction: a ring that broke (and was dropped) must not turn syncing off.
        self.distributed = ring is not None or ring_factory is not None
        self._check_pending = check_replicas and self.distributed
        if local_group is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                local_group = dist.group.WORLD
        self.local_group = local_group
        self.inner_step = 0  # inner steps taken in total
        self.outer_step = 0  # outer steps completed
        self.since_sync = 0  # inner steps since the last outer step
        self._generation = 0  # rings built by ring_factory so far
        self._outer = self._momentum = self._grad = None
        if self.distributed:
            self._build_buffers()

    # -- layout ------------------------------------------------------------

    def _build_buffers(self) -> None:
        """Flat fp32 CPU buffers for outer weights, momentum and pseudo-gradient; each parameter block-aligned."""
        self._locals = [local_shard(p.detach()) for p in self.params]
        self._offsets, off = [], 0
        for t in self._locals:
            self._offsets.append(off)
            off += -(-t.numel() // self.block_size) * self.block_size  # round up: blocks never span two parameters
        self.numel = off
        devices = {t.device.type for t in self._locals}
        self._on_gpu = "cuda" in devices
        pin = self._on_gpu and torch.cuda.is_available()
        self._outer = torch.zeros(off, dtype=torch.float32, pin_memory=pin)
        self._momentum = torch.zeros(off, dtype=torch.float32)
        self._grad = torch.zeros(off, dtype=torch.float32, pin_memory=pin)
        self._gather(self._outer)

    def _views(self, flat: torch.Tensor):
        for t, off in zip(self._locals, self._offsets):
            yield t, flat[off : off + t.numel()]

    @torch.no_grad()
    def _gather(self, dst: torch.Tensor) -> None:
        """Copies the local parameter values into the flat buffer `dst` (device -> host)."""
        for t, view in self._views(dst):
            view.copy_(t.reshape(-1), non_blocking=True)
        if self._on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies must land before the CPU reads dst

    @torch.no_grad()
    def _scatter(self, src: torch.Tensor) -> None:
        """Copies the flat buffer `src` into the local parameters (host -> device)."""
        for t, view in self._views(src):
            t.copy_(view.view_as(t), non_blocking=True)
        if self._on_gpu:
            torch.cuda.synchronize()  # src is pinned host memory that the next outer step rewrites

    # -- the step ----------------------------------------------------------

    def step(self) -> OuterStepResult:
        """Call after every inner optimizer step. Runs an outer step when inner_steps steps have passed."""
        self.inner_step += 1
        self.since_sync += 1
        if not self.distributed:
            self.since_sync = 0
            return OuterStepResult(False, self.inner_step, self.outer_step)
        if self.since_sync < self.inner_steps:
            return OuterStepResult(False, self.inner_step, self.outer_step)
        return self.sync()

    @torch.no_grad()
    def sync(self) -> OuterStepResult:
        """Runs an outer step now. Raises OuterSyncError (weights unchanged) when the all-reduce keeps failing."""
        if not self.distributed:
            raise RuntimeError("DiLoCo.sync() needs a ring; this DiLoCo was built with ring=None")
        t0 = time.perf_counter()
        if self._check_pending:
            self.check_replicas()
        g = self._grad
        self._pseudo_gradient(g)
        norm, comp_err = self._inspect(g)
        prepare_s = time.perf_counter() - t0
        finite = math.isfinite(norm)
        if not self._all_local(finite):
            raise OuterSyncError(
                f"outer step {self.outer_step + 1}: the pseudo-gradient is not finite "
                f"({'here' if not finite else 'on another process of this node'}): inner training diverged; "
                "lower optim.lr or resume from an earlier checkpoint"
            )
        stats, attempts, ar_s = self._allreduce(g, op="avg", codec=self.codec, recompute=self._pseudo_gradient)
        u0 = time.perf_counter()
        self._outer_update(g)
        self._scatter(self._outer)
        update_s = time.perf_counter() - u0
        self.since_sync = 0
        self.outer_step += 1
        return OuterStepResult(
            did_sync=True,
            inner_step=self.inner_step,
            outer_step=self.outer_step,
            numel=self.numel,
            allreduce_s=ar_s,
            outer_s=time.perf_counter() - t0,
            prepare_s=prepare_s,
            update_s=update_s,
            bytes_sent=stats.pop("bytes_sent", None),
            bytes_received=stats.pop("bytes_received", None),
            compression_error=comp_err,
            pseudo_grad_norm=norm,
            attempts=attempts,
            ring_stats=stats,
        )

    def _pseudo_gradient(self, g: torch.Tensor) -> None:
        """g = outer - local (padding stays 0 - 0 = 0)."""
        self._gather(g)
        torch.sub(self._outer, g, out=g)

    def _inspect(self, g: torch.Tensor) -> tuple[float, Optional[float]]:
        """L2 norm of g and, for int8, the relative L2 error of its quantize/dequantize round trip."""
        from prime import ops

        sq = err = 0.0
        chunk = (_CHUNK // self.block_size) * self.block_size or self.block_size  # whole blocks, as the ring cuts them
        for s in range(0, g.numel(), chunk):
            c = g[s : s + chunk]
            sq += float(torch.dot(c, c).double() if c.numel() else 0.0)
            if self.measure_compression_error and math.isfinite(sq):
                q, scales = ops.quantize_int8(c, self.block_size, check_finite=False)
                d = ops.dequantize_int8(q, scales, self.block_size)
                d.sub_(c)
                err += float(torch.dot(d, d))
        norm = math.sqrt(sq)
        if not self.measure_compression_error:
            return norm, None
        return norm, (math.sqrt(err) / norm if norm > 0 else 0.0)

    def _outer_update(self, g: torch.Tensor) -> None:
        """Nesterov SGD on the CPU fp32 outer weights; one rounding per operation (see the module docstring)."""
        mu, lr = self.outer_momentum, self.outer_lr
        tmp = torch.empty(min(_CHUNK, g.numel()), dtype=torch.float32)
        for s in range(0, g.numel(), _CHUNK):
            gc, mc, wc = g[s : s + _CHUNK], self._momentum[s : s + _CHUNK], self._outer[s : s + _CHUNK]
            t = tmp[: gc.numel()]
            mc.mul_(mu)
            mc.add_(gc)  # momentum = mu * momentum + g
            if self.nesterov:
                torch.mul(mc, mu, out=t)
                t.add_(gc)  # update = g + mu * momentum
            else:
                t.copy_(mc)
            t.mul_(lr)
            wc.sub_(t)  # outer -= lr * update

    # -- the all-reduce with retries -----------------------------------------

    def _all_local(self, ok: bool) -> bool:
        """True when `ok` holds on every process of this node (a tiny collective on the local group)."""
        if self.local_group is None:
            return ok
        import torch.distributed as dist

        dev = "cpu"
        try:
            if dist.get_backend(self.local_group) == "nccl":
                dev = torch.device("cuda", torch.cuda.current_device())
        except Exception:  # a group without a queryable backend: use the CPU
            pass
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.local_group)
        return bool(flag.item())

    def _new_ring(self, tag: str):
        if self.ring is not None:
            try:
                self.ring.close()
            except Exception:  # the ring is already broken; closing it is best effort
                pass
            self.ring = None
        self._generation += 1
        self.ring = self.ring_factory(tag)

    def _allreduce(self, buf: torch.Tensor, *, op: str, codec: str, recompute: Optional[Callable] = None):
        """ring.all_reduce(buf) with retries on fresh rings. Returns (stats, attempts, seconds)."""
        t0 = time.perf_counter()
        last = None
        attempts = 0
        max_attempts = 1 + (self.retries if self.ring_factory is not None else 0)
        for attempt in range(max_attempts):
            attempts += 1
            err = None
            stats = {}
            try:
                if self.ring is None:
                    if self.ring_factory is None:
                        raise OuterSyncError(
                            "the ring failed earlier and no ring_factory was given to rebuild it; restart the job"
                        )
                    self._new_ring(f"o{self.outer_step}a{attempt}")
                work = self.ring.all_reduce(buf, op=op, codec=codec, block_size=self.block_size)
                work.wait()
                stats = work_stats(work)
            except Exception as e:
                if not (_is_comm_error(e) or isinstance(e, OuterSyncError)):
                    raise  # a bug or a bad argument, not a network failure: no retry
                err = e
            if self._all_local(err is None):
                return stats, attempts, time.perf_counter() - t0
            # Some process of this node failed. Everyone drops its ring, so that all
            # rings of this node are rebuilt together under the next tag.
            last = err or last or RuntimeError("the all-reduce failed on another process of this node")
            if self.ring is not None:
                try:
                    self.ring.close()
                except Exception:
                    pass
                self.ring = None
            if err is None and recompute is not None:
                recompute(buf)  # this process's all-reduce had worked: restore its own input
        raise OuterSyncError(
            f"outer step {self.outer_step + 1}: the all-reduce across nodes failed {attempts} time(s) "
            f"(last error: {last}). The outer weights were not changed; stopping so that nodes do not diverge. "
            "Restart every node from the last checkpoint."
        )

    # -- consistency across nodes ----------------------------------------------

    def _fingerprint(self) -> tuple[int, int, int]:
        weights = hashlib.blake2b(self._outer.numpy().data, digest_size=8).digest()
        settings = repr(
            (self.inner_steps, self.outer_lr, self.outer_momentum, self.nesterov, self.codec, self.block_size,
             [t.numel() for t in self._locals], self.outer_step)
        )
        s = hashlib.blake2b(settings.encode(), digest_size=8).digest()
        return int.from_bytes(weights, "little"), int.from_bytes(s, "little"), self.numel

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Checks through the ring that every node holds the same outer weights, settings and shard size.

        Each node puts 16-bit pieces of its fingerprints (weights hash, settings
        hash, element count) in its own slots of a small vector; an exact sum
        all-reduce (zeros elsewhere) gathers them everywhere, since sums of
        integers below 2^24 are exact in fp32. Raises ReplicaMismatchError on
        every process when any node differs.
        """
        if self._outer is None:
            self._build_buffers()
        rank, size = _ring_rank_size(self.ring)
        if rank is None or size is None:
            self._check_pending = False
            return  # a ring that does not tell its rank: nothing to compare with
        slots = 11
        w, s, n = self._fingerprint()
        pieces = [(w >> (16 * i)) & 0xFFFF for i in range(4)] + [(s >> (16 * i)) & 0xFFFF for i in range(4)]
        pieces += [(n >> (16 * i)) & 0xFFFF for i in range(3)]

        def fill(v: torch.Tensor) -> None:
            v.zero_()
            v[rank * slots : (rank + 1) * slots] = torch.tensor(pieces, dtype=torch.float32)

        vec = torch.empty(size * slots, dtype=torch.float32)
        fill(vec)
        self._allreduce(vec, op="sum", codec="none", recompute=fill)
        table = vec.view(size, slots).to(torch.int64).tolist()
        problems = []
        for what, lo, hi in (("shard sizes", 8, 11), ("settings (inner_steps, outer lr/momentum, codec, shapes, outer step)", 4, 8), ("outer weights", 0, 4)):
            mine = table[rank][lo:hi]
            differ = [r for r in range(size) if table[r][lo:hi] != mine]
            if differ:
                problems.append(f"{what} differ from node(s) {differ}")
        ok = self._all_local(not problems)
        if not ok:
            detail = "; ".join(problems) or "another process of this node found a mismatch"
            raise ReplicaMismatchError(
                f"node {rank}: {detail}. Every node must start from the same seed (or resume from the same "
                "checkpoint step) with the same model, [diloco] settings and processes per node."
            )
        self._check_pending = False

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Counters, outer weights and momentum (CPU tensors; the caller may save them with torch.save)."""
        sd = {"inner_step": self.inner_step, "outer_step": self.outer_step, "since_sync": self.since_sync,
              "generation": self._generation}
        if self._outer is not None:
            sd.update(outer=self._outer, momentum=self._momentum, numel=self.numel)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restores state_dict(); the model's local weights must already be restored."""
        self.inner_step, self.outer_step = int(sd["inner_step"]), int(sd["outer_step"])
        self.since_sync, self._generation = int(sd["since_sync"]), int(sd.get("generation", 0))
        if "outer" in sd:
            if self._outer is None:
                self._build_buffers()
            if int(sd["numel"]) != self.numel:
                raise ValueError(
                    f"the checkpoint's outer state has {sd['numel']} values but this process's shard needs "
                    f"{self.numel}: resume with the same model and processes per node"
                )
            self._outer.copy_(sd["outer"])
            self._momentum.copy_(sd["momentum"])
        if self.distributed:
            self._check_pending = True  # verify all nodes resumed the same state before the next outer step

    def close(self) -> None:
        """Closes the current ring (also one passed to the constructor)."""
        if self.ring is not None:
            try:
                self.ring.close()
            finally:
                self.ring = None
