#!/usr/bin/env bash
# The serving benchmarks on a GPU machine in one call: Ray Serve from the bundle (the image has none), folio built
# for Hopper, a random-weight checkpoint of $SHAPE written locally (bench/make_checkpoint.py, while folio builds),
# then one suite's runs, each bounded in time so that the call ends inside the device's limit; tables print last.
#   SUITE=one  bash bench/serving_gpu.sh   # 1 GPU: through gRPC against the engine alone (W2-like, 256 streams, and
#                                          # a low-load open loop); a burst of 1,000 short requests at one replica
#   SUITE=two  ...                         # 2 GPUs: W2-like at 1 and 2 replicas; chat under folio's router, power of
#                                          # two choices and Ray's PrefixCacheAffinityRouter at the same arrivals
#   SUITE=tp   ...                         # 2 GPUs: tensor parallel 2 against 1: the engine (bench/tp_engine.py) and
#                                          # through gRPC (1 stream and 256 streams)
#   SUITE=tp-serve ...                     # 2 GPUs: tensor parallel 2 against 1 through gRPC only, W2-like in steady
#                                          # state (10 s warm-up), then both again with $TP_AB set (an A/B of a
#                                          # ServeConfig option, default gather_prompt_rows=0: prompts not gathered;
#                                          # TP_AB=none: no A/B);
#                                          # TP_SIZES ("2 1"), TP_STREAMS (1,256), PROFILE_S (0) narrow it
#   SUITE=four ...                         # 4 GPUs: W2-like at 1 and 4 replicas, chat under the three routers
#   SUITE=flood ...                        # 1 GPU: the burst of 1,000 at one replica, twice (run 1 of SUITE=one)
#   SUITE=tp4  ...                         # 4 GPUs: the 70B shape at tensor parallel 4 (engine, then through gRPC)
# Ray from .raybundle/ (../shared/tools/ray-bundle-for-gpu.sh) when it is there; WHEELS=dir: more wheels to install
# beside it (e.g. llguidance, py-spy). SHAPE (8B), BUDGET_S (570: the whole call), logs and JSON in $OUT.
# GPU_TESTS="tests/x.py ...": those tests (pytest -m gpu) run after the build; the suite runs only if they pass.
# TP_ALL_REDUCE (peer,nccl): the tensor-parallel engine runs' all-reduce paths (EngineOptions.tp_all_reduce); the
# kernel report records the first.
# TP_HEADERS (host): how rank 0 sends its message headers in those runs (bench/tp_engine.py --tp-headers).
set -uo pipefail
cd "$(dirname "$0")/.."
t_start=$(date +%s)
OUT="${OUT:-$(mktemp -d)}"; mkdir -p "$OUT"; export OUT
PY="${PYTHON:-python3}"
SUITE="${SUITE:-one}"; SHAPE="${SHAPE:-8B}"; BUDGET_S="${BUDGET_S:-570}"
export PYTHONUNBUFFERED=1 FOLIO_CUDA_ARCHS="${FOLIO_CUDA_ARCHS:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# the machines' rule: NVLink multicast stays off (it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
if [ -f .raybundle/install.sh ]; then
  bash .raybundle/install.sh || { echo "serving_gpu.sh: the Ray bundle did not install"; exit 1; }
  export PYTHONPATH="/tmp/raysite${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/raysite/bin:$PATH"
fi
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/raysite "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1
fi

case "$SUITE" in tp4) SHAPE=70B;; esac
ckpt="/tmp/ckpt-$SHAPE"
"$PY" -m pip install --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 &
build=$!
if [ "$SUITE" != tp4 ]; then  # (70B: each rank makes its own shard in bench/tp_engine.py; no checkpoint)
  "$PY" bench/make_checkpoint.py --shape "$SHAPE" --out "$ckpt" >"$OUT/checkpoint.log" 2>&1 &
  checkpoint=$!
  wait "$checkpoint" || { tail -20 "$OUT/checkpoint.log"; echo "serving_gpu.sh: no checkpoint"; exit 1; }
fi
wait "$build" || { tail -30 "$OUT/build.log"; echo "serving_gpu.sh: build FAILED"; exit 1; }
"$PY" -c 'import torch, folio._native_cuda, ray.serve, grpc; print("native module, Ray", ray.__version__, "grpc", grpc.__version__)' \
  || exit 1
echo "setup: $(( $(date +%s) - t_start )) s"
if [ -n "${GPU_TESTS:-}" ]; then
  # shellcheck disable=SC2086  # a list of test files
  timeout --kill-after=10 "${GPU_TESTS_TIMEOUT_S:-240}" "$PY" -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS \
    >"$OUT/gpu-tests.log" 2>&1
  rc=$?
  tail -15 "$OUT/gpu-tests.log"
  [ "$rc" -eq 0 ] || { echo "serving_gpu.sh: GPU tests failed (exit $rc): the suite does not run"; exit 1; }
  echo "GPU tests: $(( $(date +%s) - t_start )) s"
fi

