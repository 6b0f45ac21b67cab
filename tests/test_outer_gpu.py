"""The outer state on a GPU gives the same bits as in CPU memory (skips without CUDA).

Nodes may keep their outer state on different devices (diloco.outer_state_device); they stay identical only
if the pseudo-gradient, the update and the lookahead round the same way on both. A GPU model's state in CPU
memory is streamed through the GPU piece by piece (the arithmetic runs there, on staged copies), so the
comparison is of the streamed passes against the resident ones, and of both against a CPU model's. Fresh
random data each run, sizes that do not fill whole codec blocks."""


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
        monkeypatch.setattr("prime.layout._PIPE_CHUNK", pipe_chunk)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1000, 37), (4097,), (3, 5, 7), (1,)]
    model = _gpu_model(gen, shapes)
    states = {dev: OuterState(model.parameters(), block_size=256, outer_lr=0.7, outer_momentum=0.9,
                              nesterov=nesterov, device=dev) for dev in ("cpu", "gpu")}
    assert states["cpu"].device.type == "cpu" and states["gpu"].device.type == "cuda"
    assert states["cpu"].streamed and states["cpu"].work_device.type == "cuda" and not states["gpu"].streamed
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
        assert torch.equal(gs["cpu"].cpu(), gs["gpu"].cpu()), f"seed {seed} step {step}: pseudo-gradient"
        assert sqs["cpu"] == pytest.approx(sqs["gpu"], rel=1e-5)
        # the average the ring would return: any fresh fp32 values, the same on both
        avg = torch.randn(states["cpu"].numel, generator=gen) * 0.01
        looks = {}
        for dev, st in states.items():
            looks[dev] = st.new_buffer()
            st.lookahead(avg.to(st.work_device), looks[dev])
        assert torch.equal(looks["cpu"].cpu(), looks["gpu"].cpu()), f"seed {seed} step {step}: lookahead"
        states["cpu"].update(avg.cuda(), load=step % 2 == 0)  # the streamed update, copied into the GPU model
        snapshot = [p.detach().clone() for p in model.parameters()]
        states["gpu"].update(avg.cuda(), load=step % 2 == 0)
        st_c, st_g = states["cpu"], states["gpu"]
        assert torch.equal(st_c.outer, st_g.outer.cpu()), f"seed {seed} step {step}: outer weights"
        assert torch.equal(st_c.momentum, st_g.momentum.cpu()), f"seed {seed} step {step}: momentum"
        assert torch.equal(looks["cpu"].cpu(), st_c.outer)
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


def test_streamed_passes_on_the_gpu_match_a_cpu_model(seed, monkeypatch):
    """The same parameters on the CPU (resident state) and on the GPU (state in pinned CPU memory, streamed in
    pieces of 1000 values on side streams): every pass, over sub-ranges too, gives the CPU's bits."""
    monkeypatch.setattr("prime.layout._PIPE_CHUNK", 1000)
    monkeypatch.setattr("prime.layout._CHUNK", 1000)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1000, 37), (4097,), (3, 5, 7), (1,)]
    base = [torch.randn(*s, generator=gen) for s in shapes]
    models = []
    for dev in ("cpu", "cuda"):
        m = nn.Module()
        for i, w in enumerate(base):
            m.register_parameter(f"p{i}", nn.Parameter(w.clone().to(dev)))
        models.append(m)
    sts = [OuterState(m.parameters(), block_size=256, device="cpu") for m in models]
    assert not sts[0].streamed and sts[1].streamed and sts[1].outer.is_pinned()
    mom = torch.randn(sts[0].numel, generator=gen)
    for st in sts:
        st.take()
        st.momentum.copy_(mom)
    for step in range(3):
        move = [0.01 * torch.randn(*s, generator=gen) for s in shapes]
        avg = 0.01 * torch.randn(sts[0].numel, generator=gen)
        outs = []
        for st, m in zip(sts, models):
            dev = st.work_device
            with torch.no_grad():
                for p, d in zip(m.parameters(), move):
                    p.sub_(d.to(dev))
            g = st.new_buffer()
            cuts = st.ranges(3)
            for lo, hi in cuts:
                st.pseudo_gradient(g, lo=lo, hi=hi)
            look = st.new_buffer()
            st.lookahead(avg.to(dev), look, scale=0.75)
            s_in = look.clone()
            st.merge_stand_in(s_in, g, 0.5)
            for lo, hi in cuts:
                st.update(avg.to(dev), load=True, lo=lo, hi=hi)
            shift = look.clone()
            st.shift_to_outer(shift, 0.5)
            outs.append([t.cpu() for t in (g, look, s_in, st.outer, st.momentum, shift)]
                        + [p.detach().cpu() for p in m.parameters()])
        for i, (a, b) in enumerate(zip(*outs)):
            assert torch.equal(a, b), f"seed {seed} step {step}: tensor {i}"


