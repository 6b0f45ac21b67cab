"""prime.outer.OuterState on the CPU: the pseudo-gradient pass and its norm, the lookahead against the update,
where the state lives, and the int8 error taken from the ring's own statistics."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from prime.diloco import DiLoCo
from prime.outer import OuterState, resolve_device
from test_diloco import FakeThreadGroup, FakeThreadRing, FakeWork, TwoParams


def _model(gen, shapes=((70,), (3, 50), (1,))):
    m = nn.Module()
    for i, s in enumerate(shapes):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(*s, generator=gen)))
    return m


def test_pseudo_gradient_and_norm_against_float64(seed):
    """g = anchor - local per parameter, zero padding, and the squared norm against a float64 sum."""
    gen = torch.Generator().manual_seed(seed)
    model = _model(gen)
    st = OuterState(model.parameters(), block_size=32)
    st.take()
    anchor = st.new_buffer()
    anchor.normal_(generator=gen)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    g = st.new_buffer().fill_(7.0)  # stale values: the padding must come back as 0
    for a in (None, anchor):
        sq = st.pseudo_gradient(g, anchor=a)
        src = st.outer if a is None else a
        ref_sq = 0.0
        for p, off, n in zip(model.parameters(), st.offsets, st.sizes):
            want = src[off : off + n] - p.detach().reshape(-1)  # one fp32 subtraction
            assert torch.equal(g[off : off + n], want), f"seed {seed}"
            ref_sq += float((want.double() ** 2).sum())
        pads = torch.ones(st.numel, dtype=torch.bool)
        for off, n in zip(st.offsets, st.sizes):
            pads[off : off + n] = False
        assert torch.count_nonzero(g[pads]) == 0
        assert sq == pytest.approx(ref_sq, rel=1e-6), f"seed {seed}"


@pytest.mark.parametrize("nesterov", [True, False])
def test_lookahead_is_the_update_without_writing_the_state(seed, nesterov):
    gen = torch.Generator().manual_seed(seed)
    st = OuterState(_model(gen).parameters(), block_size=32, nesterov=nesterov)
    st.take()
    st.momentum.normal_(generator=gen)
    g = 0.1 * torch.randn(st.numel, generator=gen)
    out = st.new_buffer()
    w0, m0 = st.outer.clone(), st.momentum.clone()
    st.lookahead(g, out)
    assert torch.equal(st.outer, w0) and torch.equal(st.momentum, m0)
    st.update(g)
    assert torch.equal(out, st.outer), f"seed {seed}"
    assert not torch.equal(out, w0)


def test_update_with_load_copies_the_new_weights(seed):
    gen = torch.Generator().manual_seed(seed)
    model = _model(gen)
    st = OuterState(model.parameters(), block_size=32)
    st.take()
    st.update(torch.randn(st.numel, generator=gen), load=True)
    for p, off, n in zip(model.parameters(), st.offsets, st.sizes):
        assert torch.equal(p.detach().reshape(-1), st.outer[off : off + n])


def test_state_device_on_a_cpu_model():
    params = [torch.zeros(10)]
    assert resolve_device("auto", params, 3).type == "cpu"
    assert resolve_device("cpu", params, 3).type == "cpu"
    with pytest.raises(ValueError, match="needs the model's parameters on a GPU"):
        resolve_device("gpu", params, 3)
    with pytest.raises(ValueError, match="outer_state_device"):
        resolve_device("disk", params, 3)


def _fake_gpu(monkeypatch, total, free, reserved=0, allocated=0):
    """torch.cuda's memory queries answer as a GPU with these byte counts would (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: allocated)


def _gpu_shard(numel, esize=4):
    """What resolve_device reads of a parameter's local shard on cuda:0."""
    return SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: numel, element_size=lambda: esize)


def test_auto_state_device_counts_free_memory_pending_state_and_a_margin(monkeypatch, caplog):
    import logging

    from prime import outer

    gib = 1 << 30
    total = 85_000_000_000  # an 80 GB H100 as torch reports it (79.2 GiB)
    n = 1_500_000_000  # fp32 weights of a "1B" model: 6 GB
    shards = [_gpu_shard(n)]
    need = 5 * 4 * n  # eager overlap: 5 buffers, 30 GB (more than a third of the card: the old rule said cpu)
    assert need > total / 3
    pending = 3 * 4 * n  # gradients and AdamW's two moments, made at the first step
    margin = max(8 * gib, int(0.15 * total))
    # The rule: need <= free + cached - pending - margin, at the boundary byte.
    _fake_gpu(monkeypatch, total, free=need + pending + margin)
    with caplog.at_level(logging.INFO, logger="prime.outer"):
        assert resolve_device("auto", shards, 5, pending).type == "cuda"
    assert any("outer_state_device auto: gpu" in r.getMessage() for r in caplog.records), caplog.text
    _fake_gpu(monkeypatch, total, free=need + pending + margin - 1)
    assert resolve_device("auto", shards, 5, pending).type == "cpu"
    # Memory torch's allocator holds unused counts as free.
    _fake_gpu(monkeypatch, total, free=need + pending + margin - gib, reserved=5 * gib, allocated=4 * gib)
    assert resolve_device("auto", shards, 5, pending).type == "cuda"
    # The H100 after building a 1B model: ~73 GiB free. GPU with the state to come; a small card: CPU.
    _fake_gpu(monkeypatch, total, free=73 * gib)
    assert resolve_device("auto", shards, 5, pending).type == "cuda"
    _fake_gpu(monkeypatch, 40 * gib, free=33 * gib)
    assert resolve_device("auto", shards, 5, pending).type == "cpu"
    # The margin is at least 8 GiB, and 15% of a large card.
    assert outer.AUTO_GPU_MARGIN_BYTES == 8 * gib and outer.AUTO_GPU_MARGIN_FRACTION == 0.15
    _fake_gpu(monkeypatch, 20 * gib, free=need + pending + 8 * gib)
    assert resolve_device("auto", shards, 5, pending).type == "cuda"
    _fake_gpu(monkeypatch, 20 * gib, free=need + pending + 8 * gib - 1)
    assert resolve_device("auto", shards, 5, pending).type == "cpu"
    # "gpu" and "cpu" are taken as given, whatever the memory.
    _fake_gpu(monkeypatch, total, free=0)
    assert resolve_device("gpu", shards, 5, pending).type == "cuda"
    assert resolve_device("cpu", shards, 5, pending).type == "cpu"


