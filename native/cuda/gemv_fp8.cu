// linear for decode with FP8 weights: y[m, n] = scale[n] * sum_k x[m, k] * W[n, k] (+ bias[n]) for M <= 8 rows of x;
// W is [N, K] float8 e4m3 (row-major, F.linear's layout) with one fp32 scale per output channel, x float16/bfloat16.
// The layout is gemv.cu's (read it first): a tile of 8 rows of W is the B operand of mma.m16n8k16 with x as A, a
// block's warps split K, and every byte of W is loaded once with a streaming 16-byte load. What differs:
//
//  * A block owns kTiles tiles (16 rows) sharing each chunk of x: see linear_fp8_kernel.
//  * A 16-byte load holds 16 weights (one "chunk"), so a chunk feeds four mmas and pairs with 32 bytes of x: the
//    weight stream is half the bf16 GEMV's bytes for the same instructions on x.
//  * e4m3 -> f16 is exact (3 mantissa bits, exponents 2^-9 .. 2^8 all fit f16), two at a time with the hardware
//    conversion on sm_89+ (cvt.rn.f16x2.e4m3x2; cuda_fp8.h emulates it on older targets). float16 x multiplies
//    those directly. bfloat16 x needs bfloat16 weights: the f16 bits shifted right by 3 are a bf16 of the same
//    sign and mantissa whose exponent lacks the bias difference (127 - 15 = 112), which one bf16x2 multiply by 2^112
//    restores, exactly (every e4m3 value is a normal f16, hence a normal bf16 after the shift). Folding 2^112 into
//    the fp32 scale instead would leave products near fp32's subnormal range inside the mma.
//  * The per-channel scale multiplies the fp32 sum in the epilogue, before the bias and the single rounding.
//  * silu_gate as in gemv.cu: tile b takes gate rows 4b..4b+3 and up rows I+4b..I+4b+3; each factor is scaled,
//    biased and rounded to the dtype, then combined with silu_and_mul's arithmetic.
//
// Deterministic and batch-invariant like gemv.cu: the summation order of y[m, n] depends on K only.
#include <cuda_fp8.h>

#include <type_traits>

#include "device_utils.cuh"
#include "gemv_common.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

// Tuning knobs: tiles of 8 rows per block, 16-byte loads per lane and tile in flight, blocks per SM. The defaults
// are the fastest of bench/gemv_sweep.sh FP8=1's variants on the 8B decode shapes (bench/RESULTS.md).
#ifndef FOLIO_GEMV_FP8_TILES
#define FOLIO_GEMV_FP8_TILES 2
#endif
#ifndef FOLIO_GEMV_FP8_UNROLL
#define FOLIO_GEMV_FP8_UNROLL 4
#endif
#ifndef FOLIO_GEMV_FP8_MIN_BLOCKS
#define FOLIO_GEMV_FP8_MIN_BLOCKS 2
#endif

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 8;                    // rows of W per tile (the mma's n)
constexpr int kTiles = FOLIO_GEMV_FP8_TILES;     // tiles per block
constexpr int kUnroll = FOLIO_GEMV_FP8_UNROLL;  // 16-byte loads of W in flight per lane
constexpr int kWarpStepChunks = 4 * kUnroll;    // 16-element chunks of a row per warp step (4 lanes share a row)
constexpr int kChunk = 16;                      // weights per 16-byte load
constexpr int kMaxRows = static_cast<int>(kLinearMaxRows);
static_assert(kMaxRows <= 8, "x is the A operand of m16n8k16: rows 0..7 of a group of 8 lanes");

using gemv::load_streaming;  // (gemv_common.cuh)

