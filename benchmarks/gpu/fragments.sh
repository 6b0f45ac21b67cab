#!/usr/bin/env bash
# Streaming fragments on a 4-GPU host, one 10-minute run:
#   DiLoCo 1B, 2 nodes x 1 GPU (GPUs 0-1), 4 fragments with overlap, compiled, 1 Gbit/s per node, H = 100,
#   3 outer steps; beside it (GPUs 2-3) the 150M fidelity benchmark at 800 steps (H = 40): 4 fragments with
#   overlap (eager-merge, overlap_steps H / 4) for seeds 1-3, against the synchronous exact runs of those seeds
#   on an H200 (1.2111 / 1.2480 / 1.2161, benchmarks/RESULTS.md).
set -uo pipefail
out=${1:?usage: benchmarks/gpu/fragments.sh OUT}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
echo "== build (CUDA, sm_90)"
if ! python3 -c "import prime._C as C, sys; sys.exit(0 if getattr(C, '_ring_reduces_on_gpu', False) else 1)" 2>/dev/null; then
  PRIME_CUDA_ARCHS=90 MAX_JOBS=$(( $(nproc) < 32 ? $(nproc) : 32 )) python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; echo "BUILD FAILED"; exit 1; }
fi
fid() {  # fid GPU SEED
  CUDA_VISIBLE_DEVICES=$1 timeout 420 python3 benchmarks/bench_fidelity.py --config configs/150M.toml \
    --data.source embedded --train.steps 800 --optim.warmup_steps 40 --optim.decay_steps 100 \
    --diloco.inner_steps 40 --train.micro_batch_size 16 --data.seq_len 512 --eval-batches 16 --train.seed "$2" \
    --methods "overlap-int8-eager-merge:f4" --out "$out/fid800_f4_s$2" >"$out/fid800_f4_s$2.log" 2>&1
}
fid 2 1 & f1=$!
fid 3 2 & f2=$!
mkdir -p "$out/frag1b"
CUDA_VISIBLE_DEVICES=0,1 timeout 300 python3 -m prime.simulate --nodes 2 --procs-per-node 1 -- \
  --model.name 1B --data.seq_len 2048 --train.micro_batch_size 4 --train.steps 300 --diloco.inner_steps 100 \
  --diloco.max_rate_mbit 1000 --optim.warmup_steps 10 --metrics.log_every 50 --metrics.plot false --train.threads 8 \
  --train.compile true --diloco.fragments 4 --diloco.overlap true --metrics.out_dir "$out/frag1b" \
  >"$out/frag1b/log.txt" 2>&1
echo "== 1B 2 x 1, 4 fragments, overlap, 1 Gbit/s: exit $?"
grep -E "memory|identical|differ|rror|summary|utilization" "$out/frag1b/log.txt" | tail -12
python3 benchmarks/run_summary.py "$out/frag1b" --rate-mbit 1000 --json "$out/frag1b_summary.json" | head -8
fid 0 3 & f3=$!
wait $f1 $f2 $f3
for s in 1 2 3; do echo "== fidelity seed $s"; grep -E "eval loss|\| overlap" "$out/fid800_f4_s$s.log" | tail -2; done