def test_pending_training_bytes_counts_what_the_first_step_will_make():
    from prime.outer import pending_training_bytes

    a, b = nn.Parameter(torch.zeros(10, 3)), nn.Parameter(torch.zeros(7))
    shards = [_gpu_shard(30), _gpu_shard(7, esize=2)]
    size = 30 * 4 + 7 * 2
    assert pending_training_bytes([a, b], shards) == size  # gradients only
    adam = torch.optim.AdamW([a, b])
    assert pending_training_bytes([a, b], shards, adam) == 3 * size
    assert pending_training_bytes([a, b], shards, torch.optim.SGD([a, b], lr=0.1, momentum=0.9)) == 2 * size
    assert pending_training_bytes([a, b], shards, torch.optim.SGD([a, b], lr=0.1)) == size
    (a.sum() + b.sum()).backward()
    adam.step()  # gradients and moments exist now
    assert pending_training_bytes([a, b], shards, adam) == 0
    assert pending_training_bytes([a, b], [torch.zeros(30), torch.zeros(7)], None) == 0  # CPU shards: nothing


class ReportingRing(FakeThreadRing):
    """A fake ring whose statistics carry its own int8 error (prime.sync.QUANT_ERROR_FIELDS)."""

    reports_quant_error = True

    def all_reduce(self, t, op="avg", codec="int8", block_size=256):
        super().all_reduce(t, op, codec, block_size)
        base = FakeWork(t.numel()).stats()
        work = SimpleNamespace(wait=lambda: None,
                               stats=lambda: dataclasses.replace(base, quant_err_sq=4.0, quant_in_sq=100.0))
        return work


def test_compression_error_comes_from_the_ring_when_it_reports_it(seed, monkeypatch):
    """No quantize/dequantize pass of DiLoCo's own: the error is sqrt(quant_err_sq / quant_in_sq)."""
    def no_pass(self, g):
        raise AssertionError("DiLoCo ran its own int8 pass although the ring reports the error")

    monkeypatch.setattr(OuterState, "int8_error_sq", no_pass)
    model = TwoParams(torch.randn(64, generator=torch.Generator().manual_seed(seed)), torch.zeros(0))
    d = DiLoCo(model, None, ReportingRing(FakeThreadGroup(1), 0), inner_steps=1, codec="int8", block_size=32)
    with torch.no_grad():
        model.a -= 0.1
    r = d.step()
    assert r.compression_error == pytest.approx(math.sqrt(4.0 / 100.0))
    assert "quant_err_sq" not in r.ring_stats


def test_copy_pipeline_pieces_tile_every_parameter(monkeypatch):
    """The CPU state's GPU copies go in pieces: together they cover every parameter exactly once, the padding
    end comes with each parameter's last piece, and a non-contiguous parameter stays whole."""
    monkeypatch.setattr("prime.layout._PIPE_CHUNK", 100)
    m = nn.Module()
    m.a = nn.Parameter(torch.zeros(250))
    m.b = nn.Parameter(torch.zeros(100))
    m.c = nn.Parameter(torch.zeros(30, 10).t())  # not contiguous
    m.d = nn.Parameter(torch.zeros(0))
    st = OuterState(m.parameters(), block_size=32)
    covered = {}
    for t, off, a, b, end in st._pieces():
        covered.setdefault(off, []).append((a, b, end))
    assert covered[st.offsets[0]] == [(0, 100, None), (100, 200, None), (200, 250, st.offsets[1])]
    assert covered[st.offsets[1]] == [(0, 100, st.offsets[2])]
    assert covered[st.offsets[2]] == [(0, 300, st.offsets[3])]
    assert covered[st.offsets[3]] == [(0, 0, st.numel)]


def test_a_checkpoint_of_another_block_size_is_refused_by_name():
    """Every parameter starts a codec block, so the flat layout depends on the block size: a state
    saved at block 256 (int8's former default) does not load at 64, with a message naming the field."""
    params = [nn.Parameter(torch.randn(100)), nn.Parameter(torch.randn(3, 7))]
    saved = OuterState(params, block_size=256)
    sd = saved.state_dict()
    assert sd["block_size"] == 256
    with pytest.raises(ValueError, match=r"diloco.block_size = 256, this run has 64"):
        OuterState(params, block_size=64).load_state_dict(sd)
    old = {k: v for k, v in sd.items() if k != "block_size"}  # a checkpoint that does not record it
    with pytest.raises(ValueError, match="diloco.block_size"):
        OuterState(params, block_size=64).load_state_dict(old)
    fresh = OuterState(params, block_size=256)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.outer, saved.outer)
