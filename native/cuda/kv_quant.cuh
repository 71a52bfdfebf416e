// Quantized K/V cache codes (folio.kv_formats): quantizing a group on the cache write, dequantizing 8 elements in the
// attention kernels. Included only by .cu files.
//
// A group of G elements x (fp32) gets scale = float16(max(max|x| / QMAX, 2^-24)) and codes from x / scale, the
// division by the rounded scale (IEEE, as torch divides): fp8 e4m3 with round-to-nearest-even and saturation
// (the hardware conversion), q8 / q4 rint (half to even) clamped to +-127 / +-7, q4 biased by 8 into a nibble
// (element 2i low, 2i + 1 high). Dequantizing is float(code) * float(scale) in fp32, exact for every format (a
// code has at most 4 significant bits, a scale 11), so only the kernel's later rounding differs from the reference.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "device_utils.cuh"

namespace folio::cuda {

constexpr int kFmtNone = static_cast<int>(KvFormat::kNone);
constexpr int kFmtFp8 = static_cast<int>(KvFormat::kFp8);
constexpr int kFmtQ8 = static_cast<int>(KvFormat::kQ8);
constexpr int kFmtQ4 = static_cast<int>(KvFormat::kQ4);
constexpr int kQuantGroup = 32;  // G of q8 / q4 (fp8: the whole head)

template <int FMT> constexpr int kv_elems_per_byte() { return FMT == kFmtQ4 ? 2 : 1; }
template <int FMT> constexpr float kv_qmax() { return FMT == kFmtFp8 ? 448.0f : FMT == kFmtQ8 ? 127.0f : 7.0f; }
// Elements per scale for a head of HEAD_DIM.
template <int FMT, int HEAD_DIM> constexpr int kv_group_size() { return FMT == kFmtFp8 ? HEAD_DIM : kQuantGroup; }

// The stored scale of a group with max|x| = amax, and the value quantization divides by.
__device__ __forceinline__ float quant_scale(float amax, float qmax, __half& stored) {
  stored = __float2half_rn(fmaxf(__fdiv_rn(amax, qmax), 5.9604644775390625e-08f));  // 2^-24
  return __half2float(stored);
}

// The code of x in a group of scale `scale` (q4: the biased nibble, 1..15).
template <int FMT>
__device__ __forceinline__ uint32_t quant_code(float x, float scale) {
  const float scaled = __fdiv_rn(x, scale);
  if constexpr (FMT == kFmtFp8) {
    return static_cast<uint32_t>(__nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, __NV_E4M3));
  } else {
    constexpr int kMax = FMT == kFmtQ8 ? 127 : 7;
    const int q = min(max(__float2int_rn(scaled), -kMax), kMax);  // rn: half to even, as torch.round
    return FMT == kFmtQ8 ? static_cast<uint32_t>(q) & 0xFFu : static_cast<uint32_t>(q + 8);
  }
}

// float(x) for an unsigned integer x < 2^23: its bits under the exponent of 2^23, minus 2^23 (both exact).
__device__ __forceinline__ float small_uint_to_float(uint32_t bits_with_magic) {
  return __int_as_float(static_cast<int>(bits_with_magic)) - 8388608.0f;
}

// Eight codes -> eight dequantized floats. fp8 / q8: 8 bytes (w0 = elements 0..3, w1 = 4..7); q4: 4 bytes in w0.
template <int FMT>
__device__ __forceinline__ void dequant8(uint32_t w0, uint32_t w1, float scale, float (&f)[8]) {
  if constexpr (FMT == kFmtFp8) {
    const uint32_t words[2] = {w0, w1};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>((words[i] >> (16 * h)) & 0xFFFFu), __NV_E4M3);
        __half2 pair;
        memcpy(&pair, &raw, 4);
        const float2 v = __half22float2(pair);
        f[4 * i + 2 * h] = v.x * scale;
        f[4 * i + 2 * h + 1] = v.y * scale;
      }
    }
  } else if constexpr (FMT == kFmtQ8) {
    // A byte b of int8 code c: b ^ 0x80 = c + 128 in [1, 255], placed under the exponent of 2^23.
    const uint32_t words[2] = {w0 ^ 0x80808080u, w1 ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t bits = __byte_perm(words[i], 0x4B00u, 0x5440u + b);  // bytes: [b, 0, 0, 0x4B]
        f[4 * i + b] = (small_uint_to_float(bits) - 128.0f) * scale;
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t bits = ((w0 >> (4 * e)) & 0xFu) | 0x4B000000u;  // element e: nibble e (2i low, 2i + 1 high)
      f[e] = (small_uint_to_float(bits) - 8.0f) * scale;
    }
  }
}

__device__ __forceinline__ float half_bits_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

}  // namespace folio::cuda
