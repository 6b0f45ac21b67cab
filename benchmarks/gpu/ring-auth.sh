#!/usr/bin/env bash
# ring-auth: the cost of authenticated ring frames (bench_ring_auth.py) on a GPU host's CPU, where every rank has
# cores of its own, against a baseline source tree. Both trees are built without the CUDA kernels (the ring's
# CPU path). About 5 minutes.
#   BEFORE=DIR benchmarks/gpu.sh ring-auth OUT
# DIR: the baseline's source (e.g. `mkdir .before && git archive a8a1120 | tar -x -C .before`, carried along).
# env: ROUNDS (3), LOOPBACK_TIMEOUT (240), TC_TIMEOUT (150)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
before=${BEFORE:?BEFORE=DIR: the baseline source tree}
machine_info
[ -z "${DRY_RUN:-}" ] && python3 -c "import ssl; print(ssl.OPENSSL_VERSION)" | tee -a "$out/machine.txt"
run_step "build the baseline in $before (no CUDA kernels)" 300 build_before.log \
  bash -c "cd '$before' && PRIME_SKIP_CUDA=1 MAX_JOBS=8 python3 setup.py build_ext --inplace" || finish
run_step "build this tree (no CUDA kernels)" 300 build_after.log \
  env PRIME_SKIP_CUDA=1 MAX_JOBS=8 python3 setup.py build_ext --inplace || finish
run_step "bench_ring_auth.py, loopback" ${LOOPBACK_TIMEOUT:-240} ring_auth_loopback.log \
  python3 benchmarks/bench_ring_auth.py --before "$before" --after . --rounds ${ROUNDS:-3} --iters 5 \
  --conditions loopback --out "$out/ring_auth_loopback"
# emulated links need network namespaces (root, iproute2): a failure here means "not run on this host"
run_step "bench_ring_auth.py, tc-1gbit (needs ip and tc)" ${TC_TIMEOUT:-150} ring_auth_tc.log \
  python3 benchmarks/bench_ring_auth.py --before "$before" --after . --rounds 2 --iters 5 --conditions tc-1gbit \
  --out "$out/ring_auth_tc" || status=0
[ -z "${DRY_RUN:-}" ] && for log in ring_auth_loopback.log ring_auth_tc.log; do tail -6 "$out/$log"; done
finish
