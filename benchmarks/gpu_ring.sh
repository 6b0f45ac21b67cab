#!/usr/bin/env bash
# CUDA tensors through the ring, and the one-GPU training baseline, on a GPU machine.
#   usage: benchmarks/gpu_ring.sh RESULTS_DIR
# 1. bench_allreduce.py --device cuda: 2 and 4 rank processes on this host's GPUs (rank r on
#    GPU r mod count), loopback, gloo fp32 against the ring (fp32, int8); the rows carry the
#    ring's time split (stage_s = device-to-host copy, quantize_s, wait_s = wire, reduce_s,
#    copy_back_s = host-to-device) and gpu_quantize_s, what the quantize costs on the GPU.
# 2. One process training MODEL (default 1B) for STEPS steps, eager and with train.compile:
#    the MFU a DiLoCo node's inner steps should reach.
# Builds prime._C first when it is not importable. env: SIZES, WORLD_SIZES, MODEL, STEPS, SKIP_TRAIN
set -uo pipefail
out=${1:?usage: benchmarks/gpu_ring.sh RESULTS_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0
build_if_missing "$out/build.log" PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90}

echo "== ring with CUDA tensors"
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_allreduce.py --device cuda --conditions loopback \
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
exit $status
