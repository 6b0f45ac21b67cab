#!/usr/bin/env bash
# sparse: the topk codec on GPUs over slow links, one 10-minute run: DiLoCo 1B, 2 nodes x 1 GPU, 4 fragments with
# overlap, compiled, H = 100, each ring paced at RATE (100) Mbit/s, diloco.codec topk at DENSITY (1/64): compute
# utilization after the first outer step, the outer step on the critical path, weights identical. Then the
# Triton kernels' speed against copy bandwidth (bench_sparse_speed.py, 256 MiB).
#   benchmarks/gpu.sh sparse OUT
# env: RATE (100), DENSITY (0.015625), OUTER (4), COMPILE (true), DENSE (0: diloco.dense_outer_steps, the int8 outer
#      steps each fragment starts with; run_summary.py then states the utilization after them and theirs apart),
#      SPEED (1: the kernel benchmark after the run),
#      INT8 (0; 1: then the same run with the int8 codec at 1 Gbit/s, the regression check of the overlap path).
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
rate=${RATE:-100}
OUTER=${OUTER:-4} COMPILE=${COMPILE:-true} RUN_TIMEOUT=${RUN_TIMEOUT:-330} diloco topk1b "$rate" \
  --diloco.codec topk --diloco.density "${DENSITY:-0.015625}" --diloco.fragments 4 --diloco.overlap true \
  --diloco.dense_outer_steps "${DENSE:-0}"
if [ -z "${DRY_RUN:-}" ]; then
  python3 benchmarks/run_summary.py "$out/topk1b" --rate-mbit "$rate" --json "$out/topk1b_summary.json" \
    > "$out/topk1b_summary.txt"
  grep -E "utilization after|identical|differ" "$out/topk1b_summary.txt" "$out/diloco_topk1b.log" | tail -4
fi
if [ "${INT8:-0}" = 1 ]; then
  OUTER=${OUTER:-4} COMPILE=${COMPILE:-true} RUN_TIMEOUT=${RUN_TIMEOUT:-330} diloco int8_1b 1000 \
    --diloco.fragments 4 --diloco.overlap true
  [ -z "${DRY_RUN:-}" ] && python3 benchmarks/run_summary.py "$out/int8_1b" --rate-mbit 1000 \
    > "$out/int8_1b_summary.txt" && grep -E "utilization after" "$out/int8_1b_summary.txt"
fi
[ "${SPEED:-1}" = 1 ] && run_step "sparse kernels, 256 MiB, against copy bandwidth" 120 sparse_speed.log \
  python3 benchmarks/bench_sparse_speed.py --device cuda --mib 256 --k 16,64,256
finish
