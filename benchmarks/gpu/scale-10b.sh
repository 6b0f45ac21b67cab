#!/usr/bin/env bash
# scale-10b: INTELLECT-1's shape on one 4-GPU H200 host: the 10B model, 2 nodes x 2 GPUs (FSDP2 inside a node),
# seq 4096, activation checkpointing, torch.compile, the int8 ring paced per ring at half the node's rate (a
# node's two rings share its link), the outer state in pinned host memory streamed through the GPU. Each part
# fits one 10-minute run:
#   PART=sync    benchmarks/gpu.sh scale-10b OUT   GPU tests of the outer state and the CUDA ring; 10B synchronous
#                                                  at 10 Gbit/s per node (H = 10, 3 outer steps): the outer step
#                                                  on the critical path against the wire
#   PART=overlap benchmarks/gpu.sh scale-10b OUT   10B, 4 streaming fragments with overlap, 1 Gbit/s per node
#                                                  (H = 80, 3 phases; each fragment's 1.3 GB per ring needs ~21 s
#                                                  of a 0.5 Gbit/s ring, hidden in its 20 inner steps); H = 100
#                                                  would not leave room for start-up and the final syncs in 10 min
#   PART=topk    benchmarks/gpu.sh scale-10b OUT   the overlap run with the topk codec (its defaults: 48 / 96 of
#                                                  4096) at 100 Mbit/s per node, 50 per ring: each fragment's
#                                                  ~28 MB per ring needs ~4.5 s of wire in its 20 inner steps
#   PART=elastic benchmarks/gpu.sh scale-10b OUT   the overlap run with elastic membership on (heartbeats, the
#                                                  membership agreement before each fragment's average, a state
#                                                  server per node): utilization beside the fixed-node run's
# Micro-batch 2 without gradient accumulation: FSDP2 accumulating unsharded gradients keeps them in fp32, 41 GB
# per GPU for 10B, which leaves no room for the outer step's buffers (the memory plan says so).
# env: PART (sync), STEPS (240) and LIMIT (510 s; topk 570 s) of the elastic and topk runs, H (80) of the topk
#      run, SKIP_TESTS (set: no GPU tests), MEMORY_GIB (500: the host memory for the plan; some VMs report a
#      MemTotal that grows as memory is used)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
part=${PART:-sync}

run10b() {  # run10b NAME TIMEOUT RATE_MBIT ARGS...: 2 nodes x 2 GPUs, 10B; log and metrics under OUT/NAME
  local name=$1 limit=$2 rate=$3; shift 3
  mkdir -p "$out/$name"
  run_step "10B $name: 2 x 2 GPUs, $rate Mbit/s per ring, ${SIMULATE_ARGS:-}$*" "$limit" "$name/log.txt" \
    python3 -m prime.simulate --nodes 2 --procs-per-node 2 ${SIMULATE_ARGS:-} -- --model.name 10B \
    --data.source embedded --data.seq_len 4096 --train.micro_batch_size 2 --train.grad_accum 1 \
    --train.activation_checkpointing true --train.compile true --optim.warmup_steps 5 --diloco.timeout_s 900 \
    --metrics.log_every 10 --metrics.plot false --train.threads 8 --memory.host_gib "${MEMORY_GIB:-500}" \
    --diloco.outer_state_device cpu --diloco.max_rate_mbit "$rate" --metrics.out_dir "$out/$name" "$@"
  [ -n "${DRY_RUN:-}" ] && return 0
  grep -E "memory|outer [0-9]|identical|differ|rror|summary|utilization|median" "$out/$name/log.txt" | tail -40
  python3 benchmarks/run_summary.py "$out/$name" --rate-mbit "$rate" --json "$out/${name}_summary.json" \
    | tee "$out/${name}_summary.txt"
  detail "$(grep -m1 -E "utilization after" "$out/${name}_summary.txt" | sed 's/^ *//')"
}

case "$part" in
sync)
  [ -n "${SKIP_TESTS:-}" ] || { run_step "GPU tests: outer state, CUDA ring" 240 tests.log \
    python3 -m pytest -q -p no:cacheprovider tests/test_outer_gpu.py tests/test_ring_cuda.py \
    "tests/test_ring.py::test_cuda_tensor"; detail "$(pytest_counts tests.log)"; }
  run10b sync 360 5000 --diloco.inner_steps 10 --train.steps 30
  ;;
overlap)
  run10b overlap 570 500 --diloco.fragments 4 --diloco.overlap true --diloco.inner_steps 80 --train.steps 240
  ;;
topk)
  run10b topk "${LIMIT:-570}" 50 --diloco.codec topk --diloco.fragments 4 --diloco.overlap true \
    --diloco.inner_steps "${H:-80}" --train.steps "${STEPS:-240}"
  [ -n "${DRY_RUN:-}" ] || grep -E "identical|differ" "$out/topk/log.txt" | tail -2
  ;;
elastic)
  SIMULATE_ARGS="--elastic " run10b elastic "${LIMIT:-510}" 500 --diloco.fragments 4 --diloco.overlap true \
    --diloco.inner_steps 80 --train.steps "${STEPS:-240}" --elastic.barrier_timeout_s 600
  grep -E "identical|differ" "$out/elastic/log.txt" | tail -2
  ;;
*) echo "PART must be sync, overlap, topk or elastic"; status=2 ;;
esac
finish
