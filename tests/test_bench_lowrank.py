"""benchmarks/bench_lowrank.py: its low-rank round against float64 references on fresh random matrices (a full rank
gives the mean, error feedback keeps what a round leaves out), its rank rule against the byte budget, and a short
run end to end."""

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_lowrank as bench  # noqa: E402

SEED = random.SystemRandom().randrange(1 << 30)


def _matrices(g, nodes, m, n):
    return [torch.randn(m, n, generator=g) * torch.rand(1, n, generator=g) for _ in range(nodes)]


def test_a_full_rank_round_gives_the_mean():
    g = torch.Generator().manual_seed(SEED)
    ms = [torch.randn(40, 24, generator=g) for _ in range(3)]  # well conditioned: int8's error in P stays small in
    # its span (an ill-conditioned mean turns it into large errors along its small singular directions)
    lr = bench.LowRank((40, 24), 24, 3, decay=1.0, seed=SEED % 1000)
    got = lr.average(ms).double()
    ref = sum(m.double() for m in ms) / 3
    err = float((got - ref).norm() / ref.norm())
    assert err < 0.02, (err, SEED)  # two int8 passes (P and Q), each about 0.5%


def test_error_feedback_keeps_what_the_rounds_leave_out():
    g = torch.Generator().manual_seed(SEED)
    nodes, rounds = 2, 6
    lr = bench.LowRank((48, 32), 2, nodes, decay=1.0, seed=SEED % 1000)
    sent = torch.zeros(48, 32, dtype=torch.float64)
    given = torch.zeros(48, 32, dtype=torch.float64)
    for _ in range(rounds):
        ms = _matrices(g, nodes, 48, 32)
        given += sum(m.double() for m in ms) / nodes
        sent += lr.average(ms).double()
    left = sum(e.double() for e in lr.residual) / nodes
    err = float((sent + left - given).norm() / given.norm())
    assert err < 0.02, (err, SEED)  # what was applied plus what the residuals hold is what the nodes gave
    assert float(left.norm() / given.norm()) > 0.2, SEED  # rank 2 of 32 leaves much behind: the check can fail


def test_the_exact_valued_collective_keeps_every_contribution_and_the_selections_size():
    g = torch.Generator().manual_seed(SEED)
    world, n, chunk = 3, 30000, 4096
    cs = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g)) for _ in range(world)]
    got = bench.sparse.owner_average(cs, chunk, 48, "avg", 96, coding=bench.exact_coding)
    put = sum(c.double() for c in cs)
    kept = world * got.average.double() + sum(r.double() for r in got.residuals)
    assert torch.allclose(kept, put, rtol=0, atol=1e-5 * float(put.abs().max())), SEED
    for lo in range(0, n, chunk):  # the average keeps at most 96 a chunk, each an exact mean of what arrived
        assert int((got.average[lo : lo + chunk] != 0).sum()) <= 96
    ref = bench.sparse.owner_average(cs, chunk, 48, "avg", 96)
    assert got.sent == ref.sent  # counted as the coded payload's bytes
    assert not torch.equal(got.average, ref.average)  # the 2-bit values differ from the exact ones


def test_random_blocks_are_the_same_everywhere_and_error_feedback_keeps_the_rest():
    """randk: every node sends the same 1 / D of the blocks of 64 (a function of the seed and the outer step alone);
    the average is the mean of their codec round trips there and zero elsewhere (a float64 reference), and each
    node's residual is exactly what it did not get across: its contribution minus what it sent."""
    g = torch.Generator().manual_seed(SEED)
    nodes, n = 3, 64 * 200 + 17  # a last, partial block
    flat = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g)) for _ in range(nodes)]
    for codec, d in (("fp4", 16), ("int8", 8)):
        method = bench.parse_method(f"randk-d{d}-{codec}")
        idx = bench.random_blocks(n, d, SEED, 5)
        assert torch.equal(idx, bench.random_blocks(n, d, SEED, 5)) and len(idx) == 201 // d
        assert not torch.equal(idx, bench.random_blocks(n, d, SEED, 6))  # another outer step, other blocks
        avg, residual, values = bench.randk_average(flat, None, method, SEED, 5)
        assert values == 64 * len(idx)
        chosen = torch.zeros(n + (-n % 64), dtype=torch.bool)
        chosen.view(-1, 64)[idx] = True
        chosen = chosen[:n]
        ref = torch.zeros(n, dtype=torch.float64)
        for f, r in zip(flat, residual):
            sent = f.double() - r.double()
            assert torch.equal(r[~chosen], f[~chosen]), SEED  # unsent values wait whole
            assert torch.equal(sent[~chosen], torch.zeros_like(sent[~chosen]))
            err = float((sent[chosen] - f[chosen].double()).norm() / f[chosen].double().norm())
            assert 0 < err < (0.25 if codec == "fp4" else 0.03), (codec, err, SEED)  # the codec's rounding
            ref += sent
        assert torch.allclose(avg.double(), ref / nodes, rtol=0, atol=1e-6 * float(ref.abs().max())), SEED


