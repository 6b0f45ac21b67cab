"""The all-reduce benchmark's harness: argument checks, metric math, seeded inputs, and one
tiny unshaped run with 2 gloo ranks on 127.0.0.1. Nothing here needs root or namespaces;
timing itself is never asserted (it belongs to benchmarks/)."""

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_allreduce as bench  # noqa: E402
import fake_ring  # noqa: E402  (tests/ is on sys.path under pytest)
import netns  # noqa: E402


# ---------------------------------------------------------------------------
# arguments


def test_plan_defaults_without_tc_use_rate_limit_conditions():
    plan = bench.make_plan(["--seed", "1"], tc_reason="no tc here")
    assert [c.name for c in plan.conditions] == ["loopback", "ratelimit-100mbit", "ratelimit-1gbit",
                                                 "ratelimit-10gbit"]
    assert plan.world_sizes == [2, 4, 8]
    assert plan.sizes_mib == [1, 4, 16, 64, 256, 1024]
    assert plan.methods == list(bench.DEFAULT_METHODS)


def test_plan_drops_tc_conditions_with_a_note_when_tc_is_missing():
    plan = bench.make_plan(["--conditions", "loopback,tc-1gbit", "--seed", "1"], tc_reason="needs root")
    assert [c.name for c in plan.conditions] == ["loopback"]
    assert any("tc-1gbit" in n and "needs root" in n for n in plan.notes)


def test_quick_plan_is_small():
    plan = bench.make_plan(["--quick"], tc_reason=None)
    assert [c.name for c in plan.conditions] == ["loopback", "tc-1gbit"]
    assert plan.world_sizes == [4] and plan.sizes_mib == [4, 64]
    assert plan.out.endswith("allreduce_quick")
    assert 0 <= plan.seed < 2**31


def test_netem_conditions_expand_per_rtt_and_take_loss():
    plan = bench.make_plan(["--conditions", "loopback,netem-1gbit", "--rtt", "0,100", "--loss", "0.001",
                            "--seed", "1"], tc_reason=None)
    names = [c.name for c in plan.conditions]
    import netem

    if netem.support() is not None:  # no root, TUN, iproute2 or compiler here: dropped with a note
        assert names == ["loopback"] and any(netem.support() in n for n in plan.notes), plan.notes
        return
    assert names == ["loopback", "netem-1gbit-rtt0-loss0.1%", "netem-1gbit-rtt100-loss0.1%"]
    c = plan.conditions[2]
    assert (c.kind, c.rate_bits, c.rtt_s, c.loss) == ("netem", 1e9, 0.1, 0.001)
    t = bench.condition_topology(c, 4, "both")
    assert t.n == 4 and t.rtt_s(0, 3) == pytest.approx(0.1) and t.loss[1][2] == 0.001


def test_topology_sets_the_world_size_and_the_best_order_is_brute_forced():
    plan = bench.make_plan(["--topology", "two-regions", "--methods", "ring-int8,ring-int8-bestorder", "--seed", "1"],
                           tc_reason=None)
    topo = [c for c in plan.conditions if c.kind == "topo"]
    if topo:
        assert plan.world_sizes == [6] and topo[0].name == "topo-two-regions-6"
    import netem

    order = bench.best_order(netem.two_regions(6).to_json())
    assert sum(order[p] % 2 != order[(p + 1) % 6] % 2 for p in range(6)) == 2, order
    with pytest.raises(ValueError, match="--world-sizes"):
        bench.make_plan(["--topology", "two-regions", "--world-sizes", "4"], tc_reason=None)
    with pytest.raises(ValueError, match="neither"):
        bench.parse_topology("no-such-topology")


def test_ring_variants_set_their_ring_options():
    assert bench.method_ring_options("ring-int8-direct", {}) == {"schedule": "direct"}
    assert bench.method_ring_options("ring-int8-classic", {}) == {"schedule": "ring", "order": "rank", "streams": 1}
    assert bench.method_ring_options("ring-int8-bestorder", {"best_order": [0, 2, 1]})["order"] == [0, 2, 1]
    assert bench.method_ring_options("ring-int8", {}) == {}


