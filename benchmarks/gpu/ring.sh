#!/usr/bin/env bash
# ring: the ring with CUDA tensors (about 3 minutes on one H100; under 90 s with QUICK=1).
#   1. build prime._C with the CUDA kernels (QUICK=1: no build; the in-place one must have the CUDA ring codec);
#   2. the GPU ring tests: tests/test_ring_cuda.py (CPU and CUDA ranks mixed, bit for bit against all-CPU
#      rings; rank r on GPU r mod count) and test_ring.py's CUDA tests (SKIP_TESTS=1 skips them);
#   3. bench_ring_cuda.py: WORLD (2) ranks x MIB (256) MiB fp32 on loopback, reduced on the GPU against staged
#      through pinned host memory and gloo, with the WorkStats split, in up to three layouts:
#        a. ranks as threads of one process on the first GPU (bench_ring_cuda.log, json in OUT/);
#        b. with >= WORLD GPUs: ranks as processes, rank r on GPU r (bench_ring_cuda_gpus.log, OUT/gpus/);
#        c. PROC_CHECK=1 (default; 0 with QUICK=1): gpu-int8 and host-int8, ranks as processes sharing the
#           first GPU (what the driver's time-slicing costs; bench_ring_cuda_processes.log);
#   Options: QERR=1   the ring's own int8 error: its tests, then gpu-int8 with PRIME_RING_QUANT_ERROR=1 and =0;
#            RING_1B=1 the ring alone at the 1B model's size (2 ranks x 5716 MiB), paced at 10 Gbit/s and not;
#            ALLREDUCE=1 bench_allreduce.py --device cuda (WORLD_SIZES 2,4; SIZES 64,256 MiB).
#   benchmarks/gpu.sh ring OUT
# env: MIB, WORLD, ITERS (15), METHODS, THREADS (4), QUICK, SKIP_TESTS, PROC_CHECK, TEST_TIMEOUT (150; QUICK 40),
#      BENCH_TIMEOUT (150; QUICK 45)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
quick=${QUICK:-}
world=${WORLD:-2}
if [ -n "$quick" ]; then
  methods=${METHODS:-gpu-int8,gpu-int8/pageable,gpu-int8/seg16,gpu-fp32,gpu-fp32/pageable,host-int8,host-fp32,gloo-fp32}
  test_timeout=${TEST_TIMEOUT:-40}; bench_timeout=${BENCH_TIMEOUT:-45}; proc_check=${PROC_CHECK:-0}
else
  methods=${METHODS:-gpu-int8,gpu-int8/pageable,gpu-int8/seg4,gpu-int8/seg16,gpu-fp32,gpu-fp32/pageable,gpu-fp32/seg4,host-int8,host-fp32,gloo-fp32}
  test_timeout=${TEST_TIMEOUT:-150}; bench_timeout=${BENCH_TIMEOUT:-150}; proc_check=${PROC_CHECK:-1}
fi
machine_info
[ -z "${DRY_RUN:-}" ] && nvidia-smi topo -m 2>/dev/null | head -$(( ngpu + 1 )) | tee -a "$out/machine.txt"
if [ -n "$quick" ]; then
  if [ -z "${DRY_RUN:-}" ] && ! python3 -c "import prime._C as C, sys; sys.exit(0 if C._ring_reduces_on_gpu else 1)"; then
    echo "QUICK=1 needs prime._C built in place with CUDA (run without QUICK first)"; status=1; finish
  fi
else
  build_cuda
fi

if [ -z "${SKIP_TESTS:-}" ]; then
  tests=(tests/test_ring_cuda.py tests/test_ring.py::test_cuda_tensor)
  [ -n "${QERR:-}" ] && tests+=(tests/test_outer_gpu.py tests/test_ring.py::test_ring_reports_its_own_quantization_error
                               tests/test_ring.py::test_diloco_takes_compression_error_from_the_ring)
  run_step "GPU ring tests ($ngpu GPU(s))" $test_timeout tests.log \
    python3 -m pytest -q -rs --tb=short -p no:cacheprovider --junitxml="$out/tests.xml" "${tests[@]}"
  detail "$(pytest_counts tests.log)"
