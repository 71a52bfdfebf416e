// Rotary embedding in place on q and k, fused with writing the rotated k and v into the paged caches.
#include <algorithm>

#include "device_utils.cuh"
#include "kernels.cuh"
#include "launch.cuh"

namespace folio::cuda {
namespace {

constexpr int kMaxHalfDim = 512;                // head_dim up to 1024
constexpr int kRotaryMaxThreads = kMaxHalfDim;  // a block: rows of round_up(head_dim / 2, 32) lanes, one per pair
constexpr int kRotaryRowThreads = 128;          // rows per block = max(1, this / lanes)
constexpr int64_t kRotaryTargetBlocks = 1024;   // past about this many blocks, each row takes several heads

// A token has num_q_heads + num_kv_heads rotated "units" (its q and k heads) and num_kv_heads v-copy units.
// Grid (token, unit group): a decode step of a few tokens still spreads over dozens of blocks instead of one
// block doing every head serially. Thread (lane i, row r) owns pair (i, i + D/2) of units base + r + j * rows,
// j < units_per_row, and computes its own cos/sin once (full-precision sincosf: positions times low frequencies
// reach arguments where fast intrinsics lose digits), so no shared memory or barriers are needed. Prefill
// raises units_per_row so that sincosf is amortized over several heads rather than redone per head. A thread
// that rotates a k pair also writes it, rounded, to the cache, so the cache holds exactly the k left in `k`.
// q, k and v are addressed through their token and head strides only, so a caller can pass the slices of a fused
// QKV output as they are, without copies; the binding has checked that no two threads touch one element.
template <typename T>
__global__ void __launch_bounds__(kRotaryMaxThreads)
    rotary_cache_write_kernel(RotaryCacheWriteParams p, int units_per_row) {
  grid_dependency_wait();  // before the first return: see launch.cuh
  allow_dependent_launch();
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(p.head_dim / 2);
  const int i = threadIdx.x;
  if (i >= half) return;
  const int num_q = static_cast<int>(p.num_q_heads), num_kv = static_cast<int>(p.num_kv_heads);
  const int num_rot = num_q + num_kv, num_units = num_rot + num_kv;
  const int rows = blockDim.y;
  const int first = static_cast<int>(blockIdx.y) * rows * units_per_row + static_cast<int>(threadIdx.y);
  if (first >= num_units) return;

  const int64_t slot = p.slot_mapping[t];
  if (first >= num_rot && slot < 0) return;  // v copies only, and nothing to write
  const int64_t cache_offset =
      slot < 0 ? 0 : (slot / p.page_size) * p.cache_stride_page + (slot % p.page_size) * p.cache_stride_slot;
  float sin_i = 0.0f, cos_i = 0.0f;
  if (first < num_rot) sincosf(static_cast<float>(p.positions[t]) * p.inv_freq[i], &sin_i, &cos_i);

  T* q = static_cast<T*>(p.q) + t * p.q_stride_token;
  T* k = static_cast<T*>(p.k) + t * p.k_stride_token;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride_token;
  for (int j = 0, u = first; j < units_per_row && u < num_units; ++j, u += rows) {
    if (u >= num_rot) {  // v head u - num_rot: copied as is
      if (slot < 0) return;
      const int h = u - num_rot;
      const T* src = v + h * p.v_stride_head;
      T* dst = static_cast<T*>(p.v_cache) + cache_offset + h * p.cache_stride_head;
      dst[i] = src[i];
      dst[i + half] = src[i + half];
      continue;
    }
    const bool is_q = u < num_q;
    const int kv_head = u - num_q;
    T* x = is_q ? q + u * p.q_stride_head : k + kv_head * p.k_stride_head;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    // y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin, with the fma contraction spelled out so that the rounding does
    // not hang on the compiler's choice (this is the one nvcc made for fp16/bf16 in the one-block-per-token kernel).
    const T y1 = from_float<T>(__fmaf_rn(x1, cos_i, -__fmul_rn(x2, sin_i)));
    const T y2 = from_float<T>(__fmaf_rn(x1, sin_i, __fmul_rn(x2, cos_i)));
    x[i] = y1;
    x[i + half] = y2;
    if (!is_q && slot >= 0) {
      T* dst = static_cast<T*>(p.k_cache) + cache_offset + kv_head * p.cache_stride_head;
      dst[i] = y1;
      dst[i + half] = y2;
    }
  }
}

// The same rotation and cache writes, 8 elements per thread: lane i owns pairs 8i .. 8i + 7 (16-byte loads of x1 and
// x2; 2-byte loads left each thread one 4-byte pair in flight, and prefill ran at about two thirds of copy
// bandwidth). cos/sin of the token's half-dim frequencies are computed once per block into shared memory (a row
// of 8-pair lanes would otherwise repeat each sincosf for every row). The arithmetic per element is the scalar
// kernel's, so the results are bit-identical. The launcher takes this path when every base and stride is a whole
// number of 8-element vectors (16 bytes for 16-bit types, 32 for float) and head_dim / 2 is a multiple of 8.
template <typename T>
__global__ void __launch_bounds__(kRotaryMaxThreads)
    rotary_cache_write_vec8_kernel(RotaryCacheWriteParams p, int units_per_row) {
  __shared__ float cos_s[kMaxHalfDim], sin_s[kMaxHalfDim];
  grid_dependency_wait();
  allow_dependent_launch();
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(p.head_dim / 2);
  const int num_q = static_cast<int>(p.num_q_heads), num_kv = static_cast<int>(p.num_kv_heads);
  const int num_rot = num_q + num_kv, num_units = num_rot + num_kv;
  const int rows = blockDim.y;
  const int block_first = static_cast<int>(blockIdx.y) * rows * units_per_row;
  if (block_first < num_rot) {  // uniform over the block: it rotates something, so it needs the angles
    const float position = static_cast<float>(p.positions[t]);
    for (int j = threadIdx.y * blockDim.x + threadIdx.x; j < half; j += blockDim.x * rows) {
      sincosf(position * p.inv_freq[j], &sin_s[j], &cos_s[j]);
    }
    __syncthreads();
  }
  const int first = block_first + static_cast<int>(threadIdx.y);
  if (first >= num_units) return;
  const int64_t slot = p.slot_mapping[t];
  if (first >= num_rot && slot < 0) return;  // v copies only, and nothing to write
  const int64_t cache_offset =
      slot < 0 ? 0 : (slot / p.page_size) * p.cache_stride_page + (slot % p.page_size) * p.cache_stride_slot;
  const int i = static_cast<int>(threadIdx.x) * 8;

  T* q = static_cast<T*>(p.q) + t * p.q_stride_token;
  T* k = static_cast<T*>(p.k) + t * p.k_stride_token;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride_token;
  for (int j = 0, u = first; j < units_per_row && u < num_units; ++j, u += rows) {
    if (u >= num_rot) {  // v head u - num_rot: copied as is
      if (slot < 0) return;
      const int h = u - num_rot;
      const T* src = v + h * p.v_stride_head;
      T* dst = static_cast<T*>(p.v_cache) + cache_offset + h * p.cache_stride_head;
      Vec8<T> a, b;
      a.load(src + i);
      b.load(src + i + half);
      *reinterpret_cast<Vec8<T>*>(dst + i) = a;
      *reinterpret_cast<Vec8<T>*>(dst + i + half) = b;
      continue;
    }
    const bool is_q = u < num_q;
    const int kv_head = u - num_q;
    T* x = is_q ? q + u * p.q_stride_head : k + kv_head * p.k_stride_head;
    Vec8<T> a, b;
    a.load(x + i);
    b.load(x + i + half);
    float x1[8], x2[8], y1[8], y2[8];
    a.to_floats(x1);
    b.to_floats(x2);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float c = cos_s[i + e], s = sin_s[i + e];
      y1[e] = __fmaf_rn(x1[e], c, -__fmul_rn(x2[e], s));  // the scalar kernel's contraction, see there
      y2[e] = __fmaf_rn(x1[e], s, __fmul_rn(x2[e], c));
    }
    Vec8<T>::store(x + i, y1);
    Vec8<T>::store(x + i + half, y2);
    if (!is_q && slot >= 0) {
      T* dst = static_cast<T*>(p.k_cache) + cache_offset + kv_head * p.cache_stride_head;
      Vec8<T>::store(dst + i, y1);
      Vec8<T>::store(dst + i + half, y2);
    }
  }
}

// Every address the vec8 kernel forms is a multiple of 8 elements from an aligned base: bases 16-byte aligned
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

cudaError_t rotary_cache_write(const RotaryCacheWriteParams& p, cudaStream_t stream) {
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
      launch_kernel(rotary_cache_write_vec8_kernel<T>, grid, block, 0, stream, p, static_cast<int>(units_per_row));
    } else {
      launch_kernel(rotary_cache_write_kernel<T>, grid, block, 0, stream, p, static_cast<int>(units_per_row));
    }
  });
  return cudaGetLastError();
}

}  // namespace folio::cuda
