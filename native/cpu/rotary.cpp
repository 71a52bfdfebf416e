// Rotary embedding applied in place to q and k, fused with writing k and v into the paged caches (CPU).
#include <cmath>
#include <vector>

#include "kernels.h"
#include "scalar.h"

namespace folio::cpu {
namespace {

// Rotates pairs (i, i + D/2) of each head of one token, the HF rotate_half convention.
template <typename T>
void rotate_heads(T* x, int64_t num_heads, int64_t stride_head, int64_t half, const float* cos_v,
                  const float* sin_v) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* head = x + h * stride_head;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(head[i]);
      const float x2 = to_float(head[i + half]);
      head[i] = from_float<T>(x1 * cos_v[i] - x2 * sin_v[i]);
      head[i + half] = from_float<T>(x2 * cos_v[i] + x1 * sin_v[i]);
    }
  }
}

template <typename T>
void rotary_tokens(const RotaryCacheWriteParams& p, int64_t begin, int64_t end) {
  const int64_t half = p.head_dim / 2;
  std::vector<float> cos_v(half), sin_v(half);
  for (int64_t t = begin; t < end; ++t) {
    // Angles in fp32 from the position converted to float first, exactly as the reference forms them.
    const float pos = static_cast<float>(p.positions[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * p.inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
    }
    T* q = static_cast<T*>(p.q) + t * p.q_stride_token;
    T* k = static_cast<T*>(p.k) + t * p.k_stride_token;
    rotate_heads(q, p.num_q_heads, p.q_stride_head, half, cos_v.data(), sin_v.data());
    rotate_heads(k, p.num_kv_heads, p.k_stride_head, half, cos_v.data(), sin_v.data());

    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t offset = (slot / p.page_size) * p.cache_stride_page + (slot % p.page_size) * p.cache_stride_slot;
    const T* v = static_cast<const T*>(p.v) + t * p.v_stride_token;
    T* k_dst = static_cast<T*>(p.k_cache) + offset;
    T* v_dst = static_cast<T*>(p.v_cache) + offset;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      for (int64_t i = 0; i < p.head_dim; ++i) {
        k_dst[h * p.cache_stride_head + i] = k[h * p.k_stride_head + i];
        v_dst[h * p.cache_stride_head + i] = v[h * p.v_stride_head + i];
      }
    }
  }
}

}  // namespace

void rotary_cache_write(const RotaryCacheWriteParams& p, int64_t begin, int64_t end) {
  dispatch_scalar(p.dtype, [&](auto tag) { rotary_tokens<decltype(tag)>(p, begin, end); });
}

}  // namespace folio::cpu
