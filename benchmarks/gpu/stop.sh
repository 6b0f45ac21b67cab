#!/usr/bin/env bash
# stop: a GPU job ended by a signal leaves nothing behind (docs/stopping.md). A 10B run ended by `timeout`
# (SIGTERM to prime-simulate) during the final syncs of its fragments once left both torchruns and all four
# workers alive, holding the GPUs. Here: 2 nodes (PROCS GPUs each: 2 on a 4-GPU host, else 1), MODEL (1B),
# 4 fragments with overlap, 1 Gbit/s per ring (a fragment's average takes seconds); benchmarks/gpu/stop_job.py
# signals prime-simulate and checks that no process of the job is left and nvidia-smi lists no compute process.
#   benchmarks/gpu.sh stop OUT
# Steps: SIGTERM once the last inner step is printed, while the final syncs of three fragments run (the case
# above; their lines are printed only once all of them ended); SIGINT during the inner steps; SIGKILL of
# prime-simulate during the inner steps (its nodes die with it).
# env: PROCS, MODEL (1B), RATE (1000 Mbit/s per ring), SIGNALS ("TERM INT KILL": which steps)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
procs=${PROCS:-$(( ngpu >= 4 ? 2 : 1 ))}
args=(--nodes 2 --procs-per-node "$procs" -- --model.name "${MODEL:-1B}" --data.seq_len 2048
      --train.micro_batch_size 4 --train.steps 20 --diloco.inner_steps 20 --diloco.fragments 4 --diloco.overlap true
      --diloco.max_rate_mbit "${RATE:-1000}" --optim.warmup_steps 5 --metrics.log_every 5 --metrics.plot false
      --train.threads 8 --train.stop_grace_s 30)
stop_step() {  # stop_step NAME SIGNAL AT
  run_step "$1 (${MODEL:-1B}, 2 nodes x $procs GPU(s))" 400 "$2.log" \
    python3 benchmarks/gpu/stop_job.py --log "$out/$2_job.log" --signal "$2" --at "$3" -- "${args[@]}" \
    --metrics.out_dir "$out/$2"
  [ -n "${DRY_RUN:-}" ] || detail "$(grep -c '^ok' "$out/$2.log") checks ok, $(grep -c '^FAILED' "$out/$2.log") failed"
}
for s in ${SIGNALS:-TERM INT KILL}; do
  case $s in
    TERM) stop_step "SIGTERM to prime-simulate during the final fragment syncs" TERM "20/20 |" ;;
    INT) stop_step "SIGINT to prime-simulate during the inner steps" INT "10/20 |" ;;
    KILL) stop_step "SIGKILL of prime-simulate during the inner steps" KILL "10/20 |" ;;
  esac
done
finish
