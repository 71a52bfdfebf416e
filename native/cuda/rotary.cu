// Rotary embedding in place on q and k, fused with writing the rotated k and v into the paged caches.
#include <algorithm>

#include "device_utils.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kMaxHalfDim = 512;                // head_dim up to 1024
constexpr int kRotaryMaxThreads = kMaxHalfDim;  // a block: rows of lanes, round_up(D/2, 32) (VEC 1) or D/16 (VEC 8)
constexpr int kRotaryRowThreads = 128;          // rows per block = max(1, this / lanes)
constexpr int64_t kRotaryTargetBlocks = 1024;   // past about this many blocks, each row takes several heads

// VEC consecutive pairs (x[i .. i + VEC), x[i + half .. i + half + VEC)) of one head, as floats: VEC = 1 with
// scalar accesses (any layout), VEC = 8 with 16-byte vectors (the launcher has checked alignment and strides).
template <typename T, int VEC>
struct HeadPairs {
  float lo[VEC], hi[VEC];
  __device__ __forceinline__ void load(const T* x, int i, int half) {
    if constexpr (VEC == 1) {
      lo[0] = to_float(x[i]);
      hi[0] = to_float(x[i + half]);
    } else {
      Vec8<T> a, b;
      a.load(x + i);
      b.load(x + i + half);
      a.to_floats(lo);
      b.to_floats(hi);
    }
  }
  __device__ __forceinline__ void store(T* x, int i, int half) const {
    if constexpr (VEC == 1) {
      x[i] = from_float<T>(lo[0]);
      x[i + half] = from_float<T>(hi[0]);
    } else {
      Vec8<T>::store(x + i, lo);
      Vec8<T>::store(x + i + half, hi);
    }
  }
  // the same elements copied as stored (no conversion)
  __device__ __forceinline__ static void copy(const T* src, T* dst, int i, int half) {
    if constexpr (VEC == 1) {
      dst[i] = src[i];
      dst[i + half] = src[i + half];
    } else {
      *reinterpret_cast<Vec8<T>*>(dst + i) = *reinterpret_cast<const Vec8<T>*>(src + i);
      *reinterpret_cast<Vec8<T>*>(dst + i + half) = *reinterpret_cast<const Vec8<T>*>(src + i + half);
    }
  }
};

// A token has num_q_heads + num_kv_heads rotated "units" (its q and k heads) and num_kv_heads v-copy units.
// Grid (token, unit group): a decode step of a few tokens still spreads over dozens of blocks instead of one
// block doing every head serially. Thread (lane l, row r) owns pairs i = l * VEC .. i + VEC - 1 (each pair
// (i, i + D/2)) of units base + r + j * rows, j < units_per_row. Prefill raises units_per_row so that the angles
// are amortized over several heads rather than redone per head. A thread that rotates a k pair also writes it,
// rounded, to the cache, so the cache holds exactly the k left in `k`. q, k and v are addressed through their
// token and head strides only, so a caller can pass the slices of a fused QKV output as they are, without copies;
// the binding has checked that no two threads touch one element.
//
// Angles use full-precision sincosf: positions times low frequencies reach arguments where fast intrinsics lose
// digits. VEC = 1: each thread computes its own, with no shared memory or barrier (decode latency). VEC = 8
// (16-byte loads; with 2-byte loads each thread had one 4-byte pair in flight, and prefill ran at about two thirds
// of copy bandwidth): a row of lanes covers a head with 8 pairs each, so the block computes the token's angles
// once into shared memory instead of every row repeating them. The arithmetic per element is the same for both,
// so their results are bit-identical.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRotaryMaxThreads)
    rotary_cache_write_kernel(RotaryCacheWriteParams p, int units_per_row) {
  __shared__ float cos_s[VEC == 1 ? 1 : kMaxHalfDim], sin_s[VEC == 1 ? 1 : kMaxHalfDim];
  grid_dependency_wait();  // before the first return: see launch.cuh
  allow_dependent_launch();
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(p.head_dim / 2);
  const int num_q = static_cast<int>(p.num_q_heads), num_kv = static_cast<int>(p.num_kv_heads);
  const int num_rot = num_q + num_kv, num_units = num_rot + num_kv;
  const int rows = blockDim.y;
  const int block_first = static_cast<int>(blockIdx.y) * rows * units_per_row;
  if constexpr (VEC > 1) {
    if (block_first < num_rot) {  // uniform over the block: it rotates something, so it needs the angles
      const float position = static_cast<float>(p.positions[t]);
      for (int j = threadIdx.y * blockDim.x + threadIdx.x; j < half; j += blockDim.x * rows) {
        sincosf(position * p.inv_freq[j], &sin_s[j], &cos_s[j]);
      }
      __syncthreads();
    }
  }
  const int i = static_cast<int>(threadIdx.x) * VEC;
  const int first = block_first + static_cast<int>(threadIdx.y);
  if (i >= half || first >= num_units) return;

  const int64_t slot = p.slot_mapping[t];
  if (first >= num_rot && slot < 0) return;  // v copies only, and nothing to write
  const int64_t cache_offset =
      slot < 0 ? 0 : (slot / p.page_size) * p.cache_stride_page + (slot % p.page_size) * p.cache_stride_slot;
  float cos_i = 0.0f, sin_i = 0.0f;  // VEC = 1: this thread's angle (VEC = 8 reads them from shared memory)
  if (VEC == 1 && first < num_rot) sincosf(static_cast<float>(p.positions[t]) * p.inv_freq[i], &sin_i, &cos_i);

  T* q = static_cast<T*>(p.q) + t * p.q_stride_token;
  T* k = static_cast<T*>(p.k) + t * p.k_stride_token;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride_token;
  for (int j = 0, u = first; j < units_per_row && u < num_units; ++j, u += rows) {
    if (u >= num_rot) {  // v head u - num_rot: copied as is
      if (slot < 0) return;
      const int h = u - num_rot;
      HeadPairs<T, VEC>::copy(v + h * p.v_stride_head,
                              static_cast<T*>(p.v_cache) + cache_offset + h * p.cache_stride_head, i, half);
      continue;
    }
    const bool is_q = u < num_q;
    const int kv_head = u - num_q;
    T* x = is_q ? q + u * p.q_stride_head : k + kv_head * p.k_stride_head;
    HeadPairs<T, VEC> pairs;
    pairs.load(x, i, half);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float x1 = pairs.lo[e], x2 = pairs.hi[e];
      const float c = VEC == 1 ? cos_i : cos_s[i + e], s = VEC == 1 ? sin_i : sin_s[i + e];
      // y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, with the fma contraction spelled out so that the rounding does
      // not hang on the compiler's choice (the one nvcc made for fp16/bf16 in the first, one-block-per-token
      // kernel)
      pairs.lo[e] = __fmaf_rn(x1, c, -__fmul_rn(x2, s));
      pairs.hi[e] = __fmaf_rn(x1, s, __fmul_rn(x2, c));
    }
    pairs.store(x, i, half);  // rounds each element to T
    if (!is_q && slot >= 0) {
      pairs.store(static_cast<T*>(p.k_cache) + cache_offset + kv_head * p.cache_stride_head, i, half);
    }
  }
}

