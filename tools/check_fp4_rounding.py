"""Checks the fp4 round-to-nearest of the CUDA and Triton kernels on every fp32 |v| < 7, both signs.

The kernels (csrc/codec/formats_cuda.cuh fp4_nearest_magnitude, kernels/_codec_kernels.py
_fp4_nearest_magnitude) round t = |v| to the E2M1 grid with one IEEE addition of
M = 2^(22 + max(e, 0)) (t in [2^e, 2^(e+1))), take (t + M) - M, and read the index from the bits
of that times 2^-126; the sign goes on as bit 3 for m > 0. The format defines the code by seven
comparisons (docs/wire-format.md, "fp4"). This emulates the kernels' operations in numpy fp32
(IEEE round to nearest even, no flush to zero) and compares the two on all 2^31 - 2^24 fp32 bit
patterns below 7.0, in about a minute on one core.

    python tools/check_fp4_rounding.py
"""

import sys
import time

import numpy as np

U32 = np.uint32


def by_comparisons(v: np.ndarray) -> np.ndarray:
    t = np.abs(v)
    m = ((t > 0.25).astype(np.uint32) + (t >= 0.75) + (t > 1.25) + (t >= 1.75) + (t > 2.5) + (t >= 3.5)
         + (t > 5.0)).astype(np.uint32)
    return np.where((m > 0) & (v < 0), m | U32(8), m)


def by_magic_add(v: np.ndarray) -> np.ndarray:
    bits = v.view(U32)
    magic = (np.maximum(bits & U32(0x7F800000), U32(0x3F800000)) + U32(22 << 23)).view(np.float32)
    r = (np.abs(v) + magic) - magic
    m = (r * np.float32(2.0**-126)).view(U32) >> U32(22)
    return m | ((bits >> U32(28)) & (m + U32(7)) & U32(8))


def main() -> int:
    t0 = time.time()
    limit = int(np.float32(7.0).view(U32))
    step = 1 << 24
    bad = 0
    for lo in range(0, limit, step):
        bits = np.arange(lo, min(lo + step, limit), dtype=U32)
        for sign in (0, 0x80000000):
            v = (bits | U32(sign)).view(np.float32)
            differ = np.nonzero(by_comparisons(v) != by_magic_add(v))[0]
            if differ.size:
                bad += differ.size
                print("differ:", v[differ[:5]], by_comparisons(v[differ[:5]]), by_magic_add(v[differ[:5]]))
    print(f"{2 * limit} values (|v| < 7, both signs): {bad} differ, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
