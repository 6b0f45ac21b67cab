"""The Trainer's builders and components, one at a time, in one process (each test takes about a second or less).

prime/runtime.py (environment), prime/builders.py (model and optimizer, data,
metrics, checkpoints), prime/nodes.py (the nodes component of a fixed job),
and the one seam of the loop: a nodes component whose after_outer() says this
node rejoined at the job's step. End-to-end runs are in tests/test_train.py and
tests/test_elastic.py.
"""

import json
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from prime.builders import TrainData, build_checkpoints, build_data, build_metrics, build_model_and_optimizer
from prime.checkpoint import Checkpointer, TrainCheckpoints
from prime.config import config_from_argv
from prime.data import TokenSource
from prime.diloco import DiLoCo, OuterStepResult
from prime.metrics import RunMetrics
from prime.model import Transformer
from prime.nodes import AfterOuter, FixedNodes, final_weights_digest
from prime.runtime import Environment, build_environment
from prime.sync import SyncResult
from prime.trainer import Trainer, likely_divergence_cause

QUICK = ["--model.name", "tiny", "--train.device", "cpu", "--data.seq_len", "64", "--train.micro_batch_size", "4",
         "--optim.lr", "3e-3", "--optim.warmup_steps", "5", "--optim.decay_steps", "0", "--metrics.plot", "false"]


@pytest.fixture
def seed():
    s = random.randrange(1 << 30)
    print(f"seed {s}")
    return s


@pytest.fixture
def one_process(monkeypatch):
    """No torchrun variables, and torch's thread count restored afterwards (the environment sets train.threads)."""
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _cpu_env(node_rank=0, num_nodes=1, local_rank=0, local_world=1) -> Environment:
    return Environment(torch.device("cpu"), local_rank, local_world, node_rank, num_nodes, fsdp=False)


# -- environment ---------------------------------------------------------------------


def test_environment_of_one_cpu_process(one_process, seed):
    env = build_environment(config_from_argv(QUICK))
    assert env.device == torch.device("cpu") and (env.local_rank, env.local_world) == (0, 1)
    assert (env.node_rank, env.num_nodes, env.fsdp, env.store) == (0, 1, False, None) and env.is_logger
    assert not env.has_local_group and env.local_group() is None and env.new_local_group() is None
    values = [random.Random(seed).uniform(-1, 1) for _ in range(3)]
    assert env.local_sum(values) == values  # a node of one process: the sum is its own value
    env.close()


@pytest.mark.parametrize("launch, extra, message", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, [], "WORLD_SIZE (4) is not LOCAL_WORLD_SIZE (2)"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, ["--train.fsdp", "off"], "train.fsdp is 'off' but this node runs 2"),
])
def test_environment_refuses_a_launch_that_does_not_fit_the_config(one_process, monkeypatch, launch, extra, message):
    for k, v in launch.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_environment(config_from_argv(QUICK + extra))


# -- model and optimizer ---------------------------------------------------------------


def test_model_and_optimizer_from_the_seed(one_process, seed):
    """The same weights as a plain Transformer drawn from train.seed; weight decay on matrices only."""
    cfg = config_from_argv(QUICK + ["--train.seed", str(seed % 10000), "--optim.weight_decay", "0.05"])
    parts = build_model_and_optimizer(cfg, _cpu_env())
    torch.manual_seed(seed % 10000)
    ref = Transformer(cfg.model.args())
    got = dict(parts.model.named_parameters())
    assert list(got) == [n for n, _ in ref.named_parameters()]
    for name, p in ref.named_parameters():
        assert torch.equal(got[name].detach(), p.detach()), name
    assert parts.numel() == sum(p.numel() for p in ref.parameters())
    decay, no_decay = parts.optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(p) for p in got.values() if p.ndim >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in got.values() if p.ndim < 2} != set()


# -- data ---------------------------------------------------------------------------------


def _windows(loader) -> set:
    return {int(s) for _, s in loader.windows}


