# Sourced by every benchmarks/gpu/SUITE.sh (after `cd` to the repository root): what every GPU run
# needs, and the helpers the suites share. A suite is
#
#   source benchmarks/gpu/common.sh "$@"       # sets $out (the results folder), $status, the rows below
#   build_cuda                                 # prime._C with the CUDA kernels, in place
#   run_step "GPU ring tests" 150 tests.log python3 -m pytest ...
#   finish                                     # the summary table; exits 1 if a step failed
#
# DRY_RUN=1 prints each step's command instead of running it (the CPU check of a suite's logic).

# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: on the shared GPU hosts a program that uses it
# can put the host's GPUs out of service.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
set -uo pipefail

out=${1:?usage: benchmarks/gpu.sh SUITE OUT   (or benchmarks/gpu/SUITE.sh OUT)}
mkdir -p "$out" && out=$(cd "$out" && pwd)
suite=$(basename "$0" .sh)
status=0
_names=() _states=() _secs=() _details=()
_t_suite=$(date +%s)

# ngpu: GPUs this job may use, as torch numbers them (CUDA_VISIBLE_DEVICES respected); first_gpu: the first.
# A dry run runs nothing on them and counts ${DRY_RUN_GPUS:-0} (asking torch costs seconds on a small CPU).
if [ -n "${DRY_RUN:-}" ]; then
  ngpu=${DRY_RUN_GPUS:-0}
else
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
first_gpu=${CUDA_VISIBLE_DEVICES:-0}; first_gpu=${first_gpu%%,*}

say() { echo "== $*"; }

# commit_of_tree: the commit checked out, with "+changes" when the tree differs from it (a copied working tree
# whose .git is older than its files says so instead of naming a commit it does not hold).
commit_of_tree() {
  local c
  c=$(git rev-parse --short HEAD 2>/dev/null) || { echo unknown; return; }
  git diff --quiet HEAD -- 2>/dev/null && echo "$c" || echo "$c+changes"
}

# run_step NAME TIMEOUT LOG CMD...: runs CMD with a time limit, output into OUT/LOG (its tail on failure),
# one row of the summary table (name, ok / FAILED (exit N) / timed out, seconds).
run_step() {
  local name=$1 limit=$2 log=$3; shift 3
  say "$name"
  if [ -n "${DRY_RUN:-}" ]; then
    printf '  '; printf ' %q' timeout "$limit" "$@"; printf ' > %s\n' "$log"
    _row "$name" "dry run" 0
    return 0
  fi
  local t0=$(date +%s) rc
  timeout "$limit" "$@" >"$out/$log" 2>&1
  rc=$?
  local state=ok
  if [ $rc = 124 ] || [ $rc = 137 ]; then state="timed out (${limit} s)"; elif [ $rc != 0 ]; then state="FAILED (exit $rc)"; fi
  [ $rc = 0 ] || { status=1; tail -20 "$out/$log"; }
  _row "$name" "$state" $(( $(date +%s) - t0 ))
  return $rc
}

_row() { _names+=("$1"); _states+=("$2"); _secs+=("$3"); _details+=(""); }

