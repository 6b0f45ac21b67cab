#!/usr/bin/env bash
# fp4: the 4-bit codec on the GPU, bits and speed (about 8 minutes on one H100).
#   1. build prime._C with the CUDA kernels;
#   2. tests, GPU cases enabled: tests/test_fp4.py (CUDA against the reference, the format's rules, opcheck),
#      tests/test_ops.py (int8 and fp4 round trips on CUDA; the PTX of codec_cuda.cu with the fp4 kernels),
#      tests/test_golden.py (CUDA and Triton against the committed vectors, also beyond index 2^32),
#      tests/test_triton.py (compiled Triton, its PTX), tests/test_ring_cuda.py (CPU and CUDA ranks mixed,
#      bit for bit against all-CPU rings, for int8, fp4 and exact);
#   3. bench_quantize.py --device cuda: int8 and fp4 side by side, CUDA and Triton (the target: fp4 quantize
#      and dequantize-add at >= 90% of a device copy's GB/s at 256 MiB);
#   4. bench_fp4_quantize_shapes.py: the Triton fp4 encoder's launch shapes (tile, warps, register cap, full
#      tiles read as pairs of values or element by element, the earlier layout) beside the CUDA op, int8's
#      encoders and a copy, at SHAPES_MIB (256) MiB of fp32;
#   5. bench_ring_cuda_kernels.py: every kernel of the ring's GPU wire codec alone, the fp4 rows beside int8's;
#   6. bench_ring_cuda.py: gpu-int8 against gpu-fp4 and host-fp4, 2 ranks x 256 MiB, ranks as threads on one GPU
#      (RING=0 skips it: about 3 minutes).
#   benchmarks/gpu.sh fp4 OUT
# env: BENCH_ARGS (default "--sizes 64,256"), TEST_TIMEOUT (420), BENCH_TIMEOUT (300), KERNEL_MIB (128),
#      SHAPES_MIB (256), RING (1), TESTS (the test files of step 2)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
run_step "fp4 and codec tests, GPU cases enabled" ${TEST_TIMEOUT:-420} tests.log \
  python3 -m pytest -q -rs --tb=short -p no:cacheprovider --junitxml="$out/tests.xml" \
  ${TESTS:-tests/test_fp4.py tests/test_ops.py tests/test_golden.py tests/test_triton.py tests/test_ring_cuda.py}
detail "$(pytest_counts tests.log)"
run_step "bench_quantize.py --device cuda --codecs int8,fp4 ${BENCH_ARGS:---sizes 64,256}" ${BENCH_TIMEOUT:-300} \
  bench_quantize.log python3 benchmarks/bench_quantize.py --device cuda --codecs int8,fp4 --no-compile \
  ${BENCH_ARGS:---sizes 64,256} --out "$out/bench_quantize.json"
run_step "fp4 quantize: Triton launch shapes beside the CUDA op, int8 and a copy (${SHAPES_MIB:-256} MiB)" 120 \
  bench_fp4_quantize_shapes.log env CUDA_VISIBLE_DEVICES=$first_gpu python3 benchmarks/bench_fp4_quantize_shapes.py \
  --mib ${SHAPES_MIB:-256} --out "$out/bench_fp4_quantize_shapes.json"
run_step "ring wire codec kernels, one at a time (${KERNEL_MIB:-128} MiB)" 90 bench_ring_cuda_kernels.log \
  env CUDA_VISIBLE_DEVICES=$first_gpu python3 benchmarks/bench_ring_cuda_kernels.py --mib ${KERNEL_MIB:-128} \
  --iters 20 --out "$out"
if [ "${RING:-1}" != 0 ]; then
  run_step "ring on CUDA tensors: gpu-int8, gpu-fp4, host-fp4, 2 ranks x 256 MiB, threads on one GPU" 200 \
    bench_ring_cuda.log env CUDA_VISIBLE_DEVICES=$first_gpu python3 benchmarks/bench_ring_cuda.py --world 2 --mib 256 \
    --threads 4 --ranks threads --iters 15 --methods gpu-int8,gpu-fp4,host-fp4 --method-budget 8 --timeout 190 --out "$out"
fi
if [ -z "${DRY_RUN:-}" ]; then
  say "bench_quantize.log"; grep -vE "ref-" "$out/bench_quantize.log" | tail -40
  say "bench_fp4_quantize_shapes.log"; tail -14 "$out/bench_fp4_quantize_shapes.log"
  say "bench_ring_cuda_kernels.log"; tail -18 "$out/bench_ring_cuda_kernels.log"
  [ "${RING:-1}" != 0 ] && { say "bench_ring_cuda.log"; tail -8 "$out/bench_ring_cuda.log"; }
fi
finish
