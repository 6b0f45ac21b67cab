#!/usr/bin/env bash
# The GPU path in one call (H100/H200 machine: Python 3.12, torch 2.11 cu130, triton 3.6, no downloads):
# build prime._C with CUDA, run the whole test suite with GPU tests enabled, run the codec benchmark,
# then the kernels' resource report and one Nsight Compute pass over them (benchmarks/profile_codec.py).
#   usage: benchmarks/gpu_suite.sh RESULTS_DIR [--quick]
# env: PYTEST_TARGETS (default: tests), PYTEST_ARGS, BENCH_ARGS, TEST_TIMEOUT, BENCH_TIMEOUT
set -uo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh RESULTS_DIR [--quick]}
quick=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$out/machine.txt"

echo "== build (CUDA, sm_90)"
t0=$(date +%s)
if ! PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
python3 -c "import prime; from prime import ops; print('backends on cuda:', ops.available_backends('cuda'))"

echo "== tests (GPU tests enabled)"
PYTHONPATH=$PWD timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -rs --junitxml="$out/tests.xml" ${PYTEST_TARGETS:-tests} ${PYTEST_ARGS:-} 2>&1 | tee "$out/tests.log" | tail -25 || status=1

echo "== codec benchmark"
PYTHONPATH=$PWD timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_quantize.py --device cuda ${quick:+--quick} ${BENCH_ARGS:-} --out "$out/bench_quantize.json" 2>&1 | tee "$out/bench_quantize.log" | tail -40 || status=1
echo "== codec kernel resources (cuobjdump, Triton) and Nsight Compute (NCU=0 skips)"
PYTHONPATH=$PWD python3 benchmarks/profile_codec.py --mib 64 2>&1 | tee "$out/resources.txt" || status=1
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  # --clock-control none: measure the card as it is (never lock its clocks)
  PYTHONPATH=$PWD timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name regex:quantize \
    --section SpeedOfLight --section LaunchStats --section Occupancy \
    python3 benchmarks/profile_codec.py --launch-only --mib 64 >"$out/ncu.txt" 2>&1 || echo "ncu failed (see ncu.txt)"
  grep -E "^  [a-z_]+kernel|Memory Throughput|DRAM Throughput|Duration|Registers Per|Achieved Occupancy|Grid Size|Block Size|Waves Per SM" "$out/ncu.txt" | head -120
fi
exit $status
