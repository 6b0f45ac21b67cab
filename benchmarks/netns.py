"""Emulated internet links on one machine: one Linux network namespace per rank.

Topology (all of it created here, all of it removed here)::

    ns pbench<pid>-r0  [pveth0 192.168.77.10] --veth-- [pvb0] \
    ns pbench<pid>-r1  [pveth0 192.168.77.11] --veth-- [pvb1]  >- br0 in ns pbench<pid>-br
    ...                                                         /

Every rank has one link into the bridge, like a home or datacenter node has one
uplink. With `rate` set, a token bucket (tc tbf) shapes the rank's side of the
veth (its uplink) and, with shape="both", the bridge's side too (its downlink),
so that a node can neither send nor receive faster than `rate`, as on a real
access link. In a ring every rank sends to one peer and receives from another,
so the downlink shaping only matters for traffic patterns with fan-in (the
TCPStore rendezvous, gloo's algorithms other than the ring).

Namespaces are named with this process id, so concurrent runs never touch each
other; a run removes leftovers of runs whose process is gone. Removal happens
in `Network.down`, which runs from a `with` block, from atexit, and from
SIGTERM / SIGHUP / SIGINT (turned into exceptions so that finally blocks run).
Needs root and iproute2 (`ip`, `tc`); `check_support` says what is missing.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "pbench"
SUBNET = "192.168.77"
FIRST_HOST = 10  # rank r gets SUBNET.(FIRST_HOST + r)
RANK_IFNAME = "pveth0"  # the interface name inside every rank namespace (GLOO_SOCKET_IFNAME)
MAX_RANKS = 200  # addresses .10 to .209 of the /24

# tbf settings from ENVIRONMENT.md: the burst must be well above the MTU (a burst
# near the MTU stalls TCP); the latency bounds the queue the bucket may hold.
TBF_BURST = "4mb"
TBF_LATENCY = "200ms"

_live: list["Network"] = []


def check_support() -> str | None:
    """Returns None when namespaces can be built here, else a one-line reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the benchmark as root, or use --conditions loopback,ratelimit-*)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed, so links cannot be shaped with tc"
    return None


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _list_namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILLs every process still inside `ns` (only ever our own rank workers)."""
    proc = _run(["ip", "netns", "pids", ns], check=False)
    for tok in proc.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _run(["ip", "netns", "del", ns], check=False)


def namespaces_of(pid: int) -> list[str]:
    """Namespaces that the run with process id `pid` created (normally empty after it ends)."""
    return [ns for ns in _list_namespaces() if ns.startswith(f"{PREFIX}{pid}-")]


def remove_stale() -> list[str]:
    """Deletes namespaces of earlier runs whose process is gone; returns their names."""
    removed = []
    for ns in _list_namespaces():
        m = re.match(rf"^{PREFIX}(\d+)e?-", ns)  # "e": benchmarks/netem.py's delay-line nodes
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def _raise_on_signal(signum, frame):
    # Turn termination into an exception so `with Network(...)` / finally blocks run.
    raise SystemExit(128 + signum)


def install_signal_handlers() -> None:
    """Makes SIGTERM and SIGHUP raise SystemExit (SIGINT already raises KeyboardInterrupt)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _cleanup_all() -> None:
    for net in list(_live):
        net.down()


atexit.register(_cleanup_all)


def size_to_bytes(size: str) -> int:
    """tc sizes: '4mb' -> 4 MiB, '256kb' -> 256 KiB, '1500b' or '1500' -> 1500 (tc's 1024 multiples)."""
    m = re.fullmatch(r"([0-9.]+)\s*(b|k|kb|m|mb|g|gb)?", size.strip().lower())
    if not m:
        raise ValueError(f"size {size!r} is not like '4mb', '256kb' or '1500b'")
    scale = {None: 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}
    return int(float(m.group(1)) * scale[m.group(2)])


def rate_to_bits(rate: str) -> float:
    """'100mbit' / '1gbit' / '10gbit' / '2.5gbit' -> bits per second (tc's decimal units)."""
    m = re.fullmatch(r"([0-9.]+)\s*(kbit|mbit|gbit|bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r} is not like '100mbit' or '1gbit'")
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    return float(m.group(1)) * scale


