// Rotary embedding in place on q and k, fused with writing the rotated k and v into the paged caches.
#include "device_utils.cuh"
#include "kernels.cuh"

namespace folio::cuda {
namespace {

constexpr int kRotaryThreads = 256;
constexpr int kMaxHalfDim = 512;  // head_dim up to 1024

// One block per token. cos/sin of the token's angles are computed once into shared memory (full-precision
// sincosf: positions times low frequencies reach arguments where fast intrinsics lose digits), then every
// thread rotates (head, i) pairs. A thread that rotates a kv head's pair also writes it, rounded, to the cache,
// so the cache holds exactly the rotated k that is left in `k`.
template <typename T>
__global__ void __launch_bounds__(kRotaryThreads) rotary_cache_write_kernel(RotaryCacheWriteParams p) {
  __shared__ float cos_s[kMaxHalfDim], sin_s[kMaxHalfDim];
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(p.head_dim / 2);
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < half; i += kRotaryThreads) sincosf(pos * p.inv_freq[i], &sin_s[i], &cos_s[i]);
  __syncthreads();

  const int64_t slot = p.slot_mapping[t];
  const int64_t cache_offset =
      slot < 0 ? 0 : (slot / p.page_size) * p.cache_stride_page + (slot % p.page_size) * p.cache_stride_slot;
  T* q = static_cast<T*>(p.q) + t * p.q_stride_token;
  T* k = static_cast<T*>(p.k) + t * p.k_stride_token;
  const int num_heads = static_cast<int>(p.num_q_heads + p.num_kv_heads);
  for (int idx = threadIdx.x; idx < num_heads * half; idx += kRotaryThreads) {
    const int head = idx / half, i = idx % half;
    const bool is_q = head < p.num_q_heads;
    const int kv_head = head - static_cast<int>(p.num_q_heads);
    T* x = is_q ? q + head * p.q_stride_head : k + kv_head * p.k_stride_head;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const T y1 = from_float<T>(x1 * cos_s[i] - x2 * sin_s[i]);
    const T y2 = from_float<T>(x2 * cos_s[i] + x1 * sin_s[i]);
    x[i] = y1;
    x[i + half] = y2;
    if (!is_q && slot >= 0) {
      T* dst = static_cast<T*>(p.k_cache) + cache_offset + kv_head * p.cache_stride_head;
      dst[i] = y1;
      dst[i + half] = y2;
    }
  }
  if (slot < 0) return;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride_token;
  for (int idx = threadIdx.x; idx < p.num_kv_heads * p.head_dim; idx += kRotaryThreads) {
    const int head = idx / static_cast<int>(p.head_dim), d = idx % static_cast<int>(p.head_dim);
    static_cast<T*>(p.v_cache)[cache_offset + head * p.cache_stride_head + d] = v[head * p.v_stride_head + d];
  }
}

}  // namespace

cudaError_t rotary_cache_write(const RotaryCacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.head_dim / 2 > kMaxHalfDim) return cudaErrorInvalidValue;  // the binding refuses such head dims first
  dispatch_scalar(p.dtype, [&](auto tag) {
    rotary_cache_write_kernel<decltype(tag)><<<p.num_tokens, kRotaryThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

}  // namespace folio::cuda
