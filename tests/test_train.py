"""End to end: prime-train under torchrun, prime-simulate with several nodes, checkpoints and resume.

The multi-node tests need the real ring (prime.comm.Ring); they skip when it is
not built. Every run uses the `tiny` model on short byte sequences of the
embedded corpus, so each takes seconds of compute; most of the time is
process start-up.
"""

import json
import os
import random
import shutil
import statistics
import subprocess
import sys

import pytest
import torch

from prime.simulate import free_port, parse_slow_node
from prime.train import main as train_main
from conftest import needs_ring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and quick: 4 x 64 tokens per step and process.
QUICK = ["--model.name", "tiny", "--train.device", "cpu", "--data.seq_len", "64", "--train.micro_batch_size", "4", "--train.threads", "1",
         "--optim.lr", "3e-3", "--optim.warmup_steps", "5", "--optim.decay_steps", "0", "--metrics.plot", "false"]






def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("PRIME_NODE_RANK", "PRIME_NUM_NODES", "PRIME_STORE_ADDR", "PRIME_FAULT_EXIT_AFTER_STEP"):
        env.pop(k, None)
    return env


def run_simulate(nodes, procs, args, env_extra=None, timeout=300):
    env = dict(_env(), **(env_extra or {}))
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", str(nodes), "--procs-per-node", str(procs), "--", *args]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def run_torchrun(procs, args, env_extra=None, timeout=300):
    env = dict(_env(), **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "prime.train", *args]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def run_train(args, env_extra=None, timeout=300):
    """One process, no torchrun (no FSDP, no process group)."""
    env = dict(_env(), **(env_extra or {}))
    p = subprocess.run([sys.executable, "-m", "prime.train", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def worker_tracebacks(out):
    """Tracebacks in the output other than torchrun's own report that a child failed."""
    return out.count("Traceback (most recent call last)") - out.count("ChildFailedError:")


def records(out_dir, node=0, kind="step"):
    with open(os.path.join(out_dir, f"metrics_node{node}.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def final_digests(out):
    """The weights hashes the nodes printed after their end-of-run replica check, in print order."""
    return [line.rsplit("blake2b ", 1)[1].split()[0] for line in out.splitlines() if "final weights identical" in line]


def losses(out_dir, node=0):
    return {r["step"]: r["loss"] for r in records(out_dir, node)}


@pytest.fixture
def seed():
    s = random.randrange(1000)
    print(f"seed {s}")
    return s


# -- errors before anything starts -------------------------------------------------


def test_bad_config_value_exits_2_with_the_field(capsys):
    assert train_main(["--diloco.inner_steps", "0"]) == 2
    assert "diloco.inner_steps must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("optim.lr", "inf"), ("diloco.outer_lr", "inf"), ("model.rope_theta", "nan"),
                                         ("diloco.timeout_s", "1e-9"), ("diloco.streams", "1000")])
def test_non_finite_or_absurd_setting_exits_2_naming_it(capsys, field, value):
    assert train_main(["--" + field, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prime-train: error: {field} must be") and "Traceback" not in err, err


def test_missing_data_path_exits_2(capsys, tmp_path):
    missing = str(tmp_path / "nowhere")
    assert train_main(["--data.source", "bin", "--data.path", missing]) == 2
    err = capsys.readouterr().err
    assert missing in err and "does not exist" in err


def test_unknown_field_exits_2(capsys):
    assert train_main(["--train.stepz", "3"]) == 2
    assert "unknown config field 'train.stepz'" in capsys.readouterr().err


# -- one node ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """One node of 2 FSDP2 processes, 12 steps, run twice on one seed: uninterrupted, and killed after step 10
    with the checkpoints of steps 4 and 8. The resume tests start from copies of those checkpoints."""
    seed = random.randrange(1000)
    tmp = tmp_path_factory.mktemp("fsdp")
    common = QUICK + ["--train.steps", "12", "--train.seed", str(seed), "--metrics.log_every", "1",
                      "--checkpoint.every", "4"]
    rc, out = run_torchrun(2, common + ["--metrics.out_dir", str(tmp / "full")])
    assert rc == 0, out
    ck = str(tmp / "ck")
    rc, out = run_torchrun(2, common + ["--checkpoint.dir", ck, "--metrics.out_dir", str(tmp / "killed")],
                           env_extra={"PRIME_FAULT_EXIT_AFTER_STEP": "10"})
    assert rc != 0 and "exiting as if killed" in out, out
    assert sorted(os.listdir(os.path.join(ck, "node0"))) == ["step_00000004", "step_00000008"]
    ref = losses(str(tmp / "full"))
    assert ref[12] < ref[1] - 1.0
    return dict(seed=seed, common=common, ck=ck, ref=ref, killed=str(tmp / "killed"))


def _resume_fsdp(runs, tmp_path, name, damage=None):
    """Resumes the killed run from a copy of its checkpoints, `damage(copy)` applied first: (exit status,
    output, the copy, the metrics dir, what damage returned)."""
    copy = str(tmp_path / f"ck_{name}")
    shutil.copytree(runs["ck"], copy)
    damaged = damage(copy) if damage else None
    out_dir = str(tmp_path / name)
    rc, out = run_torchrun(2, runs["common"] + ["--checkpoint.dir", copy, "--metrics.out_dir", out_dir])
    return rc, out, copy, out_dir, damaged


def test_fsdp_node_resume_matches_uninterrupted_run(fsdp_runs, tmp_path):
    """2 FSDP2 processes on one node killed after step 10: the resume from the step-8 checkpoint trains the
    same losses as the run without the kill, bit for bit."""
    ref, seed = fsdp_runs["ref"], fsdp_runs["seed"]
    rc, out, _, out_dir, _ = _resume_fsdp(fsdp_runs, tmp_path, "intact")
    assert rc == 0 and "resumed from the checkpoint of step 8" in out, out
    got = {r["step"]: r["loss"] for r in records(out_dir)}
    assert sorted(got) == list(range(9, 13))  # a fresh metrics dir: the steps after the checkpoint
    killed = losses(fsdp_runs["killed"])
    assert sorted(killed) == list(range(1, 11))
    for step in range(1, 13):  # FSDP on CPU and the data order are deterministic: bit-identical
        loss = got[step] if step > 8 else killed[step]
        assert loss == ref[step], f"step {step}: {loss} vs {ref[step]} (seed {seed})"


def _largest_distcp(step_dir):
    names = [n for n in os.listdir(step_dir) if n.endswith(".distcp")]
    return os.path.join(step_dir, max(names, key=lambda n: os.path.getsize(os.path.join(step_dir, n))))


def _damage(path, how, rng):
    """Overwrites 4 KiB in place with other bytes (same size) or truncates the file."""
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, rng.randrange(size // 2))
        return
    off = rng.randrange(size - 4096)
    with open(path, "r+b") as f:
        f.seek(off)
        old = f.read(4096)
        f.seek(off)
        f.write(bytes((b + rng.randrange(1, 256)) % 256 for b in old))
    assert os.path.getsize(path) == size


def test_fsdp_node_falls_back_from_a_damaged_checkpoint(fsdp_runs, tmp_path):
    """A file of the step-8 checkpoint overwritten (4 KiB, same size) or truncated, one of the two chosen by the
    seed (tests/test_checkpoint.py damages every way without processes): the resume names the file, falls
    back to step 4 and trains the same losses as the run without the kill. Both checkpoints damaged: every
    process stops with a clear message. No traceback from any process."""
    ref, seed = fsdp_runs["ref"], fsdp_runs["seed"]
    rng = random.Random(seed)
    how = rng.choice(("overwrite_4k", "truncate"))
    print("damage", how)

    def damage_newest(copy):
        victim = _largest_distcp(os.path.join(copy, "node0", "step_00000008"))
        _damage(victim, how, rng)
        return victim

    rc, out, _, out_dir, victim = _resume_fsdp(fsdp_runs, tmp_path, how, damage_newest)
    assert rc == 0, out
    assert "checkpoint of step 8 on node 0 is damaged" in out and victim in out, out
    assert "resumed from the checkpoint of step 4" in out and worker_tracebacks(out) == 0, out
    got = {r["step"]: r["loss"] for r in records(out_dir)}
    assert sorted(got) == list(range(5, 13))
    for step in range(5, 13):  # deterministic on CPU: bit-identical to the run without the kill
        assert got[step] == ref[step], f"{how} step {step}: {got[step]} vs {ref[step]} (seed {seed})"

    def damage_both(copy):
        for step in (4, 8):
            _damage(_largest_distcp(os.path.join(copy, "node0", f"step_{step:08d}")), "overwrite_4k", rng)

    rc, out, copy, _, _ = _resume_fsdp(fsdp_runs, tmp_path, "none", damage_both)
    assert rc != 0, out
    assert out.count(f"prime-train: stopped: no checkpoint under {copy} is intact on every node") == 2, out
    assert worker_tracebacks(out) == 0 and "terminate called" not in out, out


def test_non_finite_state_stops_the_run_and_is_never_saved(tmp_path, seed):
    """A checkpoint whose AdamW moment holds a NaN (with a valid manifest): the first step after the resume
    poisons the weights. Saving that step is refused; without a save, the next step's loss stops the run
    naming the step and optim.lr. Exit 3 both times, and the only checkpoint stays the one of step 4."""
    from prime.config import config_from_argv
    from prime.trainer import Trainer

    ck = str(tmp_path / "ck")
    base = QUICK + ["--train.seed", str(seed), "--checkpoint.dir", ck, "--checkpoint.async_save", "false"]
    rc, out = run_train(base + ["--train.steps", "4", "--metrics.out_dir", str(tmp_path / "m0")])
    assert rc == 0, out
    threads = torch.get_num_threads()
    trainer = Trainer(config_from_argv(base + ["--train.steps", "8", "--metrics.out_dir", str(tmp_path / "m1")]))
    try:
        assert trainer.resumed_from == 4
        norm = dict(trainer.model.named_parameters())["layers.0.attention_norm.weight"]  # every token passes it
        moments = trainer.optimizer.state[norm]["exp_avg"]
        moments.view(-1)[random.Random(seed).randrange(moments.numel())] = float("nan")
        extra = {"step": 4, "data": trainer.data.state_dict(), "diloco": trainer.diloco.state_dict(),
                 "rng": torch.get_rng_state()}
        trainer.checkpoints.checkpointer.save(4, trainer.model, trainer.optimizer, extra, block=True)  # a valid manifest
    finally:
        trainer.close()
        torch.set_num_threads(threads)  # the Trainer set train.threads for this process
    rc, out = run_train(base + ["--train.steps", "8", "--checkpoint.every", "1", "--metrics.out_dir", str(tmp_path / "m2")])
    assert rc == 3 and "resumed from the checkpoint of step 4" in out, out
    assert ("prime-train: stopped: step 5: the weights or the optimizer state are not finite; they were not saved "
            "as a checkpoint. The newest checkpoint is of step 4") in out, out
    assert sorted(os.listdir(os.path.join(ck, "node0"))) == ["step_00000004"] and "Traceback" not in out, out
    rc, out = run_train(base + ["--train.steps", "8", "--metrics.out_dir", str(tmp_path / "m3")])
    assert rc == 3, out
    assert "prime-train: stopped: step 6: the loss is nan and the gradient norm nan: training diverged; likely " \
           "cause: optim.lr (0.003) too high" in out, out
    assert "Nothing of this state was saved" in out and "Traceback" not in out, out
    assert sorted(os.listdir(os.path.join(ck, "node0"))) == ["step_00000004"]


# -- several nodes through the ring -------------------------------------------------


@needs_ring
def test_two_nodes_two_procs_learn_and_agree(tmp_path, seed):
    """2 nodes x 2 FSDP processes: loss goes down, and after the last outer step every node holds the same bits."""
    out_dir, ck = str(tmp_path / "run"), str(tmp_path / "ck")
    args = QUICK + ["--train.steps", "30", "--diloco.inner_steps", "10", "--train.seed", str(seed),
                    "--metrics.out_dir", out_dir, "--checkpoint.dir", ck, "--checkpoint.async_save", "false",
                    "--metrics.log_every", "1"]
    rc, out = run_simulate(2, 2, args)
    assert rc == 0, out
    for node in (0, 1):
        ls = losses(out_dir, node)
        first, last = sum(ls[s] for s in range(1, 4)) / 3, sum(ls[s] for s in range(28, 31)) / 3
        assert last < first - 1.0, (node, first, last)
        outer = records(out_dir, node, "outer")
        assert [r["outer_step"] for r in outer] == [1, 2, 3]
        assert all(r["bytes_sent"] > 0 for r in outer)
        assert all(0 < r["prepare_s"] and 0 < r["update_s"] and r["prepare_s"] + r["update_s"] < r["outer_s"]
                   for r in outer), outer  # the parts of the outer step besides the all-reduce
    for g in (0, 1):  # each local rank's shard: outer weights and momentum identical on both nodes
        a = torch.load(os.path.join(ck, "node0", "step_00000030", f"rank{g}.pt"), weights_only=True)["diloco"]
        b = torch.load(os.path.join(ck, "node1", "step_00000030", f"rank{g}.pt"), weights_only=True)["diloco"]
        assert a["outer_step"] == b["outer_step"] == 3
        a, b = a["fragments"][0], b["fragments"][0]
        assert torch.equal(a["outer"], b["outer"]) and torch.equal(a["momentum"], b["momentum"])
        assert a["outer"].abs().sum() > 0
    digests = final_digests(out)
    assert len(digests) == 2 and digests[0] == digests[1], out  # node 0 and node 1 (their local rank 0)


@needs_ring
def test_topk_with_a_dense_start_on_nodes_of_two_processes_and_one(tmp_path, seed):
    """prime-simulate --procs-per-node 2,1 with topk (chunks of 256), 2 fragments with overlap and a dense start
    of one outer step per fragment: the DiLoCo line names it, each fragment's first outer step is marked dense in
    the line and the record and sends int8's bytes (more than its sparse ones), later ones are not; the loss goes
    down and the final weights agree."""
    out_dir = str(tmp_path / "run")
    args = QUICK + ["--train.steps", "30", "--diloco.inner_steps", "10", "--train.seed", str(seed),
                    "--diloco.fragments", "2", "--diloco.overlap", "true", "--diloco.codec", "topk",
                    "--diloco.block_size", "256", "--diloco.dense_outer_steps", "1", "--metrics.out_dir", out_dir,
                    "--metrics.log_every", "1"]
    rc, out = run_simulate(2, "2,1", args)
    assert rc == 0, out
    assert "the first 1 outer step of each fragment dense (int8)" in out, out
    assert "dense start (int8)" in out, out
    for node in (0, 1):
        ls = losses(out_dir, node)
        assert sum(ls[s] for s in range(28, 31)) / 3 < sum(ls[s] for s in range(1, 4)) / 3 - 1.0, node
        outer = [r for r in records(out_dir, node, "outer") if not r.get("final_sync")]
        # with overlap a record's bytes and its dense mark are the average applied there: fragment p's first
        # (outer step p + 1) is applied at outer step p + 3
        dense = {r["outer_step"] for r in outer if r.get("dense")}
        assert dense == {3, 4}, (node, [(r["outer_step"], r.get("dense"), r["bytes_sent"]) for r in outer])
        sent = {r["outer_step"]: r["bytes_sent"] for r in outer}
        assert min(sent[3], sent[4]) > 2 * max(v for k, v in sent.items() if k > 4), sent
    assert len(final_digests(out)) == 2, out  # each node's line: its weights agree with the other node's


@needs_ring
def test_a_node_of_two_processes_and_one_of_one_learn_and_agree_ring_by_ring(tmp_path, seed):
    """prime-simulate --procs-per-node 2,1: node 0 shards the model over 2 FSDP2 processes, node 1 runs one
    process on both rings. 2 fragments with overlap; loss goes down; node 1's outer state of ring g is node 0's
    local rank g's bit for bit; every outer step weighs node 0 twice (its tokens); the final weights agree."""
    out_dir, ck = str(tmp_path / "run"), str(tmp_path / "ck")
    args = QUICK + ["--train.steps", "30", "--diloco.inner_steps", "10", "--train.seed", str(seed),
                    "--diloco.fragments", "2", "--diloco.overlap", "true", "--metrics.out_dir", out_dir,
                    "--checkpoint.dir", ck, "--checkpoint.async_save", "false", "--metrics.log_every", "1"]
    rc, out = run_simulate(2, "2,1", args)
    assert rc == 0, out
    for node in (0, 1):
        ls = losses(out_dir, node)
        first, last = sum(ls[s] for s in range(1, 4)) / 3, sum(ls[s] for s in range(28, 31)) / 3
        assert last < first - 1.0, (node, first, last)
        weighed = [r for r in records(out_dir, node, "outer") if r.get("node_steps")]
        assert weighed and all(r["node_weights"] == pytest.approx([2 / 3, 1 / 3]) for r in weighed), weighed
        assert all(r["node_tokens"][0] == 2 * r["node_tokens"][1] for r in weighed), weighed
        assert all(r["node_steps"][0] == r["node_steps"][1] for r in weighed), weighed
    one = torch.load(os.path.join(ck, "node1", "step_00000030", "rank0.pt"), weights_only=True)["diloco"]["rings"]
    for g in (0, 1):
        a = torch.load(os.path.join(ck, "node0", "step_00000030", f"rank{g}.pt"), weights_only=True)["diloco"]
        b = one[g]
        assert a["outer_step"] == b["outer_step"] > 3
        for fa, fb in zip(a["fragments"], b["fragments"]):
            assert torch.equal(fa["outer"], fb["outer"]) and torch.equal(fa["momentum"], fb["momentum"])
            assert fa["outer"].abs().sum() > 0
    assert len(final_digests(out)) == 2, out
    assert "shard 0 of 3" in out and "shard 2 of 3" in out, out  # every process reads its own data


def test_uneven_process_counts_are_checked_before_any_node_starts():
    for own, why in ((["--procs-per-node", "4,2"], "either the most processes of any node"),
                     (["--procs-per-node", "2,1,1"], "3 process counts for 2 nodes"),
                     (["--procs-per-node", "2,1", "--elastic"], "need a fixed set of nodes")):
        cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", *own, "--", *QUICK]
        p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and why in p.stderr, p.stdout + p.stderr


@needs_ring
def test_int8_and_exact_reach_the_same_loss(tmp_path, seed):
    """The same seed with the int8 ring and with exact fp32: final losses within 2%."""
    final = {}
    for codec in ("int8", "none"):
        out_dir = str(tmp_path / codec)
        args = QUICK + ["--train.steps", "40", "--diloco.inner_steps", "10", "--diloco.codec", codec,
                        "--train.seed", str(seed), "--metrics.out_dir", out_dir, "--metrics.log_every", "1"]
        rc, out = run_simulate(2, 1, args)
        assert rc == 0, out
        per_node = [losses(out_dir, n) for n in (0, 1)]
        final[codec] = sum(ls[s] for ls in per_node for s in range(31, 41)) / 20  # last 10 steps, both nodes
        if codec == "int8":
            errs = [r["compression_error"] for r in records(out_dir, 0, "outer")]
            assert all(0 < e < 0.05 for e in errs), errs
    assert abs(final["int8"] - final["none"]) / final["none"] < 0.02, final


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory):
    """2 nodes of 1 process, 12 steps, outer steps every 3, run twice on one seed: uninterrupted, and killed
    after step 10 with the checkpoints of steps 4 and 8 (both in the middle of an outer phase)."""
    seed = random.randrange(1000)
    tmp = tmp_path_factory.mktemp("two_nodes")
    common = QUICK + ["--train.steps", "12", "--diloco.inner_steps", "3", "--train.seed", str(seed),
                      "--metrics.log_every", "1", "--checkpoint.every", "4"]
    rc, out = run_simulate(2, 1, common + ["--metrics.out_dir", str(tmp / "full")])
    assert rc == 0, out
    ck = str(tmp / "ck")
    rc, out = run_simulate(2, 1, common + ["--checkpoint.dir", ck, "--metrics.out_dir", str(tmp / "killed")],
                           env_extra={"PRIME_FAULT_EXIT_AFTER_STEP": "10"})
    assert rc != 0 and "exiting as if killed" in out, out
    for node in (0, 1):
        assert sorted(os.listdir(os.path.join(ck, f"node{node}"))) == ["step_00000004", "step_00000008"]
    return dict(seed=seed, common=common, ck=ck, full=str(tmp / "full"))


def _resume_two_nodes(runs, tmp_path, name, damage=None):
    copy = str(tmp_path / f"ck_{name}")
    shutil.copytree(runs["ck"], copy)
    damaged = damage(copy) if damage else None
    out_dir = str(tmp_path / name)
    rc, out = run_simulate(2, 1, runs["common"] + ["--checkpoint.dir", copy, "--metrics.out_dir", out_dir])
    return rc, out, out_dir, damaged


@needs_ring
def test_two_nodes_resume_matches_uninterrupted_run(two_node_runs, tmp_path):
    """Both nodes killed after step 10, resumed from the step-8 checkpoint (mid outer phase): the same losses on
    both nodes as the run without the kill, bit for bit."""
    rc, out, out_dir, _ = _resume_two_nodes(two_node_runs, tmp_path, "intact")
    assert rc == 0 and out.count("resumed from the checkpoint of step 8") == 2, out
    for node in (0, 1):
        ref, got = losses(two_node_runs["full"], node), losses(out_dir, node)
        assert sorted(got) == list(range(9, 13))
        for s, l in got.items():
            assert l == ref[s], f"node {node} step {s}: {l} vs {ref[s]} (seed {two_node_runs['seed']})"


@needs_ring
def test_a_resume_with_another_outer_lr_says_so_on_both_nodes(two_node_runs, tmp_path):
    """Resumed from the step-8 checkpoint with diloco.outer_lr 0.5 (the run had int8's default, 0.7): each node
    prints the change under the resume line, and the run goes on with it."""
    copy = str(tmp_path / "ck_lr")
    shutil.copytree(two_node_runs["ck"], copy)
    rc, out = run_simulate(2, 1, two_node_runs["common"] + ["--checkpoint.dir", copy, "--metrics.out_dir",
                                                            str(tmp_path / "lr"), "--diloco.outer_lr", "0.5"])
    assert rc == 0 and out.count("resumed from the checkpoint of step 8") == 2, out
    assert out.count("the outer step's settings differ from the checkpoint's run, and apply from here on: "
                     "outer_lr 0.5 (was 0.7)") == 2, out


@needs_ring
def test_two_nodes_agree_to_fall_back_when_one_has_a_damaged_checkpoint(two_node_runs, tmp_path):
    """Node 1's newest checkpoint is truncated, node 0's is intact: both resume from the older one (the same
    step, the same losses as the run without the kill), without a traceback on either node."""
    rng = random.Random(two_node_runs["seed"])

    def truncate_newest_of_node1(copy):
        victim = _largest_distcp(os.path.join(copy, "node1", "step_00000008"))
        _damage(victim, "truncate", rng)
        return victim

    rc, out, out_dir, victim = _resume_two_nodes(two_node_runs, tmp_path, "damaged", truncate_newest_of_node1)
    assert rc == 0, out
    assert "checkpoint of step 8 on node 1 is damaged" in out and victim in out, out
    assert out.count("resumed from the checkpoint of step 4") == 2 and "Traceback" not in out, out
    for node in (0, 1):
        ref, got = losses(two_node_runs["full"], node), losses(out_dir, node)
        assert sorted(got) == list(range(5, 13))
        for s, l in got.items():
            assert l == ref[s], f"node {node} step {s}: {l} vs {ref[s]} (seed {two_node_runs['seed']})"


@needs_ring
def test_a_failing_node_stops_the_simulation(tmp_path):
    """One node dies: prime-simulate reports it, stops the other and exits non-zero."""
    args = QUICK + ["--train.steps", "200", "--diloco.inner_steps", "5", "--diloco.timeout_s", "20",
                    "--metrics.out_dir", str(tmp_path)]
    rc, out = run_simulate(2, 1, args, env_extra={"PRIME_FAULT_EXIT_AFTER_STEP": "3"})
    assert rc != 0 and "stopping the other nodes" in out, out


@needs_ring
def test_lost_peer_stops_with_a_checkpoint_and_status_3(tmp_path):
    """Node 1 dies before the first outer step: node 0 retries on a new ring, gives up, saves a checkpoint, exits 3."""
    store = f"127.0.0.1:{free_port()}"
    ck = str(tmp_path / "ck")
    args = QUICK + ["--train.steps", "20", "--diloco.inner_steps", "5", "--diloco.timeout_s", "4",
                    "--diloco.retries", "1", "--num-nodes", "2", "--store-addr", store, "--checkpoint.dir", ck,
                    "--metrics.out_dir", str(tmp_path / "m")]
    procs = []
    for node, fault in ((0, "0"), (1, "3")):
        env = dict(_env(), PRIME_FAULT_EXIT_AFTER_STEP=fault)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "prime.train", *args,
               "--node-rank", str(node)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert procs[1].returncode != 0 and "exiting as if killed" in outs[1], outs[1]
    assert procs[0].returncode != 0, outs[0]
    assert "prime-train: stopped: outer step 1: the all-reduce across nodes failed 2 time(s)" in outs[0], outs[0]
    assert "Checkpoint of step 5 saved" in outs[0], outs[0]
    state = torch.load(os.path.join(ck, "node0", "step_00000005", "rank0.pt"), weights_only=True)
    assert state["step"] == 5 and state["diloco"]["outer_step"] == 0 and state["diloco"]["since_sync"] == 5


@needs_ring
def test_nodes_that_differ_in_checking_replicas_both_stop_saying_so(tmp_path):
    """Node 0 checks replicas (the default) and node 1 does not: the check is an exchange every node takes part
    in, so instead of node 0's check meeting node 1's first all-reduce, both stop with status 3 before it."""
    store = f"127.0.0.1:{free_port()}"
    args = QUICK + ["--train.steps", "10", "--diloco.inner_steps", "5", "--diloco.timeout_s", "20",
                    "--num-nodes", "2", "--store-addr", store]
    procs = []
    for node, check in ((0, "true"), (1, "false")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "prime.train", *args,
               "--node-rank", str(node), "--diloco.check_replicas", check,
               "--metrics.out_dir", str(tmp_path / f"m{node}")]
        procs.append(subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0 and "exitcode  : 3" in out, out
        assert (f"prime-train: stopped: node {node}: diloco.check_replicas is false on node(s) [1] and true on "
                "node(s) [0]: set it alike on every node") in out, out
        assert "all_reduce" not in out, out


# -- GPU (skipped without CUDA) ------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU = [a if a != "cpu" else "cuda" for a in QUICK]  # the same run with train.device = cuda (bf16 autocast)


@needs_cuda
@pytest.mark.parametrize("procs", [1, 2])
def test_gpu_node_bf16_learns(tmp_path, seed, procs):
    """One node on the GPU: 1 process (bf16 autocast, fused AdamW) or 2 processes with FSDP2 on NCCL
    (bf16 compute, fp32 reduce-scatter); the loss goes down and MFU is reported on known GPUs."""
    if torch.cuda.device_count() < procs:
        pytest.skip(f"needs {procs} GPUs")
    out_dir = str(tmp_path / "run")
    args = GPU + ["--train.steps", "40", "--train.seed", str(seed), "--metrics.out_dir", out_dir,
                  "--metrics.log_every", "1"]
    rc, out = run_torchrun(procs, args)
    assert rc == 0 and f"device cuda x {procs}{' (FSDP2)' if procs > 1 else ''}" in out, out
    ls = losses(out_dir)
    assert sum(ls[s] for s in range(38, 41)) / 3 < sum(ls[s] for s in range(1, 4)) / 3 - 1.0, ls
    if any(name in torch.cuda.get_device_name() for name in ("H100", "H200")):
        assert all(r["mfu"] is not None and r["mfu"] > 0 for r in records(out_dir))


@needs_ring
@needs_cuda
def test_gpu_two_nodes_diloco_agree(tmp_path, seed):
    """2 nodes x 1 GPU process (sharing the GPU when there is one): the int8 ring between them,
    the loss goes down, and both nodes end with bit-identical weights."""
    out_dir = str(tmp_path / "run")
    args = GPU + ["--train.steps", "30", "--diloco.inner_steps", "10", "--train.seed", str(seed),
                  "--metrics.out_dir", out_dir, "--metrics.log_every", "1"]
    rc, out = run_simulate(2, 1, args)
    assert rc == 0, out
    digests = final_digests(out)
    assert len(digests) == 2 and digests[0] == digests[1], out
    for node in (0, 1):
        ls = losses(out_dir, node)
        assert sum(ls[s] for s in range(28, 31)) / 3 < sum(ls[s] for s in range(1, 4)) / 3 - 1.0, (node, ls)
        assert [r["outer_step"] for r in records(out_dir, node, "outer")] == [1, 2, 3]


@needs_ring
def test_a_slowed_node_takes_longer_steps_the_other_waits_and_the_bits_stay(tmp_path):
    """prime-simulate --slow-node 1:3 (train.slowdown on node 1): node 1's inner steps take about 3x their own time,
    node 0 waits for it at every outer step, and the run ends with the bits of the same run without it (phases
    counted in steps do not depend on time)."""
    args = QUICK + ["--train.steps", "20", "--diloco.inner_steps", "10", "--train.seed", "3", "--metrics.log_every", "1"]
    outs = {}
    for name, own in (("slow", ["--slow-node", "1:3"]), ("even", [])):
        cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", *own, "--", *args,
               "--metrics.out_dir", str(tmp_path / name)]
        p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
        outs[name] = p.stdout + p.stderr
        assert p.returncode == 0, outs[name]
    out, run = outs["slow"], str(tmp_path / "slow")
    assert "[node 1] inner steps slowed 3x (train.slowdown)" in out and "[node 0] inner steps slowed" not in out, out
    median = {n: statistics.median(r["step_s"] for r in records(run, n)[2:]) for n in (0, 1)}
    assert median[1] > 2 * median[0], median
    util = {n: records(run, n, "summary")[0]["utilization"] for n in (0, 1)}
    assert util[0] < util[1], util
    digests = final_digests(out)
    assert len(digests) == 2 and digests == final_digests(outs["even"]), (digests, final_digests(outs["even"]))
    for n in (0, 1):
        assert losses(run, n) == losses(str(tmp_path / "even"), n)


@needs_ring
def test_in_time_phases_a_node_slower_than_the_window_between_outer_steps_still_trains(tmp_path):
    """Time phases of 2 s with 4 fragments (a fragment syncs every 0.5 s) and node 1 slowed 10x, so that each of
    its inner steps outlasts the window between two outer steps: after every outer step it still starts one
    step (late) instead of predicting that none fits and never training again. Every outer step after the first
    round of fragments averages inner steps of both nodes, and the weights end the same."""
    args = QUICK + ["--train.steps", "80", "--diloco.inner_steps", "20", "--diloco.fragments", "4",
                    "--diloco.overlap", "true", "--diloco.phase", "time", "--diloco.phase_seconds", "2",
                    "--metrics.out_dir", str(tmp_path)]
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", "--slow-node", "1:10", "--", *args]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    during = [r for r in records(str(tmp_path), 0, "outer") if r["step"] < 80][4:]  # (the run's end: final syncs)
    assert len(during) >= 8, during
    assert all(r["node_steps"][1] >= 1 for r in during), [r["node_steps"] for r in during]
    assert sum(r["node_steps"][0] for r in during) > 3 * sum(r["node_steps"][1] for r in during), during
    digests = final_digests(out)
    assert len(digests) == 2 and digests[0] == digests[1], out


@needs_ring
def test_in_time_phases_the_nodes_start_their_clocks_together_after_a_first_step_that_took_longer_on_one(tmp_path):
    """Node 1's first inner step takes 6 s longer (as a compiling step does, for a time that differs between
    nodes): the nodes meet after it and start their clocks together, so that both train about as many steps in
    every phase, and node 0 waits once, at the start, not for node 1's late averages (a clock started at the run's
    start left node 1 3 phases behind; one started after each node's own first step left node 0 waiting)."""
    args = QUICK + ["--train.steps", "80", "--diloco.inner_steps", "20", "--diloco.fragments", "4",
                    "--diloco.overlap", "true", "--diloco.phase", "time", "--diloco.phase_seconds", "2",
                    "--metrics.out_dir", str(tmp_path)]
    cmd = [sys.executable, "-m", "prime.simulate", "--nodes", "2", "--fault", "1=train.before_step@1=stall:6",
           "--", *args]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    during = [r for r in records(str(tmp_path), 0, "outer") if r["step"] < 80][4:]  # (the run's end: final syncs)
    assert len(during) >= 8, during
    steps = [sum(r["node_steps"][n] for r in during) for n in (0, 1)]
    assert min(steps) > max(steps) / 2 and min(steps) > 2 * len(during), [r["node_steps"] for r in during]
    first = records(str(tmp_path), 1)[0]
    assert first["step"] == 1 and first["step_s"] > 6, first
    waited = records(str(tmp_path), 0, "summary")[0]  # node 0 waited at the start, not at every average after
    assert waited["time_start_s"] > 5 and waited["time_outer_wait_s"] < 3, waited
    digests = final_digests(out)
    assert len(digests) == 2 and digests[0] == digests[1], out


def test_slow_node_specs_are_checked():
    assert parse_slow_node("1:2.5", 2) == (1, 2.5)
    for text, why in (("2:2", "there is no node 2"), ("1:0.5", r"in \[1, 100\]"), ("1", "expected R:F"),
                      ("a:2", "expected R:F"), ("1:nan", r"in \[1, 100\]")):
        with pytest.raises(ValueError, match=why):
            parse_slow_node(text, 2)
