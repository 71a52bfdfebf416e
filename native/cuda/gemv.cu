// linear for decode: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for M <= 8 rows of x; W is [N, K] row-major
// (F.linear's layout). With so few rows the product is bound by reading W once, so the kernel is laid out to
// stream W at copy bandwidth in a single launch (cuBLAS runs these shapes as split-K GEMMs plus a reduce kernel):
//
//  * Every element of W is loaded exactly once, by one thread, with a 16-byte load that does not allocate in L1
//    (W is streamed; x stays in L1 for the other blocks of the SM). Each lane has kUnroll such loads in flight.
//  * 16-bit types multiply on tensor cores: mma.m16n8k16 with x as A (row m of x = row m of A; rows M..7 repeat
//    row 0 and are never stored, rows 8..15 are zero) and eight rows of W as B. A dot product does not care in which order k comes, so a lane hands the mma the 8
//    consecutive elements it loaded (one 16-byte load = two mmas) and loads x's fragment at the same k: no
//    shuffles, no shared-memory staging, and 8 rows of x cost the same instructions as 1 (CUDA-core FMAs would be
//    ALU-bound near 8 rows, converting every x element again for every row of W).
//  * A block of kWarps warps owns kTileRows rows of W; its warps split K into interleaved runs and add their partial
//    sums in shared memory in a fixed order: no atomics, no second kernel.
//  * Deterministic and batch-invariant: the order in which y[m, n] is summed depends on K only, not on N, M, the grid
//    or the other rows of x.
//  * Any K, strides and alignment are accepted: rows that are 16-byte aligned with K a multiple of 8 (fp32: 4) take
//    the vector loads, others an element-wise path (correct, slower; no real model has such shapes).
// float32 has no exact tensor-core path: one warp per row of W, FMAs over float4 loads, a warp-shuffle sum.
//
// silu_gate (16-bit types) folds the MLP's activation into its gate_up projection: W is [gate; up] (I rows each)
// and the result is silu(gate) * up, [M, I]. Block b takes gate rows 4b..4b+3 and the matching up rows
// I+4b..I+4b+3 as its 8 rows of W, so both factors of an output meet in its epilogue, each rounded to the dtype
// first and then combined with silu_and_mul's arithmetic: bit-identical to the product followed by silu_and_mul
// (a row's dot product is summed in the same order either way: it depends on K only), one launch fewer.
#include <type_traits>

#include "device_utils.cuh"
#include "gemv_common.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

// Tuning knobs, overridable at compile time only for bench/gemv_sweep.sh (which builds variants of this file into a
// stand-alone timing harness); the library always builds with the defaults.
#ifndef FOLIO_GEMV_WARPS
#define FOLIO_GEMV_WARPS 8
#endif
#ifndef FOLIO_GEMV_UNROLL
#define FOLIO_GEMV_UNROLL 8
#endif
#ifndef FOLIO_GEMV_MIN_BLOCKS
#define FOLIO_GEMV_MIN_BLOCKS 2
#endif

constexpr int kWarps = FOLIO_GEMV_WARPS;     // per block: split K (16-bit) or own one row each (fp32)
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 8;                 // rows of W per block (the mma's n)
constexpr int kUnroll = FOLIO_GEMV_UNROLL;   // 16-byte loads of W in flight per lane
constexpr int kWarpStepChunks = 4 * kUnroll; // 8-element chunks of a row per warp step (4 lanes share a row)
constexpr int kMaxRows = static_cast<int>(kLinearMaxRows);
static_assert(kMaxRows <= 8, "x is the A operand of m16n8k16: rows 0..7 of a group of 8 lanes");

using gemv::load_streaming;  // (gemv_common.cuh)

