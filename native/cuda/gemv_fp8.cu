// linear for decode with FP8 weights: y[m, n] = scale[n] * sum_k x[m, k] * W[n, k] (+ bias[n]) for M <= 8 rows of x;
// W is [N, K] float8 e4m3 (row-major, F.linear's layout) with one fp32 scale per output channel, x float16/bfloat16.
// gemv.cu's plan (read it first: a block's warps split K, every byte of W is loaded once with a 16-byte copy, the
// warps' sums meet in shared memory), with these differences:
//
//  * A 16-byte chunk holds 16 weights, so per byte of W there is twice the multiply work of the bf16 GEMV, plus
//    the conversions: the kernel is bound by issue slots as much as by memory, and its layout minimizes
//    instructions per weight. W is the A operand of mma.m16n8k16 (16 rows: a "group" of two tiles of 8) and x the
//    B operand (n = 8 rows of x). Each lane holds the chunks of one row of each tile and the same chunks of one row
//    of x, so both fragments come straight from the lane's own loads (no zero halves, no register moves), and one
//    mma covers 16 rows of W where x as A covered 8.
//  * The grid is persistent (as many blocks as fit, block b taking groups b, b + grid, ...), and each lane stages
//    its own chunks of W through a ring of kStages warp steps in shared memory with cp.async: the copies of the next
//    steps, across group boundaries, are in flight while it converts and multiplies the current one, without
//    holding registers (K = 4096 is two warp steps: a block per group waited a full round trip at every step and
//    block boundary). A lane reads back only what it copied itself: the ring needs no barrier.
//  * e4m3 -> f16 is exact (3 mantissa bits, exponents 2^-9 .. 2^8 all fit f16), two at a time with the hardware
//    conversion on sm_89+ (cuda_fp8.h emulates it on older targets). float16 x multiplies those directly;
//    bfloat16 x needs bfloat16 weights, built from the f16 bits exactly, every value a normal bf16 (fp8x4_to).
//    Folding the exponent difference into the fp32 scale instead would leave products near fp32's subnormal range
//    inside the mma.
//  * The per-channel scale multiplies the fp32 sum in the epilogue, before the bias and the single rounding.
//  * silu_gate as in gemv.cu: tile b takes gate rows 4b..4b+3 and up rows I+4b..I+4b+3; each factor is scaled,
//    biased and rounded to the dtype, then combined with silu_and_mul's arithmetic.
//
// Deterministic and batch-invariant like gemv.cu: which products a lane sums, and in which order, depends on K only
// (not on N, M, the grid, the alignment or the other rows of x; an mma keeps the columns of D apart).
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"
#include "gemv_common.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

// Tuning knobs: 16-byte chunks per lane, row and warp step; blocks per SM (the register budget); warp steps in the
// ring. The defaults are the fastest of bench/gemv_sweep.sh FP8=1's variants on the 8B decode shapes
// (bench/RESULTS.md). kUnroll fixes the summation order (with kWarps); the others do not change results.
#ifndef FOLIO_GEMV_FP8_UNROLL
#define FOLIO_GEMV_FP8_UNROLL 4
#endif
#ifndef FOLIO_GEMV_FP8_MIN_BLOCKS
#define FOLIO_GEMV_FP8_MIN_BLOCKS 2
#endif
#ifndef FOLIO_GEMV_FP8_STAGES
#define FOLIO_GEMV_FP8_STAGES 2
#endif
#ifndef FOLIO_GEMV_FP8_WARPS
#define FOLIO_GEMV_FP8_WARPS 8
#endif

constexpr int kWarps = FOLIO_GEMV_FP8_WARPS;   // per block: split K
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 8;                    // rows of W per tile (half the mma's m; the epilogue's unit)
constexpr int kTiles = 2;                       // tiles per group: the mma's 16 rows
constexpr int kUnroll = FOLIO_GEMV_FP8_UNROLL;  // chunks per lane, tile and warp step
constexpr int kWarpStepChunks = 4 * kUnroll;    // 16-element chunks of a row per warp step (4 lanes share a row)
constexpr int64_t kBlockStepChunks = int64_t{kWarps} * kWarpStepChunks;
constexpr int kChunk = 16;                      // weights per 16-byte chunk
constexpr int kStages = FOLIO_GEMV_FP8_STAGES;  // warp steps of W in the ring (kStages - 1 in flight ahead)
constexpr int kStageChunks = kTiles * kUnroll;  // chunks per lane and warp step
constexpr size_t kRingBytes = sizeof(uint4) * kStages * kStageChunks * kThreads;
constexpr int kMaxRows = static_cast<int>(kLinearMaxRows);
static_assert(kMaxRows <= 8, "x is the B operand of m16n8k16: its 8 columns are rows of x");
static_assert(kThreads >= kMaxRows * kTileRows, "the epilogue gives each output of a tile one thread");
static_assert(kStages >= 2 && kStages <= 4, "cp_async_wait takes kStages - 1 as an immediate");