runs=()
serve="bench/serving.py --device cuda --model $ckpt --clients 4 ${SERVE_ARGS:-}"  # (e.g. --set token_channel=false)
# (two ingress replicas in both runs of a scaling pair: they take the calls of several generator replicas)
w2_1="--workload w2 --replicas 1 --max-batch-size 256 --concurrency 256 --duration 15 --no-engine --set ingress_replicas=2"
# chat: 128 conversations in flight (~170k tokens with their answers) against 98,304 cache tokens a replica: split
# by conversation they fit the replicas' caches, spread over all of them they do not (at the whole-GPU default both
# replicas hold everything and no router can matter)
chat="--workload chat --turns 4 --conversations 128 --concurrency 0 --requests 600 --no-engine --set ingress_replicas=2 \
--cache-tokens 98304"
flood="bench/flood.py --device cuda --model $ckpt --replicas 1 --requests 1000 --streams 256 --max-batch-size 256 \
--duration 20 --clients 4"
case "$SUITE" in
  flood)  # (FLOOD_PROFILE_S: py-spy the second burst's Serve processes, WHEELS with py-spy's wheel)
    runs+=("$flood" "$flood --profile-s ${FLOOD_PROFILE_S:-0} --profile-flood");;
  one)
    runs+=("$serve --workload w2 --replicas 1 --max-batch-size 256 --concurrency 256 --duration 25 --rate 2 \
--requests 40 --profile-s 10 --label w2-engine")
    runs+=("$flood")
    # through Serve's proxy actors (run 0 is direct, the default; with two ingress replicas direct ran the same)
    runs+=("$serve ${w2_1/ingress_replicas=2/ingress_replicas=1} --set ingress_mode=proxy --label w2-proxy");;
  two|four)
    n=2; [ "$SUITE" = four ] && n=4
    runs+=("$serve $w2_1 --label w2-1")
    runs+=("$serve ${w2_1/--replicas 1/--replicas $n} --concurrency $((256 * n)) --profile-s 10 --label w2-$n")
    for router in prefix pow2 ray_prefix; do
      runs+=("$serve $chat --replicas $n --rate $((20 * n)) --router $router --label chat-$n-$router")
    done;;
  tp)
    runs+=("bench/tp_engine.py --shape $SHAPE --tp 2 --tp-graphs ${TP_ENGINE_GRAPHS:-on} \
--tp-all-reduce ${TP_ALL_REDUCE:-peer,nccl} --tp-headers ${TP_HEADERS:-host} --kernel-report")
    runs+=("$serve --workload w2 --replicas 1 --max-batch-size 256 --concurrency 1,256 --duration 10 --no-engine \
--label tp-1")
    runs+=("$serve --workload w2 --replicas 1 --tensor-parallel-size 2 --cuda-graphs \${TP_GRAPHS:-off} \
--max-batch-size 256 --concurrency 1,256 --duration 10 --no-engine --label tp-2");;
  tp-serve)
    steady="--workload w2 --replicas 1 --max-batch-size 256 --duration 20 --warmup-s 10 --no-engine"
    for size in ${TP_SIZES:-2 1}; do  # (PROFILE_S: py-spy the first run's replica processes, WHEELS with py-spy)
      graphs=""; [ "$size" -gt 1 ] && graphs="--tensor-parallel-size $size --cuda-graphs on"
      runs+=("$serve $steady $graphs --concurrency ${TP_STREAMS:-1,256} --profile-s ${PROFILE_S:-0} --label tp-$size")
    done
    for size in ${TP_SIZES:-2 1}; do
      [ "${TP_AB:-}" = none ] && break
      graphs=""; [ "$size" -gt 1 ] && graphs="--tensor-parallel-size $size --cuda-graphs on"
      runs+=("$serve $steady $graphs --concurrency 256 --set ${TP_AB:-gather_prompt_rows=0} --label tp-$size-ab")
    done;;
  tp4)
    runs+=("bench/tp_engine.py --shape 70B --tp 4 --no-single --tp-graphs both");;
  *) echo "serving_gpu.sh: unknown SUITE $SUITE"; exit 2;;
esac

for i in "${!runs[@]}"; do
  left=$(( BUDGET_S - ($(date +%s) - t_start) ))
  if [ "$left" -lt 30 ]; then echo "run $i skipped: ${left} s left"; continue; fi
  cmd=$(eval echo "${runs[$i]}")  # (expands TP_GRAPHS, set by the tensor-parallel engine run)
  echo "=== run $i (${left} s left): $cmd"
  # shellcheck disable=SC2086  # a script and its options
  timeout --kill-after=10 "$left" "$PY" $cmd >"$OUT/run-$i.log" 2>&1
  rc=$?
  echo "=== run $i: exit $rc after $(( $(date +%s) - t_start )) s"
  if [ "$rc" -ge 124 ]; then  # timed out: its Ray cluster and ranks are left behind
    pkill -9 -f "ray::|/tmp/raysite/ray/|folio.tp_worker" >/dev/null 2>&1 || true
  fi
  if [ "$SUITE" = tp ] && [ "$i" = 0 ]; then
    # graphs in served tensor-parallel replicas only where the engine captured and replayed them on these GPUs
    grep -q "^| 2 ranks, graphs on" "$OUT/run-0.log" && export TP_GRAPHS=on
  fi
done
echo "--- tables"
for i in "${!runs[@]}"; do
  [ -f "$OUT/run-$i.log" ] || continue
  echo "=== run $i"; grep -E "^\||^(closed|open|w2|chat|flood|  admitted|  timeline|  refused|server )|server/engine|Traceback|Error" \
    "$OUT/run-$i.log" | tail -24
done
echo "total: $(( $(date +%s) - t_start )) s"
