// Paged attention on the CPU: one (query, head) pair at a time, exact softmax in fp32.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "scalar.h"

namespace folio::cpu {
namespace {

// out_row = softmax(score(q, k_j) for first <= j <= last_pos) @ v over sequence `seq`'s pages, for one query head,
// where first is the start of last_pos's window (0 without one) and score(q, k) = scale * q.k, soft-capped when
// p.softcap > 0. Pages before `first` are never touched. last_pos < 0 (nothing to attend to) writes zeros.
template <typename T>
void attend_row(const PagedAttentionParams& p, int64_t seq, int64_t q_head, const T* q_row, int64_t last_pos,
                T* out_row, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t kv_head = q_head / group;
  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  auto slot_offset = [&](int64_t pos) {
    const int64_t page = block_table[pos / p.page_size];
    return page * p.cache_stride_page + (pos % p.page_size) * p.cache_stride_slot + kv_head * p.cache_stride_head;
  };

  const int64_t first = first_visible_key(p, last_pos);
  const int64_t n = std::max<int64_t>(last_pos + 1 - first, 0);
  scores.resize(std::max<int64_t>(n, 1));
  const float inv_softcap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const T* k = k_cache + slot_offset(first + i);
    float dot = 0.0f;
    for (int64_t d = 0; d < p.head_dim; ++d) dot += to_float(q_row[d]) * to_float(k[d]);
    float score = dot * p.scale;
    if (p.softcap > 0.0f) score = p.softcap * std::tanh(score * inv_softcap);
    scores[i] = score;
    max_score = std::max(max_score, score);
  }
  acc.assign(p.head_dim, 0.0f);
  float denom = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float w = std::exp(scores[i] - max_score);
    denom += w;
    const T* v = v_cache + slot_offset(first + i);
    for (int64_t d = 0; d < p.head_dim; ++d) acc[d] += w * to_float(v[d]);
  }
  const float inv_denom = n > 0 ? 1.0f / denom : 0.0f;
  for (int64_t d = 0; d < p.head_dim; ++d) out_row[d] = from_float<T>(acc[d] * inv_denom);
}

template <typename T>
void prefill_items(const PagedAttentionParams& p, const int32_t* token_seq, int64_t begin, int64_t end) {
  std::vector<float> scores, acc;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t token = item / p.num_q_heads;
    const int64_t head = item % p.num_q_heads;
    const int64_t seq = token_seq[token];
    // Query i of a run of q_len sits at position context_len - q_len + i and sees positions 0..that (or its window).
    const int64_t q_begin = p.cu_seqlens_q[seq];
    const int64_t q_len = p.cu_seqlens_q[seq + 1] - q_begin;
    const int64_t last_pos = p.context_lens[seq] - q_len + (token - q_begin);
    const T* q_row = static_cast<const T*>(p.q) + token * p.q_stride_token + head * p.q_stride_head;
    T* out_row = static_cast<T*>(p.out) + (token * p.num_q_heads + head) * p.head_dim;
    attend_row(p, seq, head, q_row, last_pos, out_row, scores, acc);
  }
}

template <typename T>
void decode_items(const PagedAttentionParams& p, int64_t begin, int64_t end) {
  std::vector<float> scores, acc;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t seq = item / p.num_q_heads;
    const int64_t head = item % p.num_q_heads;
    const T* q_row = static_cast<const T*>(p.q) + seq * p.q_stride_token + head * p.q_stride_head;
    T* out_row = static_cast<T*>(p.out) + (seq * p.num_q_heads + head) * p.head_dim;
    attend_row(p, seq, head, q_row, static_cast<int64_t>(p.context_lens[seq]) - 1, out_row, scores, acc);
  }
}

}  // namespace

void paged_attention(const PagedAttentionParams& p, const int32_t* token_seq, int64_t begin, int64_t end) {
  dispatch_scalar(p.dtype, [&](auto tag) { prefill_items<decltype(tag)>(p, token_seq, begin, end); });
}

void paged_attention_decode(const PagedAttentionParams& p, int64_t begin, int64_t end) {
  dispatch_scalar(p.dtype, [&](auto tag) { decode_items<decltype(tag)>(p, begin, end); });
}

}  // namespace folio::cpu