// Chunk c of a row of W, element by element (the unaligned path): weights 16c .. 16c+15, byte i of word i / 4 at
// bits 8 * (i % 4); k >= K reads 0.
__device__ __forceinline__ uint4 load_w_chunk_bytes(const uint8_t* row, int64_t c, int64_t K) {
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

// Four e4m3 weights (first in the low byte) as two T x2 words: lo = weights 0, 1 and hi = weights 2, 3, the first
// of each in the low half.
//
// bfloat16: the f16 bits h shifted right by 3 put the f16 exponent and mantissa where a bf16's go, so that a = h >> 3
// is the bf16 of the value times 2^-112 (112 = 127 - 15, the bias difference; every e4m3 value is a normal f16,
// hence a normal bf16 here), except that the sign lands on bit 12 (exponent bit 5) instead of 15. Adding 7 times
// that bit carries it up to bit 15 (0x1000 + 0x7000 = 0x8000; bits 13..15 of a are zero: the f16 mantissa's low 7
// bits are), without a carry into the other half. One bf16x2 multiply by 2^112 then restores the value, exactly.
// (Masking the magnitude and or-ing the sign back in takes one integer-pipe operation more per pair, and that pipe
// is the kernel's busiest: the IMAD here issues to the FMA pipe.)
template <typename T>
__device__ __forceinline__ void fp8x4_to(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(l.y) << 16);
  hi = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
#endif
  if constexpr (!std::is_same_v<T, __half>) {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "fp8x4_to: float16 or bfloat16");
    constexpr uint32_t kTwoPow112 = 0x77807780u;  // bf16x2 (2^112, 2^112): exponent field 112 + 127 = 239
    uint32_t* halves[2] = {&lo, &hi};
#pragma unroll
    for (uint32_t* v : halves) {
      const uint32_t a = *v >> 3;
      const uint32_t b = a + 7u * (a & 0x10001000u);
      __nv_bfloat162 bv, f;
      memcpy(&bv, &b, 4);
      memcpy(&f, &kTwoPow112, 4);
      const __nv_bfloat162 r = __hmul2(bv, f);
      memcpy(v, &r, 4);
    }
  }
}

using gemv::mma_m16n8k16;  // (gemv_common.cuh): A = 16 rows of W, B = 8 rows of x

// One chunk of the lane's two rows of W (w0: tile 0's, w1: tile 1's) against the same chunk of its row of x: four
// mmas. mma j takes weights 4j .. 4j+3 (word j) and x elements 4j .. 4j+3 (words 2j, 2j+1 of the chunk's 32 bytes
// of x) at its k positions {2t, 2t+1, 2t+8, 2t+9}, the same on both operands. Two accumulator chains (even and odd
// j) halve the serial mma latency.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], float (&acc_hi)[4], uint4 w0, uint4 w1, uint4 x_lo,
                                          uint4 x_hi) {
  const uint32_t wv0[4] = {w0.x, w0.y, w0.z, w0.w}, wv1[4] = {w1.x, w1.y, w1.z, w1.w};
  const uint32_t xv[8] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w, x_hi.x, x_hi.y, x_hi.z, x_hi.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a0, a1, a2, a3;
    fp8x4_to<T>(wv0[j], a0, a2);
    fp8x4_to<T>(wv1[j], a1, a3);
    mma_m16n8k16<T>(j % 2 ? acc_hi : acc, a0, a1, a2, a3, xv[2 * j], xv[2 * j + 1]);
  }
}

// 16 bytes global -> shared without passing through registers (L2 only: W is read once).
__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  const auto dst_addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst_addr), "l"(src) : "memory");
}

