#!/usr/bin/env bash
# DiLoCo across simulated nodes on one multi-GPU host: NODES nodes x PROCS GPUs each (FSDP2 on
# NCCL inside a node), the int8 ring between them rate-limited to each of RATES (Mbit/s per link).
#   usage: benchmarks/gpu_diloco.sh RESULTS_DIR
# env: MODEL (1B), H (inner steps, 100), OUTER (outer steps, 2), NODES (2), PROCS (1), RATES ("1000 10000"),
#      COMPILE (false), MB (micro-batch, 4), ACCUM (gradient accumulation, 1), SEQ (2048),
#      EXTRA (more prime-train flags, e.g. "--diloco.overlap true --diloco.overlap_steps 25")
# Each run prints per-step MFU and tokens/s, each outer step's all-reduce time and utilization,
# and at the end whether the nodes' final weights are bit-identical (blake2b of every node).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_diloco.sh RESULTS_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/machine.txt"
# The ring and the CPU codec are all DiLoCo needs between nodes: skip the CUDA kernels here.
build_if_missing "$out/build.log" PRIME_SKIP_CUDA=1
H=${H:-100}
status=0
for rate in ${RATES:-1000 10000}; do
  echo "== DiLoCo ${NODES:-2} nodes x ${PROCS:-1} GPU, ${MODEL:-1B}, H=$H, accum ${ACCUM:-1}, ring limited to $rate Mbit/s"
  timeout ${RUN_TIMEOUT:-280} python3 -m prime.simulate --nodes ${NODES:-2} --procs-per-node ${PROCS:-1} -- \
    --model.name ${MODEL:-1B} --data.seq_len ${SEQ:-2048} --train.micro_batch_size ${MB:-4} --train.grad_accum ${ACCUM:-1} \
    --train.steps $((H * ${OUTER:-2})) --diloco.inner_steps $H --diloco.max_rate_mbit $rate \
    --optim.warmup_steps 10 --metrics.log_every 20 --metrics.plot false --train.threads 8 \
    --train.compile ${COMPILE:-false} ${EXTRA:-} --metrics.out_dir "$out/r$rate" 2>&1 | tee "$out/diloco_${rate}mbit.log" \
    | grep -E "model|outer|summary|utilization|median|identical|differ|rror" || status=1
done
exit $status
