"""Which 4-bit format and block size: relative L2 error against bytes per value, measured.

    python benchmarks/bench_4bit_format.py            # ~6 min on the 2-core CPU (most of it training)
    python benchmarks/bench_4bit_format.py --quick    # smaller data, shorter training

Candidates, each with one fp32 scale per block of B values (absmax scaling, round to nearest):

  int4   uniform levels k * a/7, k in -7..7 (the int8 codec with 4 bits)
  fp4    E2M1 levels +-{0, .5, 1, 1.5, 2, 3, 4, 6} * a/6 (prime.ops.quantize_fp4_reference)
  nf4    the 16 NormalFloat levels of QLoRA (a lookup table fit to a Gaussian; for reference only,
         not built: an asymmetric table, no stochastic rounding, a table lookup on every backend)

Data:
  pseudo-gradients  outer - inner weights of the tiny model (configs/demo.toml: AdamW, lr 3e-3) after H
                    inner steps from a point 100 steps into training, H = 20, 50, 100, two nodes on
                    their own data shards, and the average of the two (what the all-gather carries)
  gaussian          N(0, 1)
  student-t(3)      heavy tails

For each candidate and B the table gives the relative L2 error ||deq(q(x)) - x|| / ||x|| and the
error-bytes product err * bytes_per_value (bytes_per_value = 0.5 + 4/B): a byte saved is worth as
much as the same fraction of error, so the lowest product is the best error per byte. Writes
benchmarks/results/4bit_format_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from prime import ops  # noqa: E402

BLOCKS = [32, 64, 128, 256, 512, 1024]  # the block sizes the codecs take (32..4096) that matter here
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def _blocks(x: torch.Tensor, B: int) -> torch.Tensor:
    return x[: x.numel() // B * B].view(-1, B)


def int4_round_trip(x: torch.Tensor, B: int) -> torch.Tensor:
    b = _blocks(x, B)
    a = b.abs().amax(1, keepdim=True)
    q = torch.round(b * torch.where(a > 0, 7 / a, 0.0)).clamp(-7, 7)
    return (q * (a / 7)).reshape(-1)


def fp4_round_trip(x: torch.Tensor, B: int) -> torch.Tensor:
    b = _blocks(x, B).reshape(-1)
    q, s = ops.quantize_fp4_reference(b, B)
    return ops.dequantize_fp4_reference(q, s, b.numel(), B)


def nf4_round_trip(x: torch.Tensor, B: int) -> torch.Tensor:
    b = _blocks(x, B)
    a = b.abs().amax(1, keepdim=True)
    v = b / torch.where(a > 0, a, 1.0)
    out = torch.empty_like(v)
    for i in range(0, v.shape[0], 4096):  # (chunks: the distance matrix is 16x the data)
        chunk = v[i : i + 4096]
        out[i : i + 4096] = NF4[(chunk[..., None] - NF4).abs().argmin(-1)]
    return (out * a).reshape(-1)


FORMATS = {"int4": int4_round_trip, "fp4": fp4_round_trip, "nf4": nf4_round_trip}


def relative_l2(y: torch.Tensor, x: torch.Tensor) -> float:
    x = x[: y.numel()].double()
    return float((y.double() - x).norm() / x.norm())


def pseudo_gradients(quick: bool) -> dict:
    """Outer minus inner weights of the tiny model after H inner steps, two nodes (bench_fidelity's setup)."""
    from bench_fidelity import Setup

    from prime.config import load_config

    cfg = load_config(os.path.join(os.path.dirname(HERE), "configs", "demo.toml"), [("train.steps", "1000")]).validate()
    warm, horizons = (20, [10, 20]) if quick else (100, [20, 50, 100])

    def flat(m):
        return torch.cat([p.detach().reshape(-1).float() for p in m.parameters()])

    out = {}
    for node in (0, 1):
        s = Setup(cfg, 2, torch.device("cpu"))
        model, loader = s.model(), s.loader(node)
        opt = s.optimizer(model)
        step = 0
        while step < warm:
            step += 1
            s.inner_step(model, opt, [loader.next_batch()], step)
        start = flat(model)
        while step < warm + horizons[-1]:
            step += 1
            s.inner_step(model, opt, [loader.next_batch()], step)
            if step - warm in horizons:
                out[f"node{node} H={step - warm}"] = start - flat(model)
    for h in horizons:
        out[f"average H={h}"] = (out[f"node0 H={h}"] + out[f"node1 H={h}"]) / 2
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=1 << 20, help="values of the synthetic data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    g = torch.Generator().manual_seed(args.seed)
    n = (1 << 18) if args.quick else args.n
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).square().sum(0)
    data = {"gaussian": torch.randn(n, generator=g), "student-t(3)": (z / (chi2 / 3).sqrt()).float()}
    data.update({f"pseudo-gradient {k}": v for k, v in pseudo_gradients(args.quick).items()})
    print(f"# data ready in {time.time() - t0:.0f} s; command: python {' '.join(sys.argv)}")

    rows = []
    for name, x in data.items():
        x4 = x.double()
        kurtosis = float(((x4 - x4.mean()) ** 4).mean() / x4.var() ** 2)
        print(f"\n## {name} (n = {x.numel()}, kurtosis {kurtosis:.2f})")
        print(f"{'B':>6} {'bytes/val':>10} " + " ".join(f"{f + ' err':>10} {f + ' err*bytes':>15}" for f in FORMATS))
        for B in BLOCKS:
            per_value = 0.5 + 4 / B
            line = f"{B:>6} {per_value:>10.4f} "
            for fmt, round_trip in FORMATS.items():
                err = relative_l2(round_trip(x, B), x)
                rows.append({"data": name, "format": fmt, "block_size": B, "bytes_per_value": per_value,
                             "rel_l2": err, "err_x_bytes": err * per_value, "kurtosis": kurtosis})
                line += f"{err:>10.4f} {err * per_value:>15.4f} "
            print(line)

    print("\n## best error per byte (lowest err * bytes) per data and format")
    for name in data:
        best = {f: min((r for r in rows if r["data"] == name and r["format"] == f), key=lambda r: r["err_x_bytes"])
                for f in FORMATS}
        print(f"{name:<32} " + "  ".join(f"{f}: B={r['block_size']} {r['rel_l2']:.4f} ({r['err_x_bytes']:.4f})"
                                          for f, r in best.items()))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"4bit_format_{stamp}.json")
    with open(out, "w") as f:
        json.dump({"benchmark": "bench_4bit_format", "command": "python " + " ".join(sys.argv), "date": stamp,
                   "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows},
                  f, indent=1)
    print(f"\n# wrote {os.path.relpath(out)} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
