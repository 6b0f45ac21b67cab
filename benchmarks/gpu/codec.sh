#!/usr/bin/env bash
# codec: the int8 codec on the GPU: bench_quantize.py (every backend against copy bandwidth), the kernels'
# resources and one Nsight Compute pass (profile_codec.py), and every kernel of the ring's GPU wire codec
# alone (bench_ring_cuda_kernels.py). About 4 minutes on one H100.
#   benchmarks/gpu.sh codec OUT
# env: QUICK=1 (bench_quantize --quick), BENCH_ARGS (e.g. "--sizes 64,256"), NCU=0 (no Nsight Compute),
#      KERNEL_MIB (128), BENCH_TIMEOUT (300), NCU_TIMEOUT (240)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
run_step "bench_quantize.py --device cuda ${QUICK:+--quick} ${BENCH_ARGS:-}" ${BENCH_TIMEOUT:-300} bench_quantize.log \
  python3 benchmarks/bench_quantize.py --device cuda ${QUICK:+--quick} ${BENCH_ARGS:-} --out "$out/bench_quantize.json"
run_step "kernel resources (cuobjdump, Triton), 64 MiB" 120 resources.txt python3 benchmarks/profile_codec.py --mib 64
if [ "${NCU:-1}" = 1 ] && { [ -n "${DRY_RUN:-}" ] || command -v ncu >/dev/null; }; then
  # --clock-control none: measure the card as it is (never lock its clocks)
  run_step "Nsight Compute over the quantize kernels" ${NCU_TIMEOUT:-240} ncu.txt \
    ncu --clock-control none --kernel-name regex:quantize --section SpeedOfLight --section LaunchStats \
    --section Occupancy python3 benchmarks/profile_codec.py --launch-only --mib 64
fi
run_step "ring wire codec kernels, one at a time (${KERNEL_MIB:-128} MiB)" 90 bench_ring_cuda_kernels.log \
  env CUDA_VISIBLE_DEVICES=$first_gpu python3 benchmarks/bench_ring_cuda_kernels.py --mib ${KERNEL_MIB:-128} \
  --iters 20 --out "$out"
if [ -z "${DRY_RUN:-}" ]; then
  say "bench_quantize.log"; tail -40 "$out/bench_quantize.log"
  [ -f "$out/ncu.txt" ] && grep -E "^  [a-z_]+kernel|Memory Throughput|DRAM Throughput|Duration|Registers Per|Achieved Occupancy" "$out/ncu.txt" | head -60
  say "bench_ring_cuda_kernels.log"; tail -14 "$out/bench_ring_cuda_kernels.log"
fi
finish
