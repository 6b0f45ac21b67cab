"""A clean stop on every signal (prime/stop.py, prime-simulate, python -m prime.torchrun; docs/stopping.md).

Each end-to-end test starts prime-simulate with 2 nodes of the tiny model on
short sequences, collects the pid of every process of the job (prime-simulate,
the torchruns, their workers) before it signals, and afterwards checks by pid
that none is left. The stop is asserted within the grace (train.stop_grace_s),
the stop line on every training process, and the exit status 128 + the
signal's number. The phases are reached by what the nodes print: inner steps
after a `step N/` line, the all-reduce of an outer step on a slow wire
(diloco.max_rate_mbit) between a `step 4k/` line and its `outer` line. A run
stopped by SIGTERM resumes from its checkpoint with the same losses, bit for
bit, as the run before the stop at the same steps (across an outer step).
Process start-up dominates: about 2 minutes on 2 cores.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import needs_ring
from prime.config import load_config
from prime.simulate import free_port, process_tree, running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = 20  # train.stop_grace_s of these runs

QUICK = ["--config", "configs/demo.toml", "--model.name", "tiny", "--train.device", "cpu", "--data.seq_len", "64",
         "--train.micro_batch_size", "4", "--train.threads", "1", "--metrics.plot", "false",
         "--metrics.log_every", "1", "--diloco.inner_steps", "4", "--diloco.timeout_s", "20",
         "--train.steps", "200", "--train.stop_grace_s", str(GRACE)]


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("PRIME_NODE_RANK", "PRIME_NUM_NODES", "PRIME_STORE_ADDR", "PRIME_FAULTS", "PRIME_PARENT_PID",
              "PRIME_FAULT_EXIT_AFTER_STEP"):
        env.pop(k, None)
    return env


class Job:
    """prime-simulate in the background: its output line by line, and its process tree."""

    def __init__(self, args, nodes=2, procs=1):
        cmd = [sys.executable, "-m", "prime.simulate", "--nodes", str(nodes), "--procs-per-node", str(procs),
               "--", *args]
        self.p = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        self.lines: list[str] = []
        self.cv = threading.Condition()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self):
        for line in self.p.stdout:
            with self.cv:
                self.lines.append(line.rstrip("\n"))
                self.cv.notify_all()

    @property
    def text(self) -> str:
        with self.cv:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 120.0) -> None:
        """Until `count` lines match `pattern` (e.g. once per node)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cv:
            while sum(1 for line in self.lines if rx.search(line)) < count:
                if time.monotonic() > deadline or self.p.poll() is not None:
                    raise AssertionError(f"never saw {count} x /{pattern}/:\n" + "\n".join(self.lines[-80:]))
                self.cv.wait(0.2)

    def tree(self, expect: int) -> list[int]:
        """Every pid of the job, once all `expect` processes exist."""
        deadline = time.monotonic() + 30
        while True:
            pids = process_tree(self.p.pid)
            if len(pids) >= expect or time.monotonic() > deadline:
                return pids
            time.sleep(0.1)

    def gone_within(self, pids: list[int], seconds: float) -> float:
        """Seconds until every pid has ended; fails naming those left after `seconds`."""
        t0 = time.monotonic()
        while any(running(pid) for pid in pids):
            if time.monotonic() - t0 > seconds:
                left = [pid for pid in pids if running(pid)]
                for pid in left:  # leave nothing behind for the next test
                    os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"processes {left} still ran {seconds} s after the signal:\n{self.text[-4000:]}")
            self.p.poll()
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self, sig: int) -> tuple[float, int]:
        """Sends `sig` to prime-simulate; (seconds until every process of the job ended, its exit status)."""
        pids = self.tree(expect=5)  # prime-simulate, 2 torchruns, 2 workers
        os.kill(self.p.pid, sig)
        took = self.gone_within(pids, GRACE)
        return took, self.finish()

    def finish(self, timeout: float = 30.0) -> int:
        rc = self.p.wait(timeout=timeout)
        self.pump.join(timeout=5)
        return rc

    def kill(self):
        for pid in process_tree(self.p.pid)[::-1]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _losses(out_dir, node):
    with open(os.path.join(out_dir, f"metrics_node{node}.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "step"}


def _stop_lines(text, sig):
    # (a note may follow the step in parentheses: an average in flight abandoned, the grace passed)
    return re.findall(rf"\[node (\d)\] prime-train: stopped by {sig} at inner step (\d+)(?: \([^)]*\))?; (.*)$", text,
                      re.M)


# -- before anything starts ---------------------------------------------------------------------


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    """A port handed on to torchrun is bound a moment later; the kernel hands out ephemeral ports (bind(0),
    connect()) to every ring and store in between, so free_port draws below that range where there is room."""
    import socket

    from prime.simulate import _ephemeral_ports

    lo, hi = _ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1, ports  # drawn at random, not the same each time
    for port in ports:
        assert lo <= 12000 or 10000 <= port < lo, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_bad_setting_is_one_line_before_any_node_starts():
    p = subprocess.run([sys.executable, "-m", "prime.simulate", "--nodes", "2", "--", "--config", "configs/demo.toml",
                        "--diloco.inner_steps", "-1"], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p
    assert p.stderr.strip().splitlines() == ["prime-simulate: error: diloco.inner_steps must be >= 1, got -1"], p.stderr
    assert p.stdout == "", p.stdout  # no node was started


@pytest.mark.parametrize("value, says", [("0", "must be > 0 seconds, got 0.0"), ("7200", "must be in [0, 3600]")])
def test_the_grace_is_validated(value, says):
    with pytest.raises(ValueError, match=re.escape(f"train.stop_grace_s {says}")):
        load_config(overrides=[("train.stop_grace_s", value)]).validate()


def test_a_worker_config_error_under_prime_torchrun_has_no_traceback():
    p = subprocess.run([sys.executable, "-m", "prime.torchrun", "--nproc-per-node", "1", "--master-port", str(free_port()),
                        "-m", "prime.train", "--config", "configs/demo.toml", "--diloco.inner_steps", "-1"],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "prime-train: error: diloco.inner_steps must be >= 1, got -1" in out, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert re.search(r"prime\.torchrun: worker local rank 0 \(pid \d+\) exited with status 2", out), out


def test_the_stop_line_says_how_to_resume():
    from prime.stop import resume_hint

    assert resume_hint("", True).startswith("no checkpoint dir configured: the progress of this run is lost")
    assert resume_hint("ck", True, []).startswith("no checkpoint was written yet in ck: running the same command "
                                                  "again starts from step 0")
    assert resume_hint("ck", True, [4, 8]) == ("resume: run the same command again (checkpoint.resume = true picks "
                                               "up the newest checkpoint in ck (on this node: step 8))")
    assert "with --checkpoint.resume true" in resume_hint("ck", False, [8])


# -- one process: the handler, the watchdog, the parent's death ---------------------------------

# prime/stop.py needs only the standard library: loaded from its file, these processes start in milliseconds
# (importing the prime package would import torch).
LOAD_STOP = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("stop", {os.path.join(ROOT, "prime", "stop.py")!r})
stop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stop)
"""


def _python(code: str, env_extra=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD_STOP + textwrap.dedent(code)],
                          env=dict(_env(), **(env_extra or {})), capture_output=True, text=True, timeout=timeout)


def test_each_signal_raises_once_with_128_plus_its_number():
    """The handler raises Stopped in the main thread; a second signal while stopping is ignored."""
    p = _python("""
        import os, signal, time
        for name in ("SIGTERM", "SIGINT", "SIGHUP"):
            s = stop.StopSignals(60, lambda n, late: f"stopped by {stop.signal_name(n)} late={late}", out=sys.stdout)
            s.install()
            try:
                os.kill(os.getpid(), getattr(signal, name))
                time.sleep(5)
                print("not stopped")
            except stop.Stopped as e:
                os.kill(os.getpid(), getattr(signal, name))  # a launcher and torchrun may both forward it: ignored
                time.sleep(0.1)
                s.report(e.signum)
                s.report(e.signum)  # once
                print(e.code)
    """)
    assert p.returncode == 0, p
    assert p.stdout.splitlines() == ["stopped by SIGTERM late=False", "143", "stopped by SIGINT late=False", "130",
                                     "stopped by SIGHUP late=False", "129"], p


def test_watchdog_ends_a_process_stuck_in_c_after_the_grace():
    """A call that holds the main thread in C (here a mutex locked twice; in a job a store or gloo wait) holds
    off the Python handler: the watchdog, woken by the signal itself, prints the line and exits with the
    signal's status once the grace has passed."""
    p = _python("""
        import ctypes, os, signal, threading, time
        s = stop.StopSignals(1.0, lambda n, late: f"stopped by {stop.signal_name(n)} late={late}", out=sys.stdout)
        s.install()
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # a zeroed pthread_mutex_t is PTHREAD_MUTEX_INITIALIZER
        libc.pthread_mutex_lock(mutex)
        threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        libc.pthread_mutex_lock(mutex)  # never returns: signals do not interrupt it
        print("returned")
    """)
    assert p.returncode == 143, p
    assert p.stdout.splitlines() == ["stopped by SIGTERM late=True"], p


def test_a_child_dies_with_the_launcher_that_named_itself_its_parent():
    """PRIME_PARENT_PID: the child asks for SIGKILL at its parent's death, and dies at once when its parent is
    not the one named (it ended before the child could ask)."""
    child = LOAD_STOP + "import time; stop.die_with_parent(); print('up', flush=True); time.sleep(60)"
    parent = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, PRIME_PARENT_PID=str(os.getpid()))
        c = subprocess.Popen([sys.executable, "-c", {child!r}], env=env, stdout=subprocess.PIPE, text=True)
        assert c.stdout.readline() == "up\\n"
        print(c.pid, flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", parent], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        assert running(pid)
        p.kill()
        p.wait()
        t0 = time.monotonic()
        while running(pid) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not running(pid), "the child outlived its SIGKILLed parent"
    finally:
        p.kill()
    q = subprocess.run([sys.executable, "-c", child], env=dict(_env(), PRIME_PARENT_PID="1"), capture_output=True,
                       text=True, timeout=60)  # its parent is this test, not pid 1
    assert q.returncode == 137 and "has ended; exiting" in q.stderr and "up" not in q.stdout, q


# -- prime-simulate, end to end -------------------------------------------------------------------


@needs_ring
def test_sigterm_in_inner_steps_then_sigint_in_an_all_reduce_and_the_resume_is_exact(tmp_path):
    """SIGTERM to prime-simulate during inner steps: every process ends within the grace, each node prints its
    stop line naming the checkpoint dir, status 143. The same command again resumes from the checkpoint of
    step 8 (the newest on every node) over a slow wire, and SIGINT stops it inside the all-reduce of the outer
    step at step 16: status 130, no outer step 16 on any node. Steps 9.. of the resumed run (across the outer
    step at 12) have the losses of the first run, bit for bit."""
    ck = str(tmp_path / "ck")
    args = QUICK + ["--checkpoint.dir", ck, "--checkpoint.every", "8"]
    job = Job(args + ["--metrics.out_dir", str(tmp_path / "a")])
    try:
        # (a step's line is printed before its record is written: the signal may fall between the two)
        job.wait_for(r"\[node \d\] step +14/", count=2)
        took, rc = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    print(f"SIGTERM in inner steps: every process gone {took:.2f} s after the signal")
    text = job.text
    assert rc == 143, text[-3000:]
    stops = _stop_lines(text, "SIGTERM")
    assert sorted(n for n, _, _ in stops) == ["0", "1"], text[-3000:]
    for _, step, rest in stops:
        assert int(step) >= 14
        assert rest == f"resume: run the same command again (checkpoint.resume = true picks up the newest checkpoint " \
                       f"in {ck} (on this node: step 8))", rest
    assert re.search(r"\[simulate\] stopped by SIGTERM: every node stopped within [\d.]+ s; exit status 143", text)
    assert "Traceback" not in text, text[-3000:]
    first = [_losses(tmp_path / "a", n) for n in (0, 1)]

    # 3 Mbit/s: an outer step's 1.6 MiB takes about 4 s on the wire
    job = Job(args + ["--metrics.out_dir", str(tmp_path / "b"), "--diloco.max_rate_mbit", "3"])
    try:
        job.wait_for(r"\[node \d\] step +15/", count=2, timeout=180)
        time.sleep(1.5)  # inner step 16 (0.2 s), then its outer step's all-reduce on the wire
        assert "(step 16)" not in job.text
        took, rc = job.stop(signal.SIGINT)
    finally:
        job.kill()
    print(f"SIGINT in an all-reduce: every process gone {took:.2f} s after the signal")
    text = job.text
    assert rc == 130, text[-3000:]
    assert text.count("resumed from the checkpoint of step 8") == 2, text[-3000:]
    stops = _stop_lines(text, "SIGINT")
    assert sorted((n, s) for n, s, _ in stops) == [("0", "16"), ("1", "16")], text[-3000:]
    assert "(step 16)" not in text and "Traceback" not in text, text[-3000:]
    for node in (0, 1):
        again = _losses(tmp_path / "b", node)
        same = [s for s in sorted(again) if s in first[node]]
        assert same[0] == 9 and same[-1] >= 13, (same, sorted(first[node]))
        for s in same:
            assert again[s] == first[node][s], f"node {node} step {s}: {again[s]} vs {first[node][s]}"


@needs_ring
def test_sigterm_with_fragments_and_overlap_stops_and_the_resume_is_exact(tmp_path):
    """4 fragments with overlap at H = 4: a fragment syncs at every inner step, so an average is always in
    flight on a background thread. SIGTERM to prime-simulate: every process ends within the grace, a stop line
    per node, status 143, no traceback. The same command again resumes from the checkpoint of step 8 (written
    with its averages in flight applied), and its steps 9.. have the first run's losses, bit for bit."""
    ck = str(tmp_path / "ck")
    args = QUICK + ["--checkpoint.dir", ck, "--checkpoint.every", "8", "--diloco.fragments", "4",
                    "--diloco.overlap", "true"]
    runs = []
    for out, until in (("a", 14), ("b", 14)):
        job = Job(args + ["--metrics.out_dir", str(tmp_path / out)])
        try:
            job.wait_for(rf"\[node \d\] step +{until}/", count=2, timeout=180)
            took, rc = job.stop(signal.SIGTERM)
        finally:
            job.kill()
        print(f"run {out}: every process gone {took:.2f} s after SIGTERM")
        text = job.text
        assert rc == 143, text[-3000:]
        assert sorted(n for n, _, _ in _stop_lines(text, "SIGTERM")) == ["0", "1"], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        runs.append((text, [_losses(tmp_path / out, n) for n in (0, 1)]))
    (_, first), (text, again) = runs
    assert text.count("resumed from the checkpoint of step 8") == 2, text[-3000:]
    for node in (0, 1):
        same = [s for s in sorted(again[node]) if s in first[node]]
        assert same[0] == 9 and same[-1] >= 13, (same, sorted(first[node]))
        for s in same:
            assert again[node][s] == first[node][s], f"node {node} step {s}: {again[node][s]} vs {first[node][s]}"


@needs_ring
def test_sigterm_to_one_nodes_torchrun_stops_it_and_then_the_job(tmp_path):
    """SIGTERM to node 1's torchrun alone: it stops its worker, which prints its stop line; prime-simulate sees
    node 1 end with 143 and stops node 0 the same way. Nothing of the job is left within the grace."""
    job = Job(QUICK + ["--metrics.out_dir", str(tmp_path)])
    try:
        job.wait_for(r"\[node \d\] step +6/", count=2)
        pids = job.tree(expect=5)
        launchers = [pid for pid in pids if "prime.torchrun" in open(f"/proc/{pid}/cmdline").read()]
        node1 = [pid for pid in launchers if "--node-rank\x001\x00" in open(f"/proc/{pid}/cmdline").read()]
        assert len(launchers) == 2 and len(node1) == 1, launchers
        os.kill(node1[0], signal.SIGTERM)
        took = job.gone_within(pids, GRACE + 5)
        rc = job.finish()
    finally:
        job.kill()
    print(f"SIGTERM to node 1's torchrun: every process of the job gone {took:.2f} s after the signal")
    text = job.text
    assert rc == 143, text[-3000:]
    assert "[simulate] node 1 exited with status 143; stopping the other nodes" in text, text[-3000:]
    assert sorted(n for n, _, _ in _stop_lines(text, "SIGTERM")) == ["0", "1"], text[-3000:]
    assert "no checkpoint dir configured" in text and "Traceback" not in text, text[-3000:]


def test_sigkill_of_prime_simulate_takes_every_process_with_it(tmp_path):
    """prime-simulate SIGKILLed (no handler runs): its torchrun and the torchrun's two FSDP workers die with it."""
    job = Job(QUICK + ["--metrics.out_dir", str(tmp_path)], nodes=1, procs=2)
    try:
        job.wait_for(r"\[node 0\] memory plan")  # the workers run (their first line)
        pids = job.tree(expect=4)  # prime-simulate, torchrun, 2 workers
        assert len(pids) >= 4, pids
        job.p.kill()
        took = job.gone_within(pids, GRACE)
    finally:
        job.kill()
    print(f"SIGKILL of prime-simulate: every process gone {took:.2f} s after it")