def test_conditions_parse_rates():
    c = bench.parse_condition("tc-100mbit")
    assert (c.kind, c.rate, c.rate_bits) == ("tc", "100mbit", 100e6)
    c = bench.parse_condition("ratelimit-2.5gbit")
    assert (c.kind, c.rate_bits) == ("ratelimit", 2.5e9)
    assert bench.parse_condition("loopback").rate_bits is None


@pytest.mark.parametrize("argv, words", [
    (["--world-sizes", "1,2"], "at least 2"),
    (["--world-sizes", "2,x"], "comma-separated integers"),
    (["--sizes", "0"], "positive"),
    (["--methods", "gloo-fp32,nccl"], "unknown method"),
    (["--conditions", "wan-1gbit"], "loopback"),
    (["--conditions", "tc-1gigabit"], "like '100mbit'"),
    (["--streams", "-1"], "--streams"),
    (["--conditions", "netem-1gbit-rttx"], "RTT"),
    (["--loss", "1.5"], "--loss"),
    (["--min-iters", "5", "--max-iters", "2"], "--min-iters"),
])
def test_bad_arguments_say_what_is_wrong(argv, words):
    with pytest.raises(ValueError, match=words):
        bench.make_plan(argv, tc_reason=None)


def test_tc_units():
    assert netns.rate_to_bits("1gbit") == 1e9
    assert netns.rate_to_bits("100mbit") == 1e8
    assert netns.size_to_bytes("4mb") == 4 << 20
    assert netns.size_to_bytes("256kb") == 256 << 10
    assert netns.size_to_bytes("1500") == 1500
    with pytest.raises(ValueError):
        netns.size_to_bytes("4 megabytes")


def test_network_refuses_bad_shapes_before_touching_anything():
    with pytest.raises(ValueError, match="world_size"):
        netns.Network(0)
    with pytest.raises(ValueError, match="shape"):
        netns.Network(2, rate="1gbit", shape="downlink")
    with pytest.raises(ValueError, match="burst"):
        netns.Network(2, rate="1gbit", mtu=9000, burst="8kb")
    net = netns.Network(3)
    assert net.addr(2) == "192.168.77.12"
    assert net.exec_argv(1, ["python", "x.py"]) == ["ip", "netns", "exec", net.ns(1), "python", "x.py"]
    assert net.ns(1).startswith(f"{netns.PREFIX}{os.getpid()}-")


# ---------------------------------------------------------------------------
# metric math


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng()
    for n in (1, 2, 3, 7, 10):
        v = rng.random(n).tolist()
        for q in (0, 50, 90, 100):
            assert bench.percentile(v, q) == pytest.approx(float(np.percentile(v, q)), rel=1e-12)


def test_int8_bytes_agree_with_the_codec():
    from prime import ops

    for n in (1, 63, 64, 65, 255, 256, 257, 1 << 20):
        assert bench.int8_bytes(n) == ops.wire_bytes(n) == ops.wire_bytes(n, 64)
        assert bench.int8_bytes(n, 128) == ops.wire_bytes(n, 128)
    assert bench.method_block("ring-fp4") == ops.default_block_size("fp4")


def test_row_metrics_by_hand():
    # 4 ranks, 64 MiB: gloo sends 1.5 x 64 MiB per rank; at 1 Gbit/s that takes 0.805306368 s.
    n = 16 << 20
    wire = bench.expected_wire_bytes("gloo-fp32", n, 4)
    assert wire == 1.5 * 64 * (1 << 20)
    floor = wire * 8 / 1e9
    t = floor / 0.9
    m = bench.row_metrics([t + 0.5, t, t - 0.1], n, 4, wire, 1e9, burst_bytes=4 << 20)
    assert m["median_s"] == pytest.approx(t)
    assert m["link_util"] == pytest.approx(0.9)
    assert m["link_util_burst_adj"] == pytest.approx((wire - (4 << 20)) * 8 / 1e9 / m["median_s"])
    assert m["algbw_bits"] == pytest.approx(64 * (1 << 20) * 8 / m["median_s"])
    assert m["busbw_bits"] == pytest.approx(1.5 * m["algbw_bits"])
    assert m["p90_s"] == pytest.approx(t + 0.8 * 0.5)
    # No link rate (loopback) or unknown wire bytes: no utilization.
    assert bench.row_metrics([1.0], n, 4, wire, None)["link_util"] is None
    assert bench.row_metrics([1.0], n, 4, None, 1e9)["link_util"] is None


