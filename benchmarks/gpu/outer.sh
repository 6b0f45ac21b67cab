#!/usr/bin/env bash
# outer: the outer step on one GPU (about 3 minutes on an H100).
#   1. tests/test_outer_gpu.py: the outer state on the GPU gives the bits of the CPU one (pseudo-gradient,
#      update, lookahead, pipelined copies); nodes whose outer state lives on different devices stay identical;
#   2. bench_outer.py: the outer step's own passes for MODEL (1B), outer state on the GPU against pinned CPU
#      memory (THREADS 16): prepare, the int8 error pass, update + copy back, the eager lookahead; medians of
#      REPEATS (3), and a CPU-vs-GPU bit check at full size;
#   3. outer_state_device "auto" with 1.5G fp32 parameters and AdamW on the GPU: where it puts the outer state of
#      eager overlap (5 buffers), then the peak memory of one AdamW step (outer_auto_rule.py).
# Steps 1-2 need no build (the int8 pass uses the Triton or torch codec when prime._C is absent).
#   benchmarks/gpu.sh outer OUT
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
run_step "tests/test_outer_gpu.py" ${TEST_TIMEOUT:-120} test_outer_gpu.log \
  python3 -m pytest -q -p no:cacheprovider tests/test_outer_gpu.py
detail "$(pytest_counts test_outer_gpu.log)"
run_step "bench_outer.py ${MODEL:-1B}" ${BENCH_TIMEOUT:-150} bench_outer.log \
  python3 benchmarks/bench_outer.py --model "${MODEL:-1B}" --repeats ${REPEATS:-3} --threads ${THREADS:-16} \
  --out "$out/outer_${MODEL:-1B}.json"
run_step "outer_state_device auto, 1.5G fp32 parameters + AdamW" 120 auto_rule.log \
  python3 benchmarks/gpu/outer_auto_rule.py
if [ -z "${DRY_RUN:-}" ]; then
  say "bench_outer.log"; tail -25 "$out/bench_outer.log"
  say "auto_rule.log"; cat "$out/auto_rule.log"
fi
finish
