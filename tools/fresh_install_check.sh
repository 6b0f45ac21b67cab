#!/usr/bin/env bash
# The README's two commands as a new user meets them: for each Python, a fresh
# clone, a fresh venv, `make demo` then `make test` with PYTHON=<venv>/bin/python
# (nothing activated, nothing preinstalled). Prints one line per Python:
#
#   python 3.12.1 @ab12cd3 | pip 23.2.1, setuptools 84.2.1 | torch 2.13.0+cu130 | prime._C: CUDA kernels | demo ok 7m02s | test 289 passed, 12 skipped 5m10s
#
# Usage: tools/fresh_install_check.sh [REPO] [PYTHON_VERSION ...]
#   REPO             what to `git clone` (default: the repository this script is in;
#                    its committed HEAD, not uncommitted changes)
#   PYTHON_VERSION   pyenv versions to try (default: 3.10.13 3.11.7 3.12.1 3.13.0)
# Environment: WORK=DIR keeps clones, venvs and logs there (default: a new /tmp/prime-fresh.*);
#   KEEP=1 keeps each venv (a CUDA torch venv is ~6 GB; by default it is removed
#   once its line is printed, the clone and the logs stay).
# Slow: pip fetches torch (a CUDA build, several GB, for Pythons without a local
# CPU wheel), builds prime._C, runs the demo and the whole test suite. Run it niced.
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
repo=${1:-$here}
shift || true
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10.13 3.11.7 3.12.1 3.13.0)
work=${WORK:-$(mktemp -d /tmp/prime-fresh.XXXXXX)}
mkdir -p "$work"
echo "fresh_install_check: cloning $repo ($(git -C "$repo" rev-parse --short HEAD 2>/dev/null)); logs in $work" >&2

# seconds -> 6m05s
fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# the python executable of a pyenv version, without relying on the shims' selection
python_of() {
  local v=$1 prefix
  if command -v pyenv >/dev/null && prefix=$(pyenv prefix "$v" 2>/dev/null); then
    echo "$prefix/bin/python${v%.*}"
  elif command -v "python${v%.*}" >/dev/null; then
    command -v "python${v%.*}"
  else
    return 1
  fi
}

lines=()
for v in "${versions[@]}"; do
  dir=$work/py$v
  rm -rf "$dir" && mkdir -p "$dir"
  line="python $v"
  if ! py=$(python_of "$v"); then
    lines+=("$line | not installed"); echo "${lines[-1]}"; continue
  fi
  if ! git clone -q "$repo" "$dir/src" 2>"$dir/clone.log"; then
    lines+=("$line | git clone failed (see $dir/clone.log)"); echo "${lines[-1]}"; continue
  fi
  if ! PYENV_VERSION=$v "$py" -m venv "$dir/venv" >"$dir/venv.log" 2>&1; then
    lines+=("$line | venv failed (see $dir/venv.log)"); echo "${lines[-1]}"; continue
  fi
  vpy=$dir/venv/bin/python
  line="$line @$(git -C "$dir/src" rev-parse --short HEAD)"

  t0=$SECONDS
  if (cd "$dir/src" && make demo PYTHON="$vpy") >"$dir/demo.log" 2>&1; then demo=ok; else demo=FAIL; fi
  demo="demo $demo $(fmt $((SECONDS - t0)))"

  torch=$("$vpy" -c "import torch; print(torch.__version__)" 2>/dev/null || echo none)
  # versions from the metadata: importing pip before setuptools trips setuptools' distutils hack on 3.10
  tools=$("$vpy" -c "from importlib.metadata import version as v; print(f'pip {v(\"pip\")}, setuptools {v(\"setuptools\")}')" 2>/dev/null || echo "no setuptools")
  if [ -f "$dir/src/build/prime-cuda.txt" ]; then
    if grep -q "building with the CUDA" "$dir/src/build/prime-cuda.txt"; then built="prime._C: CUDA kernels"
    else built="prime._C: CPU ($(sed -e 's/.*kernels: //' -e 's/\.$//' "$dir/src/build/prime-cuda.txt"))"; fi
  else
    built="prime._C: not built"
  fi

  t0=$SECONDS
  (cd "$dir/src" && make test PYTHON="$vpy") >"$dir/test.log" 2>&1
  rc=$?
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$dir/test.log" | tail -1 | sed -e 's/=//g' -e 's/ in [0-9.]*s.*//' -e 's/^ *//')
  [ -n "$summary" ] || summary="no pytest summary"
  [ $rc -eq 0 ] || summary="FAIL: $summary"
  test="test $summary $(fmt $((SECONDS - t0)))"

  lines+=("$line | $tools | torch $torch | $built | $demo | $test")
  echo "${lines[-1]}"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$dir/venv"
done

echo
echo "fresh_install_check: $(uname -m), $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), $repo @ $(git -C "$repo" rev-parse --short HEAD 2>/dev/null)"
printf '%s\n' "${lines[@]}"
