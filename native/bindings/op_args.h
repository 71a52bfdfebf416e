// Validation of each op's arguments and their translation into the plain parameter structs of
// common/params.h. Shared by both backends; each backend adds its own device checks (and the CPU one the
// host-side checks of index tensors that a GPU could only do with a synchronization).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "tensor_checks.h"

namespace folio::bind {

// Every tensor argument must live on `ref`'s device, which must be of `type`.
inline void check_all_on(c10::DeviceType type, std::initializer_list<std::pair<const at::Tensor*, const char*>> args) {
  const auto& [ref, ref_name] = *args.begin();
  for (const auto& [t, name] : args) {
    check_device_type(*t, name, type);
    check_device(*t, name, *ref, ref_name);
  }
}

// A 1-D contiguous per-row parameter of the sampling ops: [num_rows] of `dtype`.
inline void check_row_param(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t num_rows) {
  check_dtype(t, name, dtype);
  check_dim(t, name, 1, "[num_rows]");
  check_size(t, name, 0, num_rows, "num_rows (logits.size(0))");
  check_contiguous(t, name);
}

// x: [N, H] float; weight: [H] of x's dtype or float32; residual: [N, H] of x's dtype (or undefined).
inline RmsNormParams rms_norm_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor* residual,
                                   const at::Tensor& weight, double eps) {
  RmsNormParams p{};
  p.dtype = float_type(x, "x");
  check_dim(x, "x", 2, "[num_rows, hidden_size]");
  check_inner_contiguous(x, "x");
  check_dim(weight, "weight", 1, "[hidden_size]");
  check_size(weight, "weight", 0, x.size(1), "hidden_size (x.size(1))");
  check_contiguous(weight, "weight");
  p.weight_dtype = float_type(weight, "weight");
  FOLIO_CHECK_TYPE(p.weight_dtype == p.dtype || p.weight_dtype == ScalarType::kFloat32,
                   "argument 'weight' must be ", x.scalar_type(), " (the dtype of 'x') or float32, got ",
                   weight.scalar_type());
  FOLIO_CHECK_VALUE(eps >= 0.0, "argument 'eps' must be >= 0, got ", eps);
  p.out = out.data_ptr();
  p.out_row_stride = out.stride(0);
  p.x = x.data_ptr();
  p.x_row_stride = x.stride(0);
  if (residual != nullptr) {
    check_same_dtype(*residual, "residual", x, "x");
    check_dim(*residual, "residual", 2, "[num_rows, hidden_size]");
    check_size(*residual, "residual", 0, x.size(0), "num_rows (x.size(0))");
    check_size(*residual, "residual", 1, x.size(1), "hidden_size (x.size(1))");
    check_inner_contiguous(*residual, "residual");
    p.residual = residual->data_ptr();
    p.residual_row_stride = residual->stride(0);
  }
  p.weight = weight.data_ptr();
  p.num_rows = x.size(0);
  p.hidden_size = x.size(1);
  p.eps = static_cast<float>(eps);
  return p;
}

// x: [N, 2F] float -> out: [N, F]
inline SiluAndMulParams silu_and_mul_args(const at::Tensor& out, const at::Tensor& x) {
  SiluAndMulParams p{};
  p.dtype = float_type(x, "x");
  check_dim(x, "x", 2, "[num_rows, 2 * width]");
  FOLIO_CHECK_VALUE(x.size(1) % 2 == 0, "argument 'x' has shape ", shape_str(x), ": dim 1 must be even");
  check_inner_contiguous(x, "x");
  p.out = out.data_ptr();
  p.out_row_stride = out.stride(0);
  p.x = x.data_ptr();
  p.x_row_stride = x.stride(0);
  p.num_rows = x.size(0);
  p.half_width = x.size(1) / 2;
  return p;
}

