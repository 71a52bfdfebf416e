// Device helpers shared by the CUDA kernels: storage-type conversions, 8-element vector loads/stores, warp and
// block reductions. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/params.h"

namespace folio::cuda {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// cp.async groups (sm_80+): close the group of the copies this thread issued since the last commit; wait until at
// most kPending of this thread's committed groups are still in flight (their copies visible to it after).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Eight consecutive elements <-> eight floats. The address must be aligned to 8 elements' worth of bytes for
// 16-bit types and to 16 bytes for float (the launchers check alignment before choosing vector paths).
template <typename T> struct Vec8;
template <> struct Vec8<float> {
  float4 lo, hi;
  __device__ __forceinline__ void load(const float* p) {
    lo = *reinterpret_cast<const float4*>(p);
    hi = *reinterpret_cast<const float4*>(p + 4);
  }
  __device__ __forceinline__ void zero() { lo = hi = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void to_floats(float (&f)[8]) const {
    f[0] = lo.x; f[1] = lo.y; f[2] = lo.z; f[3] = lo.w; f[4] = hi.x; f[5] = hi.y; f[6] = hi.z; f[7] = hi.w;
  }
  __device__ __forceinline__ static void store(float* p, const float (&f)[8]) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
};

template <typename T2, typename T>
struct Vec8Half {
  uint4 raw;
  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ void zero() { raw = make_uint4(0u, 0u, 0u, 0u); }
  __device__ __forceinline__ void to_floats(float (&f)[8]) const {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      T2 pair;
      memcpy(&pair, &words[i], 4);
      const float2 v = to_float2(pair);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ __forceinline__ static void store(T* p, const float (&f)[8]) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T2 pair = from_float2(f[2 * i], f[2 * i + 1]);
      memcpy(&words[i], &pair, 4);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
  }
  __device__ __forceinline__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __device__ __forceinline__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __device__ __forceinline__ static T2 from_float2(float a, float b);
};
template <> __device__ __forceinline__ __half2 Vec8Half<__half2, __half>::from_float2(float a, float b) {
  return __floats2half2_rn(a, b);
}
template <> __device__ __forceinline__ __nv_bfloat162 Vec8Half<__nv_bfloat162, __nv_bfloat16>::from_float2(float a,
                                                                                                          float b) {
  return __floats2bfloat162_rn(a, b);
}
template <> struct Vec8<__half> : Vec8Half<__half2, __half> {};
template <> struct Vec8<__nv_bfloat16> : Vec8Half<__nv_bfloat162, __nv_bfloat16> {};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds at least 32 floats. Deterministic: the same
// tree for the same launch shape.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < num_warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Runs fn(T{}) with T the CUDA storage type named by `type` (host side).
template <typename Fn>
void dispatch_scalar(ScalarType type, Fn&& fn) {
  switch (type) {
    case ScalarType::kFloat32: fn(float{}); return;
    case ScalarType::kFloat16: fn(__half{}); return;
    case ScalarType::kBFloat16: fn(__nv_bfloat16{}); return;
  }
}

}  // namespace folio::cuda
