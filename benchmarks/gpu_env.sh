# Sourced by benchmarks/gpu_*.sh from the repository root: what every GPU run here needs.
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: on the shared GPU hosts a program
# that uses it can put the host's GPUs out of service.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD

# build_if_missing LOG [VAR=value ...]: builds prime._C in place (with the given build variables,
# e.g. PRIME_SKIP_CUDA=1) unless the ring already imports; on failure prints the log's tail and exits.
build_if_missing() {
  local log=$1; shift
  python3 -c "import prime._C, prime.comm; prime.comm.Ring" 2>/dev/null && return 0
  echo "== build ($*)"
  env "$@" MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$log" 2>&1 || { tail -30 "$log"; exit 1; }
}

# machine_and_cuda_build OUT: records the GPU and the software in OUT/machine.txt, builds prime._C with
# the CUDA kernels (sm_90 unless PRIME_CUDA_ARCHS says otherwise; log OUT/build.log) and checks that the
# ring reduces CUDA tensors on the GPU; exits on failure.
machine_and_cuda_build() {
  local out=$1
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$out/machine.txt"
  echo "== build (CUDA, sm_${PRIME_CUDA_ARCHS:-90})"
  if ! PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; then
    grep -E "error|Error" "$out/build.log" | head -40; echo "BUILD FAILED (build.log)"; exit 1
  fi
  python3 -c "import prime._C as C, sys; sys.exit(0 if C._ring_reduces_on_gpu else 1)" || { echo "no CUDA ring codec"; exit 1; }
}
