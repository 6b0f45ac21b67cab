"""benchmarks/bench_fidelity.py end to end on a few steps: the methods a suite names by default parse and run
(data parallel among them), each reports a finite loss, and a method it does not know is refused by name."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, methods):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fidelity.py"), "--config",
                           os.path.join(ROOT, "configs", "demo.toml"), "--train.steps", "6",
                           "--diloco.inner_steps", "3", "--train.micro_batch_size", "2", "--data.seq_len", "32",
                           "--eval-batches", "1", "--methods", methods, "--out", str(tmp_path / "f")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))


def test_data_parallel_and_diloco_run_side_by_side(tmp_path):
    p = _run(tmp_path, "dp,diloco-int8,overlap-int8-eager@1/3")
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "f.json").read_text())["results"]
    assert list(r) == ["dp", "diloco-int8", "overlap-int8-eager@1/3"]
    assert all(0 < v["eval_loss"] < 10 and len(v["curve"]) == 6 for v in r.values())
    assert r["diloco-int8"]["outer_weights_identical"] and "outer_weights_identical" not in r["dp"]


def test_an_unknown_method_is_refused_by_name(tmp_path):
    for bad in ("dp@1/2", "diloco-int9"):
        p = _run(tmp_path, bad)
        assert p.returncode != 0 and f"unknown method {bad!r}" in p.stdout + p.stderr, bad
