#!/usr/bin/env bash
# train-1gpu: prime-train on one GPU, no DiLoCo: MODEL (1B), seq 2048, micro-batch 4, bf16, eager and with
# train.compile; the summary's median MFU is the one-GPU baseline the DiLoCo runs are compared with. About 5 min.
#   benchmarks/gpu.sh train-1gpu OUT
# env: MODEL (1B), STEPS (15), TRAIN_TIMEOUT (240)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_ring
for compile in false true; do
  run_step "one GPU, ${MODEL:-1B}, train.compile $compile" ${TRAIN_TIMEOUT:-240} "train_compile_$compile.log" \
    env CUDA_VISIBLE_DEVICES=$first_gpu python3 -m prime.train --model.name ${MODEL:-1B} --data.seq_len 2048 \
    --train.micro_batch_size 4 --train.steps ${STEPS:-15} --metrics.log_every 1 --optim.warmup_steps 2 \
    --metrics.plot false --train.threads 8 --train.compile $compile --metrics.out_dir "$out/train_compile_$compile"
  detail "$(grep -E "median inner step" "$out/train_compile_$compile.log" 2>/dev/null | sed 's/^ *//')"
done
finish
