"""Where the GPU time of the ring's CUDA wire codec goes: every kernel and copy it runs
per segment, timed alone over one large buffer (CUDA events, median of ITERS after one
warm-up), with the bandwidth it reaches against the bytes it must move (reads + writes).

Compare each GB/s with the "device copy" row (what the card streams) and the PCIe rows
with the link; the fused reduce-quantize should sit near the copy, the unfused rows
show what one segment cost before the fusion (their times add up).

    python benchmarks/bench_ring_cuda_kernels.py --mib 128 --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=128, help="values per kernel, MiB of fp32")
    p.add_argument("--block", type=int, default=64, help="int8 codec block size (default 64, the codec's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for bench_ring_cuda_kernels.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ring_cuda_kernels: no CUDA device", file=sys.stderr)
        return 2
    from prime import _C

    if not getattr(_C, "_ring_reduces_on_gpu", False):
        print("bench_ring_cuda_kernels: prime._C was built without the CUDA ring codec", file=sys.stderr)
        return 2
    n = args.mib * (1 << 20) // 4
    rows = _C._ring_cuda_kernel_times(args.device, n, args.block, args.iters)
    name = torch.cuda.get_device_name(args.device)
    print(f"GPU wire codec kernels: {n} values ({args.mib} MiB fp32), block {args.block}, {name}, "
          f"median of {args.iters} (CUDA events)")
    w = max(len(r[0]) for r in rows)
    print(f"{'kernel / copy':<{w}}  {'median ms':>9}  {'min ms':>7}  {'MiB moved':>9}  {'GB/s':>7}")
    print(f"{'-' * w}  {'-' * 9}  {'-' * 7}  {'-' * 9}  {'-' * 7}")
    report = []
    for kname, nbytes, ms in rows:
        med = statistics.median(ms)
        print(f"{kname:<{w}}  {med:9.3f}  {min(ms):7.3f}  {nbytes / 2**20:9.1f}  {nbytes / med / 1e6:7.0f}")
        report.append({"name": kname, "bytes": nbytes, "ms": ms})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_ring_cuda_kernels.json"), "w") as f:
            json.dump({"args": vars(args), "device": name, "kernels": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