def test_fragments_on_nodes_with_state_on_different_devices_stay_identical(seed):
    """Two fragments with overlap: node 0 keeps its outer state on the GPU, node 1 in CPU memory (streamed):
    identical outer weights after every step and identical final weights."""
    from prime.diloco import DiLoCo
    from test_diloco import FakeThreadGroup, FakeThreadRing, run_nodes

    gen = torch.Generator().manual_seed(seed)
    sizes = [3000, 1700, 2500]
    w0 = [torch.randn(n, generator=gen) for n in sizes]
    H = 4
    deltas = [[[0.01 * torch.randn(n, generator=gen) for n in sizes] for _ in range(2)] for _ in range(3 * H)]
    group = FakeThreadGroup(2)

    def node(r):
        model = nn.Module()
        model.layers = nn.ModuleList()
        for w in w0:
            m = nn.Module()
            m.w = nn.Parameter(w.clone().cuda())
            model.layers.append(m)
        d = DiLoCo(model, None, CpuSideRing(FakeThreadRing(group, r)), inner_steps=H, fragments=2, codec="int8",
                   overlap=True, outer_state_device="gpu" if r == 0 else "cpu", check_replicas=False)
        assert all(f.state.streamed == (r == 1) for f in d.fragments)
        outs = []
        for step in deltas:
            with torch.no_grad():
                for m, delta in zip(model.layers, step[r]):
                    m.w.sub_(delta.cuda())
            d.step()
            outs.append(d.outer_weights().clone())
        d.finish()
        d.close()
        return outs, [m.w.detach().cpu().clone() for m in model.layers]

    (o0, f0), (o1, f1) = run_nodes(2, node)
    for k in range(len(deltas)):
        assert torch.equal(o0[k], o1[k]), f"seed {seed} step {k + 1}"
    assert all(torch.equal(a, b) for a, b in zip(f0, f1)), f"seed {seed} final weights"


@pytest.mark.parametrize("codec", ["int8", "fp4"])
def test_error_feedback_residual_has_the_same_bits_on_every_device(seed, codec, monkeypatch):
    """Error feedback's passes (contribution, residual, update) on a CPU model, a GPU model with its outer state on
    the GPU, and one with it in CPU memory streamed through the GPU in pieces: the same bits."""
    from test_feedback import residual_passes

    monkeypatch.setattr("prime.layout._PIPE_CHUNK", 1024)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(100, 37), (4097,), (3, 5, 7), (1,)]
    init = [torch.randn(*s, generator=gen) for s in shapes]
    params_list = [[nn.Parameter(t.clone().to(dev)) for t in init] for dev in ("cpu", "cuda", "cuda")]
    states = [OuterState(params, block_size=256, error_feedback=codec, device=home)
              for params, home in zip(params_list, ("cpu", "gpu", "cpu"))]
    assert states[2].streamed and states[1].device.type == "cuda"
    residual_passes(states, params_list, gen, codec)
