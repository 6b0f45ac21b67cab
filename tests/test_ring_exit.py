"""A process that uses rings exits cleanly, however it leaves them.

Each case runs in a fresh interpreter (subprocess) and must exit 0 without printing
`terminate called` (std::terminate: a std::thread destroyed while joinable, or an
exception leaving a thread) or any traceback:

- rings dropped without close() while an all-reduce is in flight, and rings still
  referenced from a module global when the interpreter finalizes;
- close() called from another thread while connect() waits for the left neighbour
  (connect() must fail with CommError kind "closed" and start nothing; before the fix
  close() returned at once and connect() went on to use the freed rendezvous).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

prime = pytest.importorskip("prime")
from prime import _extension  # noqa: E402

pytestmark = pytest.mark.skipif(not _extension.available(), reason="prime._C is not built")

SEED = random.SystemRandom().randrange(1 << 30)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import sys, threading, time, torch, torch.distributed as dist
from prime.comm import Ring
SEED = int(sys.argv[1])
def make_rings(world, job):
    store = dist.HashStore()
    rings = [None] * world
    def build(r):
        rings[r] = Ring(store, r, world, timeout=60, secret=b"exit-test", job_id=job)
    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    [t.start() for t in threads]; [t.join() for t in threads]
    return rings
def inputs(world, n):
    return [torch.randn(n, generator=torch.Generator().manual_seed(SEED * 31 + r)) for r in range(world)]
"""


def _run(body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    code = _PRELUDE + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code, str(SEED)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _assert_clean(p: subprocess.CompletedProcess, marker: str) -> None:
    note = f"(SEED={SEED})\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert p.returncode == 0, f"exit status {p.returncode} {note}"
    assert "terminate called" not in p.stderr, note
    assert "Traceback" not in p.stderr, note
    assert marker in p.stdout, note


def test_rings_dropped_with_collectives_in_flight():
    # 3 ranks, 8 MiB each: the all-reduces are still running when the rings are dropped
    # (their Work handles too); __del__ closes them, interrupting the collective.
    p = _run("""
        rings = make_rings(3, "exit-drop")
        xs = inputs(3, 1 << 21)
        works = [rings[r].all_reduce(xs[r], op="sum", codec="none") for r in range(3)]
        del works, rings
        print("dropped", flush=True)
    """)
    _assert_clean(p, "dropped")


def test_rings_alive_at_interpreter_exit():
    # Never closed, still referenced by a module global (and a cycle) when the
    # interpreter finalizes, with collectives queued.
    p = _run("""
        RINGS = make_rings(2, "exit-global")
        RINGS.append(RINGS)  # a reference cycle: finalization order is up to the GC
        xs = inputs(2, 1 << 20)
        WORKS = [RINGS[r].all_reduce(xs[r], op="avg", codec="int8") for r in range(2)]
        WORKS += [RINGS[r].all_reduce(xs[r], op="avg", codec="int8") for r in range(2)]
        print("exiting", flush=True)
    """)
    _assert_clean(p, "exiting")


def test_close_while_connect_waits_for_a_peer():
    # The C++ ring directly: connect() on a thread (rank 1 never connects, so rank 0
    # waits for it), close() from the main thread meanwhile.
    p = _run("""
        from prime import _extension
        C = _extension.require()
        common = dict(world_size=2, job_id="exit-connect", secret=b"k" * 32, timeout_s=30.0,
                      rendezvous_timeout_s=30.0, streams=1, max_rate=0.0, encrypt=False,
                      segment_elems=1 << 16, bind_addr="127.0.0.1", socket_buffer_bytes=0,
                      corrupt_after_bytes=-1)
        r0, r1 = C._Ring(rank=0, **common), C._Ring(rank=1, **common)
        outcome = {}
        def connect():
            try:
                r0.connect([("127.0.0.1", 0), ("127.0.0.1", r1.port)])
                outcome["error"] = None
            except Exception as e:  # CommError(kind="closed") expected
                outcome["error"] = e
        t = threading.Thread(target=connect)
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        r0.close()
        closed_in = time.monotonic() - t0
        t.join(timeout=20)
        assert not t.is_alive(), "connect() still runs after close()"
        e = outcome["error"]
        assert e is not None and getattr(e, "kind", None) == "closed", repr(e)
        assert closed_in < 10, closed_in
        r1.close()
        del r0, r1
        print("connect failed with kind closed, close took %.2f s" % closed_in, flush=True)
    """)
    _assert_clean(p, "kind closed")