// k_cache, v_cache: [P, S, Hkv, last_dim] of equal shapes and strides, inner dim dense; fills the pointers, strides
// and page size.
template <typename Params>
void cache_layout_args(Params& p, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_kv_heads,
                       int64_t last_dim, const char* last_dim_what) {
  // (dtypes are the caller's: the model's for a float cache, uint8 codes for a quantized one)
  FOLIO_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "argument 'v_cache' has shape ", shape_str(v_cache),
                    " but 'k_cache' has ", shape_str(k_cache));
  FOLIO_CHECK_VALUE(v_cache.strides() == k_cache.strides(), "arguments 'k_cache' and 'v_cache' must have equal "
                    "strides, got ", k_cache.strides(), " and ", v_cache.strides());
  check_size(k_cache, "k_cache", 2, num_kv_heads, "num_kv_heads");
  check_size(k_cache, "k_cache", 3, last_dim, last_dim_what);
  check_inner_contiguous(k_cache, "k_cache");
  const int64_t page_size = k_cache.size(1);
  FOLIO_CHECK_VALUE(page_size > 0, "argument 'k_cache' has page_size 0");
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cache_stride_page = k_cache.stride(0);
  p.cache_stride_slot = k_cache.stride(1);
  p.cache_stride_head = k_cache.stride(2);
  p.page_size = page_size;
}

// k_cache, v_cache: [P, S, Hkv, D] of q's dtype.
template <typename Params>
void cache_args(Params& p, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q,
                int64_t num_kv_heads, int64_t head_dim) {
  check_dim(k_cache, "k_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim]");
  check_same_dtype(k_cache, "k_cache", q, "q");
  check_same_dtype(v_cache, "v_cache", q, "q");
  cache_layout_args(p, k_cache, v_cache, num_kv_heads, head_dim, "head_dim (q.size(2))");
}

// The scales and format code of a quantized cache (the *_quant ops, folio.kv_formats).
struct QuantCaches {
  const at::Tensor& k_scale;  // [P, S, Hkv, D / G] float16
  const at::Tensor& v_scale;  // [P, S, Hkv, D / G] float16
  int64_t kv_format;          // folio.kv_formats.KV_FORMAT_CODES: 1 fp8, 2 q8, 3 q4 (4 q4h has no kernel)
};

// cache_args for quantized caches: k_cache, v_cache [P, S, Hkv, Dq] uint8 and their scales, q 16-bit.
template <typename Params>
void quant_cache_args(Params& p, const at::Tensor& k_cache, const at::Tensor& v_cache, const QuantCaches& quant,
                      const at::Tensor& q, int64_t num_kv_heads, int64_t head_dim) {
  FOLIO_CHECK_VALUE(quant.kv_format >= 1 && quant.kv_format <= 3, "argument 'kv_format' must be 1 (fp8), 2 (q8) or "
                    "3 (q4): the CUDA kernels have no other quantized format (q4h = 4 runs on the reference), got ",
                    quant.kv_format);
  const auto format = static_cast<KvFormat>(quant.kv_format);
  FOLIO_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "CUDA ops over quantized caches "
                   "take float16 or bfloat16 'q', got ", q.scalar_type());
  const int64_t group = format == KvFormat::kFp8 ? head_dim : 32;
  FOLIO_CHECK_VALUE(head_dim > 0 && head_dim % 2 == 0 && head_dim % group == 0, "kv_format ", quant.kv_format,
                    " needs head_dim divisible by ", group, " (and even), got head_dim ", head_dim);
  const int64_t code_dim = format == KvFormat::kQ4 ? head_dim / 2 : head_dim;
  check_dim(k_cache, "k_cache", 4, "[num_pages, page_size, num_kv_heads, code_dim]");
  check_dtype(k_cache, "k_cache", at::kByte);
  check_dtype(v_cache, "v_cache", at::kByte);
  cache_layout_args(p, k_cache, v_cache, num_kv_heads, code_dim,
                    "the code bytes per head (head_dim, or head_dim / 2 for q4)");
  for (const auto& [scale, name] : {std::pair<const at::Tensor*, const char*>{&quant.k_scale, "k_scale"},
                                    std::pair<const at::Tensor*, const char*>{&quant.v_scale, "v_scale"}}) {
    check_dtype(*scale, name, at::kHalf);
    check_dim(*scale, name, 4, "[num_pages, page_size, num_kv_heads, head_dim / group_size]");
    FOLIO_CHECK_VALUE(scale->size(0) == k_cache.size(0) && scale->size(1) == k_cache.size(1) &&
                      scale->size(2) == num_kv_heads && scale->size(3) == head_dim / group,
                      "argument '", name, "' has shape ", shape_str(*scale), "; k_cache ", shape_str(k_cache),
                      " at head_dim ", head_dim, " needs [", k_cache.size(0), ", ", k_cache.size(1), ", ",
                      num_kv_heads, ", ", head_dim / group, "]");
    check_inner_contiguous(*scale, name);
  }
  FOLIO_CHECK_VALUE(quant.v_scale.strides() == quant.k_scale.strides(), "arguments 'k_scale' and 'v_scale' must "
                    "have equal strides, got ", quant.k_scale.strides(), " and ", quant.v_scale.strides());
  p.quant.format = format;
  p.quant.group_size = static_cast<int32_t>(group);
  p.quant.k_scale = quant.k_scale.data_ptr();
  p.quant.v_scale = quant.v_scale.data_ptr();
  p.quant.scale_stride_page = quant.k_scale.stride(0);
  p.quant.scale_stride_slot = quant.k_scale.stride(1);
  p.quant.scale_stride_head = quant.k_scale.stride(2);
}