def test_speedups_within_each_group_only():
    rows = [
        {"condition": "c", "world_size": 4, "size_bytes": 8, "method": "gloo-fp32", "median_s": 4.0},
        {"condition": "c", "world_size": 4, "size_bytes": 8, "method": "gloo-bf16", "median_s": 2.0},
        {"condition": "c", "world_size": 4, "size_bytes": 8, "method": "ring-int8", "median_s": 1.0},
        {"condition": "c", "world_size": 2, "size_bytes": 8, "method": "ring-int8", "median_s": 1.0},
    ]
    bench.add_speedups(rows)
    assert rows[2]["speedup_vs_gloo-fp32"] == 4.0 and rows[2]["speedup_vs_gloo-bf16"] == 2.0
    assert rows[3]["speedup_vs_gloo-fp32"] is None


def test_skips_for_memory_and_rate():
    plan = bench.make_plan(["--sizes", "1,1024", "--methods", "gloo-fp32,ring-int8", "--seed", "1",
                            "--max-case-s", "60"], tc_reason=None)
    skips = bench.plan_skips(plan, bench.parse_condition("tc-100mbit"), 2)
    assert "1:gloo-fp32" not in skips
    assert "predicted" in skips["1024:gloo-fp32"] or "GiB" in skips["1024:gloo-fp32"]
    skips = bench.plan_skips(plan, bench.parse_condition("ratelimit-1gbit"), 2)
    assert skips["1:gloo-fp32"] == "gloo has no rate limit" and "1:ring-int8" not in skips


# ---------------------------------------------------------------------------
# inputs and the float64 reference


def test_inputs_are_seeded_per_rank_and_the_reference_is_their_float64_sum():
    seed = int.from_bytes(os.urandom(4), "little")
    n = bench.CHUNK + 1000  # crosses a chunk boundary
    xs = [bench.make_input(seed, r, n) for r in range(3)]
    assert torch.equal(xs[0], bench.make_input(seed, 0, n)), f"seed {seed}"
    assert not torch.equal(xs[0][:1000], xs[1][:1000]), f"seed {seed}"
    assert 0.9 < float(xs[0].std()) < 1.1
    ref = bench.exact_sum(seed, 3, n)
    assert torch.equal(ref, xs[0].double() + xs[1].double() + xs[2].double()), f"seed {seed}"
    noisy = ref + 1e-3 * torch.randn(n, dtype=torch.float64)
    direct = float(torch.linalg.vector_norm(noisy - ref) / torch.linalg.vector_norm(ref))
    assert bench.rel_l2(noisy.float(), ref) == pytest.approx(direct, rel=1e-3)


def test_ring_adapter_reads_work_stats_by_field():
    from prime.comm import WorkStats

    stats = WorkStats(seq=3, numel=10, bytes_sent=123, bytes_received=7, frames_sent=2, frames_received=2,
                      quantize_s=0.25, reduce_s=0.5, wait_s=0.0, commit_s=0.0, queue_s=0.0, total_s=1.0)

    class Work:
        def wait(self):
            return True

        def stats(self):
            return stats

    class Ring:
        def all_reduce(self, tensor, op, codec, block_size):
            assert (op, codec, block_size) == ("sum", "int8", 64)
            return Work()

    adapter = bench.RingAdapter.__new__(bench.RingAdapter)  # no store, no sockets
    adapter.ring, adapter.codec, adapter.block, adapter.keep = Ring(), "int8", 64, {}  # keep: topk's k only
    adapter.error_feedback = False  # (topk's -ef methods pass a residual)
    sent, numeric = adapter.all_reduce(torch.zeros(4))
    assert sent == 123.0
    assert numeric["bytes_received"] == 7.0 and numeric["quantize_s"] == 0.25 and numeric["seq"] == 3.0
    # every field, but those not measured (None: the int8 error sums here) and the schedule's name
    assert set(numeric) == {f for f in WorkStats.__dataclass_fields__} - {"quant_err_sq", "quant_in_sq", "schedule"}
    stats = dataclasses.replace(stats, quant_err_sq=0.5, quant_in_sq=2.0)
    _, numeric = adapter.all_reduce(torch.zeros(4))
    assert numeric["quant_err_sq"] == 0.5 and numeric["quant_in_sq"] == 2.0
    assert set(numeric) == {f for f in WorkStats.__dataclass_fields__} - {"schedule"}


