"""benchmarks/bench_pg_rank.py: its two codes against independent references (a per-chunk sort for the selection,
the Eckart-Young error for the truncated SVD) on fresh random matrices, and a tiny run end to end."""

import json
import os
import random
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_pg_rank as bench  # noqa: E402

SEED = random.SystemRandom().randrange(1 << 30)


def test_topk_keeps_the_largest_magnitudes_of_every_chunk():
    g = torch.Generator().manual_seed(SEED)
    m = torch.randn(300, 211, generator=g) * torch.rand(300, 1, generator=g)  # 63300 values: a padded last chunk
    kept = bench.topk_kept(m, 7)
    flat, ref = m.flatten(), torch.zeros(m.numel())
    for lo in range(0, m.numel(), 4096):
        part = flat[lo : lo + 4096]
        order = sorted(range(part.numel()), key=lambda i: -abs(float(part[i])))[:7]
        ref[[lo + i for i in order]] = part[order]
    assert torch.equal(kept.flatten(), ref), f"SEED={SEED}"


def test_low_rank_error_is_the_tail_of_the_singular_values():
    g = torch.Generator().manual_seed(SEED)
    m = torch.randn(120, 80, generator=g, dtype=torch.float64).float()
    s = torch.linalg.svdvals(m.double())
    for r in (0, 1, 5, 80):
        err = (m.double() - bench.low_rank(m, r).double()).pow(2).sum()
        assert torch.allclose(err, s[r:].pow(2).sum(), rtol=1e-5, atol=1e-6), (r, float(err), SEED)


def test_a_tiny_run_reports_both_errors(tmp_path):
    out = tmp_path / "pg.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_pg_rank.py"), "--model", "tiny",
                        "--warm", "2", "--h", "1", "--batch", "2", "--seq", "32", "--seed", str(SEED % 1000),
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all 2-D weights: topk" in p.stdout
    r = json.loads(out.read_text())
    total = r["total"]
    assert total["pg"] > 0 and 0 < total["topk"] <= total["pg"] and 0 < total["lowrank"] <= total["pg"]
    assert sum(row["count"] for row in r["shapes"].values()) >= 4
