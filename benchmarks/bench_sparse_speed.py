"""Speed of the sparse codec's CPU kernels beside int8's: encode (selection, 2-bit values, packing) and
decode-add, side by side in one process.

    python benchmarks/bench_sparse_speed.py                    # 64 MiB of fp32, 1 thread and all threads
    python benchmarks/bench_sparse_speed.py --mib 256 --k 16,64,256
    python benchmarks/bench_sparse_speed.py --device cuda --mib 256 --k 16,64,256   # the GPU kernels
    python benchmarks/bench_sparse_speed.py --device cuda --mib 256 --sweep   # + Triton encode's launch settings

Each number is the median of --repeats timed calls; the implementations are interleaved call by call so that
background load hits them alike. ns/value = time / values; "x int8" = that time / int8's. Input: student-t(3)
values (heavy tails, as pseudo-gradients have). Writes benchmarks/results/sparse_speed_<date>-<time>.json.

On a GPU (--device cuda) the ops are the CUDA kernels (csrc/codec/sparse_cuda.cu, in CUDA builds) and the Triton
kernels (kernels/sparse.py) beside the int8 codec's fastest backend and a copy of the fp32 tensor (x.clone()), timed with CUDA events (medians). "of copy bw" is the
bandwidth of the bytes the op must move, against the copy's: encode reads the tensor and writes the payload
((4 n + payload) / t); decode-add reads the payload and reads and writes the accumulator ((payload + 8 n) / t,
what int8's dequantize-add moves: the sparse one touches only the kept values' sectors, so it may pass 100%).
Each sparse call includes its one host sync (the check of what the kernels report).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from prime import ops, sparse  # noqa: E402


def student_t(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi = torch.randn(3, n, generator=g).pow(2).sum(0) / 3
    return z / chi.sqrt()


def timed(fns: dict, repeats: int) -> dict:
    """{name: median seconds}, the calls interleaved."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of fp32 input")
    ap.add_argument("--k", default="64", help="comma list of values kept per chunk of 4096")
    ap.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="comma list of CPU thread counts")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--sweep", action="store_true",
                    help="on a GPU, also time encode (k = 64) over its launch settings: the CUDA kernel's blocks per "
                         "SM, the Triton kernel's warps, programs per SM, candidates per value kept and piece "
                         "(kernels/sparse.py); each payload checked against the CPU's")
    args = ap.parse_args()
    n = args.mib * (1 << 20) // 4
    x = student_t(n, args.seed)
    if args.device == "cuda":
        return gpu(x.cuda(), args)
    rows = []
    print(f"{args.mib} MiB fp32 ({n} values), student-t(3), {platform.processor() or platform.machine()}")
    print(f"{'threads':>7} {'op':<28} {'ms':>8} {'ns/value':>9} {'x int8':>7}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        q, s = ops.quantize_int8(x, 64)
        acc = torch.zeros(n)
        fns = {"int8 quantize": lambda: ops.quantize_int8(x, 64),
               "int8 dequantize_add": lambda: ops.dequantize_add_int8_(acc, q, s, 64)}
        payloads = {}
        for k in (int(v) for v in args.k.split(",")):
            payloads[k] = sparse.encode(x, 4096, k)
            fns[f"topk k={k} encode"] = lambda k=k: sparse.encode(x, 4096, k)
            fns[f"topk k={k} decode_add"] = lambda k=k: torch.ops.prime.sparse_decode_add_(acc, payloads[k], 4096, k)
        med = timed(fns, args.repeats)
        for name, sec in med.items():
            base = med["int8 quantize" if name.endswith(("encode", "quantize")) else "int8 dequantize_add"]
            rows.append({"threads": threads, "op": name, "seconds": sec, "ns_per_value": sec * 1e9 / n,
                         "vs_int8": sec / base})
            print(f"{threads:>7} {name:<28} {sec * 1e3:8.1f} {sec * 1e9 / n:9.2f} {sec / base:7.1f}")
    out = os.path.join(HERE, "results", f"sparse_speed_{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "machine": platform.platform(), "cpu": platform.processor(),
                   "torch": torch.__version__, "mib": args.mib, "rows": rows}, f, indent=1)
    print("wrote", out)
    return 0