def test_the_ring_and_its_stand_in_follow_the_ring_protocol():
    import torch.distributed as dist

    from prime import _extension
    from prime.comm import Ring, RingProtocol, WorkProtocol

    work = fake_ring._Work(4, 16, 0.1)
    assert isinstance(work, WorkProtocol) and work.stats().bytes_sent == 16
    assert not isinstance(object(), WorkProtocol)
    for name in ("all_reduce", "close"):
        assert callable(getattr(fake_ring.FakeRing, name))
    if _extension.available():
        with Ring(dist.HashStore(), 0, 1) as ring:
            assert isinstance(ring, RingProtocol)
            w = ring.all_reduce(torch.ones(3))
            assert isinstance(w, WorkProtocol) and w.wait() and w.stats().numel == 3


# ---------------------------------------------------------------------------
# one tiny run, end to end


def test_tiny_unshaped_run_of_gloo_and_of_the_ring_path(tmp_path):
    # Two rank processes on 127.0.0.1, 1 MiB, gloo baselines plus the harness's ring path
    # (adapter, wire counters, error measure) through tests/fake_ring.py, which quantizes
    # once with the reference codec and sums with gloo: the real ring is tested elsewhere.
    out = tmp_path / "res"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_allreduce.py"), "--conditions",
           "loopback,ratelimit-1gbit", "--world-sizes", "2", "--sizes", "1", "--methods",
           "gloo-fp32,gloo-bf16,ring-fp32,ring-int8", "--warmup", "1", "--min-iters", "2", "--max-iters", "3",
           "--timeout-s", "20", "--no-plot", "--out", str(out)]
    env = dict(os.environ, PRIME_BENCH_RING="fake_ring:FakeRing",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads((out.with_suffix(".json")).read_text())
    rows = {(r["condition"], r["method"]): r for r in rec["rows"]}
    seed = rec["seed"]
    n = (1 << 20) // 4
    assert len(rows) == 8, rec["rows"]
    for (cond, method), r in rows.items():
        if cond == "ratelimit-1gbit" and method.startswith("gloo"):
            assert r["skipped"] == "gloo has no rate limit"
            continue
        assert r["size_bytes"] == 4 * n and r["world_size"] == 2
        assert 2 <= r["iters"] <= 3 and len(r["times_s"]) == r["iters"]
        # the row's statistics are those of its own times (checked here with statistics.median)
        assert r["median_s"] == pytest.approx(statistics.median(r["times_s"]), rel=1e-12)
        assert r["algbw_bits"] == pytest.approx(4 * n * 8 / r["median_s"], rel=1e-12)
        if method.startswith("ring"):  # the fake ring sleeps fake_ring.DELAY_S in every all_reduce
            assert min(r["times_s"]) >= fake_ring.DELAY_S, r["times_s"]
        assert r["ranks_agree_rel"] == 0.0, f"ranks disagree (seed {seed})"
        assert r["busbw_bits"] == pytest.approx(r["algbw_bits"])  # 2 ranks: 2(N-1)/N = 1
        assert (r["link_util"] is None) == (cond == "loopback")
    # fp32 sum of two values is exact to one rounding; bf16 keeps 8 bits of mantissa.
    assert rows[("loopback", "gloo-fp32")]["rel_l2_err"] < 1e-7, f"seed {seed}"
    assert 1e-4 < rows[("loopback", "gloo-bf16")]["rel_l2_err"] < 1e-2, f"seed {seed}"
    assert rows[("loopback", "gloo-bf16")]["wire_bytes"] == 2 * n
    assert rows[("loopback", "gloo-fp32")]["speedup_vs_gloo-fp32"] == 1.0
    assert rows[("loopback", "gloo-fp32")]["ring_stats_rank0"] == {}  # gloo exposes no statistics
    # speedups are ratios of the row medians, within a condition
    for cond in ("loopback", "ratelimit-1gbit"):
        for method in ("ring-fp32", "ring-int8"):
            r = rows[(cond, method)]
            for base in ("gloo-fp32", "gloo-bf16", "ring-fp32"):
                b = rows[(cond, base)]
                want = b["median_s"] / r["median_s"] if "median_s" in b else None
                assert r[f"speedup_vs_{base}"] == (pytest.approx(want, rel=1e-12) if want else None), (cond, method, base)
    for cond in ("loopback", "ratelimit-1gbit"):
        fp32, int8 = rows[(cond, "ring-fp32")], rows[(cond, "ring-int8")]
        assert fp32["wire_source"] == "ring counters" and fp32["wire_bytes"] == 4 * n
        assert int8["wire_bytes"] == bench.int8_bytes(n)
        assert fp32["rel_l2_err"] < 1e-7, f"seed {seed}"
        # One quantization of each of 2 inputs: about 0.4% on normal data, never exact.
        assert 1e-3 < int8["rel_l2_err"] < 2e-2, f"seed {seed}"
    limited = rows[("ratelimit-1gbit", "ring-int8")]
    assert limited["link_util"] == pytest.approx(limited["wire_bytes"] * 8 / 1e9 / limited["median_s"])
    assert "loopback N=2" in proc.stdout and "ratelimit-1gbit N=2" in proc.stdout


# ---------------------------------------------------------------------------
# namespaces: only where this machine allows them (root, ip, tc); never left behind

needs_netns = pytest.mark.skipif(netns.check_support() is not None, reason=str(netns.check_support()))


@needs_netns
def test_network_is_shaped_both_ways_and_removed_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Network(2, rate="100mbit", burst="1mb") as net:
            names = netns.namespaces_of(os.getpid())
            assert sorted(names) == sorted([net.bridge_ns, net.ns(0), net.ns(1)])
            up = subprocess.run(net.exec_argv(1, ["tc", "qdisc", "show", "dev", netns.RANK_IFNAME]),
                                capture_output=True, text=True).stdout
            down = subprocess.run(["ip", "netns", "exec", net.bridge_ns, "tc", "qdisc", "show", "dev", "pvb1"],
                                  capture_output=True, text=True).stdout
            assert "tbf" in up and "100Mbit" in up, up
            assert "tbf" in down and "100Mbit" in down, down
            addr = subprocess.run(net.exec_argv(1, ["ip", "-4", "addr", "show", netns.RANK_IFNAME]),
                                  capture_output=True, text=True).stdout
            assert "192.168.77.11/24" in addr, addr
            raise RuntimeError("boom")
    assert netns.namespaces_of(os.getpid()) == []


@needs_netns
def test_network_is_removed_on_sigterm_and_leftovers_of_dead_runs_are_swept(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'benchmarks')!r})\n"
        "import netns\n"
        "netns.install_signal_handlers()\n"
        "with netns.Network(2):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n")
    for sig in ("TERM", "KILL"):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "up"
            assert len(netns.namespaces_of(proc.pid)) == 3
            proc.send_signal(getattr(__import__("signal"), "SIG" + sig))
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if sig == "KILL":  # nothing can run on SIGKILL: the next run sweeps what is left
            assert len(netns.namespaces_of(proc.pid)) == 3
            netns.remove_stale()
        assert netns.namespaces_of(proc.pid) == [], sig


