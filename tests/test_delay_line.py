"""The ring on links with a round-trip time: three ranks, each in its own network namespace on
the delay line of benchmarks/netem.py (1 Gbit/s, RTT 100 ms). The ring measures the round trip
while forming, opens the streams that the path's bandwidth-delay product needs, and a
collective that shares the uplink among its links (the direct schedule) takes its streams in
turn, so none is cold when a collective needs them all; a link that loses packets paces its
streams' writes to the rate it measured (only when its round trip shows its own queue). Needs root and /dev/net/tun (skipped elsewhere); about
25 s."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import netem  # noqa: E402

pytestmark = pytest.mark.skipif(netem.support() is not None, reason=str(netem.support()))

RTT_S = 0.1
STORE_PORT = 29641

RANK = """
    import json, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from prime.comm import Ring

    rank, world, store_host, addr, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    schedules, numel, for_s = sys.argv[6].split(","), int(sys.argv[7]), float(sys.argv[8])
    store = dist.TCPStore(store_host, {port}, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed * 101 + rank))
    out = {{}}
    with Ring(store, rank, world, secret=b"delay-line", job_id="delay-line", bind_addr=addr, advertise_addr=addr,
              timeout=60) as ring:
        for schedule in schedules:
            y = x.clone()
            start = time.monotonic()
            ring.all_reduce(y, op="avg", schedule=schedule).wait()
        # Then the last schedule back to back for about for_s seconds: rank 0 counts how many
        # collectives that takes from the last one's time, every rank runs as many.
        if rank == 0:
            store.set("runs", str(int(for_s / (time.monotonic() - start)) + 1 if for_s > 0 else 0))
        runs = int(store.get("runs"))
        store.add("read runs", 1)
        for _ in range(runs):
            y = x.clone()
            ring.all_reduce(y, op="avg", schedule=schedules[-1]).wait()
        out["runs"] = runs
        out["links"] = ring.links()
        out["result"] = y.double().sum().item(), (y.double() ** 2).sum().item()
        out["y"] = y.tolist()[:4096]
    while rank == 0 and store.add("read runs", 0) < world:  # rank 0 hosts the store: no exit before every get
        time.sleep(0.05)
    print(json.dumps(out), flush=True)
