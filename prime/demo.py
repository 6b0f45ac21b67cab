"""`make demo`: a short demonstration of the codec (later: the ring and DiLoCo)."""

import time

import torch

from prime import ops


def main() -> None:
    torch.manual_seed(0)
    n = 16 << 20
    x = torch.randn(n)
    backend = ops.available_backends("cpu")[0]
    t0 = time.perf_counter()
    q, scales = ops.quantize_int8(x, backend=backend)
    t1 = time.perf_counter()
    y = ops.dequantize_int8(q, scales, backend=backend)
    t2 = time.perf_counter()
    err = float((y.double() - x.double()).norm() / x.double().norm())
    wire = q.numel() + 4 * scales.numel()
    print(f"codec backend {backend!r}: {n} fp32 values = {4 * n / 2**20:.0f} MiB")
    print(f"  quantize   {1e3 * (t1 - t0):7.1f} ms   dequantize {1e3 * (t2 - t1):7.1f} ms")
    print(f"  wire bytes {wire / 2**20:.1f} MiB = {wire / (4 * n):.3f}x of fp32, relative L2 error {100 * err:.3f}%")


if __name__ == "__main__":
    main()