def test_the_taper_goes_from_the_outer_lr_to_1_over_the_decay():
    from types import SimpleNamespace

    cfg = SimpleNamespace(train=SimpleNamespace(steps=800), optim=SimpleNamespace(decay_steps=100))
    m = bench.parse_method("topk-taper")
    got = [bench.outer_lr(m, step, cfg) for step in (5, 700, 725, 750, 800)]
    assert got == [3.0, 3.0, 2.5, 2.0, 1.0]
    assert bench.outer_lr(bench.parse_method("topk"), 800, cfg) == 3.0


def test_the_rank_is_the_largest_that_fits_the_bytes():
    rnd = random.Random(SEED)
    for _ in range(50):
        m, n, b = rnd.randrange(8, 3000), rnd.randrange(8, 3000), rnd.uniform(0.005, 0.2)
        r = bench.rank_for((m, n), b)
        assert bench.INT8_BYTES * (m + n) * r <= b * m * n < bench.INT8_BYTES * (m + n) * (r + 1), (m, n, b, r)


def test_methods_parse_and_bad_ones_are_refused():
    assert bench.parse_method("lowrank-b0.03-ef9-lr2") == {"kind": "lowrank", "bytes_per_value": 0.03, "decay": 0.9,
                                                          "lr": 2.0, "iterations": 1, "svd": False}
    assert bench.parse_method("lowrank-ef85-it3-svd") == {"kind": "lowrank", "bytes_per_value": 0.0222, "decay": 0.85,
                                                         "lr": 1.0, "iterations": 3, "svd": True}
    assert bench.parse_method("lowrank")["decay"] == 1.0
    assert bench.parse_method("topk") == {"kind": "topk", "keep": False, "decay": 0.8, "lr": 3.0, "k": 48,
                                          "k_average": 96, "exact": False, "taper": False, "dense_end": 0,
                                          "solo": False, "drop": False}
    assert bench.parse_method("topk-k40-a80-exact-keep-ef95-lr1.5") == {
        "kind": "topk", "keep": True, "decay": 0.95, "lr": 1.5, "k": 40, "k_average": 80, "exact": True, "taper": False,
        "dense_end": 0, "solo": False, "drop": False}
    assert bench.parse_method("topk-keep-taper")["taper"]
    assert bench.parse_method("topk-lr2-taper-end20")["dense_end"] == 20
    assert bench.parse_method("topk-solo3")["solo"] and bench.parse_method("topk-solo3")["dense_end"] == 3
    assert bench.parse_method("topk-end20-drop")["drop"] and not bench.parse_method("topk-end20")["drop"]
    with pytest.raises(SystemExit, match="-keep holds"):
        bench.parse_method("topk-keep-end20-drop")
    assert bench.parse_method("topk-keep-ef1.0")["decay"] == 1.0 and bench.parse_method("topk-ef08")["decay"] == 0.08
    try:
        bench.parse_method("lowrank-x")
    except SystemExit as e:
        assert "unknown method" in str(e)
    else:
        raise AssertionError("lowrank-x was accepted")


