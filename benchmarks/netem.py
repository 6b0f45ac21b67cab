"""Emulated internet paths on one machine: rate, one-way delay, queue, loss and jitter per link.

The kernels here have no netem qdisc, so a small C forwarder (benchmarks/netem.c) is the
wire: every node gets its own network namespace whose only interface is a TUN device
held by the forwarder, which moves each packet from the sender's TUN to the receiver's
through three stages (the sender's uplink, the pair's link with its delay, the
receiver's downlink; docs in netem.c). Topologies are matrices:

    Topology.uniform(4, rate_bits=1e9, rtt_s=0.1)        # 4 nodes, 1 Gbit/s access links, RTT 100 ms
    Topology.regions([0, 1, 0, 1, 0, 1], intra=(10e9, 0.002), inter=(1e9, 0.1))   # two regions, ranks alternate

    with Emulator(topology) as net:                        # namespaces, TUNs, forwarder; all removed on exit
        subprocess.run(net.exec_argv(0, ["python3", ...]))  # runs inside node 0's namespace
        net.addr(1)                                         # node 1's address (192.168.78.11)

Queues are drop-tail, one bandwidth-delay product of the stage's longest path (at least
1000 packets: 1.5 MB). Segmentation offload (gso, on by default) lets TCP hand 64 KiB
super-packets to the forwarder, which still counts every segment's headers: TCP sees
MSS-sized segments (MTU 1500) and the forwarder does a 44th of the per-packet work, so
one core forwards several Gbit/s. Loss is per segment either way: a super-packet that
loses some of its segments is cut into the segments, and the others go on.

`python benchmarks/netem.py --check` verifies the emulator itself: RTT against 2 x delay,
one TCP stream's rate at RTT 0 against the configured rate, and the forwarder's CPU time.
Needs root and /dev/net/tun; `support()` says what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import netns  # noqa: E402  (namespace lifecycle, shared with the tc bridge)

SUBNET = "192.168.78"  # node i at .10 + i (netns.FIRST_HOST)
IFNAME = "ptun0"  # the TUN's name in every node namespace (GLOO_SOCKET_IFNAME)
MAX_NODES = 64
# A queue holds at least 1000 MTU-sized packets (Linux's default txqueuelen): on a path of
# ~0 delay a BDP is a few packets, and several TCP flows sharing it would drop far more
# than on any real host or switch (measured: 3 flows through a 150 KB queue at 1 Gbit/s
# lost 1-2% of their packets and ran at a third of the link).
MIN_QUEUE_BYTES = 1000 * 1500
# The largest super-packet TCP hands the forwarder under gso (the kernel's default).
GSO_MAX_SIZE = 65536
BUILD_DIR = os.path.join(os.path.dirname(HERE), "build", "netem")


def support() -> str | None:
    """None when emulated links can be built here, else why not (one line)."""
    if os.geteuid() != 0:
        return "the delay-line emulator needs root (network namespaces and TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if shutil.which("cc") is None:
        return "no C compiler (`cc`) to build benchmarks/netem.c"
    return None


def build_forwarder() -> str:
    """Compiles netem.c (once per source version) and returns the binary's path."""
    src = os.path.join(HERE, "netem.c")
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    binary = os.path.join(BUILD_DIR, f"prime-netem-{digest}")
    if not os.path.exists(binary):
        os.makedirs(BUILD_DIR, exist_ok=True)
        tmp = f"{binary}.{os.getpid()}.tmp"
        proc = subprocess.run(["cc", "-O2", "-Wall", "-o", tmp, src, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {src} failed:\n{proc.stderr}")
        os.replace(tmp, binary)
    return binary


# ---------------------------------------------------------------------------
# topologies


@dataclass
class Topology:
    """Links between n nodes. Rates in bits/s (0: unlimited), delays one-way in seconds.

    up_bits[i] / down_bits[i]: node i's access link (all its traffic shares it);
    rate_bits[i][j], delay_s[i][j], jitter_s[i][j], loss[i][j]: the path from i to j.
    """

    n: int
    up_bits: list[float]
    down_bits: list[float]
    rate_bits: list[list[float]]
    delay_s: list[list[float]]
    jitter_s: list[list[float]] = field(default_factory=list)
    loss: list[list[float]] = field(default_factory=list)
    name: str = "custom"

    def __post_init__(self):
        if not 2 <= self.n <= MAX_NODES:
            raise ValueError(f"a topology has 2 to {MAX_NODES} nodes, got {self.n}")
        zero = [[0.0] * self.n for _ in range(self.n)]
        self.jitter_s = self.jitter_s or [row[:] for row in zero]
        self.loss = self.loss or [row[:] for row in zero]
        for what, v in (("up_bits", self.up_bits), ("down_bits", self.down_bits)):
            if len(v) != self.n or any(x < 0 for x in v):
                raise ValueError(f"{what} must hold {self.n} rates >= 0, got {v}")
        for what, m in (("rate_bits", self.rate_bits), ("delay_s", self.delay_s), ("jitter_s", self.jitter_s),
                        ("loss", self.loss)):
            if len(m) != self.n or any(len(row) != self.n for row in m):
                raise ValueError(f"{what} must be a {self.n} x {self.n} matrix")
            if any(x < 0 for row in m for x in row):
                raise ValueError(f"{what} must not be negative")
        if any(x >= 1 for row in self.loss for x in row):
            raise ValueError("loss is a probability below 1")

    @classmethod
    def uniform(cls, n: int, rate_bits: float, rtt_s: float, loss: float = 0.0, jitter_s: float = 0.0,
                shape: str = "both") -> "Topology":
        """n nodes, each with its own access link of `rate_bits` (uplink, and downlink when shape is
        "both"), every path with the same round-trip time (each direction rtt/2)."""
        if shape not in ("uplink", "both"):
            raise ValueError(f"shape must be 'uplink' or 'both', got {shape!r}")
        def m(v: float) -> list[list[float]]:
            return [[0.0 if i == j else v for j in range(n)] for i in range(n)]

        return cls(n, [rate_bits] * n, [rate_bits if shape == "both" else 0.0] * n, m(0.0), m(rtt_s / 2),
                   m(jitter_s), m(loss), name=f"uniform-{n}")

    @classmethod
    def regions(cls, region_of: list[int], intra: tuple[float, float], inter: tuple[float, float],
                access_bits: float | None = None) -> "Topology":
        """Nodes in regions (region_of[i] = node i's region): paths within a region have
        intra = (rate_bits, rtt_s), paths between regions inter = (rate_bits, rtt_s). Every node's
        access link runs at access_bits (default: the fastest path rate)."""
        n = len(region_of)
        access = access_bits if access_bits is not None else max(intra[0], inter[0])
        rate = [[0.0 if i == j else (intra if region_of[i] == region_of[j] else inter)[0] for j in range(n)]
                for i in range(n)]
        delay = [[0.0 if i == j else (intra if region_of[i] == region_of[j] else inter)[1] / 2 for j in range(n)]
                 for i in range(n)]
        return cls(n, [access] * n, [access] * n, rate, delay, name=f"regions-{n}")

    def rtt_s(self, i: int, j: int) -> float:
        """Round-trip time of the path i -> j -> i, without queueing."""
        return self.delay_s[i][j] + self.delay_s[j][i]

    def path_rate_bits(self, i: int, j: int) -> float:
        """The slowest stage between i and j (0: unlimited)."""
        rates = [r for r in (self.up_bits[i], self.rate_bits[i][j], self.down_bits[j]) if r > 0]
        return min(rates) if rates else 0.0

    def link_rows(self) -> tuple[list[list[float]], list[list[float]]]:
        """(round trips in s, path rates in bytes/s) between every pair: what the ring would measure
        without queueing (prime.comm.links.LinkTable.from_rows takes them)."""
        rtt = [[self.rtt_s(i, j) for j in range(self.n)] for i in range(self.n)]
        rate = [[self.path_rate_bits(i, j) / 8 if i != j else 0.0 for j in range(self.n)] for i in range(self.n)]
        return rtt, rate

    def to_json(self) -> dict:
        """The matrices, for the record."""
        return {"name": self.name, "n": self.n, "up_bits": self.up_bits, "down_bits": self.down_bits,
                "rate_bits": self.rate_bits, "delay_s": self.delay_s, "jitter_s": self.jitter_s, "loss": self.loss}

    @classmethod
    def from_json(cls, d: dict) -> "Topology":
        """The inverse of to_json (missing jitter / loss: none)."""
        return cls(int(d["n"]), list(d["up_bits"]), list(d["down_bits"]), d["rate_bits"], d["delay_s"],
                   d.get("jitter_s") or [], d.get("loss") or [], name=d.get("name", "custom"))


def two_regions(n: int = 6) -> Topology:
    """n nodes in two regions, numbered alternately (node i in region i % 2): 10 Gbit/s and 2 ms RTT
    within a region, 1 Gbit/s and 100 ms RTT between them."""
    t = Topology.regions([i % 2 for i in range(n)], intra=(10e9, 0.002), inter=(1e9, 0.100))
    t.name = f"two-regions-{n}"
    return t


def _queue_bytes(rate_bits: float, rtt_s: float) -> float:
    return max(MIN_QUEUE_BYTES, rate_bits / 8 * rtt_s)


# ---------------------------------------------------------------------------
# the emulator


def _make_realtime(pid: int) -> bool:
    """Runs the forwarder under the real-time FIFO policy where allowed, so a link's timing does
    not depend on how busy the ranks keep the CPUs: a real link does not wait for a core. Safe
    because the forwarder blocks in epoll between packets (its whole cost is ~7% of a core at
    1 Gbit/s). False where the policy is refused (no CAP_SYS_NICE): it then runs as before."""
    try:
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(10))
        return True
    except (OSError, AttributeError):
        return False


class Emulator(netns.Namespaces):
    """The namespaces, TUN devices and forwarder of one topology. Use as a context manager;
    down() is idempotent and also runs at exit and on SIGTERM/SIGHUP/SIGINT (netns.py)."""

    def __init__(self, topology: Topology, gso: bool = True, mtu: int = 1500, seed: int = 1,
                 gso_max_size: int = GSO_MAX_SIZE):
        if not 576 <= mtu <= 65000:
            raise ValueError(f"mtu({mtu}) must be between 576 and 65000")
        self.topology = topology
        self.gso = gso
        self.gso_max_size = gso_max_size
        self.mtu = mtu
        self.seed = seed
        super().__init__(f"{netns.PREFIX}{os.getpid()}e", SUBNET)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.realtime = False  # up(): whether the forwarder got the real-time policy

    def spec(self) -> str:
        """The forwarder's input (netem.c)."""
        t = self.topology
        lines = [f"config {t.n} {int(self.gso)} {self.seed}"]
        for i in range(t.n):
            longest = max(t.rtt_s(i, j) for j in range(t.n) if j != i)
            longest_in = max(t.rtt_s(j, i) for j in range(t.n) if j != i)
            lines.append(f"node {i} /var/run/netns/{self.ns(i)} {self.addr(i)} {t.up_bits[i]:.0f} "
                         f"{t.down_bits[i]:.0f} {_queue_bytes(t.up_bits[i], longest):.0f} "
                         f"{_queue_bytes(t.down_bits[i], longest_in):.0f}")
        for i in range(t.n):
            for j in range(t.n):
                if i != j:
                    lines.append(f"link {i} {j} {t.rate_bits[i][j]:.0f} {round(t.delay_s[i][j] * 1e9)} "
                                 f"{round(t.jitter_s[i][j] * 1e9)} {t.loss[i][j]!r} "
                                 f"{_queue_bytes(t.rate_bits[i][j], t.rtt_s(i, j)):.0f}")
        lines.append("end")
        return "\n".join(lines) + "\n"

    def up(self) -> "Emulator":
        """Creates the namespaces, starts the forwarder and configures every TUN."""
        reason = support()
        if reason:
            raise RuntimeError(f"cannot emulate links: {reason}")
        binary = build_forwarder()
        try:
            for i in range(self.topology.n):
                self._add_ns(self.ns(i))
            self._proc = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          start_new_session=True)
            self._proc.stdin.write(self.spec())
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if line.strip() != "ready":
                self._proc.wait(timeout=5)
                raise RuntimeError(f"the forwarder did not start (exit {self._proc.returncode}); see its stderr")
            self.realtime = _make_realtime(self._proc.pid)
            for i in range(self.topology.n):
                inside = ["ip", "netns", "exec", self.ns(i)]
                netns._run(inside + ["ip", "link", "set", "lo", "up"])
                netns._run(inside + ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"], check=False)
                netns._run(inside + ["ip", "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME])
                netns._run(inside + ["ip", "link", "set", IFNAME, "mtu", str(self.mtu), "txqueuelen", "10000", "up"])
                if self.gso:
                    netns._run(inside + ["ip", "link", "set", IFNAME, "gso_max_size", str(self.gso_max_size)])
        except BaseException:
            self.down()
            raise
        return self

    def stats(self) -> dict:
        """The forwarder's counters: packets, bytes and drops per path, drops per access link."""
        with self._lock:
            self._proc.stdin.write("stats\n")
            self._proc.stdin.flush()
            return json.loads(self._proc.stdout.readline())

    def cpu_seconds(self) -> float:
        """CPU time the forwarder has used so far (user + system)."""
        with open(f"/proc/{self._proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def down(self) -> None:
        """Stops the forwarder, then deletes the namespaces (idempotent)."""
        if self._proc is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        super().down()

    def describe(self) -> str:
        """One line for logs."""
        t = self.topology
        return (f"{t.n} namespaces on a delay line ({t.name}), mtu {self.mtu}, "
                f"{'gso' if self.gso else 'no gso'}, forwarder {'real-time' if self.realtime else 'normal'} priority")


# ---------------------------------------------------------------------------
# the emulator's own check (run inside the namespaces: python3 netem.py --probe ...)

PROBE_PORT = 29700


WARM_FIELD = 15
"""Bytes of the stream probe's warm-up seconds, after its mode byte."""


def _probe_server(port: int) -> None:
    """Accepts connections: mode 'e' echoes single bytes, mode 's' counts what arrives and
    reports (bytes, seconds) of the part after the first `warm` seconds."""
    srv = socket.create_server(("0.0.0.0", port), reuse_port=False)
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        mode = conn.recv(1)
        if mode == b"e":
            while (b := conn.recv(1)):
                conn.sendall(b)
        elif mode == b"s":
            field = b""  # the client's 15-byte warm-up field, exactly: the data stream follows it at once
            while len(field) < WARM_FIELD and (part := conn.recv(WARM_FIELD - len(field))):
                field += part
            warm = float(field.decode().strip())
            start = time.monotonic()
            counted = 0
            t0 = None
            buf = bytearray(1 << 20)
            while (k := conn.recv_into(buf)):
                now = time.monotonic()
                if now - start >= warm:
                    if t0 is None:
                        t0 = now
                    counted += k
            t1 = time.monotonic()
            conn.sendall(json.dumps({"bytes": counted, "seconds": t1 - (t0 or t1)}).encode())
        elif mode == b"q":
            return
        conn.close()


def _probe_client(host: str, port: int, mode: str, seconds: float, warm: float) -> None:
    """Runs one probe against _probe_server and prints its result as JSON."""
    for _ in range(100):
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "e":
        conn.sendall(b"e")
        rtts = []
        for _ in range(int(seconds)):
            t0 = time.monotonic()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append(time.monotonic() - t0)
        print(json.dumps({"rtt_s": rtts}), flush=True)
    elif mode == "s":
        conn.sendall(b"s" + f"{warm:<{WARM_FIELD}}".encode())
        block = b"\0" * (1 << 20)
        end = time.monotonic() + warm + seconds
        while time.monotonic() < end:
            conn.sendall(block)
        conn.shutdown(socket.SHUT_WR)
        print(conn.recv(4096).decode(), flush=True)
    else:
        conn.sendall(b"q")


def check(rate_bits: float = 1e9, rtts_ms=(0, 50, 100, 200), gso: bool = True, seconds: float = 4.0,
          say=print) -> list[dict]:
    """The emulator's own check: per RTT, the measured RTT (median of 20 one-byte round trips)
    against 2 x delay, and at RTT 0 one TCP stream's goodput against the rate, with the
    forwarder's CPU time per second of that transfer."""
    rows = []
    me = os.path.abspath(__file__)
    for rtt_ms in rtts_ms:
        topo = Topology.uniform(2, rate_bits, rtt_ms / 1000)
        with Emulator(topo, gso=gso) as net:
            server = subprocess.Popen(net.exec_argv(1, [sys.executable, me, "--probe-server", str(PROBE_PORT)]),
                                      stdout=subprocess.PIPE, text=True)
            try:
                server.stdout.readline()
                client = [sys.executable, me, "--probe-client", net.addr(1), str(PROBE_PORT)]
                out = subprocess.run(net.exec_argv(0, client + ["e", "20", "0"]), capture_output=True, text=True,
                                     check=True).stdout
                rtt = statistics.median(json.loads(out)["rtt_s"])
                row = {"rtt_ms_configured": rtt_ms, "rtt_ms_measured": rtt * 1e3,
                       "rtt_error": (rtt * 1e3 - rtt_ms) / rtt_ms if rtt_ms else None}
                if rtt_ms == 0:
                    cpu0, t0 = net.cpu_seconds(), time.monotonic()
                    out = subprocess.run(net.exec_argv(0, client + ["s", str(seconds), "1"]), capture_output=True,
                                         text=True, check=True).stdout
                    cpu = (net.cpu_seconds() - cpu0) / (time.monotonic() - t0)
                    got = json.loads(out)
                    goodput = got["bytes"] * 8 / got["seconds"]
                    row.update(goodput_bits=goodput, rate_fraction=goodput / rate_bits, forwarder_cpu=cpu)
                subprocess.run(net.exec_argv(0, client + ["q", "0", "0"]), capture_output=True)
                server.wait(timeout=10)
            finally:
                if server.poll() is None:
                    server.kill()
                    server.wait()
        rows.append(row)
        extra = ""
        if "goodput_bits" in row:
            extra = (f"  one stream {row['goodput_bits'] / 1e6:.0f} Mbit/s = {100 * row['rate_fraction']:.1f}% of "
                     f"{rate_bits / 1e6:.0f}, forwarder {100 * row['forwarder_cpu']:.0f}% of a core")
        err = "" if row["rtt_error"] is None else f" ({100 * row['rtt_error']:+.1f}%)"
        say(f"RTT {rtt_ms:>4} ms configured: measured {row['rtt_ms_measured']:.2f} ms{err}{extra}")
    return rows


def main(argv=None) -> int:
    """--check (the emulator's own check), --cleanup, or the probe roles (internal)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="verify RTT, rate and CPU cost")
    p.add_argument("--rate", default="1gbit", help="link rate for --check (default 1gbit)")
    p.add_argument("--rtt", default="0,50,100,200", help="RTTs in ms for --check")
    p.add_argument("--no-gso", action="store_true", help="forward MTU-sized packets (no segmentation offload)")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by dead runs")
    p.add_argument("--probe-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--probe-client", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe_server:
        _probe_server(args.probe_server)
        return 0
    if args.probe_client:
        host, port, mode, seconds, warm = args.probe_client
        _probe_client(host, int(port), mode, float(seconds), float(warm))
        return 0
    if args.cleanup:
        print("removed:", netns.remove_stale() or "nothing")
        return 0
    if args.check:
        reason = support()
        if reason:
            print(f"netem: {reason}", file=sys.stderr)
            return 2
        netns.install_signal_handlers()
        netns.remove_stale()
        rtts = [float(x) for x in args.rtt.split(",") if x.strip()]
        check(netns.rate_to_bits(args.rate), rtts, gso=not args.no_gso)
        return 0
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
