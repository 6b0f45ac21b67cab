#!/usr/bin/env bash
# The cost of authenticated ring frames (benchmarks/bench_ring_auth.py) on a GPU host's CPU, where every
# rank has cores of its own (the 2-core development machine runs 4 ranks on 2 cores: CPU-bound).
#   usage: BEFORE=DIR benchmarks/gpu_auth.sh OUT
# DIR: a source tree of the baseline (e.g. `mkdir .before && git archive a8a1120 | tar -x -C .before`,
# sent along with the run's `carry`). Both trees are built without the CUDA kernels (the ring's CPU path).
set -uo pipefail
out=${1:?usage: BEFORE=DIR benchmarks/gpu_auth.sh OUT}
before=${BEFORE:?BEFORE=DIR: the baseline source tree}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
{ lscpu | grep -E "Model name|^CPU\(s\)"; python3 -c "import ssl; print(ssl.OPENSSL_VERSION)"; } | tee "$out/machine.txt"
(cd "$before" && PRIME_SKIP_CUDA=1 MAX_JOBS=8 python3 setup.py build_ext --inplace >"$out/build_before.log" 2>&1) &
PRIME_SKIP_CUDA=1 MAX_JOBS=8 python3 setup.py build_ext --inplace >"$out/build_after.log" 2>&1 || { tail -20 "$out/build_after.log"; exit 1; }
wait $! || { tail -20 "$out/build_before.log"; exit 1; }
status=0
timeout ${LOOPBACK_TIMEOUT:-240} python3 benchmarks/bench_ring_auth.py --before "$before" --after . --rounds ${ROUNDS:-3} \
  --iters 5 --conditions loopback --out "$out/ring_auth_loopback" 2>&1 | tail -6 || status=1
# emulated links need network namespaces (root, iproute2); skipped where they cannot be made
timeout ${TC_TIMEOUT:-150} python3 benchmarks/bench_ring_auth.py --before "$before" --after . --rounds 2 --iters 5 \
  --conditions tc-1gbit --out "$out/ring_auth_tc" 2>&1 | tail -6 || echo "tc-1gbit: not run here"
exit $status