def test_data_slots_split_the_windows_between_every_process(seed):
    """Node r's local rank g of N nodes x P processes reads windows w with w mod NP == rP + g (the reference
    below recomputes that from the token count); together they read every window once. A slot past N (an
    elastic joiner's) reads the windows of slot s mod N in another order; use_slot restores a position."""
    rng = np.random.default_rng(seed)
    seq_len, n_nodes, procs = 16, 3, 2
    tokens = rng.integers(0, 256, size=int(rng.integers(4000, 6000)), dtype=np.uint8)
    source = TokenSource([tokens], "random bytes")
    cfg = config_from_argv(QUICK + ["--data.seq_len", str(seq_len), "--train.micro_batch_size", "2"])
    n_windows = (len(tokens) - 1) // seq_len
    seen = []
    for r in range(n_nodes):
        for g in range(procs):
            data = TrainData(cfg, source, 256, _cpu_env(r, n_nodes, g, procs), slot=r)
            want = {w * seq_len for w in range(n_windows) if w % (n_nodes * procs) == r * procs + g}
            assert _windows(data.loader) == want, (r, g)
            seen.append(want)
    assert sum(len(s) for s in seen) == n_windows and set().union(*seen) == {w * seq_len for w in range(n_windows)}

    env = _cpu_env(1, n_nodes)
    data = TrainData(cfg, source, 256, env, slot=1)
    first = data.next_batch()[0]
    joiner = TrainData(cfg, source, 256, env, slot=1 + n_nodes)
    assert _windows(joiner.loader) == _windows(data.loader)
    assert not torch.equal(joiner.next_batch()[0], first)  # another order of the same windows
    for _ in range(3):
        data.next_batch()
    state, want = data.state_dict(), data.next_batch()
    moved = TrainData(cfg, source, 256, env, slot=1 + n_nodes)
    moved.use_slot(1, state)
    assert moved.slot == 1 and torch.equal(moved.next_batch()[0], want[0])


def test_build_data_puts_node_r_in_slot_r():
    cfg = config_from_argv(QUICK)
    data = build_data(cfg, _cpu_env(1, 2), vocab_size=256)
    assert (data.slot, data.loader.shard, data.loader.num_shards) == (1, 1, 2)
    assert data.tokens_per_step == 4 * 64 and "shard 1 of 2" in data.describe()


# -- metrics --------------------------------------------------------------------------------


def test_build_metrics_takes_its_rates_from_the_model_and_the_data(one_process):
    cfg = config_from_argv(QUICK + ["--train.grad_accum", "3", "--diloco.block_size", "64"])
    env = _cpu_env(0, 2)
    parts = build_model_and_optimizer(cfg, env)
    m = build_metrics(cfg, env, parts, build_data(cfg, env, parts.args.vocab_size))
    assert m.tokens_per_step == 4 * 64 * 3 and m.flops_per_token == parts.args.flops_per_token(64)
    assert m.peak is None and m.model_numel == parts.numel() and m.wire_bytes_per_value == 1 + 1 / 64
    assert m.log is None  # opened by the trainer once the resume step is known
    # topk: a contribution's payload one way and the owners' average the other, each at its density
    cfg = config_from_argv(QUICK + ["--diloco.codec", "topk", "--diloco.density", str(48 / 4096),
                                    "--diloco.average_density", str(96 / 4096)])
    m = build_metrics(cfg, env, parts, build_data(cfg, env, parts.args.vocab_size))
    # docs/wire-format-sparse.md: lo and hi, the unary upper parts, the lower bits (6 and 5), the codes
    assert m.wire_bytes_per_value == ((4 + 14 + 36 + 12) + (4 + 28 + 60 + 24)) / 2 / 4096


