"""The fp4 encoder's kernel shapes on one GPU, side by side: the Triton launch shapes (elements a
program, warps, the register cap, full tiles read as pairs of values or element by element) next to
the CUDA op, int8's two encoders and a device copy of the same bytes, at one size.

    python benchmarks/bench_fp4_quantize_shapes.py                 # 256 MiB of fp32 (GPU only)
    python benchmarks/bench_fp4_quantize_shapes.py --mib 64 --dtype bf16
    TRITON_INTERPRET=1 python benchmarks/bench_fp4_quantize_shapes.py --device cpu --mib 1 --repeats 1 --calls 1
                                                                   # the script's own check, no GPU (slow)

This picks kernels/codec.py's fp4 launch constants: bench_quantize.py times only the shapes the ops
use. Outputs are preallocated and the Triton kernels launched directly, so the numbers are the
kernels' (at 256 MiB a call's host cost is hidden anyway). GB/s counts bytes read plus written, as
bench_quantize.py does; "% copy" is against the copy in the same run. Each variant's output is
checked bit for bit against the torch reference before it is timed. Medians over repeats of a
batch of calls; variants interleaved repeat by repeat; inputs rotate over enough buffers to defeat
the L2.

Writes a table to stdout and JSON to --out (default benchmarks/results/fp4_quantize_shapes_<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from prime import ops  # noqa: E402

MiB = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (name, tile, warps, register cap, pairs): the Triton fp4 launches compared; "default" is the ops' own
TRITON_FP4_SHAPES = [
    ("default", None, None, "default", None),
    ("tile 4096, 8 warps, pairs", 4096, 8, "default", True),
    ("tile 4096, 4 warps, pairs, no cap", 4096, 4, None, True),
    ("tile 2048, 4 warps, elementwise", 2048, 4, "default", False),
    ("tile 4096, 4 warps, elementwise", 4096, 4, "default", False),  # the earlier fp4 layout
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the Triton kernels under TRITON_INTERPRET=1, to check this script without a GPU")
    p.add_argument("--mib", type=int, default=256, help="fp32-equivalent input size in MiB (n = mib * 2^18)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="input dtype")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=str, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_fp4_quantize_shapes: needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)")
        return 2
    from prime.kernels import codec as tk

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    n = args.mib * MiB // 4
    B = args.block_size
    dtype = DTYPES[args.dtype]
    nb = math.ceil(n / B)
    in_bytes = torch.tensor([], dtype=dtype).element_size() * n
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * MiB)) if cuda else 0
    sets = max(1, math.ceil(2 * l2 / in_bytes))
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    xs = [(torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))).to(dtype).to(dev)
          for _ in range(sets)]
    srcs = xs if dtype == torch.float32 else [torch.randn(n, generator=gen).to(dev) for _ in range(sets)]
    copies = [torch.empty(n, device=dev) for _ in range(sets)]
    q4 = torch.empty((n + 1) // 2, dtype=torch.uint8, device=dev)
    q8 = torch.empty(n, dtype=torch.int8, device=dev)
    scales = torch.empty(nb, device=dev)

    # name -> (fn(i) on input set i, bytes moved, check() -> bool)
    variants = {}
    ref4 = ops.quantize_fp4_reference(xs[0], B)
    ref8 = ops.quantize_int8_reference(xs[0], B)

    def same(q, ref):
        return bool(torch.equal(q, ref[0])) and bool(torch.equal(scales.view(torch.int32), ref[1].view(torch.int32)))

    fp4_bytes = in_bytes + (n + 1) // 2 + 4 * nb
    int8_bytes = in_bytes + n + 4 * nb
    variants["copy (fp32 of n)"] = (lambda i: copies[i].copy_(srcs[i]), 8 * n, lambda: True)

    def same_as(got, ref):
        q, s = got
        return bool(torch.equal(q, ref[0])) and bool(torch.equal(s.view(torch.int32), ref[1].view(torch.int32)))

    if cuda and "cuda" in ops.available_backends(dev):
        variants["fp4 cuda (op)"] = (lambda i: ops.quantize_fp4(xs[i], B, backend="cuda", check_finite=False),
                                     fp4_bytes,
                                     lambda: same_as(ops.quantize_fp4(xs[0], B, backend="cuda", check_finite=False), ref4))
        variants["int8 cuda (op)"] = (lambda i: ops.quantize_int8(xs[i], B, backend="cuda", check_finite=False),
                                      int8_bytes,
                                      lambda: same_as(ops.quantize_int8(xs[0], B, backend="cuda", check_finite=False), ref8))
    if tk.available(dev):
        def check_int8_triton():
            tk._launch_quantize(xs[0], q8, scales, B, None)
            return same(q8, ref8)

        variants["int8 triton"] = (lambda i: tk._launch_quantize(xs[i], q8, scales, B, None), int8_bytes,
                                   check_int8_triton)
        for name, tile, warps, cap, pairs in TRITON_FP4_SHAPES:
            kw = {"fp4": True}
            if tile is not None:
                kw["tile"] = tile
            if warps is not None:
                kw["num_warps"] = warps
            if cap != "default":
                kw["max_registers"] = cap
            if pairs is not None:
                kw["fp4_pairs"] = pairs

            def launch(i, kw=kw):
                return tk._launch_quantize(xs[i], q4, scales, B, None, **kw)

            def check(launch=launch):
                launch(0)
                return same(q4, ref4)

            variants[f"fp4 triton {name}"] = (launch, fp4_bytes, check)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name, (fn, _, check) in variants.items():
        fn(0)
        sync()
        if not check():
            print(f"bench_fp4_quantize_shapes: {name} differs from the reference; not timed")
            return 1
    times = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, (fn, _, _) in variants.items():
            sync()
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            for k in range(args.calls):
                fn((r * args.calls + k) % sets)
            if cuda:
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / args.calls)
            else:
                times[name].append((time.perf_counter() - t0) / args.calls)

    gpu = torch.cuda.get_device_name(dev) if cuda else "cpu (Triton interpreted)"
    copy_gbs = variants["copy (fp32 of n)"][1] / statistics.median(times["copy (fp32 of n)"]) / 1e9
    cmd = "python benchmarks/bench_fp4_quantize_shapes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# fp4 quantize shapes on {gpu}; torch {torch.__version__}; {args.mib} MiB fp32-equivalent, "
          f"{args.dtype} input, B = {B}, {sets} input set(s)\n# command: {cmd.strip()}")
    print(f"{'variant':44} {'time':>10} {'GB/s':>9} {'% copy':>7}")
    rows = []
    for name, (_, nbytes, _) in variants.items():
        t = statistics.median(times[name])
        gbs = nbytes / t / 1e9
        rows.append({"variant": name, "median_s": t, "gbps": gbs, "pct_copy": 100 * gbs / copy_gbs,
                     "times_s": times[name]})
        print(f"{name:44} {t * 1e6:8.1f}us {gbs:9.1f} {100 * gbs / copy_gbs:6.0f}%")
    out = args.out or os.path.join(HERE, "results",
                                   f"fp4_quantize_shapes_{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "mib": args.mib, "dtype": args.dtype, "block": B,
                   "command": cmd.strip(), "rows": rows}, f, indent=1)
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