// rotary_cache_write takes q, k and v as any [T, H, D] views with a dense last dim: the column slices of one
// fused [T, (Hq + 2 * Hkv) * D] QKV projection (token stride (Hq + 2 * Hkv) * D, no copies), padded heads,
// head-major buffers. What it refuses is an element that one (token, head, i) writes and another reads or
// writes: the result would hang on the order of the writes (a race on CUDA), so it would differ per backend.

// Offset in elements of t's last element from its first (t non-empty; torch strides are never negative).
inline int64_t last_offset(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return last;
}

// No two indices of t reach one element. With the dims of size > 1 taken by increasing stride, each stride must
// clear every offset the smaller ones reach: exact for the layouts above, conservative for exotic ones.
inline void check_no_self_overlap(const at::Tensor& t, const char* name) {
  if (t.numel() == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    FOLIO_CHECK_VALUE(stride > reach, "argument '", name, "' is written in place but its elements overlap (shape ",
                      shape_str(t), ", strides ", t.strides(), "): heads must lie at least head_dim apart and "
                      "tokens must not reach into each other's heads");
    reach += (size - 1) * stride;
  }
}

// The [T, H, D] views a and b (same dtype) share no element. Separate buffers differ in address range. Views into
// one buffer with a common token stride S, as the fused QKV slices are, repeat every S elements: they are disjoint
// iff each one's row span (H - 1) * head stride + D fits in S and the two spans do not meet modulo S. Any other
// layout that shares a buffer is refused; no caller needs one, and telling them apart would cost more than this.
inline void check_disjoint(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  if (a.numel() == 0 || b.numel() == 0) return;
  const int64_t elem = a.element_size();  // in bytes, so that the addresses of both compare directly
  const auto a_begin = static_cast<int64_t>(reinterpret_cast<intptr_t>(a.data_ptr()));
  const auto b_begin = static_cast<int64_t>(reinterpret_cast<intptr_t>(b.data_ptr()));
  if (a_begin + (last_offset(a) + 1) * elem <= b_begin || b_begin + (last_offset(b) + 1) * elem <= a_begin) return;
  const int64_t row = a.stride(0) * elem;
  const int64_t a_span = ((a.size(1) - 1) * a.stride(1) + a.size(2)) * elem;
  const int64_t b_span = ((b.size(1) - 1) * b.stride(1) + b.size(2)) * elem;
  bool disjoint = false;
  if (a.size(0) > 1 && b.stride(0) == a.stride(0) && a_span <= row && b_span <= row) {  // so row > 0
    const int64_t shift = ((b_begin - a_begin) % row + row) % row;  // where b's row starts within a's
    disjoint = shift >= a_span && shift + b_span <= row;
  }
  FOLIO_CHECK_VALUE(disjoint, "arguments '", a_name, "' and '", b_name, "' share memory (strides ", a.strides(),
                    " and ", b.strides(), ", ", b_begin - a_begin, " bytes apart): q and k are written in place "
                    "and v is read, so they must be separate tensors or disjoint column slices of one "
                    "[num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] buffer");
}