def test_run_metrics_account_bytes_and_compute(tmp_path, seed, capsys):
    """Bytes of outer steps that report none are estimated as a ring all-reduce of the int8 wire format,
    2 (N-1)/N x numel x (1 + 1/block) (recomputed here: a 1-byte scale per block), against data parallel's fp32 ring every inner step."""
    rng = random.Random(seed)
    numel, model_numel, block, inner = rng.randrange(1000, 100000), rng.randrange(1000, 100000), 128, 7
    m = RunMetrics(out_dir=str(tmp_path), node_rank=0, is_logger=True, local_world=1, num_nodes=3, total_steps=20,
                   log_every=1, tokens_per_step=256, flops_per_token=1e6, peak=None, local_sum=lambda v: list(v),
                   codec="int8", block_size=block, inner_steps=inner, model_numel=model_numel)
    m.print("before open")
    m.record("step", 0, loss=1.0)  # dropped: nothing is open yet
    assert capsys.readouterr().out == "before open\n"
    m.open(config={"a": 1})
    measured = rng.randrange(1, 1 << 20)
    for members, sent in (([0, 1, 2], None), ([0, 2], measured)):
        m.compute(0.5)
        r = OuterStepResult(True, inner, 1, numel=numel, allreduce_s=0.1, bytes_sent=sent, members=members,
                            pseudo_grad_norm=1.0, attempts=1)
        m.outer_step(inner, r, note=" | extra note", fields={"nodes": len(members)})
    out = capsys.readouterr().out
    assert out.count("| extra note") == 2 and "(est.)" in out
    est = 2 * 2 / 3 * numel * (1 + 1 / block)
    dp = 2 * 2 / 3 * 4 * model_numel * inner + 2 * 1 / 2 * 4 * model_numel * inner
    assert m.total_sent == pytest.approx(est + measured, rel=1e-12) and not m.sent_measured
    assert m.total_dp == pytest.approx(dp, rel=1e-12)
    s = m.summary(inner, wall=2.0, outer_steps=2, multi_node=True)
    assert s["utilization"] == pytest.approx(0.5) and s["dp_bytes"] == m.total_dp
    m.close()
    recs = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics_node0.jsonl"))]
    assert [r["kind"] for r in recs] == ["outer", "outer", "summary"]
    assert [r["nodes"] for r in recs[:2]] == [3, 2] and recs[1]["bytes_sent"] == measured


# -- checkpoints ---------------------------------------------------------------------------


