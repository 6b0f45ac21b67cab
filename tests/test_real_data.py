"""examples/real_data.sh with the tiny model: text and JSONL -> prime-tokenize (BPE of 8192 tokens) -> two
simulated nodes training on the shards with TensorBoard and offline W&B on -> "final weights identical".

The events both sinks wrote are read back (the readers of tests/test_metrics.py; tests/ is on sys.path under pytest) and compared with the JSONL
records of the same run; a model.vocab_size below the tokenizer's is refused, naming both numbers.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from test_metrics import tensorboard_scalars, wandb_history
from conftest import needs_ring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

for _package in ("tokenizers", "tensorboard", "wandb"):
    pytest.importorskip(_package, reason=f"{_package} is not installed (make deps installs it)")




def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHON=sys.executable, **extra)
    for k in ("PRIME_NODE_RANK", "PRIME_NUM_NODES", "PRIME_STORE_ADDR", "PRIME_FAULTS", "WANDB_MODE"):
        env.pop(k, None)
    return env


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@needs_ring
def test_real_data_example_end_to_end(tmp_path):
    work = str(tmp_path / "work")
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "real_data.sh"), "", work], cwd=ROOT, timeout=600,
                       env=_env(MODEL="tiny", STEPS="20", INNER_STEPS="10", SEQ_LEN="64", VOCAB="8192"),
                       capture_output=True, text=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert out.count("final weights identical on all 2 nodes") == 2, out[-4000:]
    meta = json.load(open(os.path.join(work, "tok", "meta.json")))
    assert meta["vocab_size"] == 8192 and meta["dtype"] == "uint16"
    assert any(n.endswith(".jsonl") for n in os.listdir(os.path.join(work, "corpus")))
    assert "vocabulary 8192" in out and "model tiny: 4.72M parameters" in out  # the model took the tokenizer's vocab
    run = os.path.join(work, "run")
    wandb_runs = {}
    for f in glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb")):
        info, rows = wandb_history(f)
        wandb_runs[info.display_name] = (info, rows)
    assert sorted(wandb_runs) == ["node0", "node1"]
    for node in (0, 1):
        recs = _jsonl(os.path.join(run, f"metrics_node{node}.jsonl"))
        steps = [r for r in recs if r["kind"] == "step"]
        outers = [r for r in recs if r["kind"] == "outer"]
        assert [r["step"] for r in steps] == list(range(1, 21)) and [r["step"] for r in outers] == [10, 20]
        tb = tensorboard_scalars(os.path.join(run, "tb", "prime", f"node{node}"))
        assert [s for s, _ in tb["step/loss"]] == list(range(1, 21))
        assert [v for _, v in tb["step/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
        for field in ("allreduce_s", "bytes_sent", "compression_error", "utilization", "pseudo_grad_norm"):
            assert [v for _, v in tb[f"outer/{field}"]] == pytest.approx([r[field] for r in outers], rel=1e-6), field
        assert "summary/time_compute_s" in tb and "summary/last_loss" in tb
        info, rows = wandb_runs[f"node{node}"]
        assert info.run_group == "prime" and info.project == "prime"
        logged = {row["_step"]: row for row in rows}
        assert [logged[s]["step/loss"] for s in range(1, 21)] == [r["loss"] for r in steps]
        assert [logged[s]["outer/bytes_sent"] for s in (10, 20)] == [r["bytes_sent"] for r in outers]


def test_a_smaller_model_vocab_size_is_refused_naming_both_numbers(tmp_path):
    from test_tokenize import make_corpus

    make_corpus(str(tmp_path / "corpus"), 0, text_files=2, jsonl_docs=10)
    p = subprocess.run([sys.executable, "-m", "prime.tokenize", str(tmp_path / "corpus"), "--out", str(tmp_path / "tok"),
                        "--vocab-size", "300"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    vocab = json.load(open(tmp_path / "tok" / "meta.json"))["vocab_size"]
    p = subprocess.run([sys.executable, "-m", "prime.train", "--config", "configs/demo.toml", "--data.source", "bin",
                        "--data.path", str(tmp_path / "tok"), "--model.vocab_size", "260",
                        "--metrics.out_dir", str(tmp_path / "run")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "model.vocab_size is 260" in p.stderr and f"vocabulary of {vocab} tokens" in p.stderr, p.stderr