inline RotaryCacheWriteParams rotary_cache_write_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& positions, const at::Tensor& inv_freq,
                                                      const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                      const at::Tensor& slot_mapping,
                                                      const QuantCaches* quant = nullptr) {
  RotaryCacheWriteParams p{};
  p.dtype = float_type(q, "q");
  check_dim(q, "q", 3, "[num_tokens, num_q_heads, head_dim]");
  check_dim(k, "k", 3, "[num_tokens, num_kv_heads, head_dim]");
  check_dim(v, "v", 3, "[num_tokens, num_kv_heads, head_dim]");
  check_same_dtype(k, "k", q, "q");
  check_same_dtype(v, "v", q, "q");
  const int64_t num_tokens = q.size(0), head_dim = q.size(2), num_kv_heads = k.size(1);
  FOLIO_CHECK_VALUE(head_dim % 2 == 0, "argument 'q' has shape ", shape_str(q), ": head_dim must be even");
  check_size(k, "k", 0, num_tokens, "num_tokens (q.size(0))");
  check_size(k, "k", 2, head_dim, "head_dim (q.size(2))");
  FOLIO_CHECK_VALUE(v.sizes() == k.sizes(), "argument 'v' has shape ", shape_str(v), " but 'k' has ", shape_str(k));
  check_inner_contiguous(q, "q");
  check_inner_contiguous(k, "k");
  check_inner_contiguous(v, "v");
  check_no_self_overlap(q, "q");
  check_no_self_overlap(k, "k");
  check_disjoint(q, "q", k, "k");
  check_disjoint(q, "q", v, "v");
  check_disjoint(k, "k", v, "v");
  check_dtype(positions, "positions", at::kLong);
  check_dim(positions, "positions", 1, "[num_tokens]");
  check_size(positions, "positions", 0, num_tokens, "num_tokens (q.size(0))");
  check_contiguous(positions, "positions");
  check_dtype(slot_mapping, "slot_mapping", at::kLong);
  check_dim(slot_mapping, "slot_mapping", 1, "[num_tokens]");
  check_size(slot_mapping, "slot_mapping", 0, num_tokens, "num_tokens (q.size(0))");
  check_contiguous(slot_mapping, "slot_mapping");
  check_dtype(inv_freq, "inv_freq", at::kFloat);
  check_dim(inv_freq, "inv_freq", 1, "[head_dim / 2]");
  check_size(inv_freq, "inv_freq", 0, head_dim / 2, "head_dim / 2");
  check_contiguous(inv_freq, "inv_freq");
  if (quant != nullptr) {
    quant_cache_args(p, k_cache, v_cache, *quant, q, num_kv_heads, head_dim);
  } else {
    cache_args(p, k_cache, v_cache, q, num_kv_heads, head_dim);
  }
  p.q = q.data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.k = k.data_ptr();
  p.k_stride_token = k.stride(0);
  p.k_stride_head = k.stride(1);
  p.v = v.data_ptr();
  p.v_stride_token = v.stride(0);
  p.v_stride_head = v.stride(1);
  p.positions = positions.data_ptr<int64_t>();
  p.inv_freq = inv_freq.data_ptr<float>();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = num_tokens;
  p.num_q_heads = q.size(1);
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  return p;
}

