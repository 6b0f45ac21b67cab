#!/usr/bin/env bash
# The ring with CUDA tensors on a GPU machine, in one call (about 2-3 minutes on one H100,
# under 90 s with QUICK=1):
#   1. builds prime._C with the CUDA kernels (sm_90 unless PRIME_CUDA_ARCHS says otherwise), every
#      time: ninja recompiles only what changed, and a stale build from another checkout is never used
#      (QUICK=1: no build; the extension already built in place must have the CUDA ring codec);
#   2. the GPU ring tests: tests/test_ring_cuda.py (CPU and CUDA ranks mixed, bit for bit against
#      all-CPU rings; rank r on GPU r mod count, so a 2-GPU machine also mixes GPUs) and
#      tests/test_ring.py's CUDA tests (SKIP_TESTS=1 skips them);
#   3. benchmarks/bench_ring_cuda_kernels.py: every kernel and copy of the GPU wire codec alone over
#      KERNEL_MIB (128) MiB of fp32, CUDA events, median of 20, GB/s against the bytes each must move
#      (not with QUICK=1);
#   4. benchmarks/bench_ring_cuda.py: WORLD (2) ranks x MIB (256) MiB fp32 on loopback, reduced on the
#      GPU against staged through pinned host memory (the path before issue 12) and gloo, with the
#      WorkStats split, in up to three layouts:
#        a. ranks as threads of one process, all on the first GPU (bench_ring_cuda.log; json in OUT/);
#        b. when the machine has >= WORLD GPUs: ranks as processes, rank r on GPU r, the deployment's
#           shape, one node = one process per GPU (bench_ring_cuda_gpus.log; json in OUT/gpus/);
#        c. PROC_CHECK=1 (default; 0 with QUICK=1): gpu-int8 and host-int8 with the ranks as processes
#           sharing the first GPU, to show what the driver's time-slicing of one GPU between
#           processes (no MPS) costs (bench_ring_cuda_processes.log);
#      4 torch threads per rank (THREADS), as bench_allreduce.py --threads 4 measured before.
# The timing tables are printed last; full logs go under RESULTS_DIR.
#   usage: benchmarks/gpu_ring.sh [RESULTS_DIR]      (default: $OUT)
#          QUICK=1 benchmarks/gpu_ring.sh OUT         (after a build: tests and layouts a and b only)
# env: MIB (256), WORLD (2), ITERS (15), METHODS, THREADS (4), KERNEL_MIB (128), QUICK, SKIP_TESTS,
#      PROC_CHECK (1), TEST_TIMEOUT (150; QUICK 40), BENCH_TIMEOUT (150; QUICK 45),
#      FULL=1 also runs the former contents of this script: bench_allreduce.py --device cuda
#      (SIZES, WORLD_SIZES) and the one-GPU training baseline (MODEL, STEPS; SKIP_TRAIN).
set -uo pipefail
out=${1:-${OUT:?usage: benchmarks/gpu_ring.sh RESULTS_DIR}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0
summary=()
quick=${QUICK:-}
world=${WORLD:-2}
if [ -n "$quick" ]; then
  methods=${METHODS:-gpu-int8,gpu-int8/pageable,gpu-int8/seg16,gpu-fp32,gpu-fp32/pageable,host-int8,host-fp32,gloo-fp32}
  test_timeout=${TEST_TIMEOUT:-40}; bench_timeout=${BENCH_TIMEOUT:-45}; proc_check=${PROC_CHECK:-0}
else
  methods=${METHODS:-gpu-int8,gpu-int8/pageable,gpu-int8/seg4,gpu-int8/seg16,gpu-fp32,gpu-fp32/pageable,gpu-fp32/seg4,host-int8,host-fp32,gloo-fp32}
  test_timeout=${TEST_TIMEOUT:-150}; bench_timeout=${BENCH_TIMEOUT:-150}; proc_check=${PROC_CHECK:-1}
fi
# The GPUs this job may use, as torch numbers them (CUDA_VISIBLE_DEVICES respected); the
# one-GPU layouts run on the first of them.
first_gpu=${CUDA_VISIBLE_DEVICES:-0}; first_gpu=${first_gpu%%,*}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

{ nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id --format=csv
  nvidia-smi topo -m 2>/dev/null | head -$(( ngpu + 1 ))
  lscpu | grep -E "^(Model name|CPU\(s\)|NUMA node\(s\))"
  python3 -c "import torch; print('torch', torch.__version__)"
  echo "GPUs visible: $ngpu; WORLD $world${quick:+; QUICK}"; } 2>&1 | tee "$out/machine.txt"

if [ -n "$quick" ]; then
  echo "== no build (QUICK=1): checking the in-place build"
  if ! python3 -c "import prime._C as C, sys; sys.exit(0 if C._ring_reduces_on_gpu else 1)"; then
    echo "QUICK=1 needs prime._C built in place with CUDA (run without QUICK, or setup.py build_ext --inplace)"; exit 1
  fi
  summary+=("build: skipped (QUICK=1); the in-place prime._C has the CUDA ring codec")
else
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
fi

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU ring tests ($ngpu GPU(s))"
  t0=$(date +%s)
  timeout $test_timeout python3 -m pytest -q -rs --tb=short --junitxml="$out/tests.xml" \
    tests/test_ring_cuda.py "tests/test_ring.py::test_cuda_tensor" >"$out/tests.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  summary+=("tests: exit $rc in $(( $(date +%s) - t0 )) s, $(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$out/tests.log" | tail -1)")
fi

if [ -z "$quick" ]; then
  echo "== GPU wire codec kernels, one at a time"
  CUDA_VISIBLE_DEVICES=$first_gpu timeout 60 python3 benchmarks/bench_ring_cuda_kernels.py --mib ${KERNEL_MIB:-128} \
    --iters 20 --out "$out" >"$out/bench_ring_cuda_kernels.log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  summary+=("kernels: exit $rc")
fi

bench() {  # bench LOG TIMEOUT ARGS...: one bench_ring_cuda.py run, its exit code into the summary
  local log=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout $t python3 benchmarks/bench_ring_cuda.py --world $world --mib ${MIB:-256} --threads ${THREADS:-4} \
    --method-budget 8 --timeout $(( t - 5 )) "$@" >"$out/$log" 2>&1
  local rc=$?
  [ $rc = 0 ] || status=1
  summary+=("bench $log: exit $rc in $(( $(date +%s) - t0 )) s")
}

echo "== ring with CUDA tensors: GPU reduce vs host staging; ranks as threads on GPU $first_gpu"
CUDA_VISIBLE_DEVICES=$first_gpu bench bench_ring_cuda.log $bench_timeout --ranks threads \
  --iters ${ITERS:-15} --methods "$methods" --out "$out"

if [ "$ngpu" -ge "$world" ]; then
  echo "== the same, ranks as processes, one per GPU (rank r on GPU r)"
  bench bench_ring_cuda_gpus.log $bench_timeout --ranks processes --iters ${ITERS:-15} --methods "$methods" --out "$out/gpus"
else
  summary+=("bench one process per GPU: skipped ($ngpu GPU(s) visible, WORLD $world)")
fi

if [ "$proc_check" = 1 ]; then
  echo "== gpu-int8 and host-int8, ranks as processes sharing GPU $first_gpu"
  CUDA_VISIBLE_DEVICES=$first_gpu bench bench_ring_cuda_processes.log 70 --ranks processes --iters 8 --warmup 2 \
    --methods gpu-int8,host-int8
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

if [ -f "$out/tests.log" ]; then
  echo "== test failures and skips (tests.log)"
  grep -E "^(FAILED|ERROR)|SKIPPED|Error|error:|assert" "$out/tests.log" | head -40
  tail -4 "$out/tests.log"
fi
echo "== summary"
printf '%s\n' "${summary[@]}"
if [ -z "$quick" ] && [ -f "$out/bench_ring_cuda_kernels.log" ]; then
  echo "== kernels (bench_ring_cuda_kernels.log)"
  tail -14 "$out/bench_ring_cuda_kernels.log"
fi
for log in bench_ring_cuda.log bench_ring_cuda_gpus.log bench_ring_cuda_processes.log; do
  [ -f "$out/$log" ] || continue
  case $log in
    bench_ring_cuda.log) echo "== timing, ranks as threads on one GPU ($log)";;
    bench_ring_cuda_gpus.log) echo "== timing, ranks as processes, one per GPU ($log)";;
    *) echo "== timing, ranks as processes sharing one GPU ($log)";;
  esac
  tail -14 "$out/$log"
done
exit $status