def test_a_short_run_of_every_method(tmp_path):
    out = tmp_path / "lr"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_lowrank.py"), "--config",
                        os.path.join(ROOT, "configs", "demo.toml"), "--train.steps", "6", "--diloco.inner_steps", "3",
                        "--train.micro_batch_size", "2", "--data.seq_len", "32", "--eval-batches", "1",
                        "--train.seed", str(SEED % 1000), "--methods",
                        "int8,topk,lowrank-ef8,topk-exact-keep-lr1,none,topk-end2,topk-end1,topk-solo2,topk-end1-drop,"
                        "randk,randk-keep",
                        "--model.vocab_size", "320", "--out", str(out)],  # 64 rows no byte token reaches
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "lr.json").read_text())["results"]
    assert set(r) == {"int8", "topk", "lowrank-ef8", "topk-exact-keep-lr1", "none", "topk-end2", "topk-end1",
                      "topk-solo2", "topk-end1-drop", "randk", "randk-keep"}
    for name, res in r.items():
        assert 0 < res["eval_loss"] < 10 and res["outer_steps"] == 2 and len(res["curve"]) == 6, name
        # the loss over the 256 byte tokens alone is lower, by at least -log(1 - the mass on the other rows)
        assert 0 < res["unseen_mass"] < 1 and res["eval_loss_seen"] < res["eval_loss"], name
        assert res["eval_loss"] - res["eval_loss_seen"] >= -math.log(1 - res["unseen_mass"]) * 0.99, name
    assert r["none"]["bytes_per_value_per_outer_step"] == 0 and r["none"]["eval_loss"] != r["int8"]["eval_loss"]
    assert abs(r["topk"]["bytes_per_value_per_outer_step"] - 0.0222) < 0.002
    # randk: 1/16 of the blocks at fp4's 33 bytes per 64 values, 2 (N - 1) / N of them on the ring (the tiny model's
    # values are not a whole number of blocks: within a block's worth)
    assert abs(r["randk"]["bytes_per_value_per_outer_step"] - 33 / 64 / 16) < 0.001
    # with keep the first phase is the same (its outer step comes after it) and the second is not
    assert r["randk-keep"]["curve"][:3] == r["randk"]["curve"][:3]
    assert r["randk-keep"]["curve"][3:] != r["randk"]["curve"][3:]
    assert 0 < r["topk"]["eval_loss_flushed"] < 10 and r["topk"]["eval_loss_flushed"] != r["topk"]["eval_loss"]
    assert 0.005 < r["lowrank-ef8"]["bytes_per_value_per_outer_step"] < 0.03  # the rank rule's budget, plus 1-D int8
    assert r["lowrank-ef8"]["ranks"]["(192, 192)"] == 2
    # a dense end over every outer step is the int8 method, bit for bit; over the last of two, half of each's bytes
    assert r["topk-end2"]["eval_loss"] == r["int8"]["eval_loss"] and r["topk-end2"]["curve"] == r["int8"]["curve"]
    # (its training is topk's: the dense outer step is the last, after step 6)
    assert r["topk-end1"]["curve"] == r["topk"]["curve"]
    assert r["topk-end1"]["eval_loss"] not in (r["int8"]["eval_loss"], r["topk"]["eval_loss"])
    # the same without the residuals: the same training and bytes, another last outer step
    assert r["topk-end1-drop"]["curve"] == r["topk"]["curve"]
    assert r["topk-end1-drop"]["eval_loss"] not in (r["topk-end1"]["eval_loss"], r["topk"]["eval_loss"])
    assert r["topk-end1-drop"]["bytes_per_value_per_outer_step"] == r["topk-end1"]["bytes_per_value_per_outer_step"]
    # solo over both outer steps: the first skipped (the nodes train on alone, as none does), the last dense
    assert r["topk-solo2"]["curve"] == r["none"]["curve"] and r["topk-solo2"]["curve"] != r["topk"]["curve"]
    half = r["int8"]["bytes_per_value_per_outer_step"] / 2
    assert abs(r["topk-solo2"]["bytes_per_value_per_outer_step"] - half) < 1e-9
    assert abs(r["topk-end1"]["bytes_per_value_per_outer_step"] - (r["topk"]["bytes_per_value_per_outer_step"]
               + r["int8"]["bytes_per_value_per_outer_step"]) / 2) < 1e-9


def test_the_one_pass_evaluation_gives_setups_loss_and_the_empty_rows_share():
    args = ["--config", os.path.join(ROOT, "configs", "demo.toml"), "--train.micro_batch_size", "2",
            "--data.seq_len", "32", "--model.vocab_size", "300"]  # 44 rows no byte token reaches
    _, _, s, batches = bench.setup(args, 2, 1, 2)
    model = s.model()
    got = bench.evaluate_seen(s, model, batches)
    assert got["eval_loss"] == s.evaluate(model, batches)  # the same arithmetic, bit for bit
    assert 0 < got["unseen_mass"] < 1 and got["eval_loss_seen"] < got["eval_loss"]
