"""The outer state on a GPU gives the same bits as on the CPU (skips without CUDA).

Nodes may keep their outer state on different devices (diloco.outer_state_device); they stay identical only
if the pseudo-gradient, the update and the lookahead round the same way on both. Fresh random data each run,
sizes that do not fill whole codec blocks."""


import pytest
import torch
from torch import nn

from prime.outer import OuterState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_model(gen, shapes):
    m = nn.Module()
    for i, s in enumerate(shapes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(*s, generator=gen).cuda()))
    return m


@pytest.mark.parametrize("nesterov,pipe_chunk", [(True, None), (False, None), (True, 1000)])
def test_cpu_and_gpu_outer_state_agree_bit_for_bit(seed, nesterov, pipe_chunk, monkeypatch):
    """pipe_chunk: cut the CPU state's copies into pieces of that many values (the 37000-value parameter into 37)."""
    if pipe_chunk is not None:
        monkeypatch.setattr("prime.outer._PIPE_CHUNK", pipe_chunk)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1000, 37), (4097,), (3, 5, 7), (1,)]
    model = _gpu_model(gen, shapes)
    states = {dev: OuterState(model.parameters(), block_size=256, outer_lr=0.7, outer_momentum=0.9,
                              nesterov=nesterov, device=dev) for dev in ("cpu", "gpu")}
    assert states["cpu"].device.type == "cpu" and states["gpu"].device.type == "cuda"
    momentum = torch.randn(states["cpu"].numel, generator=gen)
    for st in states.values():
        st.take()
        st.momentum.copy_(momentum)
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.sub_((0.01 * torch.randn(p.shape, generator=gen)).cuda())
        gs, sqs = {}, {}
        for dev, st in states.items():
            gs[dev] = st.new_buffer()
            sqs[dev] = st.pseudo_gradient(gs[dev])
        assert torch.equal(gs["cpu"], gs["gpu"].cpu()), f"seed {seed} step {step}: pseudo-gradient"
        assert sqs["cpu"] == pytest.approx(sqs["gpu"], rel=1e-5)
        # the average the ring would return: any fresh fp32 values, the same on both
        avg = torch.randn(states["cpu"].numel, generator=gen) * 0.01
        looks = {}
        for dev, st in states.items():
            looks[dev] = st.new_buffer()
            st.lookahead(avg.to(st.device), looks[dev])
        assert torch.equal(looks["cpu"], looks["gpu"].cpu()), f"seed {seed} step {step}: lookahead"
        states["cpu"].update(avg, load=step % 2 == 0)  # the pipelined copy back into the GPU model
        snapshot = [p.detach().clone() for p in model.parameters()]
        states["gpu"].update(avg.cuda(), load=step % 2 == 0)
        st_c, st_g = states["cpu"], states["gpu"]
        assert torch.equal(st_c.outer, st_g.outer.cpu()), f"seed {seed} step {step}: outer weights"
        assert torch.equal(st_c.momentum, st_g.momentum.cpu()), f"seed {seed} step {step}: momentum"
        assert torch.equal(looks["cpu"], st_c.outer)
        if step % 2 == 0:  # both loaded the same bits into the model
            for p, q, off, n in zip(model.parameters(), snapshot, st_c.offsets, st_c.sizes):
                assert torch.equal(p.detach().reshape(-1).cpu(), st_c.outer[off : off + n])
                assert torch.equal(q.reshape(-1).cpu(), st_c.outer[off : off + n])


def test_int8_error_pass_on_the_gpu_matches_the_cpu(seed):
    gen = torch.Generator().manual_seed(seed)
    model = _gpu_model(gen, [(5000,), (300, 3)])
    st_c = OuterState(model.parameters(), block_size=128, device="cpu")
    st_g = OuterState(model.parameters(), block_size=128, device="gpu")
    g = torch.randn(st_c.numel, generator=gen)
    assert st_c.int8_error_sq(g) == pytest.approx(st_g.int8_error_sq(g.cuda()), rel=1e-4)


class CpuSideRing:
    """Wraps the fake thread ring of tests/test_diloco.py so that nodes holding CUDA and CPU buffers meet on
    the CPU (the real ring stages CUDA tensors the same way)."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def all_reduce(self, t, op="avg", codec="int8", block_size=256):
        c = t.detach().cpu()
        work = self.inner.all_reduce(c, op, codec, block_size)
        t.copy_(c)
        return work

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("scheme", [None, "eager", "eager-merge"])
def test_nodes_with_outer_state_on_different_devices_stay_identical(seed, scheme):
    """Node 0 keeps its outer state on the GPU, node 1 in CPU memory: identical weights after every outer
    step, synchronous (scheme None) and with overlap."""
    from prime.diloco import DiLoCo
    from test_diloco import FakeThreadGroup, FakeThreadRing, run_nodes

    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(3000, generator=gen)
    deltas = [[0.01 * torch.randn(3000, generator=gen) for _ in range(2)] for _ in range(4)]
    group = FakeThreadGroup(2)

    def node(r):
        model = nn.Linear(1, 1)
        model.weight = nn.Parameter(w0.clone().cuda())
        model.bias = None
        d = DiLoCo(model, None, CpuSideRing(FakeThreadRing(group, r)), inner_steps=1, codec="int8",
                   overlap=scheme is not None, overlap_scheme=scheme or "eager-merge",
                   outer_state_device="gpu" if r == 0 else "cpu", check_replicas=False)
        assert d.state.device.type == ("cuda" if r == 0 else "cpu")
        outs = []
        for k in range(4):
            with torch.no_grad():
                model.weight.sub_(deltas[k][r].cuda())
            d.step()
            outs.append(d.state.outer.cpu().clone())
        d.finish()
        d.close()
        return outs, model.weight.detach().cpu().clone()

    (o0, f0), (o1, f1) = run_nodes(2, node)
    for k in range(4):
        assert torch.equal(o0[k], o1[k]), f"seed {seed} outer step {k + 1}"
    assert torch.equal(f0, f1), f"seed {seed} final weights"
