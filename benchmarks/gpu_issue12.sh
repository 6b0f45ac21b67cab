#!/usr/bin/env bash
# Issue 12's measurements on a 2-GPU host, split into two calls of under 10 minutes each:
#   PHASE=a benchmarks/gpu_issue12.sh OUT   CUDA build; GPU tests of the outer step and the CUDA ring;
#                                            the outer step's passes for 1B (gpu_outer.sh); the ring with
#                                            CUDA tensors, one process per GPU (gpu_ring.sh QUICK=1); DiLoCo
#                                            2 nodes x 1 GPU, 1B, H=100, synchronous, 10 Gbit/s
#   PHASE=b benchmarks/gpu_issue12.sh OUT   DiLoCo 2 nodes x 1 GPU, 1B, H=100, overlapped (eager), at
#                                            10 Gbit/s (overlap_steps 10) and 1 Gbit/s (overlap_steps 80)
#   PHASE=c (4 GPUs) benchmarks/gpu_issue12.sh OUT   2 nodes x 2 GPUs with FSDP2, overlapped, 10 Gbit/s
#   PHASE=d benchmarks/gpu_issue12.sh OUT   CUDA build; the CUDA ring alone on the 1B model's size (2 ranks x
#                                            5716 MiB fp32), paced at 10 Gbit/s and unpaced; DiLoCo 2 x 1 GPU,
#                                            synchronous, 10 Gbit/s, eager and train.compile true
#   PHASE=e benchmarks/gpu_issue12.sh OUT   DiLoCo 2 x 1 GPU overlapped (eager), train.compile true, at
#                                            1 Gbit/s (overlap_steps 90) and 10 Gbit/s (overlap_steps 20)
#   PHASE=f (4 GPUs) benchmarks/gpu_issue12.sh OUT   CUDA build; 2 nodes x 2 GPUs (FSDP2), synchronous, 10 Gbit/s
#                                            per node, eager and train.compile true
#   PHASE=g (4 GPUs) benchmarks/gpu_issue12.sh OUT   2 nodes x 2 GPUs (FSDP2), overlapped (eager-merge): 1 Gbit/s
#                                            eager and compiled, 10 Gbit/s compiled
#   PHASE=h (4 GPUs) benchmarks/gpu_issue12.sh OUT   bench_fidelity.py 150M, eager-merge against synchronous exact,
#                                            two seeds (GPUs 2 and 3), beside DiLoCo 2 x 1 GPU (GPUs 0 and 1),
#                                            overlapped (eager-merge), compiled, 1 Gbit/s
#   PHASE=i benchmarks/gpu_issue12.sh OUT   CUDA build; DiLoCo 2 x 1 GPU, synchronous, 10 Gbit/s, train.compile true
#                                            and eager (phase d's runs after the tied-embedding fix)
#   PHASE=j (4 GPUs) benchmarks/gpu_issue12.sh OUT   CUDA build; GPU tests (the mixed-device test with eager-merge);
#                                            bench_fidelity.py 150M at 800 steps (20 outer steps): synchronous
#                                            exact and eager-merge at 9/10 of H (with the stand-in share, the
#                                            default since 6db5b4b), seeds 1-3 (one GPU each), and data parallel,
#                                            seed 0 (GPU 0)
# With 2 GPUs per node each local rank keeps its own ring (ring g joins local rank g of every node), so the
# node's link is shared by its rings: phases f and g pace each ring at half the node's rate (NODE_MBIT / 2).
# Phases b, c and e name the eager scheme (the default until eager-merge replaced it), so they repeat the
# recorded runs. COMPILE=true|false sets train.compile of phases a-c (default false; d and e use true).
# Every part writes its full log under OUT; the tail of the output is a summary.
set -uo pipefail
out=${1:?usage: PHASE=a|b benchmarks/gpu_issue12.sh OUT}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
summary=()
note() { summary+=("$*"); echo "== $*"; }

echo "== build (CUDA, sm_90)"
if ! python3 -c "import prime._C as C, sys; sys.exit(0 if getattr(C, '_ring_reduces_on_gpu', False) else 1)" 2>/dev/null; then
  PRIME_CUDA_ARCHS=90 MAX_JOBS=$(( $(nproc) < 32 ? $(nproc) : 32 )) python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log"; echo "BUILD FAILED"; exit 1; }
fi
python3 -c "import prime._C as C; print('CUDA ring codec:', C._ring_reduces_on_gpu)"

