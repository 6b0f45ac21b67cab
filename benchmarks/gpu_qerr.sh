#!/usr/bin/env bash
# Branch qerr on one H100/H200 (about 3 minutes): the ring's own int8 error on the GPU and the
# outer_state_device "auto" rule on a real card.
#   1. builds prime._C with CUDA (sm_90 unless PRIME_CUDA_ARCHS says otherwise);
#   2. tests: tests/test_ring_cuda.py (GPU ranks report the all-CPU ring's quant_err_sq / quant_in_sq,
#      and every earlier bit-for-bit test), tests/test_outer_gpu.py, the CPU ring tests of the error;
#   3. benchmarks/bench_ring_cuda_kernels.py (rows "reduce-quantize + error sums" against
#      "reduce-quantize (fused ...)", and "quantization error of the own values");
#   4. benchmarks/bench_ring_cuda.py gpu-int8, 2 ranks x 256 MiB fp32, threads on one GPU, with
#      PRIME_RING_QUANT_ERROR=1 then =0 (issue 12's target: int8 <= 30 ms);
#   5. the auto rule: 1.5G fp32 parameters and AdamW on the GPU, the outer state of eager overlap
#      (5 buffers) placed by "auto" (the line it prints), then one AdamW step and the peak memory.
#   usage: benchmarks/gpu_qerr.sh [RESULTS_DIR]      (default: $OUT)
set -uo pipefail
out=${1:-${OUT:?usage: benchmarks/gpu_qerr.sh RESULTS_DIR}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$out/machine.txt"

echo "== build (CUDA, sm_${PRIME_CUDA_ARCHS:-90})"
if ! PRIME_CUDA_ARCHS=${PRIME_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40; echo "BUILD FAILED (build.log)"; exit 1
fi
python3 -c "import prime._C as C, sys; sys.exit(0 if C._ring_reduces_on_gpu else 1)" || { echo "no CUDA ring codec"; exit 1; }

echo "== tests"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rs --tb=short tests/test_ring_cuda.py tests/test_outer_gpu.py \
  "tests/test_ring.py::test_ring_reports_its_own_quantization_error" "tests/test_ring.py::test_diloco_takes_compression_error_from_the_ring" \
  >"$out/tests.log" 2>&1 || status=1
tail -5 "$out/tests.log"

echo "== GPU wire codec kernels, one at a time (128 MiB)"
timeout 60 python3 benchmarks/bench_ring_cuda_kernels.py --mib 128 --iters 20 --out "$out" >"$out/kernels.log" 2>&1 || status=1
cat "$out/kernels.log"

for on in 1 0; do
  echo "== gpu-int8, 2 ranks x 256 MiB, PRIME_RING_QUANT_ERROR=$on"
  PRIME_RING_QUANT_ERROR=$on timeout 100 python3 benchmarks/bench_ring_cuda.py --world 2 --mib 256 --threads 4 \
    --ranks threads --iters 15 --methods gpu-int8 --method-budget 8 --timeout 95 >"$out/ring_qerr$on.log" 2>&1 || status=1
  tail -12 "$out/ring_qerr$on.log"
done

echo "== outer_state_device auto with 1.5G fp32 parameters + AdamW"
timeout 120 python3 - <<'PY' 2>&1 | tee "$out/auto_rule.log" || status=1
import torch
from prime.outer import OuterState
dev = torch.device("cuda", 0)
params = [torch.nn.Parameter(torch.randn(1 << 27, device=dev) * 0.01) for _ in range(11)]  # 1.48G values, 5.9 GB
opt = torch.optim.AdamW(params, lr=1e-4)
st = OuterState(params, device="auto", extra_buffers=2, inner_optimizer=opt)  # eager overlap: 5 buffers
print(st.device_reason)
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opt.step()
torch.cuda.synchronize()
print(f"after one AdamW step: allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
      f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB of {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
PY
exit $status
