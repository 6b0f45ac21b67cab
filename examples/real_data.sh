#!/usr/bin/env bash
# From a directory of text to a two-node DiLoCo run you can watch in TensorBoard
# (examples/real_data.md walks through it).
#
#   examples/real_data.sh [CORPUS_DIR [WORK_DIR]]
#
# CORPUS_DIR: your text files and JSONL (a "text" field); without it, a sample is
# made from the Python standard library's source (text files plus one JSONL file).
# WORK_DIR (default runs/real_data) receives tok/ (the shards) and run/ (metrics,
# TensorBoard events, the offline W&B runs, loss.png).
# Settings (environment): MODEL (150M; CI runs tiny), STEPS (200), VOCAB (8192),
# SEQ_LEN (256), INNER_STEPS (20), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=${1:-}
WORK=${2:-runs/real_data}
MODEL=${MODEL:-150M} STEPS=${STEPS:-200} VOCAB=${VOCAB:-8192} SEQ_LEN=${SEQ_LEN:-256} INNER_STEPS=${INNER_STEPS:-20}
PYTHON=${PYTHON:-python3}

if [ -z "$CORPUS" ]; then
  CORPUS=$WORK/corpus
  echo "== a sample corpus in $CORPUS (the standard library's top-level .py files as text, and a JSONL of docstrings)"
  rm -rf "$CORPUS" && mkdir -p "$CORPUS"
  "$PYTHON" - "$CORPUS" <<'PY'
import ast, glob, json, os, shutil, sys
out = sys.argv[1]
files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
for path in files:
    shutil.copyfile(path, os.path.join(out, os.path.basename(path)[:-3] + ".txt"))
with open(os.path.join(out, "docstrings.jsonl"), "w") as f:
    for path in files:
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node):
                f.write(json.dumps({"source": os.path.basename(path), "text": ast.get_docstring(node)}) + "\n")
PY
fi

echo "== 1. tokenize: a byte-level BPE of $VOCAB tokens trained on the corpus, then shards"
"$PYTHON" -m prime.tokenize "$CORPUS" --out "$WORK/tok" --vocab-size "$VOCAB"

echo "== 2. train: model $MODEL on two simulated nodes, TensorBoard and offline W&B on"
rm -rf "$WORK/run"
"$PYTHON" -m prime.simulate --nodes 2 -- --config configs/demo.toml --model.name "$MODEL" \
    --data.source bin --data.path "$WORK/tok" --data.seq_len "$SEQ_LEN" \
    --train.steps "$STEPS" --diloco.inner_steps "$INNER_STEPS" --optim.decay_steps $((STEPS / 4)) \
    --metrics.out_dir "$WORK/run" --metrics.tensorboard true --metrics.wandb true --metrics.wandb_mode offline

echo "== 3. watch it: tensorboard --logdir $WORK/run/tb   (W&B: wandb sync $WORK/run/wandb/offline-run-*)"