diloco() {  # diloco NAME RATE EXTRA...
  local name=$1 rate=$2; shift 2
  echo "== DiLoCo $name: 2 nodes x ${PROCS:-1} GPU, 1B, H=100, ${OUTER:-3} outer steps, $rate Mbit/s per ring, $*"
  timeout ${RUN_TIMEOUT:-230} python3 -m prime.simulate --nodes 2 --procs-per-node ${PROCS:-1} -- \
    --model.name 1B --data.seq_len 2048 --train.micro_batch_size 4 --train.steps $((100 * ${OUTER:-3})) \
    --diloco.inner_steps 100 --diloco.max_rate_mbit "$rate" --optim.warmup_steps 10 --metrics.log_every 50 \
    --metrics.plot false --train.threads 8 --train.compile ${COMPILE:-false} "$@" --metrics.out_dir "$out/$name" \
    >"$out/diloco_$name.log" 2>&1
  local rc=$?
  grep -E "outer step|utilization|identical|differ|rror|median" "$out/diloco_$name.log" | tail -12
  ring_split "$out/$name"
  note "diloco $name: exit $rc"
}

ring_split() {  # ring_split DIR: each outer step's all-reduce and the ring's own split of it (metrics records)
  python3 - "$1" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/metrics_node*.jsonl")):
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") != "outer":
            continue
        keys = ("allreduce_s", "outer_s", "total_s", "wire_s", "reduce_s", "gpu_wait_s", "gpu_codec_s", "h2d_s",
                "d2h_s", "staging_s", "auth_s", "commit_s", "stage_s", "utilization")
        print(f"  node {r.get('node')} outer {r.get('outer_step')}: "
              + " ".join(f"{k}={r[k]:.3f}" for k in keys if isinstance(r.get(k), (int, float))))
PY
}

case "${PHASE:-a}" in
a)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_outer_gpu.py tests/test_ring_cuda.py \
    "tests/test_ring.py::test_cuda_tensor" >"$out/tests.log" 2>&1
  note "GPU tests: exit $? ($(tail -1 "$out/tests.log"))"
  grep -E "FAILED|Error" "$out/tests.log" | head -10
  BENCH_TIMEOUT=100 bash benchmarks/gpu_outer.sh "$out/outer" >"$out/gpu_outer.log" 2>&1
  note "gpu_outer.sh: exit $?"
  tail -25 "$out/gpu_outer.log"
  QUICK=1 SKIP_TESTS=1 bash benchmarks/gpu_ring.sh "$out/ring" >"$out/gpu_ring.log" 2>&1
  note "gpu_ring.sh QUICK: exit $?"
  tail -22 "$out/gpu_ring.log"
  diloco sync_10g 10000
  ;;
b)
  # the state on the GPU (before the "auto" rule counted free memory it put the 1B overlap state, 30 GB, in CPU memory)
  diloco overlap_10g 10000 --diloco.overlap true --diloco.overlap_scheme eager --diloco.overlap_steps 10 \
    --diloco.outer_state_device gpu
  diloco overlap_1g 1000 --diloco.overlap true --diloco.overlap_scheme eager --diloco.overlap_steps 80 \
    --diloco.outer_state_device gpu
  ;;
c)  # 2 nodes x 2 GPUs (FSDP2 inside a node): needs a 4-GPU host
  PROCS=2 diloco fsdp_overlap_10g 10000 --diloco.overlap true --diloco.overlap_scheme eager --diloco.overlap_steps 10 \
    --diloco.outer_state_device gpu
  ;;
d)
  timeout 150 python3 benchmarks/bench_ring_cuda.py --world 2 --mib 5716 --warmup 1 --iters 4 --method-budget 30 \
    --methods gpu-int8 --max-rate-mbit 10000 --out "$out/ring_paced" >"$out/ring_paced.log" 2>&1
  note "ring 2 x 5716 MiB paced 10 Gbit/s: exit $?"
  tail -6 "$out/ring_paced.log"
  timeout 100 python3 benchmarks/bench_ring_cuda.py --world 2 --mib 5716 --warmup 1 --iters 4 --method-budget 30 \
    --methods gpu-int8 --out "$out/ring_unpaced" >"$out/ring_unpaced.log" 2>&1
  note "ring 2 x 5716 MiB unpaced: exit $?"
  tail -6 "$out/ring_unpaced.log"
  RUN_TIMEOUT=200 diloco sync_10g 10000
  COMPILE=true RUN_TIMEOUT=200 diloco sync_10g_compile 10000
  ;;
e)
  # compiled inner steps are ~0.16 s: the 1 Gbit/s all-reduce (~12.5 s) needs ~80 of them, the 10 Gbit/s one ~12
  COMPILE=true RUN_TIMEOUT=270 diloco overlap_1g_compile 1000 --diloco.overlap true --diloco.overlap_scheme eager \
    --diloco.overlap_steps 90 --diloco.outer_state_device gpu
  COMPILE=true RUN_TIMEOUT=230 diloco overlap_10g_compile 10000 --diloco.overlap true --diloco.overlap_scheme eager \
    --diloco.overlap_steps 20 --diloco.outer_state_device gpu
  ;;
