#!/usr/bin/env bash
# Times folio's GEMV (native/cuda/gemv.cu) for several values of its compile-time knobs on the 8B decode shapes,
# with a stand-alone harness (bench/gemv_sweep.cu, no torch). Needs nvcc and a CUDA GPU.
#   bash bench/gemv_sweep.sh                           # the default variants below
#   VARIANTS="8,2 16,1" bash bench/gemv_sweep.sh   # unroll,min_blocks_per_sm (warps per block stay 8: the fp32
#                                                  # kernel gives each of a block's 8 rows of W one warp)
#   FP8=1 VARIANTS="4,2,3 4,3,2" bash bench/gemv_sweep.sh  # the FP8 GEMV (native/cuda/gemv_fp8.cu) instead, after
#                                      # its correctness check: unroll,min_blocks_per_sm,ring_stages[,warps_per_block]
#   FP8=1 FP8_SRC=old/gemv_fp8.cu ...  # another version of that file (e.g. `git show HEAD:native/cuda/gemv_fp8.cu`),
#                                      # for before/after numbers in one run
#   SWEEP_DTYPE=f16 ...                # x (and bf16 weights) as float16 instead of bfloat16
#   NCU=1 ...  # then profile one launch of each variant on one shape (NCU_SHAPE, default gate_up) with Nsight
#              # Compute (clocks left alone); the report goes to $NCU_DIR (default: the temp dir), a summary prints
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-arch=sm_90 -std=c++17 -O3 --expt-relaxed-constexpr -Inative/cuda -D__CUDA_NO_HALF_OPERATORS__
       -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
variants=(${VARIANTS:-8,2 4,2 16,1 4,3 8,1 12,1 16,2})
if [ "${FP8:-0}" != 0 ]; then
  src="${FP8_SRC:-native/cuda/gemv_fp8.cu}"
  knobs=(FOLIO_GEMV_FP8_UNROLL FOLIO_GEMV_FP8_MIN_BLOCKS FOLIO_GEMV_FP8_STAGES FOLIO_GEMV_FP8_WARPS)
  flags+=(-DSWEEP_FP8)
else
  src=native/cuda/gemv.cu knobs=(FOLIO_GEMV_UNROLL FOLIO_GEMV_MIN_BLOCKS)
fi
for v in "${variants[@]}"; do  # builds in parallel
  IFS=, read -ra values <<<"$v"
  defs=()
  for i in "${!values[@]}"; do defs+=(-D"${knobs[$i]}=${values[$i]}"); done
  name="gemv_${v//,/_}"
  nvcc "${flags[@]}" "${defs[@]}" "$src" bench/gemv_sweep.cu -o "$out/$name" >"$out/$name.log" 2>&1 &
done
wait
for v in "${variants[@]}"; do  # runs one at a time
  IFS=, read -ra values <<<"$v"
  desc=""
  for i in "${!values[@]}"; do desc+="${desc:+, }${knobs[$i]#FOLIO_GEMV_}=${values[$i]}"; done
  bin="$out/gemv_${v//,/_}"
  echo "${FP8_SRC:+$FP8_SRC: }$desc:"
  if [ -x "$bin" ]; then "$bin"; else echo "  does not build: $(head -c 300 "$bin.log")"; fi
done
if [ "${NCU:-0}" != 0 ]; then
  for v in "${variants[@]}"; do
    bin="$out/gemv_${v//,/_}" report="${NCU_DIR:-$out}/ncu_${v//,/_}.txt"
    [ -x "$bin" ] || continue
    SWEEP_SHAPE="${NCU_SHAPE:-gate_up}" ncu --clock-control none --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio -k regex:linear \
      --launch-skip 3 --launch-count 1 "$bin" >"$report" 2>&1
    echo "ncu $v (${NCU_SHAPE:-gate_up}):"
    grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|\
No Eligible|Dynamic Shared|Block Limit (Registers|Shared))" "$report" | sed 's/  */ /g'
    grep -E "issue_stalled" "$report" | awk '$NF+0 > 0.5 {print " ", $1, $NF}' |  # stall reasons, cycles per issue
      sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
    grep -E "==ERR|==PROF==|error" "$report" | head -3
  done
fi
