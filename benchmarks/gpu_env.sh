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
