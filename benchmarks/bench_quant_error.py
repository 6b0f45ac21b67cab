"""Cost of the int8 error measurement the ring makes as it encodes (codec.h quantize_error_sq, WorkStats
quant_err_sq / quant_in_sq), on the CPU:

  1. the pass alone against the quantize it follows, per CPU instruction set, one thread, on one ring
     segment (1 MiB of fp32, in cache) and on 64 MiB (from memory); medians of --repeat timings;
  2. the ring itself: --world ranks (threads of this process, loopback) all-reducing --mib MiB of fp32 with
     codec int8, prime.comm.Ring(quant_error=True) against quant_error=False, alternating, one torch thread;
     medians over --rounds of the slowest rank's total_s and of rank 0's quantize_s.

    python benchmarks/bench_quant_error.py [--repeat 50] [--mib 64] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import threading
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
    ap.add_argument("--mib", type=int, default=64, help="ring: MiB of fp32 per rank")
    ap.add_argument("--world", type=int, default=2, help="ring: ranks")
    ap.add_argument("--rounds", type=int, default=10, help="ring: timed all-reduces per setting")
    ap.add_argument("--block", type=int, default=64, help="codec block size of the kernel table (default 64, int8's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = torch.ops.prime
    print(f"torch {torch.__version__}, one thread, block {args.block}; kernels of the public ops: {ops._cpu_codec_plan()}")
    print(f"{'values':>10} {'dtype':>9} {'isa':>7} {'quantize ms':>12} {'error pass ms':>14} {'ratio':>6}")
    for n in (1 << 18, 1 << 24):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n).to(dtype)
            for isa in ops._cpu_codec_isas():
                q, s = ops._quantize_int8_isa(x, args.block, None, isa)
                tq = median_s(lambda: ops._quantize_int8_isa(x, args.block, None, isa), args.repeat)
                te = median_s(lambda: ops._quantize_error_sq_isa(x, q, s, args.block, isa), args.repeat)
                print(f"{n:>10} {str(dtype)[6:]:>9} {isa:>7} {tq * 1e3:>12.3f} {te * 1e3:>14.3f} {te / tq:>6.2f}")
    ring_on_off(args)


def ring_on_off(args) -> None:
    import torch.distributed as dist

    from prime.comm import Ring

    n = args.mib * (1 << 20) // 4
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(args.world)]
    store = dist.HashStore()
    rows = {True: [], False: []}  # (slowest total_s, rank 0 quantize_s)

    def rank(r, rings):
        ring_by = rings[r]
        for k in range(2 * args.rounds + 2):
            on = k % 2 == 0
            x = xs[r].clone()
            w = ring_by[on].all_reduce(x, op="avg", codec="int8")
            w.wait()
            st = w.stats()
            if k >= 2:
                results[r].append((on, st.total_s, st.quantize_s))

    results = [[] for _ in range(args.world)]
    rings = [{} for _ in range(args.world)]

    def build(r):
        rings[r][True] = Ring(store, r, args.world, timeout=120, job_id="qerr-on", quant_error=True)
        rings[r][False] = Ring(store, r, args.world, timeout=120, job_id="qerr-off", quant_error=False)

    for fn in (build, lambda r: rank(r, rings)):
        ts = [threading.Thread(target=fn, args=(r,)) for r in range(args.world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for r in range(args.world):
        for ring in rings[r].values():
            ring.close()
    for i in range(len(results[0])):
        on = results[0][i][0]
        rows[on].append((max(results[r][i][1] for r in range(args.world)), results[0][i][2]))
    print(f"\nring: {args.world} ranks x {args.mib} MiB fp32, codec int8, loopback, one torch thread, "
          f"{args.rounds} rounds each, alternating")
    print(f"{'quant_error':>12} {'total ms':>10} {'quantize_s ms':>14}")
    med = {}
    for on in (False, True):
        tot = statistics.median(t for t, _ in rows[on])
        q = statistics.median(q for _, q in rows[on])
        med[on] = tot
        print(f"{str(on):>12} {tot * 1e3:>10.1f} {q * 1e3:>14.1f}")
    print(f"total on / off: {med[True] / med[False]:.3f}")


if __name__ == "__main__":
    main()
