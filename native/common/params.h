// Plain-old-data descriptions of each op's arguments, shared by the CPU kernels, the CUDA kernels and the
// binding layer. No torch, no pybind11, no CUDA headers: both g++ and nvcc include this file.
//
// Pointers are raw device (or host) pointers; strides are in elements, not bytes. The innermost dimension of
// every tensor is contiguous (the binding checks it), so only the outer strides travel.
#pragma once

#include <cstdint>

namespace folio {

enum class ScalarType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// K/V cache formats of the *_quant ops (the codes of folio.kv_formats.KV_FORMAT_CODES). kNone: the caches hold
// q's dtype. Quantized caches hold uint8 codes [P, S, Hkv, Dq] and float16 scales [P, S, Hkv, D / G].
enum class KvFormat : int32_t { kNone = 0, kFp8 = 1, kQ8 = 2, kQ4 = 3 };

// The scales of a quantized K/V cache; format kNone (all zero) for unquantized caches. Cache strides are then in
// bytes (uint8 codes), scale strides in float16 elements, and k_scale / v_scale share theirs.
struct KvQuantParams {
  KvFormat format;
  int32_t group_size;             // G: head_dim for fp8, 32 for q8 / q4
  void* k_scale;                  // [P, S, Hkv, D / G] float16 (const for attention)
  void* v_scale;                  // [P, S, Hkv, D / G] float16
  int64_t scale_stride_page, scale_stride_slot, scale_stride_head;
};

inline const char* scalar_type_name(ScalarType t) {
  switch (t) {
    case ScalarType::kFloat32: return "float32";
    case ScalarType::kFloat16: return "float16";
    case ScalarType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

// rms_norm and fused_add_rms_norm.
// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * weight      (rms_norm; out may equal x)
// fused: residual[r, :] += x[r, :] (rounded to dtype), then x[r, :] = rms_norm(residual[r, :])
struct RmsNormParams {
  void* out;                 // [num_rows, hidden_size] dtype (fused: x itself)
  int64_t out_row_stride;
  const void* x;             // [num_rows, hidden_size] dtype
  int64_t x_row_stride;
  void* residual;            // [num_rows, hidden_size] dtype; nullptr for plain rms_norm
  int64_t residual_row_stride;
  const void* weight;        // [hidden_size] weight_dtype
  int64_t num_rows;
  int64_t hidden_size;
  float eps;
  ScalarType dtype;          // of out, x, residual
  ScalarType weight_dtype;   // dtype or float32
};

// out[r, :] = silu(x[r, :F]) * x[r, F:]
struct SiluAndMulParams {
  void* out;                 // [num_rows, F] dtype
  int64_t out_row_stride;
  const void* x;             // [num_rows, 2F] dtype
  int64_t x_row_stride;
  int64_t num_rows;
  int64_t half_width;        // F
  ScalarType dtype;
};

// Neox rotary (pairs i, i + D/2) on q and k in place, then k and v copied into the paged caches.
// q, k and v may be strided views, e.g. the column slices of one fused [T, (Hq + 2 * Hkv) * D] QKV output
// (token stride (Hq + 2 * Hkv) * D, head stride D); the binding checks that no written element is shared.
struct RotaryCacheWriteParams {
  void* q;                    // [T, Hq, D] dtype
  int64_t q_stride_token, q_stride_head;
  void* k;                    // [T, Hkv, D] dtype
  int64_t k_stride_token, k_stride_head;
  const void* v;              // [T, Hkv, D] dtype
  int64_t v_stride_token, v_stride_head;
  const int64_t* positions;   // [T]
  const float* inv_freq;      // [D/2]
  void* k_cache;              // [P, S, Hkv, D] dtype
  void* v_cache;              // [P, S, Hkv, D] dtype
  int64_t cache_stride_page, cache_stride_slot, cache_stride_head;  // shared by k_cache and v_cache
  const int64_t* slot_mapping;  // [T] flat slot page * S + offset; < 0 skips the token
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, page_size;
  ScalarType dtype;
  KvQuantParams quant;        // rotary_cache_write_quant: codes and scales written instead of dtype elements
};

// Paged attention over K/V caches laid out [P, S, Hkv, D]; query head h reads kv head h / (Hq / Hkv).
struct PagedAttentionParams {
  void* out;                      // [T or B, Hq, D] dtype, contiguous
  const void* q;                  // [T or B, Hq, D] dtype
  int64_t q_stride_token, q_stride_head;
  const void* k_cache;            // [P, S, Hkv, D] dtype
  const void* v_cache;            // [P, S, Hkv, D] dtype
  int64_t cache_stride_page, cache_stride_slot, cache_stride_head;  // shared by k_cache and v_cache
  const int32_t* block_tables;    // [B, max_blocks]
  int64_t block_table_stride;     // elements between rows of block_tables
  const int32_t* cu_seqlens_q;    // [B + 1]; nullptr for decode (one query per sequence)
  const int32_t* context_lens;    // [B]
  int64_t num_seqs, num_q_heads, num_kv_heads, head_dim, page_size, max_blocks;
  int64_t max_q_len;              // prefill: longest query run; decode: 1
  float scale;
  // Sliding window: 0 = the whole context; else the query at position i sees keys j with i - window < j <= i.
  // Kernels never read the pages wholly before a row's window (they may have been released to the pool).
  int64_t window;
  // Logit soft-capping: 0 = none; else each score s = scale * q.k becomes softcap * tanh(s / softcap).
  float softcap;
  ScalarType dtype;
  KvQuantParams quant;            // paged_attention*_quant: K/V dequantized from codes and scales
};

#if defined(__CUDACC__)
#define FOLIO_HOST_DEVICE __host__ __device__
#else
#define FOLIO_HOST_DEVICE
#endif

// The first key position that the query at position last_pos sees (0 without a window). Host and device code.
FOLIO_HOST_DEVICE inline int64_t first_visible_key(const PagedAttentionParams& p, int64_t last_pos) {
  const int64_t first = p.window > 0 ? last_pos - p.window + 1 : 0;
  return first > 0 ? first : 0;
}

// Copies slots [0, num_slots) of page src_page onto page dst_page, in every layer, for K and V.
struct PageCopyParams {
  void* k_cache;                  // [L, P, S, Hkv, D] dtype, contiguous
  void* v_cache;                  // [L, P, S, Hkv, D] dtype, contiguous
  int64_t num_layers, num_pages, page_size;
  int64_t slot_elems;             // Hkv * D
  int64_t src_page, dst_page, num_slots;
  int64_t elem_size;              // bytes per element
};

// Batched sampling, one row per sequence. See native/cpu/kernels.h for the exact definition.
struct SampleParams {
  const float* logits;            // [B, V]
  int64_t logits_row_stride;
  const float* temperature;       // [B]   < kGreedyTemperature: greedy
  const int32_t* top_k;           // [B]   1: greedy; <= 0 or >= V: off
  const float* top_p;             // [B]   >= 1: off
  const float* min_p;             // [B]   <= 0: off
  const float* uniform;           // [B]   draws in [0, 1)
  int64_t* out_token_ids;         // [B]   -1 where every logit is -inf
  float* out_probs;               // [B]   probability of the picked token in the final distribution
  uint32_t* key_scratch;          // [B, V] CUDA only: each row's weight keys, computed once, read by every pass
  int64_t num_rows, vocab_size;
};

// In-place repetition / presence / frequency penalties over each row's recent history, with the linear fade of
// folio.sampling: the token at distance j from the newest (j = 0: the last column) has strength
// w(j) = 1 for j < sustain, 1 - (j - sustain) / max(decay, 1) for sustain <= j < sustain + decay, else 0.
struct PenaltyParams {
  float* logits;                  // [B, V]
  int64_t logits_row_stride;
  const int64_t* history;         // [B, H] token ids, newest in the last column; ids outside [0, V) ignored
  int64_t history_row_stride;
  const float* repetition;        // [B]   1: off
  const float* frequency;         // [B]   0: off
  const float* presence;          // [B]   0: off
  const int32_t* sustain;         // [B]   tokens at full strength (>= H: all)
  const int32_t* decay;           // [B]   tokens over which the strength fades to 0 after those
  int64_t num_rows, vocab_size, history_len;
};

// logits[b, token_ids[b, j]] = -inf for every valid id (ids outside [0, V), e.g. the -1 padding, are ignored).
struct MaskTokensParams {
  float* logits;                  // [B, V]
  int64_t logits_row_stride;
  const int64_t* token_ids;       // [B, K]
  int64_t token_ids_row_stride;
  int64_t num_rows, vocab_size, num_ids;
};

// Fixed-point scale of sampling weights: a token's weight exp(z - max z) in [0, 1] becomes
// floor(weight * 2^40) as an unsigned integer. Integer sums are exact and order-free, so CPU, CUDA and the
// torch reference agree on every cumulative mass no matter how they add them up.
constexpr double kSampleWeightScale = 1099511627776.0;  // 2^40

}  // namespace folio

namespace folio {
// Rows whose temperature is below this sample greedily (argmax), as the reference engine does.
constexpr float kGreedyTemperature = 0.01f;
}  // namespace folio