// Chunk c (elements 8c .. 8c+7) of a row of 16-bit values as four words, element 2i in the low half of word i;
// elements at k >= K read as zero. VEC: the row is 16-byte aligned and K % 8 == 0 (the chunk is whole).
// STREAM (W) goes through the non-coherent path; x is read with plain loads: the kernel that writes x may still be
// running when this one starts (launch.cuh), so x is not read-only over this kernel's lifetime, which is what
// ld.global.nc requires.
template <bool VEC, bool STREAM>
__device__ __forceinline__ uint4 load_chunk16(const uint16_t* row, int64_t c, int64_t K) {
  if constexpr (VEC) {
    if constexpr (STREAM) {
      return load_streaming(row + 8 * c);
    } else {
      return *reinterpret_cast<const uint4*>(row + 8 * c);
    }
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t k = 8 * c + 2 * i;
      const uint32_t lo = k < K ? row[k] : 0u;
      const uint32_t hi = k + 1 < K ? row[k + 1] : 0u;
      w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

using gemv::mma_k16;  // (gemv_common.cuh)

// 16-bit types. Block b owns rows n0 = 8b .. 8b+7 of W. In warp w, lane (g, t) reads row n0 + g of W and row g of x:
// at warp step s and unroll u, chunk c = (s * kWarps + w) * kWarpStepChunks + 4u + t (so one load instruction of the
// warp covers 64 contiguous bytes of each of 8 rows, and a warp step 512). The two mmas of a chunk take its elements
// 0..3 and 4..7 as their k positions {2t, 2t+1, 2t+8, 2t+9}, the same on both operands. The warp's loop count is
// uniform (mma.sync needs the whole warp). __launch_bounds__(.., 2) lets ptxas keep all 2 * kUnroll loads of a step
// in flight (with a tighter register budget it interleaves them with the mmas, one round trip each).
template <typename T, bool VEC, bool GATED>
__global__ void __launch_bounds__(kThreads, FOLIO_GEMV_MIN_BLOCKS) linear_mma_kernel(LinearParams p) {
  __shared__ float partial[kWarps][kMaxRows][kTileRows];  // per warp: y[m][n0 + j] over its part of K
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t K = p.in_features;
  const int64_t num_chunks = (K + 7) / 8;
  // Lanes past the last row of W or of x read row 0 instead: the mma keeps rows of D apart (D[m][n] reads only
  // row m of A and column n of B), and those rows of D are never stored. Loads are unconditional (chunks past K
  // re-read the last chunk, then count as zero) so that the compiler keeps all of them in flight.
  const int64_t w_row_index = gemv::weight_row_index<GATED, kTileRows>(g, p.out_features);
  const uint16_t* w_row = static_cast<const uint16_t*>(p.weight) +
                          (w_row_index < p.out_features ? w_row_index * p.weight_row_stride : 0);
  const uint16_t* x_row = static_cast<const uint16_t*>(p.x) + (g < p.num_rows ? g * p.x_row_stride : 0);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  // Two accumulator chains (elements 0..3 and 4..7 of each chunk) halve the serial mma latency per step.
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // Launched early (launch.cuh): the first step's weight loads go out while the kernel that writes x finishes;
  // x is read only after the wait. (The element-wise path, off every real shape, just waits first.)
  bool waited = !VEC;
  if constexpr (!VEC) {
    grid_dependency_wait();
    allow_dependent_launch();
  }
  for (int64_t step = static_cast<int64_t>(warp) * kWarpStepChunks; step < num_chunks;
       step += kWarps * kWarpStepChunks) {
    uint4 wv[kUnroll], xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      wv[u] = load_chunk16<VEC, true>(w_row, min(step + 4 * u + t, num_chunks - 1), K);
    }
    gemv::wait_for_x_once(waited);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      xv[u] = load_chunk16<VEC, false>(x_row, min(step + 4 * u + t, num_chunks - 1), K);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (step + 4 * u + t >= num_chunks) wv[u] = xv[u] = zero;
      mma_k16<T>(acc, xv[u].x, xv[u].y, wv[u].x, wv[u].y);
      mma_k16<T>(acc_hi, xv[u].z, xv[u].w, wv[u].z, wv[u].w);
    }
  }
  gemv::finish_block<T, GATED, kWarps, kMaxRows, kTileRows>(waited, acc, acc_hi, partial, warp, g, t, p.num_rows,
                                                             p.out_features, nullptr, p.bias, p.out);
}

constexpr int kF32Unroll = 4;  // float4 loads of W in flight per lane

// Chunk c (elements 4c .. 4c+3) of a float row; elements at k >= K read as zero. VEC: 16-byte aligned, K % 4 == 0.
template <bool VEC, bool STREAM>
__device__ __forceinline__ float4 load_chunk32(const float* row, int64_t c, int64_t K) {
  if constexpr (VEC) {
    if constexpr (STREAM) {
      const uint4 v = load_streaming(row + 4 * c);
      return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
    } else {
      return *reinterpret_cast<const float4*>(row + 4 * c);  // plain load: see load_chunk16
    }
  } else {
    const int64_t k = 4 * c;
    return make_float4(k < K ? row[k] : 0.0f, k + 1 < K ? row[k + 1] : 0.0f, k + 2 < K ? row[k + 2] : 0.0f,
                       k + 3 < K ? row[k + 3] : 0.0f);
  }
}

