#!/usr/bin/env bash
# elastic: elastic nodes with streaming fragments and overlap on GPUs, one 10-minute run: DiLoCo 1B, 1 GPU per
# node, 4 fragments with overlap, 1 Gbit/s per node, H = 100; first the fixed-node run (the regression check:
# utilization after the first outer step), then the elastic run, where node 1 is SIGKILLed mid-run and a new
# node joins on its GPU (utilization over the outer steps whose membership did not change, the joiner's time to
# join beside its state bytes / link rate, final weights identical).
#   benchmarks/gpu.sh elastic OUT
# env: NODES (2; 3 on a 4-GPU host, as the acceptance shape), H (100), ELASTIC_STEPS (1500), KILL (200), JOIN (250), ELASTIC_TIMEOUT (320),
#      FIXED (1: run the fixed-node run first), COMPILE (true). On fewer GPUs than nodes the nodes share them: a
#      check that it works, not a measurement.
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
nodes=${NODES:-2}
[ "${FIXED:-1}" = 1 ] && COMPILE=${COMPILE:-true} RUN_TIMEOUT=240 NODES=$nodes diloco frag1b 1000 \
  --diloco.fragments 4 --diloco.overlap true
if [ -z "${DRY_RUN:-}" ] && [ "${FIXED:-1}" = 1 ]; then
  python3 benchmarks/run_summary.py "$out/frag1b" --rate-mbit 1000 > "$out/frag1b_summary.txt"
  grep -E "utilization after" "$out/frag1b_summary.txt"
fi
h=${H:-100}
run_step "elastic 1B: $nodes x 1 GPU, 4 fragments + overlap, 1 Gbit/s, kill node 1 at step ${KILL:-200}, join at ${JOIN:-250}" \
  "${ELASTIC_TIMEOUT:-320}" elastic1b.log \
  python3 -m prime.simulate --nodes "$nodes" --elastic --kill-node "1@step:${KILL:-200}" --join-at "step:${JOIN:-250}" -- \
  --model.name 1B --data.seq_len 2048 --train.micro_batch_size 4 --train.steps "${ELASTIC_STEPS:-1500}" \
  --diloco.inner_steps "$h" --diloco.fragments 4 --diloco.overlap true --diloco.max_rate_mbit 1000 \
  --optim.warmup_steps 10 --metrics.log_every 50 --metrics.plot false --train.threads 8 --train.compile "${COMPILE:-true}" \
  --elastic.heartbeat_timeout_s 10 --elastic.barrier_timeout_s 120 --metrics.out_dir "$out/elastic1b"
if [ -z "${DRY_RUN:-}" ]; then
  grep -E "joined at|evicted|identical|differ|rror|summary" "$out/elastic1b.log" | tail -12
  python3 benchmarks/run_summary.py "$out/elastic1b" --rate-mbit 1000 > "$out/elastic1b_summary.txt"
  grep -E "utilization" "$out/elastic1b_summary.txt" | head -12
  detail "$(grep -E 'identical|differ' "$out/elastic1b.log" | tail -1 | cut -c1-80)"
fi
finish