# ---------------------------------------------------------------------------
# the ring order model (benchmarks/ring_order_model.py) against closed forms


def test_ring_order_model_meets_the_closed_forms_of_a_uniform_ring():
    """N ranks, every link rate R and one-way delay d. A tensor of many segments is bound by the
    rate: 2(N-1) chunks one after another on each link, then the last one's delay. A tensor of one
    segment per chunk is bound by the delays: each of the 2(N-1) steps waits for a segment's hop."""
    import ring_order_model as model

    n, rate, d = 4, 1e8, 0.03
    rates = [[rate] * n for _ in range(n)]
    delays = [[d] * n for _ in range(n)]
    big = n * 64 * model.SEGMENT_VALUES  # 64 segments per chunk
    seg_bytes = model.SEGMENT_VALUES * model.INT8_BYTES_PER_VALUE + model.FRAME_OVERHEAD
    want_big = 2 * (n - 1) * 64 * seg_bytes / rate + d
    assert model.ring_time(list(range(n)), rates, delays, big) == pytest.approx(want_big, rel=0.02)
    small = n * model.SEGMENT_VALUES
    want_small = 2 * (n - 1) * (seg_bytes / rate + d)
    assert model.ring_time(list(range(n)), rates, delays, small) == pytest.approx(want_small, rel=1e-9)
    # the order of a uniform ring does not matter
    assert model.ring_time([0, 2, 1, 3], rates, delays, big) == pytest.approx(want_big, rel=0.02)


