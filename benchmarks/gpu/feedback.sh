#!/usr/bin/env bash
# feedback: what error feedback buys the fp4 and int8 codecs in loss, 150M model, one GPU, one call of under 10
# minutes: synchronous DiLoCo exact, fp4 with error feedback, int8 without and with it (bench_fidelity.py), 320
# steps (H = 40: 8 outer steps; the fidelity suite's 400 would not fit), each seed's process running the four
# methods in turn. A process peaks at 44-48 GB of GPU memory: two fit one H200 side by side (381 s), three do not
# (measured: the third ran out of memory), so the three seeds take two calls of one H200 (RUNS="2 3", then RUNS=1,
# 180 s alone).
#   benchmarks/gpu.sh feedback OUT
# env: as the fidelity suite, with RUNS ("2 3"), METHODS ("diloco-exact,diloco-fp4,diloco-int8,diloco-int8-ef"),
#      STEPS (320), FIDELITY_TIMEOUT (450), BUILD (ring: the ring without the CUDA kernels, the shorter build; the
#      codec's round trip of error feedback then runs Triton's or torch's kernels, the same bits)
cd "$(dirname "$0")/../.."
: "${RUNS:=2 3}" "${METHODS:=diloco-exact,diloco-fp4,diloco-int8,diloco-int8-ef}" "${STEPS:=320}"
: "${FIDELITY_TIMEOUT:=450}" "${BUILD:=ring}"
export RUNS METHODS STEPS FIDELITY_TIMEOUT BUILD
source benchmarks/gpu/fidelity.sh "$@"