# detail TEXT: what the last step found, in its row of the summary table.
detail() { [ ${#_details[@]} -gt 0 ] && _details[$(( ${#_details[@]} - 1 ))]="$*"; }

# pytest_counts LOG: pytest's closing line of OUT/LOG ("61 passed, 3 skipped in 40.1s").
pytest_counts() { grep -E "[0-9]+ (passed|failed|error)" "$out/$1" 2>/dev/null | tail -1 | tr -d '='; }

# machine_info: the GPUs, CPU, torch and the commit into OUT/machine.txt (and on screen).
machine_info() {
  [ -n "${DRY_RUN:-}" ] && return 0
  { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    lscpu 2>/dev/null | grep -E "^(Model name|CPU\(s\))"
    python3 -c "import torch; print('torch', torch.__version__)" 2>&1
    python3 -c "import triton; print('triton', triton.__version__)" 2>/dev/null
    echo "commit $(commit_of_tree); GPUs visible: $ngpu"; } | tee "$out/machine.txt"
}

# build_cuda: prime._C with the CUDA kernels, in place, for sm_${PRIME_CUDA_ARCHS:-90}. Every time: ninja
# recompiles only what changed, and a stale build from another checkout is never used.
build_cuda() {
  run_step "build prime._C (CUDA, sm_${PRIME_CUDA_ARCHS:-90})" ${BUILD_TIMEOUT:-400} build.log \
    env PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(( $(nproc) < 32 ? $(nproc) : 32 ))} \
    python3 setup.py build_ext --inplace || { finish; }
  [ -n "${DRY_RUN:-}" ] && return 0
  detail "$(cat build/prime-cuda.txt 2>/dev/null)"
  python3 -c "import prime._C as C, sys; sys.exit(0 if C._ring_reduces_on_gpu else 1)" \
    || { echo "the build has no CUDA ring codec (build/prime-cuda.txt says why)"; status=1; finish; }
}

# build_ring: prime._C without the CUDA kernels (the ring and the CPU codec: all DiLoCo needs between nodes),
# unless the ring already imports.
build_ring() {
  if [ -z "${DRY_RUN:-}" ] && python3 -c "import prime._C, prime.comm; prime.comm.Ring" 2>/dev/null; then
    return 0
  fi
  run_step "build prime._C (ring, no CUDA kernels)" ${BUILD_TIMEOUT:-300} build.log \
    env PRIME_SKIP_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace || finish
}

# diloco NAME RATE_MBIT [prime-train flags...]: DiLoCo on NODES (2) simulated nodes x PROCS (1) GPUs, MODEL (1B),
# H (100) inner steps, OUTER (3) outer steps, each ring paced at RATE_MBIT, COMPILE (false) -> OUT/NAME/,
# OUT/diloco_NAME.log; its row says the utilization after the first outer step and whether the weights agree.
diloco() {
  local name=$1 rate=$2; shift 2
  local h=${H:-100}
  run_step "DiLoCo $name: ${NODES:-2} x ${PROCS:-1} GPU, ${MODEL:-1B}, H=$h, $rate Mbit/s per ring $*" \
    ${RUN_TIMEOUT:-230} "diloco_$name.log" \
    python3 -m prime.simulate --nodes ${NODES:-2} --procs-per-node ${PROCS:-1} -- \
    --model.name ${MODEL:-1B} --data.seq_len ${SEQ:-2048} --train.micro_batch_size ${MB:-4} \
    --train.grad_accum ${ACCUM:-1} --train.steps $(( h * ${OUTER:-3} )) --diloco.inner_steps $h \
    --diloco.max_rate_mbit "$rate" --optim.warmup_steps 10 --metrics.log_every 50 --metrics.plot false \
    --train.threads 8 --train.compile ${COMPILE:-false} "$@" --metrics.out_dir "$out/$name"
  [ -n "${DRY_RUN:-}" ] && return 0
  grep -E "outer [0-9]+ |utilization|identical|differ|rror|median" "$out/diloco_$name.log" | tail -12
  python3 benchmarks/gpu/outer_split.py "$out/$name" | tee "$out/diloco_${name}_split.txt"
  detail "$(python3 benchmarks/gpu/outer_split.py --brief "$out/$name" "$out/diloco_$name.log")"
}

# finish: the summary table (every step: status, seconds, what it found); exits with the suite's status.
finish() {
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo
  echo "== summary of suite $suite: ${gpu:-no GPU} x $ngpu, commit $(commit_of_tree), $(( $(date +%s) - _t_suite )) s, results in $out"
  printf '%-72s %-16s %6s  %s\n' step status seconds detail
  local i
  for i in "${!_names[@]}"; do
    printf '%-72.72s %-16s %6s  %s\n' "${_names[$i]}" "${_states[$i]}" "${_secs[$i]}" "${_details[$i]}"
  done
  exit $status
}