"""


def _run(topo, seed, schedules, numel=1 << 22, for_s=0.0, **env_vars):
    world = topo.n
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env_vars)
    code = textwrap.dedent(RANK.format(port=STORE_PORT))
    with netem.Emulator(topo) as net:
        procs = [subprocess.Popen(net.exec_argv(r, [sys.executable, "-c", code, str(r), str(world), net.addr(0),
                                                    net.addr(r), str(seed), ",".join(schedules), str(numel),
                                                    str(for_s)]),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def test_ring_on_a_100ms_path_measures_it_and_keeps_every_stream_warm():
    seed = int.from_bytes(os.urandom(2), "little")
    print("seed", seed)
    world = 3
    outs = _run(netem.Topology.uniform(world, 1e9, RTT_S), seed, ["direct", "direct", "direct", "ring"])

    import torch

    xs = [torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed * 101 + r)).double() for r in range(world)]
    mean = (sum(xs) / world)[:4096]
    for r, out in enumerate(outs):
        assert out["result"] == outs[0]["result"], "ranks disagree"
        y = torch.tensor(out["y"], dtype=torch.float64)
        assert float((y - mean).norm() / mean.norm()) < 0.02
        assert len(out["links"]) == world - 1
        for link in out["links"]:
            # The round trip it measured while forming: the delay line's, within 10%.
            assert link["handshake_rtt_s"] == pytest.approx(RTT_S, rel=0.10), link
            # At 100 ms one stream's autotuned window holds a quarter of 1 Gbit/s: it wants several.
            assert link["wanted"] >= 4, link
            # The direct collectives shared the uplink (half the streams each), in turn: every
            # stream the link wants carried data, and those it does not want carried none.
            used = [b > 0 for b in link["stream_bytes"]]
            assert used[:link["wanted"]] == [True] * link["wanted"], (r, link)
            assert not any(used[link["wanted"]:]), (r, link)


def test_random_loss_on_an_empty_path_does_not_pace_the_link():
    """Random loss on every path, collectives far smaller than the path's queue: TCP
    retransmits, but the round trip never shows a queue, so no link is paced (pacing would
    only slow a link whose losses are not its own)."""
    seed = int.from_bytes(os.urandom(2), "little")
    print("seed", seed)
    world = 3
    outs = _run(netem.Topology.uniform(world, 1e9, RTT_S, loss=0.002), seed, ["ring"] * 4)
    for r, out in enumerate(outs):
        assert out["result"] == outs[0]["result"], "ranks disagree"
        # The ring schedule sends on one link: to the right neighbour.
        link = next(link for link in out["links"] if link["bytes_sent"] > 0)
        assert link["retransmits"] > 0, (r, link)
        assert link["peak_srtt_s"] < 1.5 * link["rtt_s"], (r, link)
        assert not link["paced"] and link["pacing_rate"] == 0, (r, link)


def _assert_unpaced_without_loss(outs) -> None:
    """No loss at 100 ms (the delay line's queue holds a bandwidth-delay product): TCP sends as it would, unpaced,
    and the link's rate is measured all the same: the delay line's, within the estimate's bounds."""
    payload_rate = 1e9 / 8 * 0.95
    for r, out in enumerate(outs):
        for link in out["links"]:
            assert 0.4 * payload_rate < link["uplink_rate"] < 1.6 * payload_rate, (r, link)
            if link["retransmits"] == 0:
                assert not link["paced"] and link["pacing_rate"] == 0, (r, link)


def _bbr_is_the_default():
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip() == "bbr"


@pytest.mark.skipif(_bbr_is_the_default(), reason="checked on the runs of the BBR test below")
def test_a_link_that_loses_nothing_is_not_paced():
    seed = int.from_bytes(os.urandom(2), "little")
    _assert_unpaced_without_loss(_run(netem.Topology.uniform(2, 1e9, RTT_S), seed, ["ring"] * 3, numel=1 << 24))


# Back to back for longer than BBR's 10 s minimum-RTT window, with a margin of 40%: one window
# expires inside the run, which is what both halves of the test need (a ProbeRTT left alone, one
# renewal by a restart); the run was 20 s before, 12 s of the CI's wall time for nothing more.
FOR_S = 14.0


@pytest.mark.skipif(not _bbr_is_the_default(), reason="the host's TCP congestion control is not BBR")
def test_back_to_back_collectives_keep_bbr_out_of_probe_rtt():
    """Collectives back to back for longer than BBR's 10 s minimum-RTT window (FOR_S): left alone,
    streams enter ProbeRTT inside collectives (their window falls to 4 packets); the ring
    restarts BBR on each stream before a collective its window would expire in, and none
    does. Also: a link that loses nothing is not paced, and its rate is measured."""
    seed = int.from_bytes(os.urandom(2), "little")
    print("seed", seed)
    topo = netem.Topology.uniform(2, 1e9, RTT_S)
    for restart in (False, True):
        outs = _run(topo, seed, ["ring"] * 2, numel=1 << 24, for_s=FOR_S, PRIME_RING_RESTART_BBR=str(int(restart)))
        assert outs[0]["result"] == outs[1]["result"], "ranks disagree"
        assert outs[0]["runs"] == outs[1]["runs"] > 0
        _assert_unpaced_without_loss(outs)  # (the same lossless 2-rank path, 64 MiB back to back)
        links = [link for out in outs for link in out["links"]]
        probes = sum(link["probe_rtts"] for link in links)
        print("restart", restart, "runs", outs[0]["runs"], "probe_rtts", [link["probe_rtts"] for link in links],
              "restarts", [link["bbr_restarts"] for link in links])
        if restart:
            assert probes == 0, links
            # Every stream of every link at its first collective, and again before its window ran out.
            assert all(link["bbr_restarts"] >= 2 * link["streams"] for link in links), links
        else:
            assert probes > 0, links  # what the restarts avoid, seen by the same count
            assert all(link["bbr_restarts"] == 0 for link in links), links
