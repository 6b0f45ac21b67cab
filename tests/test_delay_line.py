"""The ring on links with a round-trip time: three ranks, each in its own network namespace on
the delay line of benchmarks/netem.py (1 Gbit/s, RTT 100 ms). The ring measures the round trip
while forming, opens the streams that the path's bandwidth-delay product needs, and a
collective that shares the uplink among its links (the direct schedule) takes its streams in
turn, so none is cold when a collective needs them all. Needs root and /dev/net/tun (skipped
elsewhere); about 15 s."""

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
    import json, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from prime.comm import Ring

    rank, world, store_host, addr, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    store = dist.TCPStore(store_host, {port}, world, is_master=rank == 0, timeout=timedelta(seconds=60))
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed * 101 + rank))
    out = {{}}
    with Ring(store, rank, world, secret=b"delay-line", job_id="delay-line", bind_addr=addr, advertise_addr=addr,
              timeout=60) as ring:
        for schedule in ("direct", "direct", "direct", "ring"):
            y = x.clone()
            ring.all_reduce(y, op="avg", schedule=schedule).wait()
        out["links"] = ring.links()
        out["result"] = y.double().sum().item(), (y.double() ** 2).sum().item()
        out["y"] = y.tolist()[:4096]
    print(json.dumps(out), flush=True)
"""


def test_ring_on_a_100ms_path_measures_it_and_keeps_every_stream_warm():
    seed = int.from_bytes(os.urandom(2), "little")
    print("seed", seed)
    world = 3
    topo = netem.Topology.uniform(world, 1e9, RTT_S)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    code = textwrap.dedent(RANK.format(port=STORE_PORT))
    with netem.Emulator(topo) as net:
        procs = [subprocess.Popen(net.exec_argv(r, [sys.executable, "-c", code, str(r), str(world), net.addr(0),
                                                    net.addr(r), str(seed)]),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))

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
