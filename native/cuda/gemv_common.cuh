// What the decode GEMVs (gemv.cu: 16-bit weights; gemv_fp8.cu: FP8 weights with per-channel scales) share: the
// streaming load of W and the block epilogue. See gemv.cu for the layout both follow.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"
#include "launch.cuh"

namespace folio::cuda::gemv {

// 16 bytes of W: read-only, no L1 allocation, with a hint to fetch the surrounding 256 bytes into L2 (the next
// loads of this warp read them).
// (volatile: kept in program order with the other volatile asm, so that the first loads stay ahead of the
// grid-dependency wait.)
__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// d += A * B over one k16 step of m16n8k16 (fp32 accumulators). The lane (g = lane / 4, t = lane % 4) passes
// a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9], b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g]; it gets d = D[g][2t, 2t+1], D[g+8][2t, 2t+1].
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "mma_m16n8k16: bfloat16 or float16");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// The same with A's rows 8..15 zero: a_lo = A[g][2t, 2t+1], a_hi = A[g][2t+8, 2t+9]; d[0], d[1] = D[g][2t, 2t+1]
// (d[2], d[3]: D's rows 8..15, zero).
template <typename T>
__device__ __forceinline__ void mma_k16(float (&d)[4], uint32_t a_lo, uint32_t a_hi, uint32_t b_lo, uint32_t b_hi) {
  mma_m16n8k16<T>(d, a_lo, 0u, a_hi, 0u, b_lo, b_hi);
}

// The row of W lane group g (of kTileRows) of tile b (a block's, by default blockIdx.x) reads: row kTileRows * b + g;
// GATED: gate rows 4b..4b+3 (g < 4) and their up rows I+4b..I+4b+3 (g >= 4) of a [gate; up] weight of out_features
// = 2I rows. A row past the last is out_features (the caller reads row 0 there; that row of D is never stored).
template <bool GATED, int kTileRows>
__device__ __forceinline__ int64_t weight_row_index(int g, int64_t out_features, int64_t tile) {
  static_assert(!GATED || kTileRows == 8, "a gated block holds 4 gate and 4 up rows");
  if constexpr (GATED) {
    const int64_t half = out_features / 2;
    const int64_t gate_row = tile * 4 + (g & 3);
    return gate_row < half ? gate_row + (g < 4 ? 0 : half) : out_features;
  } else {
    return tile * kTileRows + g;
  }
}
template <bool GATED, int kTileRows>
__device__ __forceinline__ int64_t weight_row_index(int g, int64_t out_features) {
  return weight_row_index<GATED, kTileRows>(g, out_features, static_cast<int64_t>(blockIdx.x));
}

// A block's epilogue, after its warps wrote their partial sums (partial[w][m][j]: row m of x against row j of the
// block's 8 rows of W, over warp w's part of K) and synchronized. The warps' sums are added in warp order (the
// summation order depends on K only), multiplied by the row's scale (FP8 weights; nullptr: none), the bias added,
// and the result rounded once to T. GATED: the block's rows are gate rows 4b..4b+3 (j < 4) and up rows I+4b..
// I+4b+3 (j >= 4) of a [gate; up] weight of out_features = 2I rows; each factor is rounded to T as the unfused
// product would be, then combined with silu_and_mul's arithmetic into out [num_rows, I].
template <typename T, bool GATED, int kWarps, int kMaxRows, int kTileRows>
__device__ __forceinline__ void store_block_rows(const float (&partial)[kWarps][kMaxRows][kTileRows], int num_rows,
                                                 int64_t out_features, const float* scale, const void* bias,
                                                 void* out, int64_t tile = -1) {
  if (tile < 0) tile = blockIdx.x;  // (a block of one tile)
  const T* bias_t = static_cast<const T*>(bias);
  T* out_t = static_cast<T*>(out);
  if constexpr (GATED) {
    const int64_t half = out_features / 2;
    if (threadIdx.x < kMaxRows * 4) {
      const int m = threadIdx.x / 4, j = threadIdx.x % 4;
      const int64_t i = tile * 4 + j;  // output column: gate row i, up row I + i
      if (m < num_rows && i < half) {
        float gate = 0.0f, up = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          gate += partial[w][m][j];
          up += partial[w][m][j + 4];
        }
        if (scale != nullptr) {
          gate *= scale[i];
          up *= scale[half + i];
        }
        if (bias_t != nullptr) {
          gate += to_float(bias_t[i]);
          up += to_float(bias_t[half + i]);
        }
        const float g_r = to_float(from_float<T>(gate)), u_r = to_float(from_float<T>(up));  // as stored unfused
        out_t[m * half + i] = from_float<T>(g_r / (1.0f + expf(-g_r)) * u_r);
      }
    }
  } else if (threadIdx.x < kMaxRows * kTileRows) {
    const int m = threadIdx.x / kTileRows, j = threadIdx.x % kTileRows;
    const int64_t n = tile * kTileRows + j;
    if (m < num_rows && n < out_features) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][m][j];
      if (scale != nullptr) sum *= scale[n];
      if (bias_t != nullptr) sum += to_float(bias_t[n]);
      out_t[m * out_features + n] = from_float<T>(sum);
    }
  }
}

// The wait for the kernel that writes x (launch.cuh), once: a GEMV issues its first weight loads before it.
__device__ __forceinline__ void wait_for_x_once(bool& waited) {
  if (!waited) {
    grid_dependency_wait();
    allow_dependent_launch();
    waited = true;
  }
}

// After a warp's last step: the grid-dependency wait for a warp that ran none (K below one warp step), then its two
// accumulator chains added and written to partial (acc[0], acc[1] = y[m = g][n0 + 2t], y[g][n0 + 2t + 1] over
// this warp's chunks, meaningless for g >= M), and the block's epilogue (store_block_rows).
template <typename T, bool GATED, int kWarps, int kMaxRows, int kTileRows>
__device__ __forceinline__ void finish_block(bool waited, float (&acc)[4], const float (&acc_hi)[4],
                                             float (&partial)[kWarps][kMaxRows][kTileRows], int warp, int g, int t,
                                             int num_rows, int64_t out_features, const float* scale,
                                             const void* bias, void* out) {
  wait_for_x_once(waited);
  acc[0] += acc_hi[0];
  acc[1] += acc_hi[1];
  partial[warp][g][2 * t] = acc[0];
  partial[warp][g][2 * t + 1] = acc[1];
  __syncthreads();
  store_block_rows<T, GATED, kWarps, kMaxRows, kTileRows>(partial, num_rows, out_features, scale, bias, out);
}

}  // namespace folio::cuda::gemv