// Chunk c of a row of W: weights 16c .. 16c+15 as bytes, byte i of word i / 4 at bits 8 * (i % 4). k >= K reads 0.
template <bool VEC>
__device__ __forceinline__ uint4 load_w_chunk(const uint8_t* row, int64_t c, int64_t K) {
  if constexpr (VEC) {
    return load_streaming(row + kChunk * c);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = 0u;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int64_t k = kChunk * c + 4 * i + b;
        w[i] |= (k < K ? static_cast<uint32_t>(row[k]) : 0u) << (8 * b);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Half `h` (0: elements 0..7, 1: 8..15) of chunk c of a row of x (16-bit), element 2i in the low half of word i.
// Plain loads (x may still be written by the previous kernel when this one starts: see gemv.cu's load_chunk16).
template <bool VEC>
__device__ __forceinline__ uint4 load_x_half(const uint16_t* row, int64_t c, int h, int64_t K) {
  const int64_t k0 = kChunk * c + 8 * h;
  if constexpr (VEC) {
    return *reinterpret_cast<const uint4*>(row + k0);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t k = k0 + 2 * i;
      w[i] = (k < K ? static_cast<uint32_t>(row[k]) : 0u) | ((k + 1 < K ? static_cast<uint32_t>(row[k + 1]) : 0u) << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Two e4m3 weights (the low 16 bits of `pair`, first in the low byte) as T x2 bits, first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
  const uint32_t bits = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  if constexpr (std::is_same_v<T, __half>) {
    return bits;
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "fp8x2_to: float16 or bfloat16");
    // f16 s|e5|m10 >> 3 = bf16 s|e8|m7 with the f16 exponent, i.e. the value times 2^-112 (see the file comment)
    const uint32_t scaled = ((bits >> 3) & 0x0FFF0FFFu) | (bits & 0x80008000u);
    constexpr uint32_t kTwoPow112 = 0x77807780u;  // bf16x2 (2^112, 2^112): exponent field 112 + 127 = 239
    __nv_bfloat162 v, f;
    memcpy(&v, &scaled, 4);
    memcpy(&f, &kTwoPow112, 4);
    const __nv_bfloat162 r = __hmul2(v, f);
    uint32_t out;
    memcpy(&out, &r, 4);
    return out;
  }
}

using gemv::mma_k16;  // (gemv_common.cuh)

// One chunk: four mmas. mma j takes weights 4j .. 4j+3 (word j of w) and x elements 4j .. 4j+3 (words 2j, 2j+1 of
// the chunk's 32 bytes of x) at its k positions {2t, 2t+1, 2t+8, 2t+9}, the same on both operands.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], float (&acc_hi)[4], uint4 w, uint4 x_lo, uint4 x_hi) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w};
  const uint32_t xv[8] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w, x_hi.x, x_hi.y, x_hi.z, x_hi.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t b_lo = fp8x2_to<T>(wv[j]), b_hi = fp8x2_to<T>(wv[j] >> 16);
    mma_k16<T>(j % 2 ? acc_hi : acc, xv[2 * j], xv[2 * j + 1], b_lo, b_hi);
  }
}

// Block b owns kTiles tiles of 8 rows of W: tile j = kTiles * b + j has rows 8 tile .. 8 tile + 7 (GATED: see the
// file comment). In warp w, lane (g, t) reads row g of each tile and row g of x: at warp step s and unroll u, chunk
// c = (s * kWarps + w) * kWarpStepChunks + 4u + t. The tiles share x's chunks, and their loads double a block's
// bytes per round trip: a block does the same few dependent rounds of loads whatever their width, so with 1-byte
// weights 8 rows a block left half the bandwidth unused.
template <typename T, bool VEC, bool GATED>
__global__ void __launch_bounds__(kThreads, FOLIO_GEMV_FP8_MIN_BLOCKS) linear_fp8_kernel(LinearFp8Params p) {
  __shared__ float partial[kTiles][kWarps][kMaxRows][kTileRows];  // per tile and warp: unscaled y[m][row j]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t K = p.in_features;
  const int64_t num_chunks = (K + kChunk - 1) / kChunk;
  const uint8_t* w_rows[kTiles];
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const int64_t index = gemv::weight_row_index<GATED, kTileRows>(g, p.out_features, kTiles * blockIdx.x + j);
    // Lanes past the last row of W or x read row 0: their rows of D are never stored (see gemv.cu).
    w_rows[j] = p.weight + (index < p.out_features ? index * p.weight_row_stride : 0);
  }
  const uint16_t* x_row = static_cast<const uint16_t*>(p.x) + (g < p.num_rows ? g * p.x_row_stride : 0);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  float acc[kTiles][4] = {}, acc_hi[kTiles][4] = {};
  bool waited = !VEC;  // the weight loads of the first step go out before the wait for x's producer (launch.cuh)
  if constexpr (!VEC) {
    grid_dependency_wait();
    allow_dependent_launch();
  }
  for (int64_t step = static_cast<int64_t>(warp) * kWarpStepChunks; step < num_chunks;
       step += kWarps * kWarpStepChunks) {
    uint4 wv[kTiles][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < kTiles; ++j) wv[j][u] = load_w_chunk<VEC>(w_rows[j], min(step + 4 * u + t, num_chunks - 1), K);
    }
    gemv::wait_for_x_once(waited);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = min(step + 4 * u + t, num_chunks - 1);
      uint4 x_lo = load_x_half<VEC>(x_row, c, 0, K), x_hi = load_x_half<VEC>(x_row, c, 1, K);
      const bool past = step + 4 * u + t >= num_chunks;
      if (past) x_lo = x_hi = zero;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) mma_chunk<T>(acc[j], acc_hi[j], past ? zero : wv[j][u], x_lo, x_hi);
    }
  }
  gemv::wait_for_x_once(waited);  // (a warp that ran no step: K below one warp step)
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    partial[j][warp][g][2 * t] = acc[j][0] + acc_hi[j][0];
    partial[j][warp][g][2 * t + 1] = acc[j][1] + acc_hi[j][1];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    gemv::store_block_rows<T, GATED, kWarps, kMaxRows, kTileRows>(partial[j], p.num_rows, p.out_features,
                                                                  p.weight_scale, p.bias, p.out,
                                                                  kTiles * blockIdx.x + j);
  }
}