class Namespaces:
    """Namespaces named after this process (tag), node i in `<tag>-r<i>` at `<subnet>.<10 + i>`,
    all deleted by down() (idempotent; also at exit and on SIGTERM/SIGHUP/SIGINT). Subclasses
    build what runs in them (up()) and stop it before they call down()."""

    def __init__(self, tag: str, subnet: str):
        self.tag = tag
        self.subnet = subnet
        self._created: list[str] = []

    def ns(self, rank: int) -> str:
        """Name of rank `rank`'s namespace."""
        return f"{self.tag}-r{rank}"

    def addr(self, rank: int) -> str:
        """IPv4 address of rank `rank` in its namespace."""
        return f"{self.subnet}.{FIRST_HOST + rank}"

    def exec_argv(self, rank: int, argv: list[str]) -> list[str]:
        """Command line that runs `argv` inside rank `rank`'s namespace."""
        return ["ip", "netns", "exec", self.ns(rank)] + list(argv)

    def _add_ns(self, ns: str) -> None:
        if self not in _live:
            _live.append(self)
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def down(self) -> None:
        """Kills what runs inside the namespaces and deletes them (idempotent).

        Termination signals are held back meanwhile, so a second Ctrl-C cannot leave half
        the namespaces behind; they are delivered once everything is gone.
        """
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            for ns in reversed(self._created):
                _delete_namespace(ns)
            self._created.clear()
            if self in _live:
                _live.remove(self)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


class Network(Namespaces):
    """One namespace per rank on a bridge, optionally shaped to `rate` (a tc rate like '1gbit').

    Use as a context manager; `down()` is idempotent and also runs at exit and on signals.
    """

    def __init__(self, world_size: int, rate: str | None = None, shape: str = "both", mtu: int = 1500,
                 burst: str = TBF_BURST):
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size({world_size}) must be between 1 and {MAX_RANKS}")
        if shape not in ("uplink", "both"):
            raise ValueError(f"shape({shape!r}) must be 'uplink' or 'both'")
        if rate is not None:
            rate_to_bits(rate)  # validates
        if size_to_bytes(burst) <= mtu + 100:
            raise ValueError(f"burst({burst}) must be well above the mtu({mtu}); tbf stalls TCP otherwise")
        super().__init__(f"{PREFIX}{os.getpid()}", SUBNET)
        self.world_size = world_size
        self.rate = rate
        self.shape = shape
        self.mtu = mtu
        self.burst = burst
        self.bridge_ns = f"{self.tag}-br"

    def _tbf(self, ns: str, dev: str) -> None:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
              "rate", self.rate, "burst", self.burst, "latency", TBF_LATENCY])

    def up(self) -> "Network":
        """Creates the namespaces, veths, bridge, addresses and shaping."""
        reason = check_support()
        if reason:
            raise RuntimeError(f"cannot build emulated links: {reason}")
        _live.append(self)
        for ns in namespaces_of(os.getpid()):  # a previous Network of this process that leaked
            _delete_namespace(ns)
        try:
            self._add_ns(self.bridge_ns)
            br = ["ip", "netns", "exec", self.bridge_ns]
            _run(br + ["ip", "link", "add", "br0", "type", "bridge"])
            _run(br + ["ip", "link", "set", "br0", "up"])
            for r in range(self.world_size):
                ns, peer = self.ns(r), f"pvb{r}"
                self._add_ns(ns)
                # Both ends are born inside their namespaces: nothing appears in the root namespace.
                _run(["ip", "link", "add", RANK_IFNAME, "netns", ns, "mtu", str(self.mtu), "type", "veth",
                      "peer", "name", peer, "netns", self.bridge_ns, "mtu", str(self.mtu)])
                _run(br + ["ip", "link", "set", peer, "master", "br0"])
                _run(br + ["ip", "link", "set", peer, "up"])
                inside = ["ip", "netns", "exec", ns]
                _run(inside + ["ip", "addr", "add", f"{self.addr(r)}/24", "dev", RANK_IFNAME])
                _run(inside + ["ip", "link", "set", RANK_IFNAME, "up"])
                _run(inside + ["ip", "link", "set", "lo", "up"])
                if self.rate is not None:
                    self._tbf(ns, RANK_IFNAME)  # uplink
                    if self.shape == "both":
                        self._tbf(self.bridge_ns, peer)  # downlink
            self._wait_ready()
        except BaseException:
            self.down()
            raise
        return self

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        # The bridge port needs a moment to reach forwarding state; ping would be
        # the usual probe but is not always installed, so poll the port state.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = _run(["ip", "netns", "exec", self.bridge_ns, "bridge", "link", "show"], check=False).stdout
            if out.count("state forwarding") >= self.world_size:
                return
            time.sleep(0.05)
        raise RuntimeError(f"bridge ports of {self.bridge_ns} did not reach forwarding state in {timeout_s} s")

    def describe(self) -> str:
        """One line for logs: ranks, rate, which directions are shaped, MTU."""
        link = "unshaped" if self.rate is None else f"tbf {self.rate} burst {self.burst} ({self.shape})"
        return f"{self.world_size} namespaces on a bridge, {link}, mtu {self.mtu}"


if __name__ == "__main__":
    # `python benchmarks/netns.py --cleanup`: remove leftovers of dead runs and list what is left.
    if "--cleanup" in sys.argv:
        print("removed:", remove_stale() or "nothing")
        left = [ns for ns in _list_namespaces() if ns.startswith(PREFIX)]
        print("left (runs still alive):", left or "nothing")
    else:
        print(__doc__)
