#!/usr/bin/env bash
# INTELLECT-1's shape on one 4-GPU host: the 10B model, 2 nodes x 2 GPUs (FSDP2 inside a node), seq 4096,
# activation checkpointing, torch.compile, the int8 ring paced per ring at half the node's rate (a node's two
# rings share its link). Each part fits one 10-minute run:
#   PART=sync    benchmarks/gpu/scale-10b.sh OUT   build; GPU tests of the outer state and the CUDA ring; 10B
#                                                  synchronous at 10 Gbit/s per node (H = 10, 3 outer steps)
#   PART=overlap benchmarks/gpu/scale-10b.sh OUT   10B, 4 streaming fragments with overlap, 1 Gbit/s per node
#                                                  (H = 80, 3 phases; each fragment's 1.3 GB per ring needs
#                                                  ~21 s of a 0.5 Gbit/s ring, hidden in its 20 inner steps)
# Micro-batch 2 without gradient accumulation: FSDP2 accumulating unsharded gradients keeps them in fp32, 41 GB
# per GPU for 10B, which leaves no room for the outer step's work buffers (the memory plan says so).
# MEMORY_GIB: the host memory for the plan (these VMs report a MemTotal that grows as memory is used).
set -uo pipefail
out=${1:?usage: PART=sync|overlap benchmarks/gpu/scale-10b.sh OUT}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
part=${PART:-sync}

echo "== build (CUDA, sm_90)"
if ! python3 -c "import prime._C as C, sys; sys.exit(0 if getattr(C, '_ring_reduces_on_gpu', False) else 1)" 2>/dev/null; then
  PRIME_CUDA_ARCHS=90 MAX_JOBS=$(( $(nproc) < 32 ? $(nproc) : 32 )) python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; echo "BUILD FAILED"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4

run10b() {  # run10b NAME TIMEOUT ARGS...: 2 nodes x 2 GPUs, 10B; log and metrics under OUT/NAME
  local name=$1 limit=$2; shift 2
  mkdir -p "$out/$name"
  echo "== 10B $name: $*"
  timeout "$limit" python3 -m prime.simulate --nodes 2 --procs-per-node 2 -- --model.name 10B \
    --data.source embedded --data.seq_len 4096 --train.micro_batch_size 2 --train.grad_accum 1 \
    --train.activation_checkpointing true --train.compile true --optim.warmup_steps 5 --diloco.timeout_s 900 \
    --metrics.log_every 10 --metrics.plot false --train.threads 8 --memory.host_gib "${MEMORY_GIB:-500}" \
    --metrics.out_dir "$out/$name" "$@" >"$out/$name/log.txt" 2>&1
  echo "exit $?"
  grep -E "memory|outer [0-9]|identical|differ|rror|summary|utilization|median" "$out/$name/log.txt" | tail -40
}

case "$part" in
sync)
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_outer_gpu.py tests/test_ring_cuda.py \
    "tests/test_ring.py::test_cuda_tensor" >"$out/tests.log" 2>&1
  echo "== GPU tests: exit $? ($(tail -1 "$out/tests.log"))"
  grep -E "FAILED|Error|assert" "$out/tests.log" | head -20
  run10b sync 360 --diloco.inner_steps 10 --train.steps 30 --diloco.max_rate_mbit 5000
  python3 benchmarks/run_summary.py "$out/sync" --rate-mbit 5000 --json "$out/sync_summary.json"
  ;;
overlap)
  run10b overlap 570 --diloco.fragments 4 --diloco.overlap true --diloco.inner_steps 80 --train.steps 240 \
    --diloco.max_rate_mbit 500
  python3 benchmarks/run_summary.py "$out/overlap" --rate-mbit 500 --json "$out/overlap_summary.json"
  ;;
*) echo "PART must be sync or overlap"; exit 2 ;;
esac
