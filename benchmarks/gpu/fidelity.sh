#!/usr/bin/env bash
# fidelity: what the outer step's variants cost in loss (bench_fidelity.py) on the 150M model and the embedded
# corpus, 2 nodes as threads on one GPU per run; runs on different GPUs at once. About 5 minutes for 400 steps,
# 9 for 800.
#   RUNS="0 1" benchmarks/gpu.sh fidelity OUT
# RUNS: one run per entry SEED[:METHODS] (METHODS: bench_fidelity's --methods, default METHODS), on GPU i mod
# count for the i-th entry.
# env: RUNS ("0"), METHODS ("dp,diloco-exact,diloco-int8,overlap-int8-eager-merge@9/10"), STEPS (400), H (40),
#      FIDELITY_TIMEOUT (540), EXTRA (more flags for bench_fidelity.py), BUILD (cuda; ring: prime._C without the
#      CUDA kernels, a shorter build: the ring then stages the GPU tensors through the host), CORPUS (embedded,
#      read about 3 times over in 800 steps; stdlib: every .py file of the host's standard library
#      (benchmarks/stdlib_corpus.py); or a directory of text files, or a .tar.xz of one, such as
#      benchmarks/stdlib_corpus.py's output on a machine whose standard library is larger; or prime-tokenize's
#      output directory, or a .tar.xz of one: its tokens, the model's vocabulary from its meta.json), BENCH
#      (bench_fidelity; bench_lowrank: the study harness, methods none, int8, topk[-...], lowrank[-...], the same
#      flags otherwise)
cd "$(dirname "$0")/../.."
source benchmarks/gpu/common.sh "$@"
machine_info
if [ "${BUILD:-cuda}" = ring ]; then build_ring; else build_cuda; fi
corpus=  # a directory of text files (data.source text), or none: the embedded corpus
if [ "${CORPUS:-embedded}" = stdlib ]; then
  corpus=${TMPDIR:-/tmp}/prime_stdlib_corpus
  rm -rf "$corpus"; python3 benchmarks/stdlib_corpus.py "$corpus" | tee -a "$out/machine.txt"
elif [ -d "${CORPUS:-embedded}" ]; then
  corpus=$CORPUS
elif [[ ${CORPUS:-embedded} == *.tar.xz && -f $CORPUS ]]; then
  corpus=${TMPDIR:-/tmp}/prime_corpus_$(basename "$CORPUS" .tar.xz)
  rm -rf "$corpus"; mkdir -p "$corpus"; tar xJf "$CORPUS" -C "$corpus" || exit 2
  echo "corpus: $CORPUS, $(find "$corpus" -type f | wc -l) files, $(du -sm "$corpus" | cut -f1) MB" | tee -a "$out/machine.txt"
elif [ "${CORPUS:-embedded}" != embedded ]; then
  echo "fidelity: CORPUS must be embedded, stdlib, a directory or a .tar.xz, got ${CORPUS}"; exit 2
fi
bench=${BENCH:-bench_fidelity}
[[ $bench == bench_fidelity || $bench == bench_lowrank ]] || { echo "fidelity: BENCH must be bench_fidelity or bench_lowrank, got $bench"; exit 2; }
data=(--data.source embedded)
[ -n "$corpus" ] && data=(--data.source text --data.path "$corpus")
[ -f "$corpus/meta.json" ] && data=(--data.source bin --data.path "$corpus")  # prime-tokenize's shards
gpus=(${CUDA_VISIBLE_DEVICES:-})
gpus=(${gpus[@]//,/ })
[ ${#gpus[@]} -gt 0 ] || gpus=($(seq 0 $(( ngpu > 0 ? ngpu - 1 : 0 ))))
pids=() names=() logs=() tags=()
i=0
for entry in ${RUNS:-0}; do
  seed=${entry%%:*}
  methods=${METHODS:-dp,diloco-exact,diloco-int8,overlap-int8-eager-merge@9/10}
  [[ $entry == *:* ]] && methods=${entry#*:}
  gpu=${gpus[$(( i % ${#gpus[@]} ))]}
  name="$bench 150M, ${STEPS:-400} steps, seed $seed, GPU $gpu: $methods"
  tag=fidelity_seed${seed}_gpu$gpu
  [[ " ${tags[*]:-} " == *" $tag "* ]] && tag=${tag}_$i  # the same seed twice on one GPU: files of their own
  tags+=("$tag")
  log=$tag.log
  cmd=(env CUDA_VISIBLE_DEVICES=$gpu python3 benchmarks/$bench.py --config configs/150M.toml
       "${data[@]}" --train.steps ${STEPS:-400} --optim.warmup_steps 40 --optim.decay_steps 100
       --diloco.inner_steps ${H:-40} --train.micro_batch_size 16 --data.seq_len 512 --eval-batches 16
       --train.seed $seed --methods "$methods" --out "$out/$tag" ${EXTRA:-})
  # in the background, one per GPU: each row is filled in when its run ends
  ( run_step "$name" ${FIDELITY_TIMEOUT:-540} "$log" "${cmd[@]}" >/dev/null
    echo "$?" >"$out/.rc_$i" ) &
  pids+=($!) names+=("$name") logs+=("$log")
  [ -n "${DRY_RUN:-}" ] && { wait $!; say "$name"; printf '  '; printf ' %q' "${cmd[@]}"; echo; }
  i=$(( i + 1 ))
done
t0=$(date +%s)
for j in "${!pids[@]}"; do
  wait ${pids[$j]}
  rc=$(cat "$out/.rc_$j" 2>/dev/null || echo 1); rm -f "$out/.rc_$j"
  state=ok; [ "$rc" = 0 ] || { state="FAILED (exit $rc)"; status=1; }
  [ -n "${DRY_RUN:-}" ] && state="dry run"
  _row "${names[$j]}" "$state" $(( $(date +%s) - t0 ))
  [ -z "${DRY_RUN:-}" ] && { say "${names[$j]}"; grep -v Warning "$out/${logs[$j]}" | tail -9; }
  detail "$(grep -v Warning "$out/${logs[$j]}" 2>/dev/null | grep -iE "final|eval" | tail -1)"
done
finish
