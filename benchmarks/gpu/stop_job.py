"""A GPU job stopped by a signal leaves nothing behind: no process of the job, nothing on the GPUs.

    python3 benchmarks/gpu/stop_job.py --at "20/20 |" --signal TERM -- <prime-simulate args>

Starts `python -m prime.simulate <args>` (2 nodes on the GPUs), waits for the first output line that contains
--at (e.g. the last inner step's line: the final syncs of the fragments run then, where `timeout` once ended a
10B run whose processes then held the GPUs), sends --signal to prime-simulate, as `timeout` or a scheduler
does, and checks, --settle seconds after prime-simulate exited:
- every process of the job's tree (collected right before the signal) is gone;
- nvidia-smi lists no compute process (the machine runs nothing else);
- SIGTERM / SIGINT: the exit status is 128 + the signal's number and every training process printed its stop
  line ("prime-train: stopped by SIG..."); SIGKILL: prime-simulate dies at once, and its nodes follow it.
Prints one verdict line per check and exits 1 when one fails. The job's output goes to --log.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from prime.simulate import process_tree, running  # noqa: E402


def gpu_processes() -> list:
    """PIDs nvidia-smi lists as compute processes ([] without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(x) for x in out.split() if x.strip().isdigit()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", required=True, help="signal at the first output line containing this")
    ap.add_argument("--signal", default="TERM", choices=["TERM", "INT", "HUP", "KILL"])
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after the exit before the checks")
    ap.add_argument("--limit", type=float, default=400.0, help="seconds to wait for --at, then for the exit")
    ap.add_argument("--log", default="stop_job.log")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after the first "--": prime-simulate's own argv
    a, rest = ap.parse_args(argv[:cut]), argv[cut + 1:]
    sig = getattr(signal, f"SIG{a.signal}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "prime.simulate", *rest], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = threading.Event()
    lines: list = []

    def pump():
        with open(a.log, "w") as log:
            for line in p.stdout:
                log.write(line)
                log.flush()
                lines.append(line)
                if a.at in line:
                    seen.set()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    if not seen.wait(a.limit) or p.poll() is not None:
        p.kill()
        print(f"FAILED: no line with {a.at!r} within {a.limit:.0f} s (exit {p.poll()}); see {a.log}")
        return 1
    tree = process_tree(p.pid)
    t0 = time.monotonic()
    os.kill(p.pid, sig)
    try:
        rc = p.wait(timeout=a.limit)
    except subprocess.TimeoutExpired:
        print(f"FAILED: prime-simulate still running {a.limit:.0f} s after SIG{a.signal}")
        for pid in process_tree(p.pid):
            os.kill(pid, signal.SIGKILL)
        return 1
    took = time.monotonic() - t0
    time.sleep(a.settle)
    t.join(timeout=5)
    text = "".join(lines)
    left = [pid for pid in tree if running(pid)]
    on_gpu = gpu_processes()
    stops = text.count(f"prime-train: stopped by SIG{a.signal}")
    ok = True

    def check(good: bool, what: str) -> None:
        nonlocal ok
        ok &= good
        print(f"{'ok' if good else 'FAILED'}: {what}")

    print(f"SIG{a.signal} at the first line with {a.at!r}; prime-simulate exited with {rc} after {took:.1f} s; "
          f"{len(tree)} processes in the job's tree")
    check(not left, f"no process of the job left {a.settle:.0f} s after the exit (left: {left})")
    check(not on_gpu, f"no compute process on the GPUs (nvidia-smi: {on_gpu})")
    if sig != signal.SIGKILL:
        check(rc == 128 + sig, f"exit status {rc} (documented: 128 + {int(sig)})")
        check(stops >= 2, f"{stops} stop lines ('prime-train: stopped by SIG{a.signal}')")
    else:
        check(rc == -sig, f"prime-simulate killed (status {rc})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
