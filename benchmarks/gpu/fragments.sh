#!/usr/bin/env bash
# fragments: streaming fragments on a 4-GPU host, one 10-minute run: DiLoCo 1B, 2 nodes x 1 GPU (GPUs 0-1), 4
# fragments with overlap, compiled, 1 Gbit/s per node, H = 100, 3 outer steps; beside it (GPUs 2-3, then 0) the
# 150M fidelity benchmark at 800 steps (H = 40): 4 fragments with overlap (eager-merge, overlap_steps H / 4) for
# seeds 1-3, against the synchronous exact runs of those seeds on an H200 (1.2111 / 1.2480 / 1.2161,
# benchmarks/RESULTS.md).
#   benchmarks/gpu.sh fragments OUT
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
fid() {  # fid GPU SEED: the 150M fidelity run of SEED on GPU
  CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/bench_fidelity.py --config configs/150M.toml \
    --data.source embedded --train.steps 800 --optim.warmup_steps 40 --optim.decay_steps 100 \
    --diloco.inner_steps 40 --train.micro_batch_size 16 --data.seq_len 512 --eval-batches 16 --train.seed "$2" \
    --methods "overlap-int8-eager-merge:f4" --out "$out/fid800_f4_s$2"
}
if [ -z "${DRY_RUN:-}" ]; then
  (timeout 420 bash -c "$(declare -f fid); out=$out; fid 2 1" >"$out/fid800_f4_s1.log" 2>&1) & f1=$!
  (timeout 420 bash -c "$(declare -f fid); out=$out; fid 3 2" >"$out/fid800_f4_s2.log" 2>&1) & f2=$!
fi
CUDA_VISIBLE_DEVICES=0,1 COMPILE=true RUN_TIMEOUT=300 diloco frag1b 1000 --diloco.fragments 4 --diloco.overlap true
if [ -z "${DRY_RUN:-}" ]; then
  python3 benchmarks/run_summary.py "$out/frag1b" --rate-mbit 1000 --json "$out/frag1b_summary.json" \
    > "$out/frag1b_summary.txt"
  grep -E "utilization after" "$out/frag1b_summary.txt"
fi
run_step "150M fidelity, 4 fragments with overlap, seed 3 (seeds 1-2 beside the 1B run)" 420 fid800_f4_s3.log \
  bash -c "$(declare -f fid); out=$out; fid 0 3"
if [ -z "${DRY_RUN:-}" ]; then
  wait $f1 $f2
  for s in 1 2 3; do echo "== fidelity seed $s"; grep -E "\| overlap" "$out/fid800_f4_s$s.log" | tail -1; done
fi
finish