// Every address the VEC = 8 kernel forms is a multiple of 8 elements from an aligned base: bases 16-byte aligned
// (32 for float: Vec8<float> is two float4), strides and half a head whole numbers of 8 elements.
bool rotary_vec8_ok(const RotaryCacheWriteParams& p) {
  const int64_t align = p.dtype == ScalarType::kFloat32 ? 32 : 16;
  const auto aligned = [align](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % align == 0; };
  const int64_t strides[] = {p.q_stride_token, p.q_stride_head, p.k_stride_token, p.k_stride_head, p.v_stride_token,
                             p.v_stride_head, p.cache_stride_page, p.cache_stride_slot, p.cache_stride_head,
                             p.head_dim / 2};
  for (const int64_t stride : strides) {
    if (stride % 8 != 0) return false;
  }
  return aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.k_cache) && aligned(p.v_cache);
}

}  // namespace

cudaError_t rotary_cache_write(const RotaryCacheWriteParams& p, const Launch& launch) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.head_dim / 2 > kMaxHalfDim) return cudaErrorInvalidValue;  // the binding refuses such head dims first
  const int64_t half = p.head_dim / 2;
  const int64_t num_units = p.num_q_heads + 2 * p.num_kv_heads;
  if (half == 0 || num_units == 0) return cudaSuccess;  // nothing to rotate or copy
  if (p.num_tokens > INT32_MAX || num_units > INT32_MAX) return cudaErrorInvalidValue;
  const bool vec8 = rotary_vec8_ok(p);
  // scalar: one lane per pair, rounded up to whole warps; vec8: one lane per 8 pairs
  const int64_t lanes = vec8 ? half / 8 : (half + 31) / 32 * 32;
  const int64_t rows = std::min<int64_t>(std::max<int64_t>(kRotaryRowThreads / lanes, 1), num_units);
  // Few tokens: one unit per row, as many blocks as possible. Many tokens: stack units onto rows until the grid
  // is about kRotaryTargetBlocks, then even out the groups so the last one is not nearly empty.
  const int64_t max_per_row = (num_units + rows - 1) / rows;
  const int64_t per_row =
      std::min(std::max<int64_t>(p.num_tokens * num_units / (rows * kRotaryTargetBlocks), 1), max_per_row);
  const int64_t groups = (num_units + rows * per_row - 1) / (rows * per_row);
  const int64_t units_per_row = (num_units + groups * rows - 1) / (groups * rows);
  const int64_t grid_y = (num_units + rows * units_per_row - 1) / (rows * units_per_row);  // <= groups
  if (grid_y > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(grid_y));
  const dim3 block(static_cast<unsigned>(lanes), static_cast<unsigned>(rows));
  dispatch_scalar(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vec8) {
      launch_kernel(rotary_cache_write_kernel<T, 8>, grid, block, 0, launch, p, static_cast<int>(units_per_row));
    } else {
      launch_kernel(rotary_cache_write_kernel<T, 1>, grid, block, 0, launch, p, static_cast<int>(units_per_row));
    }
  });
  return cudaGetLastError();
}

}  // namespace folio::cuda
