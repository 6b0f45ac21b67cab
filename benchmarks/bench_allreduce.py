"""All-reduce over emulated internet links: gloo fp32 / bf16 against our TCP ring (exact fp32, int8, fp4).

Every rank is a separate process. Link conditions:

  loopback          all ranks on 127.0.0.1, no shaping
  netns             one network namespace per rank on a bridge, no shaping
  tc-<rate>         one network namespace per rank on a bridge, each rank's uplink and
                    downlink shaped to <rate> with tc tbf (benchmarks/netns.py; needs root, ip, tc)
  netem-<rate>-rtt<ms>
                    one network namespace per rank on the delay line of benchmarks/netem.py:
                    each rank's uplink and downlink at <rate> with a drop-tail queue of one
                    bandwidth-delay product, every path with that round-trip time (and
                    --loss, --jitter-ms). `--conditions netem-1gbit --rtt 0,50,100` expands to
                    one condition per RTT. Needs root and /dev/net/tun.
  topo-<name>       the delay line with a topology given as matrices (--topology): e.g.
                    two-regions, 6 nodes numbered alternately, 10 Gbit/s and 2 ms RTT within
                    a region, 1 Gbit/s and 100 ms RTT between them
  ratelimit-<rate>  ranks on 127.0.0.1, the ring paces itself with max_rate=<rate>; for
                    machines without tc (the GPU machines). gloo cannot be limited, so rows
                    compare against our exact fp32 ring under the same limit.

Methods, run on the same input tensors in the same process group:

  gloo-fp32, gloo-bf16      torch.distributed.all_reduce(SUM) with the gloo backend; bf16
                            times only the all_reduce of a bf16 copy (the casts are free for it)
  ring-fp32                 prime.comm.Ring, codec "none", the ring's defaults (--streams to force streams)
  ring-int8                 prime.comm.Ring, codec "int8", the ring's defaults: streams and buffers
                            chosen per link, the schedule per collective, the ring order planned
  ring-int8-1stream         as ring-int8 with one TCP stream per link (the same as ring-int8
                            unless --streams is above 1)
  ring-int8-b128            as ring-int8 with block_size=128: one 1-byte scale per 128 values
                            (1.008 bytes/value instead of 1.016 at the default 64) for a larger error
  ring-int8-nocheck         as ring-int8 with checksums off
  ring-fp4                  prime.comm.Ring, codec "fp4" (4-bit codes, 0.516 bytes/value at block 256)
  ring-int8-ring            as ring-int8 with schedule="ring" (hop by hop, the planned order)
  ring-int8-direct          as ring-int8 with schedule="direct" (two hops)
  ring-int8-rankorder       schedule="ring" in the rank order 0, 1, ..., N-1
  ring-int8-bestorder       schedule="ring" in the best order for the topology (topo-* conditions;
                            found by brute force from the topology's matrices)
  ring-int8-classic         the ring as it was before links were sized and schedules chosen: the
                            ring schedule in rank order, one stream per link, autotuned buffers
  ring-topk                 prime.comm.Ring, codec "topk" (docs/wire-format-sparse.md): per chunk of 4096
                            the 64 largest values at 2 bits with their positions (0.0205 bytes/value),
                            the direct schedule; ring-topk-k16 / -k256 keep 16 / 256 per chunk;
                            ring-topk-k48-a96: 48 per chunk of each contribution, 96 of each average;
                            ring-topk-k48-a96-ef: the same with a residual (residual=), as DiLoCo's error
                            feedback runs it: the ring also hands back what every selection dropped
  pg-prime-fp32             torch.distributed.all_reduce(SUM) on a group of the "prime" backend
                            (prime.comm.backend), exact: the same ring as ring-fp32 behind torch's API
  pg-prime-int8             the same with PrimeOptions(codec="int8"): ring-int8 behind torch's API

Per row: median / p90 over the timed iterations of the slowest rank's time (each iteration
starts after a barrier), algbw = fp32 tensor bytes / time, busbw = algbw * 2(N-1)/N (NCCL's
definition, always counted on the fp32 tensor so that rows compare), bytes sent per rank
(the ring's own counters; for gloo the theory 2(N-1)/N * buffer bytes), link utilization =
(bytes sent per rank / link rate) / time, speedups against gloo fp32 and bf16 of the same
row group, and the relative L2 error against the exact sum computed in float64.

Input: rank r's tensor is standard normal, drawn chunk by chunk from seeds derived from
(--seed, r, chunk), so rank 0 can rebuild every rank's input for the float64 reference.

Quick run (about a minute):   python benchmarks/bench_allreduce.py --quick
Full run:                     python benchmarks/bench_allreduce.py
Output: a table on stdout, benchmarks/results/allreduce[_quick].json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, REPO)  # the prime of this checkout, in this process and (PYTHONPATH) in the ranks
import netem  # noqa: E402  (benchmarks/netem.py, next to this file)
import netns  # noqa: E402
from prime.simulate import free_port  # noqa: E402  (drawn outside the kernel's ephemeral range)

MiB = 1 << 20
CHUNK = 1 << 20  # elements per seeded chunk of the input: 4 MiB of fp32
INT8_BLOCK = 64  # elements per 1-byte scale in the int8 codec, its default (docs/wire-format.md)
FP4_BLOCK = 256  # elements per fp32 scale in the fp4 codec, its default
GLOO_METHODS = ("gloo-fp32", "gloo-bf16")
RING_METHODS = ("ring-fp32", "ring-int8", "ring-int8-1stream", "ring-int8-nocheck", "ring-int8-b128", "ring-fp4")
# The ring's schedules and orders forced (run them with --methods).
RING_VARIANTS = ("ring-int8-ring", "ring-int8-direct", "ring-int8-rankorder", "ring-int8-bestorder",
                 "ring-int8-classic")
# The sparse codec (run them with --methods): values kept per chunk of TOPK_CHUNK.
TOPK_METHODS = {"ring-topk": (64, 64), "ring-topk-k16": (16, 16), "ring-topk-k256": (256, 256),
                "ring-topk-k48-a96": (48, 96), "ring-topk-k48-a96-ef": (48, 96)}  # values kept per chunk of each contribution, of each average
TOPK_CHUNK = 4096
# The ring through torch.distributed: dist.all_reduce on a backend="prime" group (prime.comm.backend).
PG_METHODS = ("pg-prime-fp32", "pg-prime-int8")
DEFAULT_METHODS = GLOO_METHODS + RING_METHODS + PG_METHODS
ALL_METHODS = GLOO_METHODS + RING_METHODS + RING_VARIANTS + tuple(TOPK_METHODS) + PG_METHODS
RESULT_TAG = "@@RESULT "  # rank 0 prints one such line (JSON) per finished case
STORE_PORT_NETNS = 29500  # each namespace is fresh, so a fixed port is free there
LOOPBACK_ASSUMED_BITS = 8e9  # only for skipping cases that would run too long on loopback


# ---------------------------------------------------------------------------
# configuration


@dataclass
class Condition:
    """A link condition: how ranks are connected and how fast."""

    name: str
    # "loopback", "tc" (namespaces + tbf), "netem" (the delay line, uniform links), "topo" (the
    # delay line with a topology) or "ratelimit" (the ring's own max_rate)
    kind: str
    # link rate in bits per second; None when unshaped (or a topology's links differ)
    rate_bits: float | None = None
    # the tc spelling of the rate, e.g. "1gbit"
    rate: str | None = None
    # netem: every path's round-trip time, random loss per packet, jitter (seconds)
    rtt_s: float = 0.0
    loss: float = 0.0
    jitter_s: float = 0.0
    # topo: the topology (netem.Topology.to_json())
    topology: dict | None = None


def _netem_name(rate: str, rtt_ms: float, loss: float, jitter_ms: float) -> str:
    name = f"netem-{rate}-rtt{rtt_ms:g}"
    if loss:
        name += f"-loss{100 * loss:g}%"
    if jitter_ms:
        name += f"-jitter{jitter_ms:g}"
    return name


def parse_condition(name: str, loss: float = 0.0, jitter_ms: float = 0.0) -> Condition:
    """'loopback' | 'netns' | 'tc-<rate>' | 'ratelimit-<rate>' | 'netem-<rate>-rtt<ms>' with rates like
    100mbit, 1gbit (topologies come from parse_topology)."""
    if name == "loopback":
        return Condition(name, "loopback")
    if name == "netns":  # namespaces on the bridge, unshaped: what the veths and bridge cost
        return Condition(name, "tc")
    if name.startswith("netem-"):
        rate, sep, rtt = name[len("netem-"):].partition("-rtt")
        try:
            rtt_ms = float(rtt.split("-")[0]) if sep else 0.0
        except ValueError:
            raise ValueError(f"condition {name!r}: the RTT is not a number of ms (like netem-1gbit-rtt100)") from None
        bits = netns.rate_to_bits(rate)
        return Condition(_netem_name(rate, rtt_ms, loss, jitter_ms), "netem", bits, rate, rtt_ms / 1000, loss,
                         jitter_ms / 1000)
    for kind in ("tc", "ratelimit"):
        if name.startswith(kind + "-"):
            rate = name[len(kind) + 1:]
            return Condition(name, kind, netns.rate_to_bits(rate), rate)
    raise ValueError(f"condition {name!r} is not 'loopback', 'netns', 'tc-<rate>', 'ratelimit-<rate>' or "
                     "'netem-<rate>-rtt<ms>' (rate like 1gbit)")


def parse_topology(spec: str) -> Condition:
    """--topology: 'two-regions' (6 nodes) or 'two-regions:<n>', or a JSON file of netem.Topology.to_json()."""
    import netem

    if spec.startswith("two-regions"):
        _, _, n = spec.partition(":")
        topo = netem.two_regions(int(n) if n else 6)
    elif os.path.exists(spec):
        with open(spec) as f:
            topo = netem.Topology.from_json(json.load(f))
    else:
        raise ValueError(f"--topology {spec!r} is neither 'two-regions[:n]' nor a JSON file")
    return Condition(f"topo-{topo.name}", "topo", topology=topo.to_json())


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,4,64' -> [1, 4, 64]; each value must be a positive integer."""
    try:
        values = [int(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


def default_conditions(tc_reason: str | None) -> list[str]:
    """All link conditions this machine can run."""
    if tc_reason is None:
        return ["loopback", "tc-100mbit", "tc-1gbit", "tc-10gbit", "ratelimit-1gbit"]
    return ["loopback", "ratelimit-100mbit", "ratelimit-1gbit", "ratelimit-10gbit"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (also used by the tests)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="about a minute: 4 ranks, 4 and 64 MiB, loopback and 1 Gbit/s (tc or ratelimit)")
    p.add_argument("--conditions", help="comma list of loopback, tc-<rate>, ratelimit-<rate>, netem-<rate> "
                   "(default: all this machine can run, netem aside)")
    p.add_argument("--rtt", default=None, help="comma list of round-trip times in ms for the netem-* conditions "
                   "(default 0)")
    p.add_argument("--loss", type=float, default=0.0, help="netem: random loss probability per packet (0.001: 0.1%%)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="netem: up to this much extra one-way delay per packet")
    p.add_argument("--topology", default=None,
                   help="run on the delay line with this topology: two-regions[:n] or a JSON file (netem.Topology)")
    p.add_argument("--no-gso", action="store_true",
                   help="netem: forward MTU-sized packets (per-packet loss; costs the forwarder much more CPU)")
    p.add_argument("--world-sizes", default="2,4,8", help="comma list of rank counts (default 2,4,8)")
    p.add_argument("--sizes", default="1,4,16,64,256,1024", help="comma list of MiB of fp32 per rank")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {', '.join(ALL_METHODS)} "
                   f"(default: all but {', '.join(RING_VARIANTS)})")
    p.add_argument("--streams", type=int, default=0,
                   help="TCP streams per ring link for the ring-* methods (default 0: the ring chooses per link)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per case")
    p.add_argument("--netns-sysctl", action="append", default=[], metavar="net.KEY=VALUE",
                   help="a sysctl set in every rank's namespace (tc and netem conditions), e.g. "
                        "net.ipv4.tcp_slow_start_after_idle=0; repeatable")
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="untimed pause before every iteration, as between the outer steps of training "
                        "(links idle longer than TCP's retransmission timeout restart with a small window)")
    p.add_argument("--min-iters", type=int, default=3, help="timed iterations per case, at least")
    p.add_argument("--max-iters", type=int, default=20, help="timed iterations per case, at most")
    p.add_argument("--case-budget-s", type=float, default=4.0,
                   help="timed iterations stop after about this many seconds (once --min-iters ran)")
    p.add_argument("--max-case-s", type=float, default=90.0,
                   help="skip a case whose predicted time (from link rate and bytes) exceeds this")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the tensors live; cuda puts rank r on GPU r mod count (gloo and the ring copy)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank process")
    p.add_argument("--shape", choices=("both", "uplink"), default="both",
                   help="tc: shape each rank's uplink only, or uplink and downlink (default)")
    p.add_argument("--mtu", type=int, default=1500, help="tc: MTU of the veths (default 1500, as on the internet)")
    p.add_argument("--burst", default=netns.TBF_BURST, help="tc: tbf burst (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="ring / gloo / store timeout per operation")
    p.add_argument("--out", default=None,
                   help="output path without extension (default benchmarks/results/allreduce[_quick])")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON spec of one rank process
    return p


@dataclass
class Plan:
    """Everything the parent decided from the command line."""

    conditions: list[Condition]
    world_sizes: list[int]
    sizes_mib: list[int]
    methods: list[str]
    streams: int
    warmup: int
    min_iters: int
    max_iters: int
    case_budget_s: float
    max_case_s: float
    threads: int
    device: str
    shape: str
    mtu: int
    burst: str
    seed: int
    timeout_s: float
    out: str
    plot: bool
    notes: list[str] = field(default_factory=list)
    gso: bool = True
    idle_s: float = 0.0
    netns_sysctl: list[str] = field(default_factory=list)


def make_plan(argv: list[str] | None = None, tc_reason: str | None = "unchecked") -> Plan:
    """Parses and validates the command line. tc_reason: netns.check_support() (None = usable)."""
    if tc_reason == "unchecked":
        tc_reason = netns.check_support()
    args = build_parser().parse_args(argv)
    notes = []
    if args.quick:
        cond_names = ["loopback", "tc-1gbit" if tc_reason is None else "ratelimit-1gbit"]
        world_sizes, sizes = [4], [4, 64]
        args.max_iters = min(args.max_iters, 5)
        args.case_budget_s = min(args.case_budget_s, 2.0)
    else:
        world_sizes = parse_int_list(args.world_sizes, "--world-sizes")
        sizes = parse_int_list(args.sizes, "--sizes")
        cond_names = default_conditions(tc_reason)
    if args.conditions:
        cond_names = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if args.topology:
        cond_names = [c for c in cond_names if args.conditions and c in args.conditions.split(",")]
    rtts = [float(x) for x in args.rtt.split(",") if x.strip()] if args.rtt else None
    expanded = []
    for c in cond_names:
        if c.startswith("netem-") and "-rtt" not in c:
            expanded += [f"{c}-rtt{r:g}" for r in (rtts or [0.0])]
        else:
            expanded.append(c)
    if args.loss < 0 or args.loss >= 1 or args.jitter_ms < 0:
        raise ValueError(f"--loss({args.loss}) must be in [0, 1) and --jitter-ms({args.jitter_ms}) >= 0")
    conditions = [parse_condition(c, args.loss, args.jitter_ms) for c in expanded]
    if args.topology:
        topo = parse_topology(args.topology)
        conditions.append(topo)
        n = topo.topology["n"]
        if "--world-sizes" in (argv or []) and world_sizes != [n]:
            raise ValueError(f"--topology {args.topology} has {n} nodes; --world-sizes must be {n} (or left out)")
        world_sizes = [n]
    if any(c.kind in ("netem", "topo") for c in conditions):
        import netem

        reason = netem.support()
        if reason is not None:
            dropped = [c.name for c in conditions if c.kind in ("netem", "topo")]
            notes.append(f"skipped {', '.join(dropped)}: {reason}")
            conditions = [c for c in conditions if c.kind not in ("netem", "topo")]
    if any(c.kind == "tc" for c in conditions) and tc_reason is not None:
        dropped = [c.name for c in conditions if c.kind == "tc"]
        notes.append(f"skipped {', '.join(dropped)}: {tc_reason}; only loopback and ratelimit-* run")
        conditions = [c for c in conditions if c.kind != "tc"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from {', '.join(ALL_METHODS)}")
    if any(w < 2 for w in world_sizes):
        raise ValueError(f"world sizes must be at least 2, got {world_sizes}")
    if any(w > netns.MAX_RANKS for w in world_sizes):
        raise ValueError(f"world sizes must be at most {netns.MAX_RANKS}, got {world_sizes}")
    if args.streams < 0:
        raise ValueError(f"--streams({args.streams}) must be at least 0 (0: the ring chooses)")
    if not 1 <= args.min_iters <= args.max_iters:
        raise ValueError(f"need 1 <= --min-iters({args.min_iters}) <= --max-iters({args.max_iters})")
    if args.warmup < 0:
        raise ValueError(f"--warmup({args.warmup}) must be >= 0")
    if args.idle_s < 0:
        raise ValueError(f"--idle-s({args.idle_s}) must be >= 0")
    for kv in args.netns_sysctl:
        if "=" not in kv or not kv.split("=", 1)[0].startswith("net."):
            raise ValueError(f"--netns-sysctl({kv!r}) must be net.<key>=<value>")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    out = args.out or os.path.join(HERE, "results", "allreduce_quick" if args.quick else "allreduce")
    return Plan(conditions, world_sizes, sizes, methods, args.streams, args.warmup, args.min_iters,
                args.max_iters, args.case_budget_s, args.max_case_s, args.threads, args.device, args.shape, args.mtu,
                args.burst, seed, args.timeout_s, out, not args.no_plot, notes, gso=not args.no_gso,
                idle_s=args.idle_s, netns_sysctl=list(args.netns_sysctl))


# ---------------------------------------------------------------------------
# metrics (pure functions; tested in tests/test_bench_harness.py)


def ring_factor(world_size: int) -> float:
    """Bytes each rank sends per byte of tensor in a ring all-reduce: 2(N-1)/N."""
    return 2.0 * (world_size - 1) / world_size


def int8_bytes(n: int, block: int = INT8_BLOCK, payloads: int = 1) -> int:
    """Bytes of n values in the int8 codec sent as `payloads` payloads: one byte each, one 1-byte
    scale per block and a 2-byte header per payload."""
    return n + (n + block - 1) // block + 2 * payloads if n else 0


def method_ring_options(method: str, spec: dict) -> dict:
    """prime.comm.Ring options a ring-* method sets (beyond the codec and block size)."""
    return {
        "ring-int8-1stream": {"streams": 1},
        "ring-int8-ring": {"schedule": "ring"},
        "ring-int8-direct": {"schedule": "direct"},
        "ring-int8-rankorder": {"schedule": "ring", "order": "rank"},
        "ring-int8-bestorder": {"schedule": "ring", "order": spec.get("best_order") or "rank"},
        "ring-int8-classic": {"schedule": "ring", "order": "rank", "streams": 1},
    }.get(method, {})


def method_block(method: str) -> int:
    """The codec block size a ring-* method uses (the codec's default, but for ring-int8-b128)."""
    if method in TOPK_METHODS:
        return TOPK_CHUNK
    return {"ring-int8-b128": 128, "ring-fp4": FP4_BLOCK}.get(method, INT8_BLOCK)


def expected_wire_bytes(method: str, n: int, world_size: int) -> float:
    """Bytes a rank sends for an all-reduce of n fp32 values by `method`, in theory."""
    if method in TOPK_METHODS:
        from prime import sparse

        k, ka = TOPK_METHODS[method]  # half the bytes at each: contributions one way, averages the other
        return ring_factor(world_size) * (sparse.payload_bytes(n, TOPK_CHUNK, k)
                                          + sparse.payload_bytes(n, TOPK_CHUNK, ka)) / 2
    per_value = {"gloo-fp32": 4 * n, "gloo-bf16": 2 * n, "ring-fp32": 4 * n, "pg-prime-fp32": 4 * n,
                 "ring-fp4": (n + 1) // 2 + 4 * ((n + FP4_BLOCK - 1) // FP4_BLOCK)}.get(method)
    payload = per_value if per_value is not None else int8_bytes(n, method_block(method))
    return ring_factor(world_size) * payload


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a non-empty list; q in [0, 100]."""
    if not values:
        raise ValueError("percentile of an empty list")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def row_metrics(times_s: list[float], n: int, world_size: int, wire_bytes: float | None,
                rate_bits: float | None, burst_bytes: int = 0) -> dict:
    """median / p90 time, algbw and busbw (bit/s, counted on the fp32 tensor), link utilization.

    link_util = (wire bytes / rate) / median time: the share of the physical floor reached.
    A token bucket lets `burst_bytes` through at once when it starts full (the workers wait
    for it to refill before each iteration), so link_util may pass 100%; link_util_burst_adj
    credits that burst: ((wire bytes - burst) / rate) / median time.
    """
    med = percentile(times_s, 50)
    algbw = 4 * n * 8 / med
    util = util_adj = None
    if rate_bits and wire_bytes is not None:
        util = (wire_bytes * 8 / rate_bits) / med
        if burst_bytes:
            util_adj = (max(wire_bytes - burst_bytes, 0.0) * 8 / rate_bits) / med
    return {
        "median_s": med,
        "p90_s": percentile(times_s, 90),
        "algbw_bits": algbw,
        "busbw_bits": algbw * ring_factor(world_size),
        "link_util": util,
        "link_util_burst_adj": util_adj,
    }


def add_speedups(rows: list[dict]) -> None:
    """Adds speedup_vs_<baseline> = baseline median / row median within each (condition, world, size)."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r.get("median_s"):
            groups.setdefault((r["condition"], r["world_size"], r["size_bytes"]), {})[r["method"]] = r
    for members in groups.values():
        for r in members.values():
            for base in ("gloo-fp32", "gloo-bf16", "ring-fp32", "ring-int8"):
                b = members.get(base)
                r[f"speedup_vs_{base}"] = b["median_s"] / r["median_s"] if b else None


def fmt_bits(b: float | None) -> str:
    """bit/s as a short human string."""
    if b is None:
        return "-"
    return f"{b / 1e9:.2f}G" if b >= 1e9 else f"{b / 1e6:.0f}M"


def fmt_pct(v: float | None) -> str:
    """0.953 -> '95.3%'; None -> '-'."""
    return "-" if v is None else f"{100 * v:.1f}%"


def fmt_size(nbytes: float | None) -> str:
    """bytes as MiB / GiB."""
    if nbytes is None:
        return "-"
    return f"{nbytes / (1 << 30):.2f}GiB" if nbytes >= 1 << 30 else f"{nbytes / MiB:.1f}MiB"


# ---------------------------------------------------------------------------
# rank worker (runs inside the rank's namespace, or on loopback)


def chunk_seed(seed: int, rank: int, chunk: int) -> int:
    """Seed of one CHUNK of one rank's input, independent of the tensor size."""
    h = hashlib.sha256(f"{seed}:{rank}:{chunk}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFFFFFFFFFFFFFF


def make_input(seed: int, rank: int, n: int):
    """Rank `rank`'s fp32 input of n values (standard normal), reproducible by any process."""
    import torch

    out = torch.empty(n, dtype=torch.float32)
    g = torch.Generator()
    for c, start in enumerate(range(0, n, CHUNK)):
        g.manual_seed(chunk_seed(seed, rank, c))
        stop = min(n, start + CHUNK)
        out[start:stop] = torch.randn(stop - start, generator=g)
    return out


def exact_sum(seed: int, world_size: int, n: int):
    """The float64 sum of all ranks' inputs, chunk by chunk (memory: 8n bytes)."""
    import torch

    ref = torch.zeros(n, dtype=torch.float64)
    g = torch.Generator()
    for r in range(world_size):
        for c, start in enumerate(range(0, n, CHUNK)):
            g.manual_seed(chunk_seed(seed, r, c))
            stop = min(n, start + CHUNK)
            ref[start:stop] += torch.randn(stop - start, generator=g).double()
    return ref


def rel_l2(result, ref) -> float:
    """||result - ref|| / ||ref|| in float64, chunked to keep memory at one chunk."""
    import torch

    num = den = 0.0
    for start in range(0, ref.numel(), 8 * CHUNK):
        r = ref[start:start + 8 * CHUNK]
        x = result[start:start + 8 * CHUNK].to(device="cpu", dtype=torch.float64)
        num += float(torch.sum((x - r) ** 2))
        den += float(torch.sum(r * r))
    return math.sqrt(num / den) if den > 0 else float("nan")


def gpu_quantize_seconds(x, block_size: int, repeats: int = 10) -> float:
    """Median time of prime.ops.quantize_int8 on the GPU tensor x (CUDA events, bench_quantize's Timer)."""
    from bench_quantize import Timer  # benchmarks/bench_quantize.py, next to this file

    from prime import ops

    def quantize(t):
        return ops.quantize_int8(t, block_size)

    timer = Timer(x.device)
    quantize(x)  # warm-up (and kernel load)
    times = sorted(timer.batch(quantize, [x], 1) for _ in range(repeats))
    return times[len(times) // 2]


class RingAdapter:
    """The one place that knows prime.comm.Ring's constructor, all_reduce and statistics.

    The ring (or a stand-in, PRIME_BENCH_RING) follows prime.comm.RingProtocol: its works'
    stats() return a prime.comm.WorkStats, read here by field name.
    """

    def __init__(self, store, rank: int, world_size: int, spec: dict, method: str):
        import importlib

        import torch.distributed as dist

        # PRIME_BENCH_RING=module:Class swaps in another implementation with the same API
        # (the harness tests use tests/fake_ring.py); default prime.comm:Ring.
        module, _, cls = os.environ.get("PRIME_BENCH_RING", "prime.comm:Ring").partition(":")
        ring_cls = getattr(importlib.import_module(module), cls)
        self.codec = {"ring-fp32": "none", "ring-fp4": "fp4"}.get(method, "topk" if method in TOPK_METHODS else "int8")
        self.block = method_block(method)
        self.keep = ({"keep": TOPK_METHODS[method][0], "keep_average": TOPK_METHODS[method][1]}
                     if method in TOPK_METHODS else {})
        kwargs = dict(timeout=timedelta(seconds=spec["timeout_s"]), secret=f"bench-{spec['seed']}",
                      max_rate=spec["max_rate_bytes"], checksum=method != "ring-int8-nocheck")
        kwargs.update(method_ring_options(method, spec))
        if spec["streams"] and "streams" not in kwargs:
            kwargs["streams"] = spec["streams"]
        if spec["addr"]:
            kwargs.update(bind_addr=spec["addr"], advertise_addr=spec["addr"])
        self.ring = ring_cls(dist.PrefixStore(f"ring/{method}", store), rank, world_size, **kwargs)
        self.schedule = None  # what the last collective ran (WorkStats.schedule)
        self.error_feedback = method.endswith("-ef")

    def all_reduce(self, tensor) -> tuple[float, dict]:
        """Sums `tensor` in place over all ranks. Returns (bytes this rank sent on the wire,
        every statistic of the work, for the record: times, bytes received...)."""
        extra = dict(self.keep)
        if self.error_feedback:  # error feedback's residual, fresh for every collective as DiLoCo's
            import torch

            extra["residual"] = torch.zeros(tensor.numel(), dtype=torch.float32)
        work = self.ring.all_reduce(tensor, op="sum", codec=self.codec, block_size=self.block, **extra)
        work.wait()
        stats = work.stats()
        self.schedule = getattr(stats, "schedule", None)
        return float(stats.bytes_sent), self.numeric_stats(stats)

    @staticmethod
    def numeric_stats(stats) -> dict:
        """A WorkStats as {field: float}, without the fields that were not measured (None: quant_err_sq and
        quant_in_sq of the exact codec) and those that are not numbers (the schedule's name)."""
        values = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
        return {name: float(v) for name, v in values.items() if v is not None and not isinstance(v, str)}

    def close(self) -> None:
        """Closes the ring's sockets and threads."""
        self.ring.close()


class PrimeGroupAdapter(RingAdapter):
    """The ring through torch.distributed: a backend="prime" group and dist.all_reduce, with
    the ring options RingAdapter gives (pg-prime-fp32: exact; pg-prime-int8: int8)."""

    def __init__(self, store, rank: int, world_size: int, spec: dict, method: str):
        import torch.distributed as dist

        from prime.comm.backend import PrimeOptions

        options = PrimeOptions(codec="int8" if method == "pg-prime-int8" else "none", streams=spec["streams"],
                               secret=f"bench-{spec['seed']}", max_rate=spec["max_rate_bytes"],
                               bind_addr=spec["addr"] or None, advertise_addr=spec["addr"] or None)
        # Every rank creates the groups in the same order (the methods' order), as new_group needs.
        self.group = dist.new_group(backend="prime", pg_options=options,
                                    timeout=timedelta(seconds=spec["timeout_s"]))

    def all_reduce(self, tensor) -> tuple[float | None, dict]:
        """dist.all_reduce(SUM) on the prime group; the Work's ring statistics as RingAdapter's."""
        import torch.distributed as dist

        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        work.wait()  # what dist.all_reduce(async_op=False) does
        stats = work.stats()  # the ring's WorkStats (prime.comm.backend.PrimeWork)
        return float(stats.bytes_sent), self.numeric_stats(stats)

    def close(self) -> None:
        """Nothing: destroy_process_group() at the worker's end shuts the group down."""


def worker_main(spec: dict) -> None:
    """One rank: runs every (size, method) case of the spec; rank 0 prints a RESULT line per case."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    rank, world = spec["rank"], spec["world_size"]
    device = torch.device("cpu")
    if spec["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=spec["timeout_s"])
    store = dist.TCPStore(spec["store_host"], spec["store_port"], world, is_master=(rank == 0),
                          timeout=timeout, wait_for_workers=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world,
                            timeout=timeout)
    rings: dict[str, RingAdapter] = {}

    def emit(obj: dict) -> None:
        if rank == 0:
            print(RESULT_TAG + json.dumps(obj), flush=True)

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    try:
        for size_mib in spec["sizes_mib"]:
            n = size_mib * MiB // 4
            x = make_input(spec["seed"], rank, n).to(device)
            ref = exact_sum(spec["seed"], world, n) if rank == 0 else None
            buf = torch.empty_like(x)
            for method in spec["methods"]:
                case = {"size_bytes": 4 * n, "method": method}
                skip = spec["skips"].get(f"{size_mib}:{method}")
                if skip:
                    emit({**case, "skipped": skip})
                    continue
                try:
                    if not method.startswith("gloo") and method not in rings:
                        adapter = PrimeGroupAdapter if method in PG_METHODS else RingAdapter
                        rings[method] = adapter(store, rank, world, spec, method)
                except Exception as e:  # the ring is not there yet, or refused the options
                    emit({**case, "skipped": f"ring unavailable: {type(e).__name__}: {e}"})
                    spec["skips"].update({f"{s}:{method}": "ring unavailable" for s in spec["sizes_mib"]})
                    continue
                work_buf = buf.to(torch.bfloat16) if method == "gloo-bf16" else buf

                def once() -> tuple[float, float | None]:
                    work_buf.copy_(x)
                    if spec["refill_s"]:
                        time.sleep(spec["refill_s"])  # every iteration starts with a full token bucket
                    if spec["idle_s"]:
                        time.sleep(spec["idle_s"])
                    dist.barrier()
                    t0 = time.perf_counter()
                    stats = {}
                    if method.startswith("gloo"):
                        dist.all_reduce(work_buf, op=dist.ReduceOp.SUM)
                        sent = None
                    else:
                        sent, stats = rings[method].all_reduce(work_buf)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # the op may return before the GPU is done
                    ring_stats.append(stats)
                    return time.perf_counter() - t0, sent

                first = None
                ring_stats: list[dict] = []
                for _ in range(spec["warmup"]):
                    first = once()[0]
                # The number of timed iterations comes from the slowest rank's warm-up time,
                # so every rank loops the same number of times.
                est = slowest([first if first is not None else 0.0])[0]
                iters = spec["max_iters"] if est <= 0 else int(spec["case_budget_s"] / (est + spec["refill_s"]
                                                                                        + spec["idle_s"]))
                iters = max(spec["min_iters"], min(spec["max_iters"], iters))
                times, sent = [], []
                ring_stats.clear()
                for _ in range(iters):
                    dt, s = once()
                    times.append(dt)
                    sent.append(s)
                times = slowest(times)
                wire = None
                if all(s is not None for s in sent):
                    wire = max(slowest([sum(sent) / len(sent)]))
                # Do all ranks hold the same result? (float64 sum and sum of squares per rank)
                digest = torch.zeros(world, 2, dtype=torch.float64)
                xd = work_buf.double()
                digest[rank, 0], digest[rank, 1] = float(xd.sum()), float((xd * xd).sum())
                del xd
                dist.all_reduce(digest)
                spread = float(((digest - digest[0]).abs() / digest[0].abs().clamp_min(1e-30)).max())
                row = {**case, "iters": iters, "times_s": times, "wire_bytes": wire, "ranks_agree_rel": spread}
                if rank == 0:
                    if device.type == "cuda" and method.startswith("ring-int8"):
                        # What the ring's CPU quantize would cost on the GPU instead (the same tensor, median
                        # of 10); rank 0 alone, so ranks sharing a GPU do not time each other's launches.
                        row["gpu_quantize_s"] = gpu_quantize_seconds(x, rings[method].block)
                    row["rel_l2_err"] = rel_l2(work_buf, ref)
                    keys = set().union(*ring_stats) if ring_stats else set()
                    row["ring_stats_rank0"] = {k: sum(st.get(k, 0.0) for st in ring_stats) / len(ring_stats)
                                               for k in sorted(keys)}
                    adapter = rings.get(method)
                    if getattr(adapter, "schedule", None):
                        row["schedule"] = adapter.schedule
                        row["order"] = list(getattr(adapter.ring, "order", []))
                        links = getattr(adapter.ring, "links", None)
                        row["links_rank0"] = links() if callable(links) else None
                emit(row)
            del x, ref, buf
    finally:
        for r in rings.values():
            r.close()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# parent: launch rank processes per (condition, world size), collect rows


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (a large number where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def plan_skips(plan: Plan, cond: Condition, world: int) -> dict[str, str]:
    """Cases to skip, with a reason: too much memory for this machine, or too long at this rate."""
    skips = {}
    avail = mem_available_bytes()
    for size_mib in plan.sizes_mib:
        nbytes = size_mib * MiB
        # Per rank: input + result buffer + a bf16 copy + about one tensor of ring buffers;
        # rank 0 also holds the float64 reference (2x); plus ~400 MB of torch per process.
        need = world * (3.5 * nbytes + 400 * MiB) + 2 * nbytes
        for method in plan.methods:
            key = f"{size_mib}:{method}"
            if need > 0.85 * avail:
                skips[key] = f"needs ~{need / (1 << 30):.1f} GiB of {avail / (1 << 30):.1f} GiB available"
                continue
            rate = cond.rate_bits or LOOPBACK_ASSUMED_BITS
            if cond.kind == "ratelimit" and method.startswith("gloo"):
                skips[key] = "gloo has no rate limit"
                continue
            predicted = expected_wire_bytes(method, nbytes // 4, world) * 8 / rate + 2 * world * cond.rtt_s
            if method.startswith("gloo") and cond.rtt_s:
                # gloo keeps one TCP stream per pair, window-limited to ~2.8 MB in flight
                predicted = max(predicted, expected_wire_bytes(method, nbytes // 4, world) / 2.8e6 * cond.rtt_s)
            if predicted * (plan.warmup + plan.min_iters) > plan.max_case_s:
                skips[key] = f"predicted {predicted:.0f} s per iteration (over --max-case-s)"
    return skips


def condition_topology(cond: Condition, world: int, shape: str):
    """The delay line's topology of a netem-* or topo-* condition."""
    if cond.kind == "topo":
        topo = netem.Topology.from_json(cond.topology)
        if topo.n != world:
            raise ValueError(f"topology {topo.name} has {topo.n} nodes, not {world}")
        return topo
    return netem.Topology.uniform(world, cond.rate_bits, cond.rtt_s, loss=cond.loss, jitter_s=cond.jitter_s,
                                  shape=shape)


def best_order(topology: dict) -> list[int]:
    """The best ring order of a topology, by brute force over every ring (prime.comm.links)."""
    from prime.comm.links import LinkTable, brute_force_order

    return brute_force_order(LinkTable.from_rows(*netem.Topology.from_json(topology).link_rows()))


def _die_with_parent() -> None:
    # Runs in the child before exec: the kernel SIGKILLs it when the benchmark process dies,
    # even by SIGKILL, so no rank outlives the run (prctl PR_SET_PDEATHSIG = 1; survives exec).
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _pump(stream, sink: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        sink.put(line)
    sink.put(None)


def run_group(plan: Plan, cond: Condition, world: int, on_row, logdir: str) -> None:
    """Runs all sizes and methods for one (condition, world size); calls on_row(row) per case."""
    skips = plan_skips(plan, cond, world)
    expected = len(plan.sizes_mib) * len(plan.methods)
    base = {
        "world_size": world, "sizes_mib": plan.sizes_mib, "methods": plan.methods, "streams": plan.streams,
        "warmup": plan.warmup, "idle_s": plan.idle_s, "netns_sysctl": plan.netns_sysctl,
        "min_iters": plan.min_iters, "max_iters": plan.max_iters,
        "case_budget_s": plan.case_budget_s, "threads": plan.threads, "device": plan.device, "seed": plan.seed,
        "timeout_s": plan.timeout_s, "skips": skips,
        "max_rate_bytes": cond.rate_bits / 8 if cond.kind == "ratelimit" else None,
        "best_order": best_order(cond.topology) if cond.topology else None,
        # tbf lets a full bucket (the burst) through at once; waiting burst/rate before each
        # iteration refills it, so every iteration gets the same credit (link_util_burst_adj).
        "idle_s": plan.idle_s,
        "refill_s": 1.1 * netns.size_to_bytes(plan.burst) * 8 / cond.rate_bits
        if cond.kind == "tc" and cond.rate_bits else 0.0,
    }
    env = dict(os.environ, OMP_NUM_THREADS=str(plan.threads))
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    net = None
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        if cond.kind == "tc":
            net = netns.Network(world, rate=cond.rate, shape=plan.shape, mtu=plan.mtu, burst=plan.burst)
            net.up()
            env["GLOO_SOCKET_IFNAME"] = netns.RANK_IFNAME
            store_host, store_port = net.addr(0), STORE_PORT_NETNS
        elif cond.kind in ("netem", "topo"):
            net = netem.Emulator(condition_topology(cond, world, plan.shape), gso=plan.gso, mtu=plan.mtu,
                                 seed=plan.seed)
            net.up()
            env["GLOO_SOCKET_IFNAME"] = netem.IFNAME
            store_host, store_port = net.addr(0), STORE_PORT_NETNS
        else:
            env["GLOO_SOCKET_IFNAME"] = "lo"
            store_host, store_port = "127.0.0.1", free_port()
        for rank in range(world if net else 0):
            for kv in plan.netns_sysctl:
                subprocess.run(net.exec_argv(rank, ["sysctl", "-qw", kv]), check=True)
        for rank in range(world):
            addr = net.addr(rank) if net else "127.0.0.1"
            spec = dict(base, rank=rank, store_host=store_host, store_port=store_port, addr=addr)
            argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
            if net:
                argv = net.exec_argv(rank, argv)
            log = open(os.path.join(logdir, f"{cond.name}-w{world}-r{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if rank == 0 else log,
                                          stderr=log, text=True, start_new_session=True,
                                          preexec_fn=_die_with_parent))
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(procs[0].stdout, lines), daemon=True).start()
        got = 0
        # A case may take (warmup + max iters) slow iterations; give it that and some.
        idle_limit = plan.timeout_s * 2 + 60
        last = time.monotonic()
        while got < expected:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line.startswith(RESULT_TAG):
                row = json.loads(line[len(RESULT_TAG):])
                row.update(condition=cond.name, world_size=world)
                on_row(row)
                got += 1
                last = time.monotonic()
            elif line:
                print(f"  [rank 0] {line.rstrip()}", flush=True)
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank(s) {failed} exited with {[procs[i].returncode for i in failed]}")
            if time.monotonic() - last > idle_limit:
                raise RuntimeError(f"no case finished for {idle_limit:.0f} s: ranks hang")
        for p in procs:
            p.wait(timeout=plan.timeout_s)
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if bad or got < expected:
            raise RuntimeError(f"ranks ended with {bad or 'exit 0'} after {got} of {expected} cases")
    except Exception as e:
        tails = []
        for i, log in enumerate(logs):
            log.flush()
            log.seek(0)
            text = log.read().strip().splitlines()[-15:]
            if text:
                tails.append(f"--- rank {i} log (last lines) ---\n" + "\n".join(text))
        print(f"! {cond.name} world {world} failed: {e}\n" + "\n".join(tails), file=sys.stderr, flush=True)
        on_row({"condition": cond.name, "world_size": world, "failed": str(e)})
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for log in logs:
            log.close()
        if net:
            net.down()


# ---------------------------------------------------------------------------
# output


def finish_row(row: dict, conditions: dict[str, Condition], burst_bytes: int) -> dict:
    """Adds the metrics to a raw case row from a worker."""
    if "times_s" not in row:
        return row
    n = row["size_bytes"] // 4
    world = row["world_size"]
    if row["method"].startswith("gloo"):
        row["wire_bytes"] = expected_wire_bytes(row["method"], n, world)
        row["wire_source"] = "theory"
    else:
        row["wire_source"] = "ring counters" if row.get("wire_bytes") is not None else "unknown"
    cond = conditions[row["condition"]]
    burst = burst_bytes if cond.kind == "tc" and cond.rate_bits else 0
    row.update(row_metrics(row["times_s"], n, world, row["wire_bytes"], cond.rate_bits, burst))
    # Rows where the token bucket's burst is a tenth or more of the bytes sent mostly time the burst.
    row["burst_dominated"] = bool(burst and row["wire_bytes"] and burst >= 0.1 * row["wire_bytes"])
    return row


def progress_line(row: dict) -> str:
    """One line per finished case, printed while the benchmark runs."""
    head = f"{row['condition']:>16} N={row['world_size']}"
    if "failed" in row:
        return f"{head} FAILED: {row['failed']}"
    head += f" {fmt_size(row['size_bytes']):>9} {row['method']:<18}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    util = fmt_pct(row.get("link_util"))
    if row.get("link_util_burst_adj") is not None:
        util += f" ({fmt_pct(row['link_util_burst_adj'])} burst-adj)"
    if row.get("burst_dominated"):
        util += " [burst-dominated]"
    err = f"{row['rel_l2_err']:.2e}" if row.get("rel_l2_err") is not None else "-"
    agree = f"  RANKS DIFFER by {row['ranks_agree_rel']:.1e}" if row.get("ranks_agree_rel") else ""
    sched = f"  [{row['schedule']}]" if row.get("schedule") else ""
    return (f"{head} median {row['median_s']:.4f} s  p90 {row['p90_s']:.4f} s  busbw {fmt_bits(row['busbw_bits'])}"
            f"  util {util}  err {err}  ({row['iters']} iters){agree}{sched}")


def table(rows: list[dict]) -> str:
    """The final table, one line per measured case."""
    hdr = (f"{'condition':>16} {'N':>2} {'size':>9} {'method':<18} {'median s':>9} {'p90 s':>9} {'algbw':>7} "
           f"{'busbw':>7} {'wire/rank':>10} {'util':>7} {'adj':>6} {'x gloo32':>8} {'x bf16':>7} {'x ring32':>8} {'rel L2':>9}"
           f" {'sched':>6}")
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        if "median_s" not in r:
            continue

        def sp(key):
            v = r.get(key)
            return f"{v:.2f}" if v else "-"

        util, adj = fmt_pct(r.get("link_util")), fmt_pct(r.get("link_util_burst_adj"))
        if r.get("burst_dominated"):
            util += "*"
        err = f"{r['rel_l2_err']:.2e}" if r.get("rel_l2_err") is not None else "-"
        out.append(f"{r['condition']:>16} {r['world_size']:>2} {fmt_size(r['size_bytes']):>9} {r['method']:<18} "
                   f"{r['median_s']:>9.4f} {r['p90_s']:>9.4f} {fmt_bits(r['algbw_bits']):>7} "
                   f"{fmt_bits(r['busbw_bits']):>7} {fmt_size(r.get('wire_bytes')):>10} {util:>7} {adj:>6} "
                   f"{sp('speedup_vs_gloo-fp32'):>8} {sp('speedup_vs_gloo-bf16'):>7} {sp('speedup_vs_ring-fp32'):>8} "
                   f"{err:>9} {r.get('schedule') or '-':>6}")
    out.append("")
    out.append("time: slowest rank, median and p90 over the timed iterations; algbw = fp32 tensor bytes / time;")
    out.append("busbw = algbw * 2(N-1)/N; wire/rank: the ring's counters, gloo's theory; util = (wire / rate) / time;")
    out.append("adj = util with one tbf burst credited ((wire - burst) / rate / time); * = burst >= 10% of wire bytes,")
    out.append("so the row mostly times the burst; x gloo32 / x bf16 / x ring32 = that method's median / this one's;")
    out.append("rel L2 = ||result - float64 sum|| / ||float64 sum|| on rank 0; sched = the ring's schedule (the last")
    out.append("iteration's; ring or direct).")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> str | None:
    """Median time vs size, one line per method; one panel per link condition (rows of the
    figure) and world size (columns). Returns why it drew nothing, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    measured = [r for r in rows if "median_s" in r]
    if not measured:
        return "no measured rows"
    conds = list(dict.fromkeys(r["condition"] for r in measured))
    worlds = sorted({r["world_size"] for r in measured})
    sizes = sorted({r["size_bytes"] / MiB for r in measured})
    fig, axes = plt.subplots(len(conds), len(worlds), figsize=(5 * len(worlds), 3.8 * len(conds)), squeeze=False)
    for i, cond in enumerate(conds):
        for j, world in enumerate(worlds):
            ax = axes[i][j]
            drawn = False
            for method in ALL_METHODS:
                pts = sorted((r["size_bytes"] / MiB, r["median_s"]) for r in measured
                             if r["condition"] == cond and r["world_size"] == world and r["method"] == method)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=method)
                    drawn = True
            if not drawn:
                ax.set_visible(False)
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([f"{s:g}" for s in sizes])
            ax.set_xlabel("fp32 MiB per rank")
            ax.set_ylabel("median time (s)")
            ax.set_title(f"{cond}, {world} ranks")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def machine_description() -> str:
    """CPU count, model and kernel, for the record."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} cpus ({model}), {platform.system()} {platform.release()}, load at start {load:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Parent: plan, run every (condition, world size) group, write table, JSON and PNG."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(json.loads(argv[1]))
        return 0
    netns.install_signal_handlers()
    tc_reason = netns.check_support()
    try:
        plan = make_plan(argv, tc_reason)
    except ValueError as e:
        print(f"bench_allreduce: {e}", file=sys.stderr)
        return 2
    if tc_reason is None:
        stale = netns.remove_stale()
        if stale:
            print(f"removed namespaces left by dead runs: {', '.join(stale)}")
    for note in plan.notes:
        print(f"note: {note}")
    command = "python benchmarks/bench_allreduce.py " + " ".join(shlex.quote(a) for a in argv)
    machine = machine_description()
    print(f"machine: {machine}\nseed: {plan.seed}\ncommand: {command}")
    if any(c.kind == "tc" for c in plan.conditions):
        print(f"tc links: tbf burst {plan.burst} latency {netns.TBF_LATENCY}, shaped {plan.shape}, mtu {plan.mtu}")
    if any(c.kind in ("netem", "topo") for c in plan.conditions):
        print(f"delay line (benchmarks/netem.py): drop-tail queues of one BDP, mtu {plan.mtu}, "
              f"{'gso' if plan.gso else 'no gso'}, shaped {plan.shape}")
    conditions = {c.name: c for c in plan.conditions}
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(finish_row(row, conditions, netns.size_to_bytes(plan.burst)))
        print(progress_line(row), flush=True)

    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_allreduce_") as logdir:
            for cond in plan.conditions:
                for world in plan.world_sizes:
                    run_group(plan, cond, world, on_row, logdir)
    except (KeyboardInterrupt, SystemExit) as e:
        # run_group's finally has already killed the ranks and removed the namespaces.
        code = e.code if isinstance(e, SystemExit) else 130
        print(f"\ninterrupted after {len(rows)} cases; rank processes and namespaces removed", file=sys.stderr)
        return code
    add_speedups(rows)
    print()
    print(table(rows))
    os.makedirs(os.path.dirname(plan.out) or ".", exist_ok=True)
    record = {
        "machine": machine, "command": command, "seed": plan.seed,
        "torch": _torch_version(), "elapsed_s": time.time() - t0,
        "config": {k: v for k, v in asdict(plan).items() if k not in ("conditions", "notes")},
        "conditions": [asdict(c) for c in plan.conditions], "notes": plan.notes,
        "tc": {"burst": plan.burst, "latency": netns.TBF_LATENCY, "shape": plan.shape, "mtu": plan.mtu},
        "rows": rows,
    }
    with open(plan.out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print(f"\nwrote {plan.out}.json", end="")
    if plan.plot:
        why = plot(rows, plan.out + ".png")
        print(f", {plan.out}.png" if why is None else f" (no plot: {why})", end="")
    print()
    return 1 if any("failed" in r for r in rows) else 0


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
