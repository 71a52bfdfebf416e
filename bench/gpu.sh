#!/usr/bin/env bash
# One call on a CUDA machine: build the native library for Hopper only, run the GPU tests, run the kernel
# benchmark. Logs and bench JSON go to $OUT (a temp dir when unset); the benchmark table prints last.
#   bash bench/gpu.sh            # from anywhere; needs python3 with torch (CUDA), pip, nvcc, ninja, pybind11, pytest
#   ENGINE_BENCH=1 bash bench/gpu.sh     # then also the engine benchmark (bench/engine.py, its table last)
#   ENGINE_BENCH=only bash bench/gpu.sh  # the engine benchmark instead of the kernel one; ENGINE_ARGS passes options
#   ENGINE_BENCH=only EXTRA_BENCH="bench/constrained.py --batches 1,64" bash bench/gpu.sh
#                                        # a feature benchmark instead (its table last); several: separate them by ';'
#   WHEELS=bench/scratch/wheels ...     # install these wheels first (the image has no llguidance, which folio needs)
#   GPU_TESTS="tests/test_kv_quant_gpu.py tests/test_fp8_weights_gpu.py" ...
#                                        # only these test files' gpu tests after the native ones (default: all)
#   The quantized formats and the host tier (issue 21) in one call:
#   ENGINE_BENCH=only GPU_TESTS="tests/test_kv_quant_gpu.py tests/test_kv_formats.py tests/test_fp8_weights_gpu.py
#     tests/test_host_tier.py tests/test_replica_engine_gpu.py" EXTRA_BENCH="bench/kv_attention.py;
#     bench/engine.py --workloads W1,W2 --compare-formats --kv-format fp8 --no-peers; bench/host_tier.py --shape 8B"
#     bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 FOLIO_CUDA_ARCHS="${FOLIO_CUDA_ARCHS:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; nvcc --version | tail -2
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } 2>&1 | tee "$OUT/machine.txt"

# WHEELS=dir: wheels of folio's pure dependencies the machine's image lacks (llguidance: folio.constrain, which the
# engine imports), installed first without their dependencies.
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-deps --no-index "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
fi
"$PY" -c 'import llguidance' 2>/dev/null || echo "gpu.sh: llguidance is missing (folio imports it): set WHEELS"

start=$(date +%s)
# An editable install, not only `setup.py build_ext --inplace`: it builds the native modules in place the same way
# and makes replicas/ and router/ importable as folio.serve and folio.router (tests/test_replica_engine_gpu.py).
if ! "$PY" -m pip install --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "gpu.sh: build FAILED (log: $OUT/build.log)"
  exit 1
fi
build_s=$(( $(date +%s) - start ))
"$PY" -c 'import torch, folio._native_cpu, folio._native_cuda; print("native modules import")' || exit 1  # torch first: it loads libc10

# The native kernels' tests first, CPU and GPU cases (they decide whether the benchmark numbers mean anything), in
# worker processes when pytest-xdist is there, so that a crash fails one test instead of ending the session; then
# every other gpu-marked test of the repository, bounded in time (OTHER_TESTS_TIMEOUT_S, default 150 s).
xdist=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n 4")
"$PY" -m pytest tests/test_native_ops.py $xdist -q -p no:cacheprovider --tb=short -rfE >"$OUT/pytest-native.log" 2>&1
native_rc=$?
if grep -q "crashed" "$OUT/pytest-native.log" && command -v cuda-gdb >/dev/null; then
  # a native crash: a C++ backtrace of the first crashed test (cuda-gdb also debugs host-only code)
  crashed=$(grep -o "crashed while running '[^']*'" "$OUT/pytest-native.log" | head -1 | sed "s/.*running '//; s/'$//")
  timeout 180 cuda-gdb -q -batch -ex run -ex bt --args "$PY" -m pytest "$crashed" -q -p no:cacheprovider \
    -p no:xdist >"$OUT/crash-backtrace.log" 2>&1
  grep -E "^#" "$OUT/crash-backtrace.log" | head -25
fi
# shellcheck disable=SC2086  # GPU_TESTS is a list of files
timeout "${OTHER_TESTS_TIMEOUT_S:-150}" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
  --deselect tests/test_native_ops.py -rfE ${GPU_TESTS:-} >"$OUT/pytest-gpu-others.log" 2>&1
others_rc=$?
grep -E "^(FAILED|ERROR)|crashed" "$OUT/pytest-native.log" "$OUT/pytest-gpu-others.log" | head -30

bench_rc=0
if [ "${ENGINE_BENCH:-0}" != "only" ]; then
  "$PY" bench/kernels.py >"$OUT/bench.log" 2>&1
  bench_rc=$?
  cat "$OUT/bench.log" | tail -45
fi
engine_rc=
extra_rc=
if [ -n "${EXTRA_BENCH:-}" ]; then
  extra_rc=0
  IFS=';' read -d '' -ra benches <<<"$EXTRA_BENCH"  # (-d '': the list may span lines)
  for i in "${!benches[@]}"; do
    # shellcheck disable=SC2086  # each is a script and its options
    "$PY" ${benches[$i]} >"$OUT/extra-$i.log" 2>&1 || extra_rc=$?
    tail -30 "$OUT/extra-$i.log"
  done
elif [ "${ENGINE_BENCH:-0}" != "0" ]; then
  # shellcheck disable=SC2086  # ENGINE_ARGS is a list of options
  "$PY" bench/engine.py ${ENGINE_ARGS:-} >"$OUT/engine.log" 2>&1
  engine_rc=$?
  sed -n '/^ceilings:/,$p' "$OUT/engine.log"
fi
echo "---"
echo "build (sm_${FOLIO_CUDA_ARCHS/./}, $MAX_JOBS jobs): ${build_s} s"
echo "native gpu tests (rc $native_rc): $(tail -1 "$OUT/pytest-native.log")"
echo "other gpu tests (rc $others_rc): $(tail -1 "$OUT/pytest-gpu-others.log")"
echo "bench rc $bench_rc${engine_rc:+; engine bench rc $engine_rc}${extra_rc:+; $EXTRA_BENCH rc $extra_rc}; logs in $OUT"