def gpu(x: torch.Tensor, args) -> int:
    n = x.numel()
    name = torch.cuda.get_device_name()
    print(f"{args.mib} MiB fp32 ({n} values), student-t(3), {name}, Triton {__import__('triton').__version__}")
    q, s = ops.quantize_int8(x, 64)
    acc = torch.zeros_like(x)
    fns = {"copy": lambda: x.clone(), "int8 quantize": lambda: ops.quantize_int8(x, 64),
           "int8 dequantize_add": lambda: ops.dequantize_add_int8_(acc, q, s, 64)}
    moved = {"copy": 8 * n, "int8 quantize": 4 * n + q.numel() + s.numel(),
             "int8 dequantize_add": 8 * n + q.numel() + s.numel()}
    backends = [b for b in ("cuda", "triton") if b in sparse.available_backends(x.device)]
    for k in (int(v) for v in args.k.split(",")):
        want = sparse.encode(x.cpu(), 4096, k)
        for b in backends:
            payload = sparse.encode(x, 4096, k, backend=b)
            assert torch.equal(payload.cpu(), want), f"the {b} and CPU payloads differ"
            fns[f"{b} k={k} encode"] = lambda k=k, b=b: sparse.encode(x, 4096, k, backend=b)
            fns[f"{b} k={k} decode_add"] = lambda k=k, b=b, p=payload: sparse.decode_add_(acc, p, 4096, k, backend=b)
            moved[f"{b} k={k} encode"] = 4 * n + payload.numel()
            moved[f"{b} k={k} decode_add"] = 8 * n + payload.numel()
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(args.repeats):
        for key, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[key].append(a.elapsed_time(b) / 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_bw = moved["copy"] / med["copy"]
    rows = []
    print(f"{'op':<26} {'ms':>8} {'GB/s':>8} {'of copy bw':>10}")
    for key, sec in med.items():
        bw = moved[key] / sec
        rows.append({"op": key, "seconds": sec, "bytes_moved": moved[key], "gb_per_s": bw / 1e9,
                     "of_copy_bw": bw / copy_bw})
        print(f"{key:<26} {sec * 1e3:8.3f} {bw / 1e9:8.0f} {100 * bw / copy_bw:9.0f}%")
    sweep = []
    if args.sweep:
        if "cuda" in backends:
            sweep += cuda_blocks_sweep(x, copy_bw)
        if "triton" in backends:
            sweep += encode_sweep(x, copy_bw)
    out = os.path.join(HERE, "results", f"sparse_speed_gpu_{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "gpu": name, "torch": torch.__version__, "mib": args.mib,
                   "rows": rows, "encode_sweep": sweep}, f, indent=1)
    print("wrote", out)
    return 0


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def cuda_blocks_sweep(x: torch.Tensor, copy_bw: float, repeats: int = 9) -> list:
    """The CUDA encode (k = 64) over the blocks resident per SM (0: as many as the GPU schedules)."""
    want = sparse.encode(x.cpu(), 4096, 64)
    rows = []
    print(f"{'cuda encode, blocks/SM':>22} {'ms':>8} {'of copy bw':>10}")
    for blocks in (0, 4, 8, 12, 16):
        def fn():
            return torch.ops.prime._sparse_encode_blocks(x, 4096, 64, blocks)

        if not torch.equal(fn().cpu(), want):
            raise SystemExit(f"cuda encode at {blocks} blocks per SM: payload differs")
        sec = _median_seconds(fn, repeats)
        share = (4 * x.numel() + want.numel()) / sec / copy_bw
        rows.append({"backend": "cuda", "blocks_per_sm": blocks, "seconds": sec, "of_copy_bw": share})
        print(f"{blocks:>22} {sec * 1e3:8.3f} {100 * share:9.0f}%", flush=True)
    return rows


def encode_sweep(x: torch.Tensor, copy_bw: float, repeats: int = 9) -> list:
    """Encode (k = 64) over the Triton launcher's settings: medians of CUDA-event times, payloads checked."""
    from prime.kernels import sparse as kernels

    want = sparse.encode(x.cpu(), 4096, 64)
    names = ("ENCODE_WARPS", "ENCODE_PROGRAMS_PER_SM", "CANDIDATES_PER_KEPT", "ENCODE_PIECE")
    saved = [getattr(kernels, a) for a in names]
    rows = []
    print(f"{'warps':>5} {'programs/SM':>11} {'cand/kept':>9} {'piece':>6} {'ms':>8} {'of copy bw':>10}")
    settings = [(w, p, 8, piece) for w in (1, 2) for p in (16, 32) for piece in (512, 1024)]
    settings += [(1, 16, 4, 512)]
    try:
        for warps, per_sm, cand, piece in settings:
            for a, v in zip(names, (warps, per_sm, cand, piece)):
                setattr(kernels, a, v)
            if not torch.equal(kernels.encode(x, 4096, 64).cpu(), want):
                raise SystemExit(f"encode at warps {warps}, {per_sm}/SM, {cand}/kept, {piece}: payload differs")
            sec = _median_seconds(lambda: kernels.encode(x, 4096, 64), repeats)
            share = (4 * x.numel() + want.numel()) / sec / copy_bw
            rows.append({"backend": "triton", "warps": warps, "programs_per_sm": per_sm, "candidates_per_kept": cand,
                         "piece": piece, "seconds": sec, "of_copy_bw": share})
            print(f"{warps:>5} {per_sm:>11} {cand:>9} {piece:>6} {sec * 1e3:8.3f} {100 * share:9.0f}%",
                  flush=True)
    finally:
        for a, v in zip(names, saved):
            setattr(kernels, a, v)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
