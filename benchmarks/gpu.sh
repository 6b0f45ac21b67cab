#!/usr/bin/env bash
# The GPU benchmarks, one entry point: runs the suite benchmarks/gpu/SUITE.sh with OUT as its results folder.
# Each suite fits one 10-minute run and ends with a summary table; its header comment says what it measures
# and which environment variables change it. benchmarks/gpu/common.sh holds what every suite shares (NCCL and
# NVSHMEM settings, the build, the step runner, the table).
#   benchmarks/gpu.sh SUITE OUT
#   benchmarks/gpu.sh --list                 # the suites and what each runs
#   DRY_RUN=1 benchmarks/gpu.sh SUITE OUT    # print the commands instead of running them (as on DRY_RUN_GPUS GPUs, default 0)
set -uo pipefail
cd "$(dirname "$0")/.."
list() {
  for f in benchmarks/gpu/*.sh; do
    [ "$(basename "$f")" = common.sh ] && continue
    printf '  %-14s %s\n' "$(basename "$f" .sh)" "$(sed -n '2s/^# [a-z0-9-]*: //p' "$f")"
  done
}
suite=${1:-}
if [ -z "$suite" ] || [ "$suite" = --list ] || [ "$suite" = -h ] || [ "$suite" = --help ]; then
  echo "usage: benchmarks/gpu.sh SUITE OUT; suites:"; list
  [ -n "$suite" ]; exit $?
fi
if [ ! -f "benchmarks/gpu/$suite.sh" ] || [ "$suite" = common ]; then
  echo "benchmarks/gpu.sh: no suite '$suite'; the suites are:"; list; exit 2
fi
[ $# -ge 2 ] || { echo "usage: benchmarks/gpu.sh $suite OUT"; exit 2; }
exec bash "benchmarks/gpu/$suite.sh" "$2"
