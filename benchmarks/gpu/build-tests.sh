#!/usr/bin/env bash
# build-tests: build prime._C with the CUDA kernels, then the whole test suite with the GPU tests on
# (about 6-8 minutes on one H100; TESTS=gpu: only the GPU tests, the sparse CUDA kernels among them, about 2 minutes).
#   benchmarks/gpu.sh build-tests OUT
# env: TESTS (all | gpu | test files and ids), PYTEST_ARGS, TEST_TIMEOUT (420), PRIME_CUDA_ARCHS (90)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
build_cuda
[ -z "${DRY_RUN:-}" ] && python3 -c "from prime import ops; print('codec backends on cuda:', ops.available_backends('cuda'))"
case ${TESTS:-all} in
  all) targets=(tests);;
  gpu) targets=(tests/test_outer_gpu.py tests/test_ring_cuda.py tests/test_ring.py::test_cuda_tensor tests/test_sparse.py);;
  *) targets=($TESTS);;
esac
run_step "tests: ${targets[*]} (GPU tests on)" ${TEST_TIMEOUT:-420} tests.log \
  python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/tests.xml" "${targets[@]}" ${PYTEST_ARGS:-}
detail "$(pytest_counts tests.log)"
[ -z "${DRY_RUN:-}" ] && grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20
finish