// Shared by paged_attention (cu_seqlens_q defined) and paged_attention_decode (undefined).
// q: [T or B, Hq, D]; block_tables: [B, max_blocks] int32; context_lens: [B] int32; out: [T or B, Hq, D].
inline PagedAttentionParams attention_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                                           const at::Tensor* cu_seqlens_q, const at::Tensor& context_lens,
                                           double scale, int64_t max_q_len, int64_t window, double softcap,
                                           const QuantCaches* quant = nullptr) {
  PagedAttentionParams p{};
  p.dtype = float_type(q, "q");
  check_dim(q, "q", 3, cu_seqlens_q ? "[num_tokens, num_q_heads, head_dim]" : "[num_seqs, num_q_heads, head_dim]");
  check_inner_contiguous(q, "q");
  const int64_t num_q_heads = q.size(1), head_dim = q.size(2);
  FOLIO_CHECK_VALUE(head_dim > 0, "argument 'q' has head_dim 0");
  FOLIO_CHECK_VALUE(k_cache.dim() == 4, "argument 'k_cache' must be [num_pages, page_size, num_kv_heads, head_dim]"
                    " (4 dims), got shape ", shape_str(k_cache));
  const int64_t num_kv_heads = k_cache.size(2);
  FOLIO_CHECK_VALUE(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "num_q_heads (q.size(1) = ", num_q_heads,
                    ") must be a multiple of num_kv_heads (k_cache.size(2) = ", num_kv_heads, ")");
  if (quant != nullptr) {
    quant_cache_args(p, k_cache, v_cache, *quant, q, num_kv_heads, head_dim);
  } else {
    cache_args(p, k_cache, v_cache, q, num_kv_heads, head_dim);
  }

  check_dtype(block_tables, "block_tables", at::kInt);
  check_dim(block_tables, "block_tables", 2, "[num_seqs, max_blocks]");
  check_inner_contiguous(block_tables, "block_tables");
  const int64_t num_seqs = block_tables.size(0);
  check_dtype(context_lens, "context_lens", at::kInt);
  check_dim(context_lens, "context_lens", 1, "[num_seqs]");
  check_size(context_lens, "context_lens", 0, num_seqs, "num_seqs (block_tables.size(0))");
  check_contiguous(context_lens, "context_lens");
  if (cu_seqlens_q != nullptr) {
    check_dtype(*cu_seqlens_q, "cu_seqlens_q", at::kInt);
    check_dim(*cu_seqlens_q, "cu_seqlens_q", 1, "[num_seqs + 1]");
    check_size(*cu_seqlens_q, "cu_seqlens_q", 0, num_seqs + 1, "num_seqs + 1 (block_tables.size(0) + 1)");
    check_contiguous(*cu_seqlens_q, "cu_seqlens_q");
    FOLIO_CHECK_VALUE(max_q_len >= 0, "argument 'max_q_len' must be >= 0, got ", max_q_len);
    p.cu_seqlens_q = cu_seqlens_q->data_ptr<int32_t>();
  } else {
    check_size(q, "q", 0, num_seqs, "num_seqs (block_tables.size(0))");
  }
  FOLIO_CHECK_VALUE(std::isfinite(scale), "argument 'scale' must be finite, got ", scale);
  FOLIO_CHECK_VALUE(window >= 0, "argument 'window' must be >= 0 (0: the whole context), got ", window);
  FOLIO_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, "argument 'softcap' must be finite and >= 0 (0: none), "
                    "got ", softcap);

  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.num_seqs = num_seqs;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.max_blocks = block_tables.size(1);
  p.max_q_len = cu_seqlens_q != nullptr ? max_q_len : 1;
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.softcap = static_cast<float>(softcap);
  return p;
}

// k_cache, v_cache: [L, P, S, Hkv, D] contiguous, equal shapes and dtypes: float caches, or a quantized cache's
// uint8 codes [L, P, S, Hkv, Dq] (its float16 scales [L, P, S, Hkv, D / G] are a float cache here).
inline PageCopyParams copy_page_slots_args(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t src_page,
                                           int64_t dst_page, int64_t num_slots) {
  check_dim(k_cache, "k_cache", 5, "[num_layers, num_pages, page_size, num_kv_heads, head_dim]");
  const auto dtype = k_cache.scalar_type();
  FOLIO_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kByte,
                   "argument 'k_cache' must be float32, float16, bfloat16 or uint8 (quantized codes), got ", dtype);
  check_same_dtype(v_cache, "v_cache", k_cache, "k_cache");
  FOLIO_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "argument 'v_cache' has shape ", shape_str(v_cache),
                    " but 'k_cache' has ", shape_str(k_cache));
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  const int64_t num_pages = k_cache.size(1), page_size = k_cache.size(2);
  FOLIO_CHECK_VALUE(0 <= src_page && src_page < num_pages, "argument 'src_page' = ", src_page,
                    " outside [0, num_pages = ", num_pages, ")");
  FOLIO_CHECK_VALUE(0 <= dst_page && dst_page < num_pages, "argument 'dst_page' = ", dst_page,
                    " outside [0, num_pages = ", num_pages, ")");
  FOLIO_CHECK_VALUE(0 <= num_slots && num_slots <= page_size, "argument 'num_slots' = ", num_slots,
                    " outside [0, page_size = ", page_size, "]");
  PageCopyParams p{};
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.num_layers = k_cache.size(0);
  p.num_pages = num_pages;
  p.page_size = page_size;
  p.slot_elems = k_cache.size(3) * k_cache.size(4);
  p.src_page = src_page;
  p.dst_page = dst_page;
  p.num_slots = num_slots;
  p.elem_size = k_cache.element_size();
  return p;
}

