#!/usr/bin/env bash
# The ring with CUDA tensors on a GPU machine, in one call (about 2-3 minutes on one H100):
#   1. builds prime._C with the CUDA kernels (sm_90 unless PRIME_CUDA_ARCHS says otherwise), every
#      time: ninja recompiles only what changed, and a stale build from another checkout is never used;
#   2. the GPU ring tests: tests/test_ring_cuda.py (CPU and CUDA ranks mixed, bit for bit against
#      all-CPU rings) and tests/test_ring.py's CUDA tests;
#   3. benchmarks/bench_ring_cuda_kernels.py: every kernel and copy of the GPU wire codec alone over
#      KERNEL_MIB (128) MiB of fp32, CUDA events, median of 20, GB/s against the bytes each must move;
#   4. benchmarks/bench_ring_cuda.py: 2 ranks x 256 MiB fp32 on loopback, reduced on the GPU against
#      staged through pinned host memory (the path before issue 12) and gloo, with the WorkStats split;
#      ranks as threads of one process when they share a GPU (processes sharing one are time-sliced
#      by the driver), 4 torch threads per rank (as bench_allreduce.py --threads 4 measured before);
#   5. (PROC_CHECK=1, default) gpu-int8 and host-int8 again with the ranks as processes, to show
#      what the time-slicing of one GPU between processes costs.
# The timing tables are printed last; full logs go under RESULTS_DIR.
#   usage: benchmarks/gpu_ring.sh [RESULTS_DIR]      (default: $OUT)
# env: MIB (256), WORLD (2), ITERS (15), METHODS, RANKS (auto), THREADS (4), KERNEL_MIB (128),
#      PROC_CHECK (1), TEST_TIMEOUT (150), BENCH_TIMEOUT (150),
#      FULL=1 also runs the former contents of this script: bench_allreduce.py --device cuda
#      (SIZES, WORLD_SIZES) and the one-GPU training baseline (MODEL, STEPS; SKIP_TRAIN).
set -uo pipefail
out=${1:-${OUT:?usage: benchmarks/gpu_ring.sh RESULTS_DIR}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0
summary=()

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$out/machine.txt"

echo "== build (CUDA, sm_${PRIME_CUDA_ARCHS:-90})"
t0=$(date +%s)
if ! PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40
  tail -30 "$out/build.log"
  echo "BUILD FAILED (full log: build.log)"
  exit 1
fi
cat build/prime-cuda.txt 2>/dev/null
if ! python3 -c "import prime._C as C, sys; sys.exit(0 if C._ring_reduces_on_gpu else 1)"; then
  echo "BUILD has no CUDA ring codec (see build/prime-cuda.txt above)"; exit 1
fi
summary+=("build: ok in $(( $(date +%s) - t0 )) s")

echo "== GPU ring tests"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rs --tb=short --junitxml="$out/tests.xml" \
  tests/test_ring_cuda.py "tests/test_ring.py::test_cuda_tensor" >"$out/tests.log" 2>&1
rc=$?
[ $rc = 0 ] || status=1
summary+=("tests: exit $rc, $(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$out/tests.log" | tail -1)")

echo "== GPU wire codec kernels, one at a time"
timeout 60 python3 benchmarks/bench_ring_cuda_kernels.py --mib ${KERNEL_MIB:-128} --iters 20 --out "$out" \
  >"$out/bench_ring_cuda_kernels.log" 2>&1
rc=$?
[ $rc = 0 ] || status=1
summary+=("kernels: exit $rc")

echo "== ring with CUDA tensors: GPU reduce vs host staging"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_ring_cuda.py --world ${WORLD:-2} --mib ${MIB:-256} \
  --iters ${ITERS:-15} --methods ${METHODS:-gpu-int8,gpu-int8/seg4,gpu-int8/seg16,gpu-fp32,gpu-fp32/seg4,host-int8,host-fp32,gloo-fp32} \
  --ranks ${RANKS:-auto} --threads ${THREADS:-4} --method-budget 8 --timeout $(( ${BENCH_TIMEOUT:-150} - 10 )) --out "$out" \
  >"$out/bench_ring_cuda.log" 2>&1
rc=$?
[ $rc = 0 ] || status=1
summary+=("bench: exit $rc")

if [ "${PROC_CHECK:-1}" = 1 ]; then
  echo "== the same, ranks as processes"
  timeout 70 python3 benchmarks/bench_ring_cuda.py --world ${WORLD:-2} --mib ${MIB:-256} --iters 8 --warmup 2 \
    --methods gpu-int8,host-int8 --ranks processes --threads ${THREADS:-4} --method-budget 8 --timeout 60 \
    >"$out/bench_ring_cuda_processes.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  summary+=("bench (processes): exit $rc")
fi

if [ -n "${FULL:-}" ]; then
  echo "== bench_allreduce.py --device cuda"
  timeout ${FULL_BENCH_TIMEOUT:-300} python3 benchmarks/bench_allreduce.py --device cuda --conditions loopback \
    --world-sizes "${WORLD_SIZES:-2,4}" --sizes "${SIZES:-64,256}" --methods gloo-fp32,ring-fp32,ring-int8 \
    --threads 4 --no-plot --out "$out/allreduce_cuda" 2>&1 | tee "$out/allreduce_cuda.log" | tail -20 || status=1
  if [ -z "${SKIP_TRAIN:-}" ]; then
    C="--model.name ${MODEL:-1B} --data.seq_len 2048 --train.micro_batch_size 4 --train.steps ${STEPS:-15}
       --metrics.log_every 1 --optim.warmup_steps 2 --metrics.plot false --train.threads 8"
    for compile in false true; do
      echo "== one GPU, ${MODEL:-1B}, train.compile $compile"
      CUDA_VISIBLE_DEVICES=0 timeout ${TRAIN_TIMEOUT:-240} python3 -m prime.train $C --train.compile $compile \
        --metrics.out_dir "$out/train_compile_$compile" 2>&1 | tee "$out/train_compile_$compile.log" | grep -E "model|summary|median|step +(1|5|10|15)/" || status=1
    done
  fi
fi

echo "== test failures and skips (tests.log)"
grep -E "^(FAILED|ERROR)|SKIPPED|Error|error:|assert" "$out/tests.log" | head -40
tail -4 "$out/tests.log"
echo "== summary"
printf '%s\n' "${summary[@]}"
echo "== kernels (bench_ring_cuda_kernels.log)"
tail -14 "$out/bench_ring_cuda_kernels.log"
echo "== timing (bench_ring_cuda.log)"
tail -14 "$out/bench_ring_cuda.log"
if [ -f "$out/bench_ring_cuda_processes.log" ]; then
  echo "== timing, ranks as processes (bench_ring_cuda_processes.log)"
  tail -6 "$out/bench_ring_cuda_processes.log"
fi
exit $status
