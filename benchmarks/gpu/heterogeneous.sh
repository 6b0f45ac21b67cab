#!/usr/bin/env bash
# heterogeneous: nodes of different speeds on GPUs, one 10-minute run: DiLoCo 1B, 2 nodes x 1 GPU, node 1 made
# SLOW (2) times slower (--slow-node), 4 fragments with overlap, compiled, 1 Gbit/s per ring; steps phases (H = 100)
# beside time phases (diloco.phase_seconds PHASE_S, 15: about H fast steps): compute utilization of each node
# after the first outer step, each node's inner steps and weight per outer step, weights identical.
#   benchmarks/gpu.sh heterogeneous OUT
# env: SLOW (2), PHASE_S (15), OUTER (4), COMPILE (true), MODES ("steps time": which runs), PROCS (1: processes
# per node, e.g. 2,1 for a node of 2 GPUs (FSDP2) beside a node of one on every ring; with fewer GPUs than
# processes the nodes share what the host has)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
het() {  # het NAME [prime-train flags...]
  local name=$1; shift
  run_step "1B, node 1 ${SLOW:-2}x slower, processes ${PROCS:-1}, $name phases" ${RUN_TIMEOUT:-240} "het_$name.log" \
    python3 -m prime.simulate --nodes 2 --procs-per-node "${PROCS:-1}" --slow-node "1:${SLOW:-2}" -- \
    --model.name 1B --data.seq_len 2048 --train.micro_batch_size 4 --train.steps $(( 100 * ${OUTER:-4} )) \
    --diloco.inner_steps 100 --diloco.fragments 4 --diloco.overlap true --diloco.max_rate_mbit 1000 \
    --optim.warmup_steps 10 --metrics.log_every 50 --metrics.plot false --train.threads 8 \
    --train.compile ${COMPILE:-true} --metrics.out_dir "$out/$name" "$@"
  [ -n "${DRY_RUN:-}" ] && return 0
  python3 benchmarks/run_summary.py "$out/$name" --rate-mbit 1000 > "$out/${name}_summary.txt"
  grep -E "utilization after" "$out/${name}_summary.txt"
  grep -E "identical|differ" "$out/het_$name.log" | tail -1
  detail "$(grep -oE 'utilization after the first outer step [0-9.]+%' "$out/${name}_summary.txt" | cut -d' ' -f7 | tr '\n' ' ')"
}
for mode in ${MODES:-steps time}; do
  if [ "$mode" = time ]; then het time --diloco.phase time --diloco.phase_seconds "${PHASE_S:-15}"; else het steps; fi
done
finish
