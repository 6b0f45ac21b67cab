"""Multi-process helpers for the ring tests: a pool of long-lived rank processes.

Starting a Python process that imports torch costs seconds on the CI machine, so
the ring tests share one pool of MAX_RANKS spawned processes for the whole session
and run many cases per call. The test process hosts the TCPStore; each worker
connects to it once. A test ships a module-level function to the first
`world_size` workers, which run it as ranks 0..world_size-1 and send back its
result (or their traceback). Every call gets a fresh job id, so every ring built
through `RankContext.ring()` has fresh store keys.

Only the ring tests use this (tests/test_ring.py).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import random
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import pytest

MAX_RANKS = 5


def ring_built() -> bool:
    """Whether prime.comm.Ring can run here: it needs the compiled extension prime._C (the class
    itself always imports, so its presence says nothing)."""
    from prime import _extension

    return _extension.available()


needs_ring = pytest.mark.skipif(not ring_built(), reason="prime._C is not built: prime.comm.Ring cannot run")


@dataclass
class RankContext:
    """What a rank function gets as its first argument."""

    rank: int
    world_size: int
    store: Any  # torch.distributed.TCPStore (client)
    job: str
    _rings: int = 0
    timings: Dict[str, float] = field(default_factory=dict)

    def job_id(self) -> str:
        """A fresh job id for the next ring of this call."""
        self._rings += 1
        return f"{self.job}/ring{self._rings}"

    def ring(self, **kwargs):
        """A Ring of this call's ranks on the shared store (fresh job id unless given)."""
        from prime.comm import Ring

        kwargs.setdefault("job_id", self.job_id())
        kwargs.setdefault("timeout", 30)
        return Ring(self.store, self.rank, self.world_size, **kwargs)


@dataclass
class Died:
    """Result slot of a rank whose process died during the call (expected in kill tests)."""

    rank: int
    exitcode: Optional[int]


def _worker_main(rank: int, store_port: int, inbox, outbox) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the CI machine has 2 cores for 5 ranks and the test process
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    while True:
        item = inbox.get()
        if item is None:
            return
        job, world_size, fn, args, kwargs = item
        ctx = RankContext(rank, world_size, store, job)
        try:
            out = fn(ctx, *args, **kwargs)
            outbox.put((rank, job, "ok", out))
        except BaseException:  # report everything, including assertion failures
            outbox.put((rank, job, "error", traceback.format_exc()))


class RankPool:
    """MAX_RANKS worker processes; run(fn, world_size=W) runs fn on the first W of them."""

    def __init__(self, size: int = MAX_RANKS):
        import torch.distributed as dist

        self.size = size
        # On loopback only (prime.comm.host_store): the rings of the tests that pass no
        # secret draw one into it, which prime allows only for a store nothing else reaches.
        from prime.comm.rendezvous import host_store

        self.store = host_store("127.0.0.1", 0)
        self._ctx = mp.get_context("spawn")
        self._outbox = self._ctx.Queue()
        self._inboxes: List[Any] = [None] * size
        self._procs: List[Any] = [None] * size
        self._jobs = itertools.count()
        for r in range(size):
            self._start(r)

    def _start(self, rank: int) -> None:
        self._inboxes[rank] = self._ctx.Queue()
        p = self._ctx.Process(
            target=_worker_main, args=(rank, self.store.port, self._inboxes[rank], self._outbox), daemon=True
        )
        p.start()
        self._procs[rank] = p

    def pid(self, rank: int) -> int:
        return self._procs[rank].pid

    def start(self, fn: Callable, *args, world_size: int, **kwargs) -> str:
        """Sends fn to ranks 0..world_size-1 without waiting; returns the job id for gather()."""
        assert 1 <= world_size <= self.size
        for r in range(world_size):
            if not self._procs[r].is_alive():
                self._start(r)
        job = f"job{next(self._jobs)}-{os.getpid()}-{time.monotonic_ns()}"
        for r in range(world_size):
            self._inboxes[r].put((job, world_size, fn, args, kwargs))
        return job

    def gather(self, job: str, world_size: int, timeout: float = 180, may_die=()) -> List[Any]:
        """Results of ranks 0..world_size-1 (Died(...) for ranks in may_die that died).
        Raises with the ranks' tracebacks if any rank raised."""
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            try:
                rank, got_job, status, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                for r in range(world_size):
                    if r in results or r in errors or self._procs[r].is_alive():
                        continue
                    if r in may_die:
                        results[r] = Died(r, self._procs[r].exitcode)
                    else:
                        errors[r] = f"rank {r} process died (exit code {self._procs[r].exitcode})"
                if time.monotonic() > deadline:
                    self._kill_all()
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results) - set(errors))} did "
                                       f"not finish within {timeout} s; the pool was restarted")
                continue
            if got_job != job:
                continue  # a late answer of an earlier, abandoned call
            (results if status == "ok" else errors)[rank] = payload
        if errors:
            text = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{len(errors)} rank(s) failed:\n{text}")
        return [results[r] for r in range(world_size)]

    def run(self, fn: Callable, *args, world_size: int, timeout: float = 180, may_die=(), **kwargs) -> List[Any]:
        """start() + gather()."""
        job = self.start(fn, *args, world_size=world_size, **kwargs)
        return self.gather(job, world_size, timeout=timeout, may_die=may_die)

    def _kill_all(self) -> None:
        for r, p in enumerate(self._procs):
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
            self._start(r)

    def close(self) -> None:
        for r, p in enumerate(self._procs):
            if p.is_alive():
                self._inboxes[r].put(None)
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture
def seed():
    """A fresh random seed per test, printed so that a failure can be replayed (test files may override it)."""
    s = random.randrange(2**31)
    print(f"seed {s}")
    return s


@pytest.fixture(scope="session")
def ranks():
    """The session's pool of rank processes (see RankPool)."""
    pool = RankPool()
    yield pool
    pool.close()
