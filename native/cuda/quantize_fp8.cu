// Per-row dynamic FP8 quantization of activations (folio.model.fp8's _scaled_mm path): for each row of x [M, K]
// (float16 / bfloat16), scale = max(max|x| / 448, 1e-12) in fp32 and codes = e4m3(x / scale), the division IEEE
// (__fdiv_rn, as torch divides) and the conversion round-to-nearest-even with saturation to +-448 (torch's clamp then
// cast). One block per row: it reads the row for the maximum, again (from cache) for the codes, and writes the codes
// once; the torch version makes about six passes over x with an fp32 copy of it, and as many launches.
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kFp8Max = 448.0f;
constexpr float kMinScale = 1e-12f;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) quantize_rows_fp8_kernel(QuantizeRowsFp8Params p) {
  __shared__ float scratch[kThreads / 32];
  grid_dependency_wait();
  allow_dependent_launch();
  // rows stride by gridDim.x: a long prompt has more rows than one launch should have blocks
  for (int64_t row = blockIdx.x; row < p.num_rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
    uint8_t* out = p.out + row * p.out_row_stride;
    float amax = 0.0f;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * VEC; i < p.width; i += kThreads * VEC) {
      float f[8];
      if constexpr (VEC == 8) {
        Vec8<T> v;
        v.load(x + i);
        v.to_floats(f);
      } else {
        f[0] = to_float(x[i]);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = fmaxf(amax, fabsf(f[e]));
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = scratch[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, scratch[w]);
    __syncthreads();  // scratch is rewritten for the next row
    const float scale = fmaxf(__fdiv_rn(amax, kFp8Max), kMinScale);
    if (threadIdx.x == 0) p.scale[row] = scale;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * VEC; i < p.width; i += kThreads * VEC) {
      float f[8];
      if constexpr (VEC == 8) {
        Vec8<T> v;
        v.load(x + i);  // (an L1/L2 hit: this block read the row just now)
        v.to_floats(f);
        uint32_t words[2] = {0u, 0u};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint32_t code = __nv_cvt_float_to_fp8(__fdiv_rn(f[e], scale), __NV_SATFINITE, __NV_E4M3);
          words[e / 4] |= code << (8 * (e % 4));
        }
        *reinterpret_cast<uint2*>(out + i) = make_uint2(words[0], words[1]);
      } else {
        out[i] = __nv_cvt_float_to_fp8(__fdiv_rn(to_float(x[i]), scale), __NV_SATFINITE, __NV_E4M3);
      }
    }
  }
}

}  // namespace

cudaError_t quantize_rows_fp8(const QuantizeRowsFp8Params& p, const Launch& launch) {
  if (p.dtype == ScalarType::kFloat32) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  const bool vec = p.width % 8 == 0 && aligned16(p.x) && p.x_row_stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(p.out) % 8 == 0 && p.out_row_stride % 8 == 0;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(p.num_rows, 65535));
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      if (vec) {
        launch_kernel(quantize_rows_fp8_kernel<T, 8>, dim3(blocks), dim3(kThreads), 0, launch, p);
      } else {
        launch_kernel(quantize_rows_fp8_kernel<T, 1>, dim3(blocks), dim3(kThreads), 0, launch, p);
      }
    }
  });
  return cudaGetLastError();
}

}  // namespace folio::cuda