# ---------------------------------------------------------------------------
# run summaries of GPU runs: a sparse codec's dense start is stated apart


def test_run_summaries_leave_a_dense_start_out_of_the_utilization(tmp_path, seed):
    """Two nodes' metrics with the first three outer steps marked dense (slow: the int8 wire) and the rest fast:
    run_summary.py's utilization after the dense start and outer_split.py --brief's count only the phases after
    it, and run_summary states the dense start's time and utilization apart; without the marks the first outer
    step alone is left out, as before."""
    import random as _random

    import run_summary
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))
    import outer_split

    rng = _random.Random(seed)
    phases = [(rng.uniform(5, 9), rng.uniform(1, 3)) for _ in range(3)] + [(10.0, rng.uniform(9.8, 9.99))
                                                                          for _ in range(5)]

    def write(dense: bool, where):
        where.mkdir()
        for node in (0, 1):
            with open(where / f"metrics_node{node}.jsonl", "w") as f:
                f.write(json.dumps({"kind": "step", "step": 80, "loss": 1.0, "step_s": 0.1}) + "\n")
                for k, (wall, comp) in enumerate(phases, 1):
                    rec = {"kind": "outer", "step": 10 * k, "outer_step": k, "node": node, "phase_s": wall,
                           "phase_compute_s": comp, "utilization": comp / wall, "outer_s": 0.01, "bytes_sent": 1}
                    if dense and k <= 3:
                        rec["dense"] = True
                    f.write(json.dumps(rec) + "\n")
        (where / "log.txt").write_text("[node 0] final weights identical on all 2 nodes: blake2b 00\n")

    write(True, tmp_path / "dense")
    write(False, tmp_path / "plain")
    after = sum(c for _, c in phases[3:]) / sum(w for w, _ in phases[3:])
    s = run_summary.summarize(str(tmp_path / "dense"))["nodes"][0]
    assert s["utilization_after_first_outer"] == pytest.approx(after) and s["dense_outer_steps"] == 3
    assert s["dense_start_s"] == pytest.approx(sum(w for w, _ in phases[:3]))
    assert s["utilization_dense_start"] == pytest.approx(sum(c for _, c in phases[:3]) / sum(w for w, _ in phases[:3]))
    plain = run_summary.summarize(str(tmp_path / "plain"))["nodes"][0]
    assert plain["utilization_after_first_outer"] == pytest.approx(sum(c for _, c in phases[1:]) /
                                                                   sum(w for w, _ in phases[1:]))
    assert plain["dense_outer_steps"] == 0
    import contextlib
    import io

    for run, words, mean in (("dense", "after the dense start (outer 3)", phases[3:]), ("plain", "after outer 1", phases[1:])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            outer_split.main(["--brief", str(tmp_path / run), str(tmp_path / run / "log.txt")])
        line = buf.getvalue()
        util = sum(c / w for w, c in mean) / len(mean)
        assert f"utilization {100 * util:.1f}% {words}" in line and "weights identical" in line, line
