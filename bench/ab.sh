#!/usr/bin/env bash
# One GPU call for A/B work on a kernel change: build for sm_90, run the native tests (optionally a -k subset),
# the kernel benchmark, then engine workloads under EngineOptions variants. Logs go to $OUT; a short table last.
#   TESTS_K="attention or linear" KERNELS=1 VARIANTS="base: nopdl:--no-pdl" ENGINE_ARGS="--workloads W1 --no-peers" \
#     bash bench/ab.sh
# VARIANTS: space-separated name:FLAG,FLAG entries of bench/engine.py's option flags (--no-pdl, --decode-attention=simt,
# --no-prefill-cudnn, --no-residual-gemm); "name:" (nothing after the colon) runs the defaults. KERNEL_ARGS go to
# bench/kernels.py (e.g. --no-pdl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 FOLIO_CUDA_ARCHS="${FOLIO_CUDA_ARCHS:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/machine.txt"
start=$(date +%s)
if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"; echo "ab.sh: build FAILED"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
summary=()
if [ -n "${TESTS_K+x}" ]; then
  xdist=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 4")
  # shellcheck disable=SC2086
  timeout "${TESTS_TIMEOUT_S:-180}" "$PY" -m pytest tests/test_native_ops.py $xdist -q -p no:cacheprovider --tb=short -rfE ${TESTS_K:+-k "$TESTS_K"} \
    >"$OUT/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)|^E  |crashed" "$OUT/pytest.log" | head -30
  summary+=("tests: $(tail -1 "$OUT/pytest.log")")
fi
if [ "${KERNELS:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout 180 "$PY" bench/kernels.py ${KERNEL_ARGS:-} >"$OUT/kernels.log" 2>&1
  tail -40 "$OUT/kernels.log"
fi
for variant in ${VARIANTS:-}; do
  name="${variant%%:*}"; flags="${variant#*:}"
  # shellcheck disable=SC2086,SC2046
  timeout "${ENGINE_TIMEOUT_S:-240}" "$PY" bench/engine.py ${ENGINE_ARGS:-} $(echo "$flags" | tr "," " ") >"$OUT/engine-$name.log" 2>&1
  rc=$?
  echo "== $name ($flags)"; sed -n '/^ceilings:/,$p' "$OUT/engine-$name.log" | head -30
  [ $rc = 0 ] || tail -15 "$OUT/engine-$name.log"
  summary+=("$name: rc $rc")
done
echo "---"; printf '%s\n' "${summary[@]}"