// float32: warp w of block b owns row n = 8b + w of W; lane l sums chunks l, l + 32, ... in order, then the warp
// adds its lanes' sums (shuffle tree).
template <bool VEC>
__global__ void __launch_bounds__(kThreads) linear_f32_kernel(LinearParams p) {
  grid_dependency_wait();  // before the first return: see launch.cuh
  allow_dependent_launch();
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (n >= p.out_features) return;  // whole warps only
  const int64_t K = p.in_features;
  const int64_t num_chunks = (K + 3) / 4;
  const float* w_row = static_cast<const float*>(p.weight) + n * p.weight_row_stride;
  const float* x = static_cast<const float*>(p.x);

  float acc[kMaxRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) acc[m] = 0.0f;
  for (int64_t step = lane; step < num_chunks; step += 32 * kF32Unroll) {
    float4 wv[kF32Unroll];
#pragma unroll
    for (int u = 0; u < kF32Unroll; ++u) {
      const int64_t c = step + 32 * u;
      wv[u] = c < num_chunks ? load_chunk32<VEC, true>(w_row, c, K) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kF32Unroll; ++u) {
      const int64_t c = step + 32 * u;
      if (c >= num_chunks) break;
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
        if (m < p.num_rows) {
          const float4 xv = load_chunk32<VEC, false>(x + m * p.x_row_stride, c, K);
          acc[m] = fmaf(wv[u].x, xv.x, acc[m]);
          acc[m] = fmaf(wv[u].y, xv.y, acc[m]);
          acc[m] = fmaf(wv[u].z, xv.z, acc[m]);
          acc[m] = fmaf(wv[u].w, xv.w, acc[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    if (m < p.num_rows) {
      float sum = warp_sum(acc[m]);
      if (lane == 0) {
        if (p.bias != nullptr) sum += static_cast<const float*>(p.bias)[n];
        static_cast<float*>(p.out)[m * p.out_features + n] = sum;
      }
    }
  }
}

// Rows of `width` elements at `base`, `row_stride` apart, all start on 16 bytes and hold whole 16-byte chunks.
bool rows_vectorizable(const void* base, int64_t row_stride, int64_t width, int64_t per_16_bytes) {
  return aligned16(base) && row_stride % per_16_bytes == 0 && width % per_16_bytes == 0;
}

}  // namespace

cudaError_t linear(const LinearParams& p, const Launch& launch) {
  if (p.num_rows < 0 || p.num_rows > kLinearMaxRows) return cudaErrorInvalidValue;
  if (p.num_rows == 0 || p.out_features == 0) return cudaSuccess;
  const int64_t per_16_bytes = p.dtype == ScalarType::kFloat32 ? 4 : 8;
  // (the stride of a single row is never used, and torch gives size-1 dims arbitrary strides)
  const bool vec =
      rows_vectorizable(p.weight, p.out_features > 1 ? p.weight_row_stride : 0, p.in_features, per_16_bytes) &&
      rows_vectorizable(p.x, p.num_rows > 1 ? p.x_row_stride : 0, p.in_features, per_16_bytes);
  if (p.silu_gate && (p.dtype == ScalarType::kFloat32 || p.out_features % 2)) {
    return cudaErrorInvalidValue;  // 16-bit types; [gate; up] halves
  }
  static_assert(kTileRows == kWarps, "both kernels cover 8 rows of W per block");
  const auto blocks = static_cast<unsigned>(p.silu_gate ? (p.out_features / 2 + 3) / 4
                                                        : (p.out_features + kTileRows - 1) / kTileRows);
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      if (vec) {
        launch_kernel(linear_f32_kernel<true>, dim3(blocks), dim3(kThreads), 0, launch, p);
      } else {
        launch_kernel(linear_f32_kernel<false>, dim3(blocks), dim3(kThreads), 0, launch, p);
      }
    } else if (p.silu_gate) {
      if (vec) {
        launch_kernel(linear_mma_kernel<T, true, true>, dim3(blocks), dim3(kThreads), 0, launch, p);
      } else {
        launch_kernel(linear_mma_kernel<T, false, true>, dim3(blocks), dim3(kThreads), 0, launch, p);
      }
    } else if (vec) {
      launch_kernel(linear_mma_kernel<T, true, false>, dim3(blocks), dim3(kThreads), 0, launch, p);
    } else {
      launch_kernel(linear_mma_kernel<T, false, false>, dim3(blocks), dim3(kThreads), 0, launch, p);
    }
  });
  return cudaGetLastError();
}

}  // namespace folio::cuda
