"""The memory plan (prime/memory.py): what it counts for a 10B shard against an H200's budget, which settings it
names when a run cannot fit, the checkpoint mode it picks, and a run refused before its first step."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from prime.config import Config
from prime.comm.ring import segment_values
from prime.memory import GIB, MemoryPlanError, _dense_ring_gpu, _topk_ring_gpu, plan_memory
from prime.model import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Param:
    """Stands for a parameter of the model: its size and its local shard's (FSDP2 over `shards`)."""

    def __init__(self, numel, shards):
        self._n, self._local = numel, -(-numel // shards)

    def numel(self):
        return self._n

    def detach(self):
        return torch.empty(1, device="meta").expand(self._local)


@pytest.fixture(autouse=True)
def _rings_reduce_on_the_gpu(monkeypatch):
    """The plans below are of CUDA builds, as in the runs they are checked against, whatever this build is."""
    monkeypatch.setattr("prime.memory.ring_reduces_on_gpu", lambda: True)


def _fake_run(name="10B", *, fragments=1, overlap=False, home="cpu", procs=2, nodes=2, mb=1, accum=2,
              ckpt=True, checkpoint_dir="ck", seq=4096, uneven=False):
    """cfg, env, parts and a DiLoCo stand-in for `name` on `procs` GPUs per node: the numbers the plan reads."""
    from prime.fragments import PIPELINE_DEPTH, sync_pieces

    cfg = Config()
    cfg.model.name, cfg.data.seq_len = name, seq
    cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.train.activation_checkpointing = mb, accum, ckpt
    cfg.checkpoint.dir = checkpoint_dir
    cfg.diloco.fragments, cfg.diloco.overlap = fragments, overlap
    args = preset(name)
    sizes = [args.vocab_size * args.dim] + [(args.num_params() - 2 * args.vocab_size * args.dim) // args.n_layers] \
        * args.n_layers + [args.vocab_size * args.dim]
    params = [_Param(n, procs) for n in sizes]
    local = [-(-n // procs) for n in sizes]
    per = -(-len(sizes) // fragments)
    frag_numel = [sum(local[i : i + per]) for i in range(0, len(sizes), per)]
    pieces = [1 if overlap else sync_pieces(n * procs, procs) for n in frag_numel]
    if overlap:
        work = (2 if fragments == 1 else 1) * 4 * max(frag_numel) + 4 * max(frag_numel)
    else:
        work = max(4 * (n if k == 1 else PIPELINE_DEPTH * (-(-n // k) + (1 << 24))) for n, k in zip(frag_numel, pieces))
    dev = torch.device("cuda" if home == "gpu" else "cpu")
    frags = [SimpleNamespace(state=SimpleNamespace(numel=n, device=dev, streamed=home != "gpu"), pieces=k)
             for n, k in zip(frag_numel, pieces)]
    diloco = SimpleNamespace(fragments=frags, work_bytes=work, overlap=overlap)
    env = SimpleNamespace(device=torch.device("cuda", 0), fsdp=procs > 1, num_nodes=nodes,
                          shares=SimpleNamespace(uneven=uneven))
    parts = SimpleNamespace(model=SimpleNamespace(parameters=lambda: params), args=args)
    return cfg, env, parts, diloco


H200 = int(140.4 * GIB)
HOST4 = 503 * GIB


def test_10b_shard_counts_what_the_seed_measured():
    """10B on 2 GPUs per node: the local shard's weights, gradients, AdamW and FSDP2's fp32 accumulation of
    unsharded gradients (grad_accum 2), the outer state in pinned host memory (exact size)."""
    cfg, env, parts, d = _fake_run()
    plan = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    gpu = dict(plan.gpu)
    assert gpu["weights"] == pytest.approx(4 * 10.2e9 / 2, rel=0.02)
    assert gpu["AdamW"] == 2 * gpu["weights"] and gpu["gradients"] == gpu["weights"]
    assert gpu["unsharded gradients (grad_accum)"] == pytest.approx(4 * 10.2e9, rel=0.02)
    host = dict(plan.host)
    assert host["outer weights + momentum (pinned)"] == pytest.approx(8 * 10.2e9 / 2, rel=0.02)
    assert plan.host_procs == 4 and "memory plan" in plan.describe()


def test_overlap_of_the_whole_10b_model_is_refused_naming_fragments():
    """Whole-model overlap keeps three work buffers of the shard (2 x 20 GB pseudo-gradients, a 20 GB start) on
    a GPU that has no room: refused, naming diloco.fragments first; 8 fragments fit (with micro-batch 2 and no
    gradient accumulation, which frees FSDP2's unsharded fp32 gradients)."""
    cfg, env, parts, d = _fake_run(overlap=True)
    plan = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    with pytest.raises(MemoryPlanError) as e:
        plan.check()
    msg = str(e.value)
    assert "does not fit" in msg and msg.index("diloco.fragments") < msg.index("diloco.overlap = false")
    assert "memory.check = false" in msg
    cfg, env, parts, d = _fake_run(overlap=True, fragments=8, mb=2, accum=1)
    plan = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    plan.check()


def test_checkpoints_go_synchronous_when_async_staging_cannot_fit():
    """Four 10B processes on a 503 GiB host: staging a copy of the model, AdamW and the outer state for an async
    save (100 GB each) does not fit beside the outer state, so checkpoints are saved synchronously and the plan
    says so; a host twice as large stages them."""
    cfg, env, parts, d = _fake_run(mb=2, accum=1)
    plan = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    assert plan.checkpoint == "blocking" and any("synchronously" in n for n in plan.notes)
    plan.check()
    plan = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=2 * HOST4)
    assert plan.checkpoint == "async" and plan.fits()


def test_a_host_too_small_names_the_host_settings():
    cfg, env, parts, d = _fake_run(mb=2, accum=1)
    plan = plan_memory(cfg, env, parts, d, host_procs=16, gpu_total=H200, host_total=HOST4)
    with pytest.raises(MemoryPlanError, match=r"host memory needs .*\(16 process\(es\).*outer_state_device"):
        plan.check()


def test_uneven_nodes_count_the_whole_model_initialized_on_the_cpu():
    # nodes of 2 and 1 processes: each process initializes the whole model in fp32 on the CPU before it shards it;
    # with the outer state on the GPU and no checkpoints, that start is the host's peak
    kw = dict(home="gpu", checkpoint_dir="")
    cfg, env, parts, d = _fake_run(uneven=True, **kw)
    whole = 4 * sum(p.numel() for p in parts.model.parameters())
    plan = plan_memory(cfg, env, parts, d, host_procs=3, gpu_total=H200, host_total=2 * HOST4)
    even = plan_memory(*_fake_run(**kw), host_procs=3, gpu_total=H200, host_total=2 * HOST4)
    assert even.host_start == 0 and even.host_peak == even.host_bytes
    assert plan.host_bytes == even.host_bytes  # training itself holds the same
    assert plan.host_start > whole > plan.host_bytes and plan.host_peak == plan.host_start
    assert "at start" in plan.describe() and "at start" not in even.describe()
    # a host that holds three processes' training but not three whole models at once: refused, naming nodes.procs
    budget = 3 * (plan.host_bytes + plan.host_start) // 2
    assert plan_memory(*_fake_run(**kw), host_procs=3, gpu_total=H200, host_total=budget).fits_host()
    tight = plan_memory(cfg, env, parts, d, host_procs=3, gpu_total=H200, host_total=budget)
    with pytest.raises(MemoryPlanError, match=r"host memory needs .*the same nodes\.procs on every node"):
        tight.check()


def test_a_run_that_cannot_fit_stops_before_its_first_step(tmp_path):
    """Two simulated CPU nodes with a host budget far below their runtime: every node stops before training
    with the plan and the setting to change, and no step line is printed."""
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", "--", "--config", "configs/demo.toml",
           "--memory.host_gib", "0.5", "--metrics.out_dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert "this run does not fit: host memory needs" in text and "fewer processes on this host" in text, text[-3000:]
    assert "step      1/" not in text and "| loss" not in text


@pytest.mark.parametrize("what,kw,peak_gib", [
    ("10B, 2 x 2, synchronous", dict(mb=2, accum=1), 103.3),
    ("10B, 2 x 2, 4 fragments with overlap", dict(overlap=True, fragments=4, mb=2, accum=1), 122.6),
    ("1B, 2 x 2, synchronous", dict(name="1B", mb=4, accum=1, seq=2048, ckpt=False), 42.9),
    ("1B, 2 x 1, 4 fragments with overlap, state on the GPU", dict(name="1B", procs=1, mb=4, accum=1, seq=2048,
                                                                  ckpt=False, overlap=True, fragments=4, home="gpu"),
     56.3)])
def test_the_plan_covers_the_peaks_measured_on_h200(what, kw, peak_gib):
    """The GPU plan is at least the peak torch reserved in the runs of benchmarks/RESULTS.md ("Streaming fragments
    and the 10B model", H200s) and not more than a quarter above it."""
    plan = plan_memory(*_fake_run(**kw), host_procs=4, gpu_total=H200, host_total=HOST4)
    assert peak_gib * GIB <= plan.gpu_bytes <= 1.25 * peak_gib * GIB, (what, plan.describe())


@pytest.mark.parametrize("home", ["cpu", "gpu"])
def test_error_feedback_adds_its_residual_to_the_outer_state(home):
    """The error-feedback residual is a third buffer of the outer state's size, where the outer state lives (and in
    the asynchronous checkpoint's staging copy)."""
    cfg, env, parts, d = _fake_run(home=home)
    plain = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    d.error_feedback = True
    ef = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    where, key = ("host", "outer weights + momentum (pinned)") if home == "cpu" else ("gpu", "outer weights + momentum")
    before = dict(getattr(plain, where))[key]
    after = dict(getattr(ef, where))[key.replace("momentum", "momentum + error-feedback residual")]
    assert after * 2 == before * 3


def test_the_topk_codec_plans_its_buffers_on_the_gpu():
    """The sparse codec runs on the fragment's GPU: only its records cross to the host, and what the selections
    dropped goes into one device buffer as the collective runs (Ring.all_reduce's `dropped`).
    The plan covers the peaks of the 1B run over 100 Mbit/s in benchmarks/RESULTS.md (2 x 1 H200, 4 fragments
    with overlap: GPU 62.1 GiB reserved, host 2.2 GiB; staged through the host it was 8.6 GiB; that run had no
    dense start). A dense start adds int8's ring buffers and staging, which stay cached after it."""
    kw = dict(name="1B", procs=1, mb=4, accum=1, seq=2048, ckpt=False, overlap=True, fragments=4, home="gpu")
    cfg, env, parts, d = _fake_run(**kw)
    d.error_feedback = True
    int8 = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    cfg.diloco.codec, cfg.diloco.dense_outer_steps = "topk", 0
    topk = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    cfg.diloco.dense_outer_steps = 3
    dense = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    assert dict(dense.gpu)["ring buffers (dense start)"] == dict(int8.gpu)["ring buffers"]  # int8 in blocks of 64
    assert dict(dense.host)["ring staging (pinned)"] == (dict(topk.host)["ring staging (pinned)"]
                                                         + dict(int8.host)["ring staging (pinned)"])
    largest = max(f.state.numel for f in d.fragments)
    staged = dict(topk.host)["ring staging (pinned)"]
    # the records of this rank's contributions and of the averages it receives: under a tenth of a byte a value
    assert 0 < staged < 0.1 * largest < dict(int8.host)["ring staging (pinned)"]
    assert dict(topk.gpu)["ring: the dropped part"] == 4 * largest
    # the ring's own: the final records of the whole tensor and a segment's buffers, the dropped part the caller's
    ring = dict(topk.gpu)["ring buffers"]
    assert ring == _topk_ring_gpu(largest, 4096, 48, 96, own_dropped=False) < 0.05 * largest
    assert 62.1 * GIB <= topk.gpu_bytes <= 1.25 * 62.1 * GIB, topk.describe()
    assert topk.host_bytes >= 2.2 * GIB, topk.describe()


# What each rank's ring context held after one all-reduce of 2^20 fp32 values, 2 ranks, in segments of 64 KiB
# (16 Ki values), on an H200: tests/test_ring_cuda.py::test_the_rings_device_buffers_are_counted_while_it_is_open
# in benchmarks/results/ring_device_bytes/gpu_tests.log.
MEASURED_RING_BYTES = {"int8": 1149442, "topk": 4356056}


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_the_rings_own_gpu_buffers_are_planned_as_measured(codec):
    """The plan's count of the ring's cudaMalloc'd buffers is at least what the ring held on the GPU and at most 5%
    more: int8 the result's image (a byte a value and an fp32 scale a block of 64) and a segment's buffers; topk
    (with `residual`) what its selections dropped, 4 bytes a value, the final records and a segment's buffers."""
    n, segment = 1 << 20, segment_values(1 << 16)
    assert segment == 1 << 14
    if codec == "int8":
        plan = _dense_ring_gpu(n, 64, "int8", segment=segment, ranks=2)
    else:
        plan = _topk_ring_gpu(n, 4096, 48, 96, segment=segment, own_dropped=True)
    assert MEASURED_RING_BYTES[codec] <= plan <= 1.05 * MEASURED_RING_BYTES[codec], plan


def test_the_ring_buffers_follow_the_segment_and_the_schedule():
    """The per-segment buffers scale with the segment (a run's: prime.comm.ring's default, 1 MiB of fp32), not with
    the tensor; the fp32 sum of a segment counts where the ring may take it (blocks above 1024: no fused kernel;
    more than 2 ranks: the direct schedule's owner adds several contributions)."""
    n, seg = 1 << 26, segment_values()
    assert seg == 1 << 18
    base = _dense_ring_gpu(n, 64, "int8")
    assert n * (1 + 4 / 64) < base < n * (1 + 4 / 64) + 3 * seg
    assert _dense_ring_gpu(n, 64, "int8", ranks=3) == base + 4 * seg
    assert _dense_ring_gpu(n, 1024, "int8", ranks=3) == _dense_ring_gpu(n, 1024, "int8", ranks=2) + 4 * seg
    assert _dense_ring_gpu(n, 2048, "int8", ranks=3) == _dense_ring_gpu(n, 2048, "int8", ranks=2)  # (unfused)
    assert _dense_ring_gpu(n, 256, "fp4") < 0.6 * n


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_build_without_cuda_kernels_plans_the_staging_through_the_host(codec, monkeypatch):
    """A CUDA torch with prime._C built without the CUDA kernels (no toolkit at install time): the ring copies each
    all-reduce's input and result through pinned host memory and codes it on the CPU, so its buffers move from
    the GPU to the host. The 1B run over 100 Mbit/s staged that way peaked at 8.6 GiB of host memory a process
    (benchmarks/RESULTS.md), against 2.2 GiB on the GPU path."""
    kw = dict(name="1B", procs=1, mb=4, accum=1, seq=2048, ckpt=False, overlap=True, fragments=4, home="gpu")
    cfg, env, parts, d = _fake_run(**kw)
    d.error_feedback = codec == "topk"
    cfg.diloco.codec = codec
    on_gpu = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    monkeypatch.setattr("prime.memory.ring_reduces_on_gpu", lambda: False)
    staged = plan_memory(cfg, env, parts, d, host_procs=4, gpu_total=H200, host_total=HOST4)
    largest = max(f.state.numel for f in d.fragments)
    ring = dict(staged.host)["ring staging (pinned)"]
    assert ring >= 8 * largest + dict(on_gpu.host)["ring staging (pinned)"] * (codec == "int8")
    gpu_ring = [k for k, _ in on_gpu.gpu if k.startswith("ring")]
    assert gpu_ring and not [k for k, _ in staged.gpu if k.startswith("ring")]
    assert staged.gpu_bytes < on_gpu.gpu_bytes
    if codec == "topk":  # (that run saved no checkpoint: the plan's host items before the checkpoint's staging)
        before_checkpoints = lambda plan: sum(v for k, v in plan.host if not k.startswith("checkpoint"))  # noqa: E731
        assert before_checkpoints(on_gpu) < 8.6 * GIB <= before_checkpoints(staged), staged.describe()


def test_the_gpu_peak_adds_the_rings_own_buffers(monkeypatch):
    # The ring's GPU staging is cudaMalloc'd, out of torch's sight: the peak line adds it to torch's reserved
    # peak, per GPU, from the open rings' contexts (stand-ins here: no GPU needed).
    import torch.distributed as dist

    from prime.comm import Ring
    from prime.comm.ring import device_buffer_bytes

    cfg, env, parts, diloco = _fake_run("1B", procs=1, nodes=2, home="gpu")
    plan = plan_memory(cfg, env, parts, diloco, host_procs=1, gpu_total=H200, host_total=HOST4)
    reserved = int(3.25 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    base = device_buffer_bytes()  # (rings other tests left open, if any)
    with Ring(dist.HashStore(), 0, 1) as ring:
        ring._cuda_contexts = {0: SimpleNamespace(device_bytes=GIB // 2), 1: SimpleNamespace(device_bytes=GIB // 4)}
        assert device_buffer_bytes(0) - base == GIB // 2 and device_buffer_bytes() - base == 3 * GIB // 4
        line = plan.peaks(torch.device("cuda", 0))
        assert "GPU peak 3.8 GiB (3.2 reserved by torch, 512.0 MiB the ring's buffers)" in line, line
        line = plan.peaks(torch.device("cuda"))  # the current device's: 1
        assert "GPU peak 3.5 GiB (3.2 reserved by torch, 256.0 MiB the ring's buffers)" in line, line
    assert device_buffer_bytes() == base  # closed: freed
    assert f"GPU peak 3.2 GiB reserved (plan {plan.gpu_bytes / GIB:.1f})" in plan.peaks(torch.device("cuda", 0))
