"""`make demo`: the whole data path on this machine, in about a minute or two.

1. the int8 codec on 64 MiB of fp32 (speed, bytes, error);
2. a 4-rank int8 ring all-reduce on 127.0.0.1 (timing, bytes on the wire, error);
3. DiLoCo: 2 simulated nodes x 1 CPU process on the embedded corpus, a few
   outer steps through the int8 ring (loss, bytes against data parallel,
   compute utilization, loss plot).
"""

import os
import sys
import time

import torch

from prime import ops


def codec_demo(n: int = 16 << 20) -> None:
    """Quantize and dequantize n fp32 values with the fastest CPU backend."""
    torch.manual_seed(0)
    x = torch.randn(n)
    backend = ops.available_backends("cpu")[0]
    ops.quantize_int8(x[: 1 << 16], backend=backend)  # warm-up: threads, caches
    t0 = time.perf_counter()
    q, scales = ops.quantize_int8(x, backend=backend)
    t1 = time.perf_counter()
    y = ops.dequantize_int8(q, scales, backend=backend)
    t2 = time.perf_counter()
    err = float((y.double() - x.double()).norm() / x.double().norm())
    wire = ops.wire_bytes(n)
    print(f"codec ({backend!r} backend), {4 * n / 2**20:.0f} MiB of fp32:")
    print(f"  quantize {1e3 * (t1 - t0):.1f} ms ({5 * n / (t1 - t0) / 1e9:.1f} GB/s read+written), "
          f"dequantize {1e3 * (t2 - t1):.1f} ms")
    print(f"  {wire / 2**20:.1f} MiB on the wire = {wire / (4 * n):.3f}x of fp32, relative L2 error {100 * err:.3f}%")


def main() -> int:
    print("== 1. the int8 block codec", flush=True)
    codec_demo()
    print("\n== 2. a 4-rank int8 ring all-reduce on 127.0.0.1", flush=True)
    from prime.comm.demo import run_ring_demo

    run_ring_demo()
    print("\n== 3. DiLoCo: 2 simulated nodes, int8 ring between them", flush=True)
    from prime import simulate

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.toml")
    return simulate.main(["--nodes", "2", "--procs-per-node", "1", "--", "--config", config])


if __name__ == "__main__":
    sys.exit(main())