bool aligned_rows(const void* base, int64_t row_stride_bytes) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride_bytes % 16 == 0;
}

template <typename T, bool VEC>
void launch_typed(const LinearFp8Params& p, unsigned blocks, const Launch& launch) {
  if (p.silu_gate) {
    launch_kernel(linear_fp8_kernel<T, VEC, true>, dim3(blocks), dim3(kThreads), 0, launch, p);
  } else {
    launch_kernel(linear_fp8_kernel<T, VEC, false>, dim3(blocks), dim3(kThreads), 0, launch, p);
  }
}

}  // namespace

cudaError_t linear_fp8(const LinearFp8Params& p, const Launch& launch) {
  if (p.num_rows < 0 || p.num_rows > kLinearMaxRows || p.dtype == ScalarType::kFloat32) return cudaErrorInvalidValue;
  if (p.silu_gate && p.out_features % 2) return cudaErrorInvalidValue;  // [gate; up] halves
  if (p.num_rows == 0 || p.out_features == 0) return cudaSuccess;
  // (the stride of a single row is never used, and torch gives size-1 dims arbitrary strides)
  const bool vec = p.in_features % kChunk == 0 &&
                   aligned_rows(p.weight, p.out_features > 1 ? p.weight_row_stride : 0) &&
                   aligned_rows(p.x, p.num_rows > 1 ? 2 * p.x_row_stride : 0);
  const int64_t tiles = p.silu_gate ? (p.out_features / 2 + 3) / 4 : (p.out_features + kTileRows - 1) / kTileRows;
  const auto blocks = static_cast<unsigned>((tiles + kTiles - 1) / kTiles);
  if (p.dtype == ScalarType::kBFloat16) {
    vec ? launch_typed<__nv_bfloat16, true>(p, blocks, launch) : launch_typed<__nv_bfloat16, false>(p, blocks, launch);
  } else {
    vec ? launch_typed<__half, true>(p, blocks, launch) : launch_typed<__half, false>(p, blocks, launch);
  }
  return cudaGetLastError();
}

}  // namespace folio::cuda
