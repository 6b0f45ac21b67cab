#!/usr/bin/env bash
# Compile-checks the CUDA codec where no GPU (and possibly only a CPU torch) is
# installed, as on the CI machine:
#   1. csrc/codec/codec_cuda.cu and ring_cuda.cu (the kernels of both formats; CUDA
#      headers only) to object files, failing on any register spill;
#   2. their PTX: no fused multiply-add, no approximate division, no flush-to-zero
#      (the wire format needs the exact IEEE operations);
#   3. csrc/ring/wire_codec_cuda.cu and wire_codec_sparse_cuda.cu (the ring's GPU wire
#      codecs; plain C++ headers);
#   4. csrc/codec/ops_cuda.cu and sparse_cuda.cu (the torch wrappers) against the installed torch's
#      headers. CPU wheels ship the c10/cuda headers but not the generated
#      c10/cuda/impl/cuda_cmake_macros.h; a stand-in is written for this check.
#
# Usage: tools/check_cuda_compile.sh [sm_XX ...]   (default: sm_80 sm_90)
# On a GPU machine, build and test for real instead:
#   PRIME_CUDA_ARCHS=90 MAX_JOBS=16 python setup.py build_ext --inplace && python -m pytest -q tests/test_ops.py
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "check_cuda_compile: nvcc not found (set NVCC)" >&2; exit 2; }
ARCHS=("$@")
[ ${#ARCHS[@]} -gt 0 ] || ARCHS=(sm_80 sm_90)
# the nvcc flags of setup.py that matter for the bits
FLAGS=(-O3 --fmad=false -std=c++17 --expt-relaxed-constexpr)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for arch in "${ARCHS[@]}"; do
  for src in codec_cuda ring_cuda; do
    echo "== $src.cu, $arch"
    "$NVCC" "${FLAGS[@]}" -arch="$arch" -Xptxas -v -c "csrc/codec/$src.cu" -o "$work/$src.o" 2>"$work/ptxas.txt" \
      || { cat "$work/ptxas.txt" >&2; exit 1; }
    if grep -E "[1-9][0-9]* bytes spill" "$work/ptxas.txt" >&2; then
      echo "check_cuda_compile: register spills in $src.cu ($arch)" >&2
      exit 1
    fi
    grep -oE "Used [0-9]+ registers" "$work/ptxas.txt" | sort | uniq -c | sort -rn | head -4 | sed 's/^/   /'

    "$NVCC" "${FLAGS[@]}" -arch="$arch" -ptx "csrc/codec/$src.cu" -o "$work/$src.ptx"
    if grep -nE "fma\.[a-z.]*f32|div\.(approx|full)|\.ftz|rcp\.approx" "$work/$src.ptx" | head -5 >&2; then
      echo "check_cuda_compile: inexact float instructions in the PTX of $src.cu ($arch)" >&2
      exit 1
    fi
    echo "   PTX: no fma / approximate division / flush-to-zero"
  done
done

for src in wire_codec_cuda wire_codec_sparse_cuda; do
  echo "== $src.cu"
  "$NVCC" "${FLAGS[@]}" -arch="${ARCHS[-1]}" -DPRIME_WITH_CUDA=1 -c "csrc/ring/$src.cu" -o "$work/$src.o"
done

echo "== ops_cuda.cu against torch's headers"
PY=${PYTHON:-python3}
mapfile -t INCS < <("$PY" -c "from torch.utils.cpp_extension import include_paths; print('\n'.join(include_paths()))")
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
mkdir -p "$work/stub/c10/cuda/impl"
found=""
for inc in "${INCS[@]}"; do [ -f "$inc/c10/cuda/impl/cuda_cmake_macros.h" ] && found=1; done
if [ -z "$found" ]; then
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$work/stub/c10/cuda/impl/cuda_cmake_macros.h"
fi
"$NVCC" "${FLAGS[@]}" -arch="${ARCHS[-1]}" "${INCS[@]/#/-I}" -I"$work/stub" -I"$PYINC" -DPRIME_WITH_CUDA=1 \
  -diag-suppress 3306 -Xcompiler -Wno-c++20-extensions -c csrc/codec/ops_cuda.cu -o "$work/ops_cuda.o"
echo "== sparse_cuda.cu against torch's headers"
"$NVCC" "${FLAGS[@]}" -arch="${ARCHS[-1]}" "${INCS[@]/#/-I}" -I"$work/stub" -I"$PYINC" -DPRIME_WITH_CUDA=1 \
  -diag-suppress 3306 -Xcompiler -Wno-c++20-extensions -c csrc/codec/sparse_cuda.cu -o "$work/sparse_cuda.o"
echo "OK: the CUDA codec compiles for ${ARCHS[*]}"
