"""The ring on CUDA tensors: reduced on the GPU against staged through pinned host memory.

WORLD ranks on this host's GPUs (rank r on GPU r mod count), loopback, one Ring per rank
(per segment size). For every method, WARMUP untimed then ITERS timed all-reduces of a
fresh copy of the same random tensor (op=avg); a time is from the all_reduce call to
wait() returning (the result is then in the tensor). Methods:

  gpu-int8, gpu-fp4, gpu-fp32   reduced on the GPU (PRIME_RING_CUDA_REDUCE=gpu; fp32 = codec "none")
  host-int8, host-fp4, host-fp32 staged through pinned host memory, CPU codec (PRIME_RING_CUDA_REDUCE=cpu)
  gpu-topk, host-topk  the sparse codec at topk's default counts (48 / 96 of 4096), with the residual
                       error feedback hands it (on the GPU, or in pinned host memory), the direct schedule
  gloo-fp32            torch.distributed gloo all_reduce, then a division (reference)
  METHOD/segN          the same with Ring(segment_bytes=N MiB) (default: the Ring's 1 MiB)
  gpu-*/pageable       received payloads uploaded straight from the transport's buffers
                       (PRIME_RING_CUDA_UPLOAD=pageable) instead of through pinned slots
  METHOD/ring, /direct the schedule forced (default: the Ring's, "auto"; docs/ring.md, "Schedules")

--ranks: "processes" (one per rank, the deployment's shape) or "threads" (all ranks in one
process). "auto" (default) takes processes when every rank has a GPU of its own and threads
when ranks share one: processes sharing a GPU without MPS are time-sliced by the driver
(one context runs at a time), which puts milliseconds of the other rank's slice into every
GPU wait and event span; threads share one context, whose streams run concurrently.
--threads sets torch's intra-op (OpenMP) threads per rank, which the CPU codec of the
host-* methods uses: 4, as benchmarks/bench_allreduce.py --threads 4 measured the host
path before (torch's default, every core in every rank, oversubscribes the host and
made that path ~50x slower).

Prints a table (median, p10-p90, and the median of each WorkStats field of rank 0) and
writes every sample to OUT/bench_ring_cuda.json.

    python benchmarks/bench_ring_cuda.py --mib 256 --world 2 --iters 15 --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from prime.simulate import free_port  # drawn outside the kernel's ephemeral range

METHODS = ("gpu-int8", "gpu-fp4", "gpu-fp32", "host-int8", "host-fp4", "host-fp32", "gpu-topk", "host-topk",
           "gloo-fp32")
SPLIT = (  # WorkStats fields shown, in ms (rank 0's median)
    ("stage_s", "stage"),
    ("quantize_s", "quant"),
    ("reduce_s", "reduce"),
    ("gpu_codec_s", "gpu codec"),
    ("h2d_s", "h2d"),
    ("d2h_s", "d2h"),
    ("staging_s", "staging"),
    ("gpu_wait_s", "gpu wait"),
    ("wait_s", "wire wait"),
    ("auth_s", "auth"),
    ("commit_s", "commit"),
    ("copy_back_s", "copy back"),
    ("total_s", "total"),
)


def split_method(method: str) -> tuple[str, int | None, bool, str | None]:
    """'gpu-int8/seg4/pageable/direct' -> ('gpu-int8', 4 MiB in bytes, True, 'direct'); no suffix:
    (method, None, False, None)."""
    base, *options = method.split("/")
    segment, pageable, schedule, ok = None, False, None, base in METHODS
    for o in options:
        if o.startswith("seg") and o[3:].isdigit() and segment is None:
            segment = int(o[3:]) << 20
        elif o == "pageable" and base.startswith("gpu") and not pageable:
            pageable = True
        elif o in ("ring", "direct") and schedule is None and base != "gloo-fp32":
            schedule = o
        else:
            ok = False
    if not ok:
        raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)}, optionally /segN with N in MiB, "
                         "/ring or /direct, and for gpu-* /pageable)")
    return base, segment, pageable, schedule


def run_rank(rank: int, args, port: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from prime.comm import Ring

    torch.set_num_threads(args.threads)
    if args.device == "cpu":  # (a smoke test of this script on a machine without a GPU)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, args.world, is_master=rank == 0, timeout=timedelta(seconds=120))
    n = args.mib * (1 << 20) // 4
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    source = torch.randn(n, device=device, generator=g)
    x = torch.empty_like(source)
    methods = [m for m in args.methods.split(",") if m]
    report = {}
    rings = {}
    gloo = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        for method in methods:
            base, segment, pageable, schedule = split_method(method)
            if base == "gloo-fp32" and gloo is None:
                gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, args.world, timedelta(seconds=120))
            elif base != "gloo-fp32" and segment not in rings:
                rings[segment] = Ring(dist.PrefixStore(f"ring{segment}", store), rank, args.world, timeout=120,
                                      job_id=f"bench-ring-cuda-{segment}", segment_bytes=segment,
                                      max_rate=args.max_rate_mbit * 1e6 / 8, secret=b"bench-ring-cuda")
            times, stats = [], []
            iters = args.iters
            times_warm = []
            it = 0
            while it < args.warmup + iters:
                if it == args.warmup:
                    # A slow method gets fewer timed runs (rank 0 decides, from its warm-up).
                    if rank == 0:
                        per = max(times_warm) if times_warm else 0.0
                        fit = int(args.method_budget / per) if per > 0 else iters
                        store.set(f"{method}/iters", str(min(iters, max(3, fit))))
                    iters = int(store.get(f"{method}/iters"))
                x.copy_(source)
                if base.endswith("-topk"):  # (error feedback's buffer, outside the timed part)
                    home = device if base.startswith("gpu") else torch.device("cpu")
                    residual = torch.zeros(n, device=home, pin_memory=home.type == "cpu" and device.type == "cuda")
                sync()
                store.set(f"{method}/{it}/{rank}", "1")  # start together
                store.wait([f"{method}/{it}/{r}" for r in range(args.world)])
                t0 = time.perf_counter()
                if base == "gloo-fp32":
                    gloo.allreduce([x]).wait()
                    x.div_(args.world)
                    sync()
                    st = None
                else:
                    os.environ["PRIME_RING_CUDA_REDUCE"] = "gpu" if base.startswith("gpu") else "cpu"
                    os.environ["PRIME_RING_CUDA_UPLOAD"] = "pageable" if pageable else "pinned"
                    codec = {"int8": "int8", "fp4": "fp4", "topk": "topk"}.get(base.split("-")[1], "none")
                    if codec == "topk":
                        work = rings[segment].all_reduce(x, op="avg", codec="topk", keep=48, keep_average=96,
                                                         residual=residual)
                    else:
                        work = rings[segment].all_reduce(x, op="avg", codec=codec, schedule=schedule)
                    work.wait()
                    st = work.stats()
                elapsed = time.perf_counter() - t0
                if it < args.warmup:
                    times_warm.append(elapsed)
                it += 1
                if it > args.warmup:
                    times.append(elapsed)
                    if st is not None:
                        stats.append({k: float(getattr(st, k)) for k, _ in SPLIT})
            report[method] = {"times_s": times, "stats": stats}
    finally:
        for ring in rings.values():
            ring.close()
    return report


def worker(rank: int, args, port: int, conn) -> None:
    conn.send(run_rank(rank, args, port))


def table(report: dict, args) -> str:
    head = ["method", "n", "median ms", "p10-p90 ms", "vs host", "vs gloo"] + [label for _, label in SPLIT]
    rows = [head]
    for method, r in report.items():
        t = sorted(r["times_s"])
        med = statistics.median(t)
        p10, p90 = t[len(t) // 10], t[min(len(t) - 1, (len(t) * 9) // 10)]
        base = report.get("host-" + method.split("-", 1)[1].split("/")[0]) if method.startswith("gpu") else None
        ratio = f"{statistics.median(base['times_s']) / med:.2f}x" if base else ""
        gloo = report.get("gloo-fp32")
        vs_gloo = f"{statistics.median(gloo['times_s']) / med:.2f}x" if gloo and method != "gloo-fp32" else ""
        row = [method, str(len(t)), f"{med * 1e3:.1f}", f"{p10 * 1e3:.1f}-{p90 * 1e3:.1f}", ratio, vs_gloo]
        for key, _ in SPLIT:
            vals = [s[key] for s in r["stats"]]
            row.append(f"{statistics.median(vals) * 1e3:.1f}" if vals else "")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=256, help="tensor size per rank, MiB of fp32")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--max-rate-mbit", type=float, default=0.0,
                   help="pace each ring link at this many Mbit/s (the Ring's rate limiter; 0: unlimited), "
                        "as DiLoCo's --diloco.max_rate_mbit does")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=180, help="seconds for the whole run")
    p.add_argument("--out", default=None, help="directory for bench_ring_cuda.json")
    p.add_argument("--ranks", choices=("auto", "processes", "threads"), default="auto",
                   help="ranks as processes or as threads of one process (see above)")
    p.add_argument("--threads", type=int, default=4, help="torch intra-op (OpenMP) threads per rank")
    p.add_argument("--method-budget", type=float, default=20.0,
                   help="seconds of timed runs per method: a slower method gets fewer (at least 3) runs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for m in args.methods.split(","):
        if m:
            split_method(m)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ring_cuda: no CUDA device", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.ranks == "auto":
        args.ranks = "processes" if gpus >= args.world else "threads"
    port = free_port()
    if args.ranks == "threads":
        reports = run_threads(args, port)
    else:
        reports = run_processes(args, port)
    if reports is None:
        return 1
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    share = (f"{args.world} ranks on {max(1, min(gpus, args.world))} GPU(s), rank r on cuda:(r mod {gpus})"
             if args.device == "cuda" else "CPU")
    print(f"ring on CUDA tensors: {args.world} ranks x {args.mib} MiB fp32, loopback, op=avg, {name}, "
          f"ranks as {args.ranks} ({share}), {args.threads} torch threads per rank, "
          f"median of n <= {args.iters} (after {args.warmup} warm-up; n < {args.iters} where the runs would take over "
          f"{args.method_budget:g} s); split = rank 0's WorkStats medians, ms")
    print(table(reports[0], args))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_ring_cuda.json"), "w") as f:
            json.dump({"args": vars(args), "device": name, "gpus": gpus, "layout": share, "ranks": reports}, f, indent=1)
    return 0


def run_threads(args, port: int):
    import threading

    reports = [None] * args.world
    errors = []

    def body(r):
        try:
            reports[r] = run_rank(r, args, port)
        except BaseException as e:  # reported below
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(args.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.timeout)
    if errors or any(t.is_alive() for t in threads):
        print("bench_ring_cuda: " + ("; ".join(errors) or f"did not finish within {args.timeout} s"), file=sys.stderr)
        return None
    return reports


def run_processes(args, port: int):
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # (inherited by the spawned ranks)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(args.world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(r, args, port, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    reports = []
    deadline = time.monotonic() + args.timeout
    for r, (pipe, proc) in enumerate(zip(pipes, procs)):
        while not pipe.poll(1.0):
            if proc.exitcode is not None or time.monotonic() > deadline:
                for q in procs:
                    q.kill()
                print(f"bench_ring_cuda: rank {r} " + ("died (exit code %s)" % proc.exitcode if proc.exitcode is not None
                                                       else f"did not finish within {args.timeout} s"), file=sys.stderr)
                return None
        reports.append(pipe.recv())
    for proc in procs:
        proc.join()
    return reports


if __name__ == "__main__":
    sys.exit(main())
