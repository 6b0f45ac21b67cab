#!/usr/bin/env bash
# diloco-1b: DiLoCo with the 1B model across simulated nodes on one multi-GPU host (2 nodes x PROCS GPUs, FSDP2
# inside a node, the int8 ring reduced on the GPU between nodes, each ring paced to a WAN rate). Each run prints
# its outer steps with the ring's own split, and its row says the compute utilization after the first outer step
# and whether the final weights are bit-identical. About 3-4 minutes a run: two runs fit one call.
#   VARIANTS="sync_10g overlap_1g_compile" benchmarks/gpu.sh diloco-1b OUT
# A variant is {sync|overlap}_{1g|10g}[_compile]: synchronous or overlapped (the all-reduce runs behind the next
# inner steps; outer state on the GPU), 1 or 10 Gbit/s per node, eager or train.compile. With PROCS=2 the node's
# link is shared by its two rings (ring g joins local rank g of every node): each is paced at half the rate.
# overlap_steps (when the average is applied) is what the wire needs at that rate: OVERLAP_STEPS, else 90 / 20
# compiled and 80 / 10 eager at 1 / 10 Gbit/s.
# env: VARIANTS ("sync_10g overlap_10g_compile"), PROCS (1; 2 needs 4 GPUs), RING_MBIT (each ring's rate instead of
#      the node's rate / PROCS), SCHEME (the default, eager-merge; e.g. eager), H (100), OUTER (3), MODEL (1B), MB (4),
#      ACCUM (1), SEQ (2048), COMPILE (false; _compile sets it), EXTRA (more prime-train flags),
#      RUN_TIMEOUT (230 a run; 270 for overlap at 1 Gbit/s, whose last average waits ~11 s of wire)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
for variant in ${VARIANTS:-sync_10g overlap_10g_compile}; do
  case $variant in
    sync_1g|sync_10g|overlap_1g|overlap_10g|sync_1g_compile|sync_10g_compile|overlap_1g_compile|overlap_10g_compile) ;;
    *) echo "unknown variant $variant: {sync|overlap}_{1g|10g}[_compile]"; status=1; continue;;
  esac
  node_mbit=1000; [[ $variant == *_10g* ]] && node_mbit=10000
  compile=${COMPILE:-false}; [[ $variant == *_compile ]] && compile=true
  flags=()
  if [[ $variant == overlap_* ]]; then
    if [ "$compile" = true ]; then steps=20; [ $node_mbit = 1000 ] && steps=90
    else steps=10; [ $node_mbit = 1000 ] && steps=80; fi
    flags=(--diloco.overlap true --diloco.overlap_steps ${OVERLAP_STEPS:-$steps} --diloco.outer_state_device gpu)
    [ -n "${SCHEME:-}" ] && flags+=(--diloco.overlap_scheme "$SCHEME")
  fi
  name=$variant; [ "${PROCS:-1}" != 1 ] && name=fsdp${PROCS}_$variant
  limit=230; [[ $variant == overlap_1g* ]] && limit=270
  COMPILE=$compile RUN_TIMEOUT=${RUN_TIMEOUT:-$limit} diloco "$name" ${RING_MBIT:-$(( node_mbit / ${PROCS:-1} ))} \
    "${flags[@]}" ${EXTRA:-}
done
finish