fi

bench() {  # bench NAME LOG TIMEOUT GPUS ARGS...: one bench_ring_cuda.py run on GPUS (a CUDA_VISIBLE_DEVICES value)
  local name=$1 log=$2 t=$3 gpus=$4; shift 4
  run_step "$name" $t "$log" env CUDA_VISIBLE_DEVICES="$gpus" python3 benchmarks/bench_ring_cuda.py --world $world \
    --mib ${MIB:-256} --threads ${THREADS:-4} --method-budget 8 --timeout $(( t - 5 )) "$@"
}
all_gpus=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( ngpu > 0 ? ngpu - 1 : 0 )))}
bench "ranks as threads on GPU $first_gpu: GPU reduce vs host staging, gloo" bench_ring_cuda.log $bench_timeout \
  "$first_gpu" --ranks threads --iters ${ITERS:-15} --methods "$methods" --out "$out"
if [ "$ngpu" -ge "$world" ] || [ -n "${DRY_RUN:-}" ]; then
  bench "ranks as processes, one per GPU" bench_ring_cuda_gpus.log $bench_timeout "$all_gpus" --ranks processes \
    --iters ${ITERS:-15} --methods "$methods" --out "$out/gpus"
fi
if [ "$proc_check" = 1 ]; then
  bench "gpu-int8, host-int8: processes sharing GPU $first_gpu" bench_ring_cuda_processes.log 70 "$first_gpu" \
    --ranks processes --iters 8 --warmup 2 --methods gpu-int8,host-int8
fi
if [ -n "${QERR:-}" ]; then
  for on in 1 0; do
    run_step "gpu-int8, 2 ranks x 256 MiB, PRIME_RING_QUANT_ERROR=$on" 100 "ring_qerr$on.log" \
      env PRIME_RING_QUANT_ERROR=$on python3 benchmarks/bench_ring_cuda.py --world 2 --mib 256 --threads 4 --ranks threads --iters 15 \
      --methods gpu-int8 --method-budget 8 --timeout 95
  done
fi
if [ -n "${RING_1B:-}" ]; then
  run_step "ring alone, 2 ranks x 5716 MiB (the 1B model), paced at 10 Gbit/s" 150 ring_paced.log \
    python3 benchmarks/bench_ring_cuda.py --world 2 --mib 5716 --warmup 1 --iters 4 --method-budget 30 \
    --methods gpu-int8 --max-rate-mbit 10000 --out "$out/ring_paced"
  run_step "ring alone, 2 ranks x 5716 MiB, unpaced" 100 ring_unpaced.log \
    python3 benchmarks/bench_ring_cuda.py --world 2 --mib 5716 --warmup 1 --iters 4 --method-budget 30 \
    --methods gpu-int8 --out "$out/ring_unpaced"
fi
if [ -n "${ALLREDUCE:-}" ]; then
  run_step "bench_allreduce.py --device cuda" ${ALLREDUCE_TIMEOUT:-300} allreduce_cuda.log \
    python3 benchmarks/bench_allreduce.py --device cuda --conditions loopback --world-sizes "${WORLD_SIZES:-2,4}" \
    --sizes "${SIZES:-64,256}" --methods gloo-fp32,ring-fp32,ring-int8 --threads 4 --no-plot --out "$out/allreduce_cuda"
fi
if [ -z "${DRY_RUN:-}" ]; then
  [ -f "$out/tests.log" ] && { grep -E "^(FAILED|ERROR)|SKIPPED" "$out/tests.log" | head -20; }
  for log in bench_ring_cuda.log bench_ring_cuda_gpus.log bench_ring_cuda_processes.log ring_qerr1.log ring_qerr0.log \
             ring_paced.log ring_unpaced.log allreduce_cuda.log; do
    [ -f "$out/$log" ] && { say "timing ($log)"; tail -14 "$out/$log"; }
  done
fi
finish