f)  # 2 nodes x 2 GPUs (FSDP2 inside a node): needs a 4-GPU host; each ring gets half of the node's 10 Gbit/s
  PROCS=2 RUN_TIMEOUT=200 diloco fsdp_sync_10g 5000
  PROCS=2 COMPILE=true RUN_TIMEOUT=220 diloco fsdp_sync_10g_compile 5000
  ;;
g)
  PROCS=2 RUN_TIMEOUT=170 diloco fsdp_overlap_1g 500 --diloco.overlap true --diloco.overlap_steps 80 \
    --diloco.overlap_scheme eager-merge --diloco.outer_state_device gpu
  PROCS=2 COMPILE=true RUN_TIMEOUT=190 diloco fsdp_overlap_1g_compile 500 --diloco.overlap true \
    --diloco.overlap_steps 90 --diloco.overlap_scheme eager-merge --diloco.outer_state_device gpu
  PROCS=2 COMPILE=true RUN_TIMEOUT=180 diloco fsdp_overlap_10g_compile 5000 --diloco.overlap true \
    --diloco.overlap_steps 20 --diloco.overlap_scheme eager-merge --diloco.outer_state_device gpu
  ;;
h)
  # the fidelity runs time nothing, so they share the host with the timed run (one GPU each)
  pids=()
  for seed in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2 + seed)) timeout ${FIDELITY_TIMEOUT:-400} python3 benchmarks/bench_fidelity.py \
      --config configs/150M.toml --data.source embedded --train.steps 400 --optim.warmup_steps 40 \
      --optim.decay_steps 100 --diloco.inner_steps 40 --train.micro_batch_size 16 --data.seq_len 512 \
      --eval-batches 16 --train.seed $seed \
      --methods "${FID_METHODS:-diloco-exact,diloco-int8,overlap-int8-eager@9/10,overlap-int8-eager-merge@1/5,overlap-int8-eager-merge@9/10}" \
      --out "$out/fidelity_150M_seed$seed" >"$out/fidelity_150M_seed$seed.log" 2>&1 &
    pids+=($!)
  done
  CUDA_VISIBLE_DEVICES=0,1 COMPILE=true RUN_TIMEOUT=200 diloco overlap_1g_compile_merge 1000 --diloco.overlap true \
    --diloco.overlap_steps 90 --diloco.overlap_scheme eager-merge --diloco.outer_state_device gpu
  for i in 0 1; do
    wait ${pids[$i]}
    note "fidelity 150M seed $i: exit $?"
    grep -v Warning "$out/fidelity_150M_seed$i.log" | tail -9
  done
  ;;
j)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_outer_gpu.py tests/test_ring_cuda.py \
    "tests/test_ring.py::test_cuda_tensor" >"$out/tests.log" 2>&1
  note "GPU tests: exit $? ($(tail -1 "$out/tests.log"))"
  grep -E "FAILED|Error" "$out/tests.log" | head -10
  pids=()
  for gpu in 0 1 2 3; do  # GPU 0: data parallel, seed 0 (the 800-step exact and eager-merge of seed 0 are recorded)
    if [ $gpu = 0 ]; then seed=0 methods=dp; else seed=$gpu methods=diloco-exact,overlap-int8-eager-merge@9/10; fi
    CUDA_VISIBLE_DEVICES=$gpu timeout ${FIDELITY_TIMEOUT:-540} python3 benchmarks/bench_fidelity.py \
      --config configs/150M.toml --data.source embedded --train.steps 800 --optim.warmup_steps 40 \
      --optim.decay_steps 100 --diloco.inner_steps 40 --train.micro_batch_size 16 --data.seq_len 512 \
      --eval-batches 16 --train.seed $seed --methods "$methods" --out "$out/fid800_gpu$gpu" \
      >"$out/fid800_gpu$gpu.log" 2>&1 &
    pids+=($!)
  done
  for gpu in 0 1 2 3; do
    wait ${pids[$gpu]}
    note "fidelity 150M 800 steps, GPU $gpu: exit $?"
    grep -v Warning "$out/fid800_gpu$gpu.log" | tail -5
  done
  ;;
i)
  COMPILE=true RUN_TIMEOUT=200 diloco sync_10g_compile 10000
  RUN_TIMEOUT=180 diloco sync_10g 10000
  ;;
esac
echo "== summary"
printf '%s\n' "${summary[@]}"
