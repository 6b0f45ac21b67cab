#!/usr/bin/env bash
# The lean outer step on a GPU machine (issue 12, item 2): one call, about 2 minutes on an H100.
#   usage: benchmarks/gpu_outer.sh [RESULTS_DIR]      (default: $OUT)
# 1. tests/test_outer_gpu.py: the outer state on the GPU gives the same bits as on the CPU
#    (pseudo-gradient, update, lookahead, the pipelined copies), and nodes whose outer state
#    lives on different devices stay identical, with and without overlap.
# 2. bench_outer.py: the outer step's own passes for MODEL (default 1B, fp32 parameters on the
#    GPU), outer state on the GPU against pinned CPU memory (16 threads): prepare (pseudo-gradient
#    + norm), the separate int8 error pass, update + copy back, the eager lookahead; medians of 3,
#    and a CPU-vs-GPU bit check at full size. Target: prepare + update <= 0.3 s for 1B.
# 3. Only with FIDELITY=1 (about 5 more minutes; builds prime._C for the ring if needed; FIDELITY_ONLY=1
#    skips steps 1-2, FID_METHODS picks bench_fidelity's --methods):
#    bench_fidelity.py on the 150M model, 2 nodes as threads on this GPU, the embedded corpus.
# Steps 1-2 need no build (the int8 pass uses the Triton or torch codec when prime._C is absent).
set -uo pipefail
out=${1:-${OUT:?usage: benchmarks/gpu_outer.sh RESULTS_DIR}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ -z "${FIDELITY_ONLY:-}" ]; then
echo "== tests/test_outer_gpu.py"
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider tests/test_outer_gpu.py 2>&1 | tee "$out/test_outer_gpu.log" | tail -5 || status=1
echo "== bench_outer.py ${MODEL:-1B}"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_outer.py --model "${MODEL:-1B}" --repeats ${REPEATS:-3} \
  --threads ${THREADS:-16} --out "$out/outer_${MODEL:-1B}.json" 2>&1 | tee "$out/bench_outer.log" || status=1
fi
if [ -n "${FIDELITY:-}" ]; then
  build_if_missing "$out/build.log" PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90}
  echo "== bench_fidelity.py 150M"
  timeout ${FIDELITY_TIMEOUT:-420} python3 benchmarks/bench_fidelity.py --config configs/150M.toml \
    --data.source embedded --train.steps ${FID_STEPS:-400} --optim.warmup_steps 40 --optim.decay_steps 100 \
    --diloco.inner_steps 40 --train.micro_batch_size 16 --data.seq_len 512 --eval-batches 16 \
    --methods "${FID_METHODS:-dp,diloco-exact,diloco-int8,overlap-int8-eager,overlap-int8-eager@1/4}" \
    --out "$out/fidelity_150M" 2>&1 | grep -v Warning | tee "$out/fidelity_150M.log" || status=1
fi
exit $status