// One warp step of one lane: chunk c = first_chunk + 4u of its rows of W (from its ring slot `in`:
// [kTiles][kUnroll][kThreads] uint4, this lane's column) and of its row of x. PARTIAL: the row's last step, whose
// chunks past the end count as zero (the copies re-read the last chunk there).
template <typename T, bool VEC, bool PARTIAL>
__device__ __forceinline__ void multiply_step(float (&acc)[4], float (&acc_hi)[4], const uint4* in,
                                              const uint16_t* x_row, int64_t first_chunk, int64_t num_chunks,
                                              int64_t K) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = first_chunk + 4 * u;
    const int64_t c_read = PARTIAL ? min(c, num_chunks - 1) : c;
    uint4 x_lo = load_x_half<VEC>(x_row, c_read, 0, K), x_hi = load_x_half<VEC>(x_row, c_read, 1, K);
    uint4 w0 = in[u * kThreads], w1 = in[(kUnroll + u) * kThreads];
    if (PARTIAL && c >= num_chunks) x_lo = x_hi = w0 = w1 = zero;
    mma_chunk<T>(acc, acc_hi, w0, w1, x_lo, x_hi);
  }
}

// Block b takes groups b, b + gridDim.x, ... of two tiles of 8 rows of W: tile j of group q has rows 8 (2q + j) .. +7
// (GATED: see the file comment). In warp w, lane (g, t) reads row g of each tile and row g of x: at warp step s and
// unroll u, chunk c = (s * kWarps + w) * kWarpStepChunks + 4u + t (so one instruction of the warp covers 64
// contiguous bytes of each of 8 rows). The warps' sums of a group meet in shared memory (one barrier; two buffers,
// so that a fast warp's next group never overwrites sums still being read).
template <typename T, bool VEC, bool GATED>
__global__ void __launch_bounds__(kThreads, FOLIO_GEMV_FP8_MIN_BLOCKS)
    linear_fp8_kernel(LinearFp8Params p, int64_t num_groups) {
  extern __shared__ uint4 ring[];  // [kStages][kTiles][kUnroll][kThreads]: each lane's own chunks of W
  __shared__ float partial[2][kTiles][kWarps][kMaxRows][kTileRows];  // unscaled y[m][row j] per tile and warp
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t K = p.in_features;
  const int64_t num_chunks = (K + kChunk - 1) / kChunk;
  const int64_t first = int64_t{warp} * kWarpStepChunks + t;  // this lane's first chunk of a row
  const int steps = first - t < num_chunks  // warp-uniform
                        ? static_cast<int>((num_chunks - (first - t) + kBlockStepChunks - 1) / kBlockStepChunks)
                        : 0;
  const int groups = static_cast<int>((num_groups - blockIdx.x + gridDim.x - 1) / gridDim.x);  // this block's
  // Lanes past the last row of x read row 0: their columns of D are never stored (see gemv.cu).
  const uint16_t* x_row = static_cast<const uint16_t*>(p.x) + (g < p.num_rows ? g * p.x_row_stride : 0);

  // The copy cursor: the next warp step to stage (group of this block, step in it) and its ring slot. Every call
  // commits one (possibly empty) group of copies, so "the step consumed now has landed" is wait_group(kStages - 1).
  int copy_group = steps > 0 ? 0 : groups, copy_step = 0, copy_slot = 0;
  const uint8_t* copy_rows[kTiles];
  auto stage_next = [&]() {
    if (copy_group < groups) {
      if (copy_step == 0) {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          const int64_t tile = kTiles * (blockIdx.x + int64_t{copy_group} * gridDim.x) + j;
          const int64_t index = gemv::weight_row_index<GATED, kTileRows>(g, p.out_features, tile);
          // Lanes past the last row of W read row 0: that row of D is never stored.
          copy_rows[j] = p.weight + (index < p.out_features ? index * p.weight_row_stride : 0);
        }
      }
      const int64_t c0 = first + int64_t{copy_step} * kBlockStepChunks;
      uint4* slot = ring + copy_slot * (kStageChunks * kThreads) + threadIdx.x;
      if (VEC && c0 - t + kWarpStepChunks <= num_chunks) {  // (the common case: immediate offsets, no clamp)
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          const uint8_t* src = copy_rows[j] + kChunk * c0;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) copy_async16(slot + (j * kUnroll + u) * kThreads, src + 4 * kChunk * u);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t c = min(c0 + 4 * u, num_chunks - 1);
            uint4* dst = slot + (j * kUnroll + u) * kThreads;
            if constexpr (VEC) {
              copy_async16(dst, copy_rows[j] + kChunk * c);
            } else {
              *dst = load_w_chunk_bytes(copy_rows[j], c, K);
            }
          }
        }
      }
      if (++copy_step == steps) {
        copy_step = 0;
        ++copy_group;
      }
      copy_slot = copy_slot + 1 == kStages ? 0 : copy_slot + 1;
    }
    cp_async_commit();
  };

  bool waited = !VEC;  // the first steps' copies go out before the wait for x's producer (launch.cuh)
  if constexpr (!VEC) {
    grid_dependency_wait();
    allow_dependent_launch();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) stage_next();
  int slot = 0;
  for (int group = 0; group < groups; ++group) {
    float acc[4] = {}, acc_hi[4] = {};  // D[g][2t, 2t+1] (tile 0, rows 2t, 2t+1 of x), D[g+8][..] (tile 1)
    for (int s = 0; s < steps; ++s) {
      stage_next();
      cp_async_wait<kStages - 1>();
      gemv::wait_for_x_once(waited);
      const uint4* in = ring + slot * (kStageChunks * kThreads) + threadIdx.x;
      const int64_t c0 = first + int64_t{s} * kBlockStepChunks;
      if (c0 - t + kWarpStepChunks <= num_chunks) {
        multiply_step<T, VEC, false>(acc, acc_hi, in, x_row, c0, num_chunks, K);
      } else {
        multiply_step<T, VEC, true>(acc, acc_hi, in, x_row, c0, num_chunks, K);
      }
      slot = slot + 1 == kStages ? 0 : slot + 1;
    }
    gemv::wait_for_x_once(waited);  // (a warp that ran no step: K below one warp step)
    const int buf = group & 1;
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      partial[buf][j][warp][2 * t][g] = acc[2 * j] + acc_hi[2 * j];
      partial[buf][j][warp][2 * t + 1][g] = acc[2 * j + 1] + acc_hi[2 * j + 1];
    }
    __syncthreads();
    const int64_t tile0 = kTiles * (blockIdx.x + int64_t{group} * gridDim.x);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      gemv::store_block_rows<T, GATED, kWarps, kMaxRows, kTileRows>(partial[buf][j], p.num_rows, p.out_features,
                                                                    p.weight_scale, p.bias, p.out, tile0 + j);
    }
  }
}

