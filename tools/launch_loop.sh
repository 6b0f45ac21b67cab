#!/usr/bin/env bash
# Runs N consecutive 2-process FSDP launches of prime-train on one node, as
# tests/test_train.py starts them (torchrun, static master address), and reports
# how many exited 0 and how many printed "terminate called" (the rare abort at
# exit that prime/train.py's _end_process avoids).
#
#   tools/launch_loop.sh [N] [-- extra prime-train args]
#   nice tools/launch_loop.sh 30                      # what benchmarks/RESULTS.md records
#   tools/launch_loop.sh 20 -- --checkpoint.every 0   # other settings go after --
#
# Each launch trains the tiny model for a few steps with async checkpoints. The
# logs of every launch stay under $LAUNCH_LOOP_LOGS (default: a fresh /tmp dir);
# the checkpoints of launches that exited 0 are deleted.
set -u
N=${1:-30}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
LOGS=${LAUNCH_LOOP_LOGS:-$(mktemp -d /tmp/launch_loop.XXXXXX)}
mkdir -p "$LOGS"
ok=0
aborted=0
echo "launch_loop: $N launches of 2 FSDP processes, prime from $ROOT, logs in $LOGS"
echo "launch_loop: start $(date -u +%H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq 1 "$N"); do
    dir="$LOGS/run$i"
    mkdir -p "$dir"
    port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    t0=$(date +%s.%N)
    OMP_NUM_THREADS=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
        -m prime.train --model.name tiny --train.device cpu --train.threads 1 --data.seq_len 64 \
        --train.micro_batch_size 4 --train.steps 6 --optim.warmup_steps 2 --metrics.plot false \
        --metrics.out_dir "$dir/metrics" --checkpoint.dir "$dir/ck" --checkpoint.every 2 "$@" \
        >"$dir/log" 2>&1
    rc=$?
    secs=$(echo "$(date +%s.%N) - $t0" | bc)
    note=""
    if grep -q "terminate called" "$dir/log"; then
        aborted=$((aborted + 1))
        note=" (terminate called)"
    fi
    if [ $rc -eq 0 ]; then
        ok=$((ok + 1))
        rm -rf "$dir/ck"
    fi
    printf 'launch %d/%d: exit %d, %.1f s%s\n' "$i" "$N" "$rc" "$secs" "$note"
done
echo "launch_loop: end $(date -u +%H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "launch_loop: $ok of $N launches exited 0; $aborted printed 'terminate called'"
[ $ok -eq "$N" ]
