#!/usr/bin/env bash
# Times folio's GEMV (native/cuda/gemv.cu) for several values of its compile-time knobs on the 8B decode shapes,
# with a stand-alone harness (bench/gemv_sweep.cu, no torch). Needs nvcc and a CUDA GPU.
#   bash bench/gemv_sweep.sh                           # the default variants below
#   VARIANTS="8,2 16,1" bash bench/gemv_sweep.sh   # unroll,min_blocks_per_sm (warps per block stay 8: the fp32
#                                                  # kernel gives each of a block's 8 rows of W one warp)
#   FP8=1 VARIANTS="4,2 2,4,2" bash bench/gemv_sweep.sh  # the FP8 GEMV (native/cuda/gemv_fp8.cu) instead; a third
#                                                      # value: tiles of 8 rows per block (default 2)
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-arch=sm_90 -std=c++17 -O3 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__
       -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
variants=(${VARIANTS:-8,2 4,2 16,1 4,3 8,1 12,1 16,2})
if [ "${FP8:-0}" != 0 ]; then
  src=native/cuda/gemv_fp8.cu knobs=(FOLIO_GEMV_FP8_UNROLL FOLIO_GEMV_FP8_MIN_BLOCKS FOLIO_GEMV_FP8_TILES)
  flags+=(-DSWEEP_FP8)
else
  src=native/cuda/gemv.cu knobs=(FOLIO_GEMV_UNROLL FOLIO_GEMV_MIN_BLOCKS)
fi
for v in "${variants[@]}"; do  # builds in parallel
  IFS=, read -r unroll blocks tiles <<<"$v"
  extra=()
  [ -n "$tiles" ] && extra=(-D"${knobs[2]}=$tiles")
  nvcc "${flags[@]}" -D"${knobs[0]}=$unroll" -D"${knobs[1]}=$blocks" "${extra[@]}" \
    "$src" bench/gemv_sweep.cu -o "$out/gemv_${unroll}_${blocks}_${tiles}" >"$out/gemv_${unroll}_${blocks}_${tiles}.log" 2>&1 &
done
wait
for v in "${variants[@]}"; do  # runs one at a time
  IFS=, read -r unroll blocks tiles <<<"$v"
  bin="$out/gemv_${unroll}_${blocks}_${tiles}"
  echo "unroll $unroll, min blocks/SM $blocks${tiles:+, tiles $tiles}:"
  if [ -x "$bin" ]; then "$bin"; else echo "  does not build: $(head -c 300 "$bin.log")"; fi
done
