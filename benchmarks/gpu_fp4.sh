#!/usr/bin/env bash
# The fp4 codec on one H100/H200 (about 10 minutes): bits and speed on the GPU.
#   1. builds prime._C with CUDA (sm_90 unless PRIME_CUDA_ARCHS says otherwise);
#   2. tests, GPU cases enabled: tests/test_fp4.py (CUDA against the reference, the rules, opcheck),
#      tests/test_golden.py (CUDA and Triton against the committed vectors, also beyond index 2^32),
#      tests/test_triton.py (compiled Triton, its PTX), tests/test_ops.py (int8, and the PTX check of
#      codec_cuda.cu with the fp4 kernels), tests/test_ring_cuda.py (mixed CPU/CUDA rings bit-identical
#      to all-CPU rings for int8, fp4 and exact);
#   3. benchmarks/bench_quantize.py --device cuda: int8 and fp4, CUDA and Triton, 64 and 256 MiB (the
#      target: fp4 quantize and dequantize-add >= 90% of a device copy's GB/s at 256 MiB);
#   4. benchmarks/bench_ring_cuda_kernels.py: the ring's per-segment kernels, the fp4 rows beside int8's;
#   5. benchmarks/bench_ring_cuda.py: gpu-int8 against gpu-fp4 (and host-fp4), 2 ranks x 256 MiB, threads.
#   usage: benchmarks/gpu_fp4.sh [RESULTS_DIR]      (default: $OUT)
set -uo pipefail
out=${1:-${OUT:?usage: benchmarks/gpu_fp4.sh RESULTS_DIR}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0
machine_and_cuda_build "$out"

echo "== tests"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rs --tb=short tests/test_fp4.py tests/test_golden.py tests/test_triton.py \
  tests/test_ops.py tests/test_ring_cuda.py >"$out/tests.log" 2>&1 || status=1
tail -8 "$out/tests.log"

echo "== codec throughput, int8 and fp4 (CUDA, Triton)"
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_quantize.py --device cuda --sizes 64,256 --codecs int8,fp4 --no-compile \
  --out "$out/bench_quantize.json" >"$out/bench_quantize.log" 2>&1 || status=1
grep -vE "ref-" "$out/bench_quantize.log" | tail -40

echo "== GPU wire codec kernels, one at a time (128 MiB)"
timeout 90 python3 benchmarks/bench_ring_cuda_kernels.py --mib 128 --iters 20 --out "$out" >"$out/kernels.log" 2>&1 || status=1
cat "$out/kernels.log"

echo "== ring on CUDA tensors, 2 ranks x 256 MiB (threads on one GPU)"
timeout 200 python3 benchmarks/bench_ring_cuda.py --world 2 --mib 256 --threads 4 --ranks threads --iters 15 \
  --methods gpu-int8,gpu-fp4,host-fp4 --method-budget 8 --timeout 190 --out "$out" >"$out/ring.log" 2>&1 || status=1
tail -12 "$out/ring.log"
exit $status