// logits: [B, V] float32, inner dim dense. Returns B.
inline int64_t logits_args(const at::Tensor& logits) {
  check_dtype(logits, "logits", at::kFloat);
  check_dim(logits, "logits", 2, "[num_rows, vocab_size]");
  check_inner_contiguous(logits, "logits");
  FOLIO_CHECK_VALUE(logits.size(1) > 0, "argument 'logits' has vocab_size 0");
  return logits.size(0);
}

inline SampleParams sample_rows_args(const at::Tensor& out_ids, const at::Tensor& out_probs, const at::Tensor& logits,
                                     const at::Tensor& temperature,
                                     const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                                     const at::Tensor& u) {
  const int64_t rows = logits_args(logits);
  check_row_param(temperature, "temperature", at::kFloat, rows);
  check_row_param(top_k, "top_k", at::kInt, rows);
  check_row_param(top_p, "top_p", at::kFloat, rows);
  check_row_param(min_p, "min_p", at::kFloat, rows);
  check_row_param(u, "u", at::kFloat, rows);
  SampleParams p{};
  p.logits = logits.data_ptr<float>();
  p.logits_row_stride = logits.stride(0);
  p.temperature = temperature.data_ptr<float>();
  p.top_k = top_k.data_ptr<int32_t>();
  p.top_p = top_p.data_ptr<float>();
  p.min_p = min_p.data_ptr<float>();
  p.uniform = u.data_ptr<float>();
  p.out_token_ids = out_ids.data_ptr<int64_t>();
  p.out_probs = out_probs.data_ptr<float>();
  p.num_rows = rows;
  p.vocab_size = logits.size(1);
  return p;
}

// A [B, K] int64 id table with a dense inner dim (history or blocked ids).
inline void id_table_args(const at::Tensor& ids, const char* name, int64_t rows) {
  check_dtype(ids, name, at::kLong);
  check_dim(ids, name, 2, "[num_rows, num_ids]");
  check_size(ids, name, 0, rows, "num_rows (logits.size(0))");
  check_inner_contiguous(ids, name);
}

inline PenaltyParams apply_penalties_args(const at::Tensor& logits, const at::Tensor& history, const at::Tensor& rep,
                                          const at::Tensor& freq, const at::Tensor& pres, const at::Tensor& sustain,
                                          const at::Tensor& decay) {
  const int64_t rows = logits_args(logits);
  id_table_args(history, "history", rows);
  check_row_param(rep, "rep", at::kFloat, rows);
  check_row_param(freq, "freq", at::kFloat, rows);
  check_row_param(pres, "pres", at::kFloat, rows);
  check_row_param(sustain, "sustain", at::kInt, rows);
  check_row_param(decay, "decay", at::kInt, rows);
  PenaltyParams p{};
  p.logits = logits.data_ptr<float>();
  p.logits_row_stride = logits.stride(0);
  p.history = history.data_ptr<int64_t>();
  p.history_row_stride = history.stride(0);
  p.repetition = rep.data_ptr<float>();
  p.frequency = freq.data_ptr<float>();
  p.presence = pres.data_ptr<float>();
  p.sustain = sustain.data_ptr<int32_t>();
  p.decay = decay.data_ptr<int32_t>();
  p.num_rows = rows;
  p.vocab_size = logits.size(1);
  p.history_len = history.size(1);
  return p;
}

inline MaskTokensParams mask_tokens_args(const at::Tensor& logits, const at::Tensor& token_ids) {
  const int64_t rows = logits_args(logits);
  id_table_args(token_ids, "token_ids", rows);
  MaskTokensParams p{};
  p.logits = logits.data_ptr<float>();
  p.logits_row_stride = logits.stride(0);
  p.token_ids = token_ids.data_ptr<int64_t>();
  p.token_ids_row_stride = token_ids.stride(0);
  p.num_rows = rows;
  p.vocab_size = logits.size(1);
  p.num_ids = token_ids.size(1);
  return p;
}

}  // namespace folio::bind
