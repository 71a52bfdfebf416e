#!/usr/bin/env bash
# One GPU call: the engine benchmark (bench/engine.py) of this tree and of another checkout of folio (the commit
# before a change, say), built side by side and run one after the other on the same card; each run's table prints
# last, the other checkout's first.
#   bash bench/ab_trees.sh OTHER_DIR [bench/engine.py options...]
#   e.g. mkdir base && git archive 78ef355 | tar -x -C base && bash bench/ab_trees.sh base --no-peers
set -uo pipefail
cd "$(dirname "$0")/.."
other=$(cd "$1" && pwd); shift
OUT="${OUT:-$(mktemp -d)}"
export OUT PYTHONUNBUFFERED=1 FOLIO_CUDA_ARCHS="${FOLIO_CUDA_ARCHS:-9.0}" MAX_JOBS="${MAX_JOBS:-8}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
build() {  # dir name
  if ! (cd "$1" && "$PY" setup.py build_ext --inplace >"$OUT/build-$2.log" 2>&1); then
    tail -30 "$OUT/build-$2.log"; echo "ab_trees.sh: build of $2 FAILED"; return 1
  fi
}
start=$(date +%s)
build "$other" other & other_pid=$!
build . this || exit 1
wait "$other_pid" || exit 1
echo "builds: $(( $(date +%s) - start )) s"
for run in other this; do
  dir=$([ "$run" = this ] && pwd || echo "$other")
  mkdir -p "$OUT/$run"
  (cd "$dir" && OUT="$OUT/$run" "$PY" bench/engine.py "$@" >"$OUT/engine-$run.log" 2>&1) || {
    tail -30 "$OUT/engine-$run.log"; echo "ab_trees.sh: the $run run FAILED"; }
done
for run in other this; do
  echo "=== $run ($([ "$run" = this ] && pwd || echo "$other"))"
  sed -n '/^ceilings:/,$p' "$OUT/engine-$run.log"
done