class _Position:
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def test_train_checkpoints_resume_the_state_and_refuse_a_non_finite_one(tmp_path, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco, data = DiLoCo(model, opt, None, inner_steps=4), _Position()
    ck = TrainCheckpoints(Checkpointer(str(tmp_path), 0, 0, 1, async_save=False), model, opt, data, diloco,
                          local_sum=lambda v: list(v))
    for step in range(1, 4):
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step()
        data.pos += 5
    rng_state = torch.get_rng_state()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert ck.save(3, block=True) and ck.newest() == 3
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    data.pos, diloco.inner_step = 0, 0
    torch.randn(10)  # moves the RNG on
    assert ck.resume(None, 0, 1, publish=True) == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert data.pos == 15 and diloco.inner_step == 3 and torch.equal(torch.get_rng_state(), rng_state)
    with torch.no_grad():
        model[1].weight.view(-1)[random.Random(seed).randrange(model[1].weight.numel())] = float("nan")
    assert not ck.state_is_finite() and not ck.save(4, block=True)
    assert ck.newest() == 3 and sorted(os.listdir(os.path.join(tmp_path, "node0"))) == ["step_00000003"]
    ck.close()


def test_build_checkpoints_only_with_a_directory(tmp_path, one_process):
    cfg = config_from_argv(QUICK)
    env = _cpu_env()
    parts = build_model_and_optimizer(cfg, env)
    data = build_data(cfg, env, parts.args.vocab_size)
    diloco = DiLoCo(parts.model, parts.optimizer, None, inner_steps=4)
    assert build_checkpoints(cfg, env, parts, data, diloco) is None
    cfg = config_from_argv(QUICK + ["--checkpoint.dir", str(tmp_path)])
    ck = build_checkpoints(cfg, env, parts, data, diloco)
    assert isinstance(ck, TrainCheckpoints) and ck.checkpointer.node_dir == os.path.join(tmp_path, "node0")
    ck.close()


# -- the nodes component, and the loop's one call into it ------------------------------------


def test_fixed_nodes_of_a_single_node_do_nothing(one_process):
    cfg = config_from_argv(QUICK)
    env = _cpu_env()
    parts = build_model_and_optimizer(cfg, env)
    nodes = FixedNodes(cfg, env)
    assert nodes.sync is None and nodes.records is None and not nodes.multi_node and nodes.describe() is None
    diloco = DiLoCo(parts.model, parts.optimizer, nodes.sync, inner_steps=4)
    nodes.attach(diloco)
    r = nodes.start()
    assert not r.did_sync and (r.inner_step, r.outer_step) == (0, 0)
    assert nodes.after_outer(r) == AfterOuter() and nodes.finish(parts.model) == {}
    nodes.close()
    nodes.release()


def test_final_weights_digest_is_of_every_value(seed):
    """blake2b-128 over the fp32 bytes of every parameter in order (recomputed here); one changed value changes it."""
    import hashlib

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    diloco = DiLoCo(model, None, None, inner_steps=2)
    ref = hashlib.blake2b(b"".join(p.detach().float().numpy().tobytes() for p in model.parameters()), digest_size=16)
    digest, what = final_weights_digest(model, diloco)
    assert digest == ref.hexdigest() and what == "weights"
    with torch.no_grad():
        model[0].weight.view(-1)[random.Random(seed).randrange(128)] += 1e-3
    assert final_weights_digest(model, diloco)[0] != digest


def test_likely_divergence_cause_names_the_setting():
    cfg = config_from_argv(QUICK)
    assert "diloco.outer_lr (0.7)" in likely_divergence_cause(cfg, 11, None, after_outer=True)
    assert "the checkpoint of step 8" in likely_divergence_cause(cfg, 9, 8, after_outer=False)
    assert "the first step diverged" in likely_divergence_cause(cfg, 1, None, after_outer=False)
    assert "optim.lr (0.003) too high" in likely_divergence_cause(cfg, 5, None, after_outer=False)


class _AveragingAlone:
    """A prime.sync.Sync of one node that, at outer step `rejoin_at`, reports the job at inner step `job_step`."""

    def __init__(self, rejoin_at: int, job_step: int):
        self.rejoin_at, self.job_step = rejoin_at, job_step

    def bind(self, state, settings):
        pass

    def agree(self, ok):
        return ok

    def verify(self, fingerprint, *, outer_step):
        pass

    def average(self, grad, *, outer_step, inner_step, recompute):
        job = self.job_step if outer_step == self.rejoin_at else None
        return SyncResult(members=[0], contributors=1, inner_step=job, details=job)

    def committed(self, result):
        pass

    def close(self):
        pass


class _RejoiningNodes:
    """A nodes component whose after_outer() says: this node rejoined the job at inner step `details`."""

    resumes, multi_node, stop_errors, finished_errors, records = True, False, (), (), None

    def __init__(self, sync):
        self.sync, self.calls = sync, []

    def attach(self, diloco):
        self.diloco = diloco

    def describe(self):
        return None

    def start(self):
        return OuterStepResult(False, 0, 0)

    def after_outer(self, result):
        self.calls.append(result.outer_step)
        return AfterOuter(rejoined_at=result.details, note=" | fake nodes", fields={"fake": True})

    def finish(self, model):
        return {"finished": True}

    def host_processes(self):
        return 1

    def nodes_that_do_not_fit(self, fits):
        return [] if fits else [0]

    def launch_scope(self):
        return ""

    def close(self):
        pass

    def release(self):
        pass


def test_the_loop_takes_the_job_step_from_the_nodes_component(tmp_path, monkeypatch, one_process, seed):
    """Outer steps every 3 inner steps; at the second one the nodes component reports a rejoin at step 20: the
    loop records no step line for that step, logs the outer step at step 20 and goes on with step 21."""
    import prime.trainer

    nodes = _RejoiningNodes(_AveragingAlone(rejoin_at=2, job_step=20))

    def build_outer_step(cfg, env, parts, data, metrics):
        diloco = DiLoCo(parts.model, parts.optimizer, nodes.sync, inner_steps=3)
        nodes.attach(diloco)
        return diloco, nodes

    monkeypatch.setattr(prime.trainer, "build_outer_step", build_outer_step)
    out = str(tmp_path / "m")
    trainer = Trainer(config_from_argv(QUICK + ["--train.steps", "23", "--train.seed", str(seed % 1000),
                                                "--diloco.inner_steps", "3", "--metrics.out_dir", out]))
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["finished"] and summary["steps"] == 23 and nodes.calls == [1, 2, 3]
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics_node0.jsonl"))]
    steps = [r["step"] for r in recs if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4, 5, 21, 22, 23]
    outer = [(r["step"], r["outer_step"], r["fake"]) for r in recs if r["kind"] == "outer"]
    assert outer == [(3, 1, True), (20, 2, True), (23, 3, True)]
