// Device helpers of the tensor-core decode kernel over quantized pages (attention_mma_quant.cu): where a tile's
// rows sit in shared memory, copies, the f16 mma, exact conversions of fp8 / int8 / int4 codes to float16 mma
// operands, and the order of the dims these give Q K^T.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

#include "kv_quant.cuh"

namespace folio::cuda {

constexpr uint32_t kFullMask = 0xffffffffu;

// Position of 16-byte piece `piece` of key row `key` inside a tile: XOR-swizzled by key so that the K slice and V
// run loads below (lanes reading the same piece of keys 2 or 4 apart) spread over the banks.
template <int PIECES>
__device__ __forceinline__ int swizzled_piece(int key, int piece) {
  return piece ^ ((key >> 1) & (PIECES - 1));
}

// WORDS 32-bit words of key row `key` from byte `offset` on (a multiple of min(16, 4 WORDS)), from a tile.
template <int WORDS, int PIECES, int ROW_BYTES>
__device__ __forceinline__ void load_row_words(const unsigned char* tile, int key, int offset,
                                               uint32_t (&w)[WORDS]) {
  const unsigned char* row = tile + key * ROW_BYTES;
  if constexpr (WORDS >= 4) {
#pragma unroll
    for (int c = 0; c < WORDS / 4; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + swizzled_piece<PIECES>(key, offset / 16 + c) * 16);
      w[4 * c] = v.x;
      w[4 * c + 1] = v.y;
      w[4 * c + 2] = v.z;
      w[4 * c + 3] = v.w;
    }
  } else {
    const unsigned char* at = row + swizzled_piece<PIECES>(key, offset / 16) * 16 + offset % 16;
    if constexpr (WORDS == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(at);
      w[0] = v.x;
      w[1] = v.y;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(at);
    }
  }
}

// cp.async of BYTES (4, 8 or 16) from global to shared, or zeros without reading when !valid.
template <int BYTES>
__device__ __forceinline__ void cp_async_bytes(uint32_t dst_shared, const void* src, bool valid) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_shared), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
  } else {  // .cg takes 16 bytes only
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst_shared), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0)
                 : "memory");
  }
}

__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ __half2 as_half2(uint32_t w) {
  __half2 h;
  memcpy(&h, &w, 4);
  return h;
}
__device__ __forceinline__ uint32_t as_word(__half2 h) {
  uint32_t w;
  memcpy(&w, &h, 4);
  return w;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return as_word(__floats2half2_rn(lo, hi)); }

// Two fp8 e4m3 codes (low byte first) -> float16x2, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t bits16) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits16 & 0xFFFFu), __NV_E4M3);
  uint32_t w;
  memcpy(&w, &raw, 4);
  return w;
}

// Two int8 codes (bytes of w ^ 0x80808080 chosen by `select`, with 0x64 above each) -> float16x2: 1024 + c + 128
// is exact, so subtracting 1152 gives c.
__device__ __forceinline__ __half2 int8x2_to_half2(uint32_t biased, uint32_t select) {
  return __hsub2(as_half2(__byte_perm(biased, 0x64646464u, select)), as_half2(0x64806480u));  // 1152
}

// Two int4 codes at bits 0..3 and 16..19 (low nibbles) or 4..7 and 20..23 (high) of w -> float16x2 of code - 8:
// under the exponent of 1024 they read 1024 + n (low) or 1024 + 16n (high), both exact.
__device__ __forceinline__ __half2 int4x2_low_to_half2(uint32_t w) {
  return __hsub2(as_half2((w & 0x000F000Fu) | 0x64006400u), as_half2(0x64086408u));  // - 1032
}
__device__ __forceinline__ __half2 int4x2_high_to_half2(uint32_t w) {
  return __hfma2(as_half2((w & 0x00F000F0u) | 0x64006400u), as_half2(0x2C002C00u), as_half2(0xD480D480u));  // /16 - 72
}

// The dim (within a lane's K slice) of element i of k-step s: i = 0, 1 are B rows 2t, 2t + 1 (b0), i = 2, 3 rows
// 2t + 8, 2t + 9 (b1). fp8 / q8: bytes in order; q4: the nibbles each word's decoding pairs up (k_fragment()).
template <int FMT>
__device__ __forceinline__ constexpr int k_dim(int s, int i) {
  if constexpr (FMT == kFmtQ4) {
    return 8 * (s / 2) + 2 * (s % 2) + (i >> 1) + 4 * (i & 1);
  } else {
    return 4 * s + i;
  }
}

// The B fragment (b0, b1) of k-step s from a lane's K slice words, as float16 codes times `ratio` (q8 / q4).
template <int FMT, int WORDS>
__device__ __forceinline__ void k_fragment(const uint32_t (&w)[WORDS], int s, __half2 ratio, uint32_t& b0,
                                           uint32_t& b1) {
  if constexpr (FMT == kFmtFp8) {
    b0 = e4m3x2_to_half2(w[s]);
    b1 = e4m3x2_to_half2(w[s] >> 16);
  } else if constexpr (FMT == kFmtQ8) {
    const uint32_t biased = w[s] ^ 0x80808080u;
    b0 = as_word(__hmul2(int8x2_to_half2(biased, 0x4140u), ratio));  // bytes 0, 1
    b1 = as_word(__hmul2(int8x2_to_half2(biased, 0x4342u), ratio));  // bytes 2, 3
  } else {
    const uint32_t nibbles = w[s / 2] >> (8 * (s % 2));
    b0 = as_word(__hmul2(int4x2_low_to_half2(nibbles), ratio));   // nibbles 0, 4 (s odd: 2, 6)
    b1 = as_word(__hmul2(int4x2_high_to_half2(nibbles), ratio));  // nibbles 1, 5 (s odd: 3, 7)
  }
}

// The smallest power of two >= x (x > 0, normal), and the inverse of a power of two; both exact.
__device__ __forceinline__ float pow2_ceil(float x) {
  return __int_as_float((__float_as_int(x) + 0x007FFFFF) & 0x7F800000);
}
__device__ __forceinline__ float pow2_inverse(float x) { return __int_as_float((254 << 23) - __float_as_int(x)); }

// 2^x by the special-function unit alone (exp2f adds a range check and two multiplies for subnormal results): the
// arguments are <= 0 or -inf, and a probability below 2^-126 flushed to 0 changes nothing a float16 P could hold.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int LANES>  // the max over groups of LANES consecutive lanes (xor 1 .. LANES / 2)
__device__ __forceinline__ float lanes_max(float x) {
#pragma unroll
  for (int offset = 1; offset < LANES; offset <<= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

}  // namespace folio::cuda
