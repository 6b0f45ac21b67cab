"""A job on one host without a secret draws one into its store: that store must not be
reachable from another machine (docs/security.md).

The honest test needs another address that really is another host's: two network
namespaces joined by a veth pair, as two machines on one link. The job runs in the
first (its store hosted the way the trainer's node 0 hosts it, prime.runtime ->
prime.comm.host_store, and its ranks draw the secret into it); a stranger in the second
namespace connects to the job machine's network address. A second loopback address
(127.0.0.2) would not do: it is still this host. The same stranger reaches torch's own
TCPStore server (it listens on every interface), which shows the test can see a
reachable store. Needs root (skipped elsewhere); about 10 s.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB, STRANGER = f"pstore{os.getpid()}-job", f"pstore{os.getpid()}-out"
JOB_ADDR, STRANGER_ADDR = "192.168.79.1", "192.168.79.2"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and iproute2 for network namespaces")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """Two namespaces on one veth link; removed afterwards, also on failure."""
    for ns in (JOB, STRANGER):
        _ip("netns", "del", ns, check=False)
    try:
        _ip("netns", "add", JOB)
        _ip("netns", "add", STRANGER)
        _ip("link", "add", "pst-a", "netns", JOB, "type", "veth", "peer", "name", "pst-b", "netns", STRANGER)
        for ns, dev, addr in ((JOB, "pst-a", JOB_ADDR), (STRANGER, "pst-b", STRANGER_ADDR)):
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            _ip("netns", "exec", ns, "ip", "link", "set", dev, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield
    finally:
        for ns in (JOB, STRANGER):
            _ip("netns", "del", ns, check=False)


def _run_in(ns, code, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


JOB_CODE = """
    import sys, threading
    from datetime import timedelta
    import torch.distributed as dist
    from prime.comm import Ring, rendezvous
    from prime.config import Config

    # The trainer's node 0: prime.runtime hosts the cross-node store (nodes on this host).
    from prime.runtime import build_environment
    cfg = Config()
    cfg.nodes.num_nodes, cfg.nodes.node_rank, cfg.nodes.store_addr = 2, 0, "127.0.0.1:29600"  # a fresh namespace
    env = build_environment(cfg)
    store = env.store
    port = rendezvous.store_endpoint(store)[1]
    # A two-rank ring on it, no secret: rank 0 draws one into the store.
    def rank(r):
        client = dist.PrefixStore("ring", dist.TCPStore("127.0.0.1", port, is_master=False))
        with Ring(client, r, 2, timeout=20) as ring:
            ring.all_reduce(__import__("torch").ones(8), codec="none").wait()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]; [t.join() for t in threads]
    drawn = dist.PrefixStore("ring", dist.TCPStore("127.0.0.1", port, is_master=False)).check(
        ["prime_ring/prime/secret"])
    # torch's own server, for comparison: it listens on every interface.
    wide = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    refused = None
    try:
        rendezvous.require_secret_or_one_host(wide, "127.0.0.1", "a ring on torch's own store")
    except ValueError as e:
        refused = str(e)
    print(port, wide.port, drawn, repr(refused), flush=True)
    sys.stdin.readline()  # stay up while the stranger tries
"""

STRANGER_CODE = """
    import socket, sys
    for port in map(int, sys.argv[1:]):
        try:
            socket.create_connection(("{addr}", port), timeout=5).close()
            print("reached", flush=True)
        except OSError as e:
            print(type(e).__name__, flush=True)
"""


def test_store_of_a_job_without_secret_is_not_reachable_from_another_host(two_hosts):
    job = _run_in(JOB, JOB_CODE)
    try:
        line = job.stdout.readline().split(maxsplit=3)
        assert len(line) == 4, job.communicate(timeout=30)
        port, wide_port, drawn, refused = int(line[0]), int(line[1]), line[2] == "True", eval(line[3])
        assert drawn, "the job drew no secret into its store: the test would show nothing"
        assert refused and "every interface" in refused, refused  # no secret drawn into torch's own server
        code = STRANGER_CODE.replace("{addr}", JOB_ADDR)
        out = subprocess.run(["ip", "netns", "exec", STRANGER, sys.executable, "-c", textwrap.dedent(code),
                              str(port), str(wide_port)], capture_output=True, text=True, timeout=60)
        private, control = out.stdout.split()
        assert control == "reached", f"the stranger could not reach torch's own store either: {out.stdout} {out.stderr}"
        assert private == "ConnectionRefusedError", f"the job's store was {private} from {STRANGER_ADDR}"
    finally:
        try:
            job.communicate(input="\n", timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()
