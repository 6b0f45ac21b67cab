"""The sparse top-k format (prime/sparse.py): bytes per value and error of one round trip, against int8 and fp4.

    python benchmarks/bench_sparse_format.py            # ~2 min on the 2-core CPU (most of it training)
    python benchmarks/bench_sparse_format.py --quick

For k values kept per chunk of 4096 (density k / 4096) the table gives the payload bytes per value, how many
times fewer than int8's, the relative L2 error ||decode(encode(x)) - x|| / ||x|| of one round trip, and the
same error with the kept values sent exactly (fp32): the part of the error the 2-bit values add to what the
selection drops. One round's error of a sparse codec is large by design (it drops most of the values' energy);
error feedback carries the rest into the next outer step, so the fidelity benchmark, not this table, says what
it costs in loss. Data: the tiny model's pseudo-gradients (bench_4bit_format.py), N(0, 1), student-t(3).
Writes benchmarks/results/sparse_format_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_4bit_format import fp4_round_trip, pseudo_gradients, relative_l2  # noqa: E402

from prime import ops, sparse  # noqa: E402

KEEP = (16, 32, 64, 128)


def topk_exact(x: torch.Tensor, k: int, chunk: int = sparse.CHUNK) -> torch.Tensor:
    """The top k magnitudes of each chunk, kept exactly: the selection's error alone."""
    out = torch.zeros_like(x)
    for s in range(0, x.numel(), chunk):
        part = x[s : s + chunk]
        idx = part.abs().topk(sparse.chunk_keep(part.numel(), chunk, k)).indices
        out[s + idx] = part[idx]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller data, shorter training")
    ap.add_argument("--values", type=int, default=1 << 20, help="values of each synthetic tensor")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    data = {"gaussian": torch.randn(args.values, generator=gen),
            "student-t(3)": torch.distributions.StudentT(3.0).sample((args.values,))}
    data.update({k: v for k, v in pseudo_gradients(args.quick).items() if k.startswith(("node0", "average"))})
    int8_bpv = ops.wire_bytes(1 << 20, ops.DEFAULT_BLOCK_SIZE, "int8") / (1 << 20)
    rows = []
    print(f"int8: {int8_bpv:.4f} bytes a value; fp4: {ops.wire_bytes(1 << 20, 256, 'fp4') / (1 << 20):.4f}")
    print(f"{'data':22} {'k':>4} {'density':>8} {'bytes/value':>11} {'x int8':>7} {'error':>7} {'kept exact':>10} "
          f"{'int8 err':>8} {'fp4 err':>8}")
    for name, x in data.items():
        x = x.float().contiguous()
        int8_err = relative_l2(ops.dequantize_int8_reference(*ops.quantize_int8_reference(x)), x)
        fp4_err = relative_l2(fp4_round_trip(x, 256), x)
        for k in KEEP:
            y = sparse.decode(sparse.encode(x, k=k), x.numel(), k=k)
            row = {"data": name, "k": k, "density": k / sparse.CHUNK, "bytes_per_value": sparse.bytes_per_value(k=k),
                   "error": relative_l2(y, x), "error_kept_exact": relative_l2(topk_exact(x, k), x),
                   "int8_error": int8_err, "fp4_error": fp4_err}
            row["times_fewer_than_int8"] = int8_bpv / row["bytes_per_value"]
            rows.append(row)
            print(f"{name:22} {k:4d} {row['density']:8.2%} {row['bytes_per_value']:11.4f} "
                  f"{row['times_fewer_than_int8']:6.1f}x {row['error']:7.3f} {row['error_kept_exact']:10.3f} "
                  f"{int8_err:8.4f} {fp4_err:8.4f}")
    out = os.path.join(HERE, "results", f"sparse_format_{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    with open(out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "quick": args.quick, "rows": rows}, f,
                  indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