bool aligned_rows(const void* base, int64_t row_stride_bytes) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && row_stride_bytes % 16 == 0;
}

// How many blocks of the kernel the device holds at once (all its multiprocessors), after raising the kernel's
// shared-memory limit to the ring's (needed above 48 KB): the persistent grid. Cached per device: a hardware
// property, and the occupancy query costs host time on every one of a decode step's launches. 0: an error.
template <typename T, bool VEC, bool GATED>
int resident_blocks(int device) {
  constexpr int kMaxDevices = 64;
  static int blocks_by_device[kMaxDevices] = {};  // 0: not asked yet (benign race: every writer stores the same)
  if (device < 0 || device >= kMaxDevices) return 0;
  if (blocks_by_device[device] == 0) {
    int sms = 0, per_sm = 0;
    if (cudaFuncSetAttribute(linear_fp8_kernel<T, VEC, GATED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kRingBytes)) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, linear_fp8_kernel<T, VEC, GATED>, kThreads,
                                                      kRingBytes) != cudaSuccess) {
      return 0;
    }
    blocks_by_device[device] = sms * per_sm;
  }
  return blocks_by_device[device];
}

template <typename T, bool VEC, bool GATED>
cudaError_t launch_groups(const LinearFp8Params& p, int64_t groups, const Launch& launch) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const int resident = resident_blocks<T, VEC, GATED>(device);
  if (resident == 0) return cudaErrorInvalidConfiguration;  // (the ring does not fit this device's shared memory)
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(groups, resident));
  return launch_kernel(linear_fp8_kernel<T, VEC, GATED>, dim3(blocks), dim3(kThreads), kRingBytes, launch, p, groups);
}

template <typename T, bool VEC>
cudaError_t launch_typed(const LinearFp8Params& p, int64_t groups, const Launch& launch) {
  return p.silu_gate ? launch_groups<T, VEC, true>(p, groups, launch) : launch_groups<T, VEC, false>(p, groups, launch);
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
  const int64_t groups = (tiles + kTiles - 1) / kTiles;
  cudaError_t e;
  if (p.dtype == ScalarType::kBFloat16) {
    e = vec ? launch_typed<__nv_bfloat16, true>(p, groups, launch)
            : launch_typed<__nv_bfloat16, false>(p, groups, launch);
  } else {
    e = vec ? launch_typed<__half, true>(p, groups, launch) : launch_typed<__half, false>(p, groups, launch);
  }
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace folio::cuda
