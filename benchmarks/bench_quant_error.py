"""Cost of the int8 error measurement the ring makes as it encodes (codec.h quantize_error_sq), against the
quantize it follows, per CPU instruction set, one thread, on one ring segment (1 MiB of fp32, in cache) and on
64 MiB (from memory). Medians of --repeat timings.

    python benchmarks/bench_quant_error.py [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import prime  # noqa: F401  (loads prime._C and its ops)


def median_s(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = torch.ops.prime
    print(f"torch {torch.__version__}, one thread, block 256; kernels of the public ops: {ops._cpu_codec_plan()}")
    print(f"{'values':>10} {'dtype':>9} {'isa':>7} {'quantize ms':>12} {'error pass ms':>14} {'ratio':>6}")
    for n in (1 << 18, 1 << 24):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n).to(dtype)
            for isa in ops._cpu_codec_isas():
                q, s = ops._quantize_int8_isa(x, 256, None, isa)
                tq = median_s(lambda: ops._quantize_int8_isa(x, 256, None, isa), args.repeat)
                te = median_s(lambda: ops._quantize_error_sq_isa(x, q, s, 256, isa), args.repeat)
                print(f"{n:>10} {str(dtype)[6:]:>9} {isa:>7} {tq * 1e3:>12.3f} {te * 1e3:>14.3f} {te / tq:>6.2f}")


if __name__ == "__main__":
    main()
