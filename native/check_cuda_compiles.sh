#!/usr/bin/env bash
# Compile-checks every CUDA source of native/ for Hopper (sm_90) with the flags torch's extension build adds.
# Needs only nvcc (no GPU, no torch): the kernels include no torch headers. Used by CI on CPU machines.
#   native/check_cuda_compiles.sh            # all of native/cuda/*.cu, in parallel
#   NVCC=/path/to/nvcc native/check_cuda_compiles.sh
set -euo pipefail
cd "$(dirname "$0")"
NVCC="${NVCC:-nvcc}"
command -v "$NVCC" >/dev/null || { echo "check_cuda_compiles: $NVCC not found" >&2; exit 1; }
out_dir="$(mktemp -d)"
trap 'rm -rf "$out_dir"' EXIT
flags=(-arch=sm_90 -std=c++17 -O3 -c --expt-relaxed-constexpr -Werror all-warnings
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__)
start=$(date +%s)
status=0
ls cuda/*.cu | xargs -P "$(nproc)" -I{} sh -c \
  '"$0" "$@" {} -o "'"$out_dir"'/$(basename {}).o" && echo "ok   {}" || { echo "FAIL {}"; exit 255; }' \
  "$NVCC" "${flags[@]}" || status=1
echo "check_cuda_compiles: $(ls cuda/*.cu | wc -l) files, $(( $(date +%s) - start )) s, $("$NVCC" --version | tail -1)"
exit $status
