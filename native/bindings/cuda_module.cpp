// folio._native_cuda: checks the tensors and enqueues the CUDA kernels of native/cuda on the current stream of
// the tensors' device. Nothing here synchronizes with the device or reads device memory, so every op can be
// captured in a CUDA graph; scratch space comes from torch's caching allocator (graph-capture safe).
// Signatures: op_signatures.h, those of folio/reference_ops.py (plus the sampling ops) followed by keyword-only launch
// options: `pdl` (programmatic dependent launch, EngineOptions.pdl) on the ops that launch through launch_kernel, and
// `use_mma` (EngineOptions.decode_attention == "mma") on paged_attention_decode.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include "../cuda/kernels.cuh"
#include "op_args.h"
#include "op_signatures.h"

namespace folio::bind {
namespace {

constexpr c10::DeviceType kCuda = c10::DeviceType::CUDA;

cudaStream_t current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.get_device()).stream(); }

// Kernels go to the current stream of t's device, with programmatic dependent launch where `pdl` asks for it.
cuda::Launch launch_on(const at::Tensor& t, bool pdl) { return cuda::Launch{current_stream(t), pdl}; }

int multiprocessor_count(const at::Tensor& t) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, t.get_device()));
  return count;
}

at::Tensor rms_norm(const at::Tensor& x,       // [N, H] float32/float16/bfloat16
                    const at::Tensor& weight,  // [H] x's dtype or float32
                    double eps, bool pdl) {
  check_all_on(kCuda, {{&x, "x"}, {&weight, "weight"}});
  const c10::cuda::CUDAGuard guard(x.device());
  const auto out = at::empty_like(x, at::MemoryFormat::Contiguous);  // [N, H] x's dtype
  const RmsNormParams p = rms_norm_args(out, x, nullptr, weight, eps);
  C10_CUDA_CHECK(cuda::rms_norm(p, launch_on(x, pdl)));
  return out;
}

void fused_add_rms_norm(const at::Tensor& x,         // [N, H] float; in place: rms_norm(residual + x) * weight
                        const at::Tensor& residual,  // [N, H] x's dtype; in place: residual + x
                        const at::Tensor& weight,    // [H] x's dtype or float32
                        double eps, bool pdl) {
  check_all_on(kCuda, {{&x, "x"}, {&residual, "residual"}, {&weight, "weight"}});
  const c10::cuda::CUDAGuard guard(x.device());
  const RmsNormParams p = rms_norm_args(x, x, &residual, weight, eps);
  C10_CUDA_CHECK(cuda::rms_norm(p, launch_on(x, pdl)));
}

at::Tensor silu_and_mul(const at::Tensor& x,  // [N, 2F] float
                        bool pdl) {
  check_all_on(kCuda, {{&x, "x"}});
  check_dim(x, "x", 2, "[num_rows, 2 * width]");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());  // [N, F] x's dtype
  const SiluAndMulParams p = silu_and_mul_args(out, x);
  C10_CUDA_CHECK(cuda::silu_and_mul(p, launch_on(x, pdl)));
  return out;
}

void rotary_cache_write(const at::Tensor& q,             // [T, Hq, D] float; rotated in place
                        const at::Tensor& k,             // [T, Hkv, D] q's dtype; rotated in place
                        const at::Tensor& v,             // [T, Hkv, D] q's dtype
                        const at::Tensor& positions,     // [T] int64
                        const at::Tensor& inv_freq,      // [D/2] float32
                        const at::Tensor& k_cache,       // [P, S, Hkv, D] q's dtype
                        const at::Tensor& v_cache,       // [P, S, Hkv, D] q's dtype
                        const at::Tensor& slot_mapping,  // [T] int64, < 0 = do not write; not range-checked here
                        bool pdl) {                      // (that would need a device-to-host read)
  check_all_on(kCuda, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&positions, "positions"}, {&inv_freq, "inv_freq"},
                       {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&slot_mapping, "slot_mapping"}});
  const c10::cuda::CUDAGuard guard(q.device());
  const RotaryCacheWriteParams p =
      rotary_cache_write_args(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping);
  FOLIO_CHECK_VALUE(p.head_dim <= 1024, "CUDA rotary_cache_write supports head_dim <= 1024, got ", p.head_dim);
  C10_CUDA_CHECK(cuda::rotary_cache_write(p, launch_on(q, pdl)));
}

// Shared by both attention entry points: plans the context split, takes workspace, launches. decode_mma: decode
// rows on the tensor-core kernel where it applies.
void run_attention(const PagedAttentionParams& p, const at::Tensor& q, int64_t num_rows, bool decode_mma, bool pdl) {
  const char* unsupported = cuda::attention_unsupported_reason(p);
  FOLIO_CHECK_VALUE(unsupported == nullptr, unsupported, " (head_dim=", p.head_dim, ", page_size=", p.page_size,
                    ", dtype=", q.scalar_type(), ")");
  const cuda::AttentionPlan plan = cuda::plan_paged_attention(p, num_rows, multiprocessor_count(q), decode_mma);
  at::Tensor workspace;  // [workspace_floats] float32: per-split partial results
  if (plan.workspace_floats > 0) workspace = at::empty({plan.workspace_floats}, q.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cuda::paged_attention(p, num_rows, plan, workspace.defined() ? workspace.data_ptr<float>() : nullptr,
                                       decode_mma, launch_on(q, pdl)));
}

at::Tensor paged_attention(const at::Tensor& q,             // [T, Hq, D] float
                           const at::Tensor& k_cache,       // [P, S, Hkv, D] q's dtype
                           const at::Tensor& v_cache,       // [P, S, Hkv, D] q's dtype
                           const at::Tensor& block_tables,  // [B, max_blocks] int32
                           const at::Tensor& cu_seqlens_q,  // [B + 1] int32 (trusted: checked by the CPU op only)
                           const at::Tensor& context_lens,  // [B] int32
                           double scale, int64_t max_q_len,
                           int64_t window,   // 0 = the whole context; else keys j with i - window < j <= i
                           double softcap,   // 0 = none; else scores become softcap * tanh(score / softcap)
                           bool pdl) {
  check_all_on(kCuda, {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_tables, "block_tables"},
                       {&cu_seqlens_q, "cu_seqlens_q"}, {&context_lens, "context_lens"}});
  const c10::cuda::CUDAGuard guard(q.device());
  const auto out = at::empty(q.sizes(), q.options());  // [T, Hq, D] q's dtype, contiguous
  const PagedAttentionParams p =
      attention_args(out, q, k_cache, v_cache, block_tables, &cu_seqlens_q, context_lens, scale, max_q_len, window,
                     softcap);
  run_attention(p, q, q.size(0), /*decode_mma=*/false, pdl);  // (prefill rows: the CUDA-core kernel either way)
  return out;
}

at::Tensor paged_attention_decode(const at::Tensor& q,             // [B, Hq, D] float
                                  const at::Tensor& k_cache,       // [P, S, Hkv, D] q's dtype
                                  const at::Tensor& v_cache,       // [P, S, Hkv, D] q's dtype
                                  const at::Tensor& block_tables,  // [B, max_blocks] int32
                                  const at::Tensor& context_lens,  // [B] int32
                                  double scale,
                                  int64_t window,   // 0 = the whole context; else the last `window` positions
                                  double softcap,   // 0 = none; else scores become softcap * tanh(score / softcap)
                                  bool pdl,
                                  bool use_mma) {  // the tensor-core kernel where it applies (else CUDA cores)
  check_all_on(kCuda, {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_tables, "block_tables"},
                       {&context_lens, "context_lens"}});
  const c10::cuda::CUDAGuard guard(q.device());
  const auto out = at::empty(q.sizes(), q.options());  // [B, Hq, D] q's dtype, contiguous
  const PagedAttentionParams p =
      attention_args(out, q, k_cache, v_cache, block_tables, nullptr, context_lens, scale, 1, window, softcap);
  run_attention(p, q, p.num_seqs, use_mma, pdl);
  return out;
}

// The *_quant ops (folio.kv_formats): caches of uint8 codes [P, S, Hkv, Dq] (Dq = D, or D / 2 for q4) with float16
// scales [P, S, Hkv, D / G]; kv_format 1 fp8, 2 q8, 3 q4. q, k and v float16 or bfloat16.
void rotary_cache_write_quant(const at::Tensor& q,             // [T, Hq, D] 16-bit; rotated in place
                              const at::Tensor& k,             // [T, Hkv, D] q's dtype; rotated in place
                              const at::Tensor& v,             // [T, Hkv, D] q's dtype
                              const at::Tensor& positions,     // [T] int64
                              const at::Tensor& inv_freq,      // [D/2] float32
                              const at::Tensor& k_cache,       // [P, S, Hkv, Dq] uint8
                              const at::Tensor& v_cache,       // [P, S, Hkv, Dq] uint8
                              const at::Tensor& k_scale,       // [P, S, Hkv, D / G] float16
                              const at::Tensor& v_scale,       // [P, S, Hkv, D / G] float16
                              const at::Tensor& slot_mapping,  // [T] int64, < 0 = do not write
                              int64_t kv_format, bool pdl) {
  check_all_on(kCuda, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&positions, "positions"}, {&inv_freq, "inv_freq"},
                       {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&k_scale, "k_scale"}, {&v_scale, "v_scale"},
                       {&slot_mapping, "slot_mapping"}});
  const c10::cuda::CUDAGuard guard(q.device());
  const QuantCaches quant{k_scale, v_scale, kv_format};
  const RotaryCacheWriteParams p =
      rotary_cache_write_args(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, &quant);
  FOLIO_CHECK_VALUE(p.head_dim <= 512, "CUDA rotary_cache_write_quant supports head_dim <= 512, got ", p.head_dim);
  C10_CUDA_CHECK(cuda::rotary_cache_write_quant(p, launch_on(q, pdl)));
}

at::Tensor paged_attention_quant(const at::Tensor& q,             // [T, Hq, D] 16-bit
                                 const at::Tensor& k_cache,       // [P, S, Hkv, Dq] uint8
                                 const at::Tensor& v_cache,       // [P, S, Hkv, Dq] uint8
                                 const at::Tensor& k_scale,       // [P, S, Hkv, D / G] float16
                                 const at::Tensor& v_scale,       // [P, S, Hkv, D / G] float16
                                 const at::Tensor& block_tables,  // [B, max_blocks] int32
                                 const at::Tensor& cu_seqlens_q,  // [B + 1] int32 (trusted)
                                 const at::Tensor& context_lens,  // [B] int32
                                 double scale, int64_t max_q_len, int64_t window, double softcap, int64_t kv_format,
                                 bool pdl) {
  check_all_on(kCuda, {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&k_scale, "k_scale"},
                       {&v_scale, "v_scale"}, {&block_tables, "block_tables"}, {&cu_seqlens_q, "cu_seqlens_q"},
                       {&context_lens, "context_lens"}});
  const c10::cuda::CUDAGuard guard(q.device());
  const auto out = at::empty(q.sizes(), q.options());  // [T, Hq, D] q's dtype, contiguous
  const QuantCaches quant{k_scale, v_scale, kv_format};
  const PagedAttentionParams p = attention_args(out, q, k_cache, v_cache, block_tables, &cu_seqlens_q, context_lens,
                                                scale, max_q_len, window, softcap, &quant);
  run_attention(p, q, q.size(0), /*decode_mma=*/false, pdl);
  return out;
}

// Decode rows run on the tensor-core kernel wherever it applies (head_dim 64 / 128, <= 16 query heads per kv head),
// else on the CUDA-core one.
at::Tensor paged_attention_decode_quant(const at::Tensor& q,             // [B, Hq, D] 16-bit
                                        const at::Tensor& k_cache,       // [P, S, Hkv, Dq] uint8
                                        const at::Tensor& v_cache,       // [P, S, Hkv, Dq] uint8
                                        const at::Tensor& k_scale,       // [P, S, Hkv, D / G] float16
                                        const at::Tensor& v_scale,       // [P, S, Hkv, D / G] float16
                                        const at::Tensor& block_tables,  // [B, max_blocks] int32
                                        const at::Tensor& context_lens,  // [B] int32
                                        double scale, int64_t window, double softcap, int64_t kv_format, bool pdl) {
  check_all_on(kCuda, {{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&k_scale, "k_scale"},
                       {&v_scale, "v_scale"}, {&block_tables, "block_tables"}, {&context_lens, "context_lens"}});
  const c10::cuda::CUDAGuard guard(q.device());
  const auto out = at::empty(q.sizes(), q.options());  // [B, Hq, D] q's dtype, contiguous
  const QuantCaches quant{k_scale, v_scale, kv_format};
  const PagedAttentionParams p = attention_args(out, q, k_cache, v_cache, block_tables, nullptr, context_lens, scale,
                                                1, window, softcap, &quant);
  run_attention(p, q, p.num_seqs, /*decode_mma=*/true, pdl);
  return out;
}

void copy_page_slots(const at::Tensor& k_cache,  // [L, P, S, Hkv, D] float or uint8 codes, contiguous
                     const at::Tensor& v_cache,  // [L, P, S, Hkv, D] k_cache's dtype, contiguous
                     int64_t src_page, int64_t dst_page, int64_t num_slots) {
  check_all_on(kCuda, {{&k_cache, "k_cache"}, {&v_cache, "v_cache"}});
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const PageCopyParams p = copy_page_slots_args(k_cache, v_cache, src_page, dst_page, num_slots);
  C10_CUDA_CHECK(cuda::copy_page_slots(p, current_stream(k_cache)));
}

std::tuple<at::Tensor, at::Tensor> sample_rows(
    const at::Tensor& logits,       // [B, V] float32 (penalties, bias and masks already applied)
    const at::Tensor& temperature,  // [B] float32; < 0.01 = greedy
    const at::Tensor& top_k,        // [B] int32; 1 = greedy, <= 0 = off
    const at::Tensor& top_p,        // [B] float32; >= 1 = off
    const at::Tensor& min_p,        // [B] float32; <= 0 = off
    const at::Tensor& u) {          // [B] float32 uniform draws in [0, 1)
  check_all_on(kCuda, {{&logits, "logits"}, {&temperature, "temperature"}, {&top_k, "top_k"}, {&top_p, "top_p"},
                       {&min_p, "min_p"}, {&u, "u"}});
  logits_args(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto token_ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));  // [B] int64
  const auto probs = at::empty({logits.size(0)}, logits.options());                      // [B] float32
  SampleParams p = sample_rows_args(token_ids, probs, logits, temperature, top_k, top_p, min_p, u);
  const auto keys = at::empty({logits.size(0), logits.size(1)}, logits.options().dtype(at::kInt));  // [B, V] scratch
  p.key_scratch = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  C10_CUDA_CHECK(cuda::sample_rows(p, current_stream(logits)));
  return {token_ids, probs};
}

void apply_penalties(const at::Tensor& logits,    // [B, V] float32, modified in place
                     const at::Tensor& history,   // [B, H] int64 token ids, newest last, -1 = padding
                     const at::Tensor& rep,       // [B] float32 repetition penalty (1 = off)
                     const at::Tensor& freq,      // [B] float32 frequency penalty (0 = off)
                     const at::Tensor& pres,      // [B] float32 presence penalty (0 = off)
                     const at::Tensor& sustain,   // [B] int32 newest tokens at full strength
                     const at::Tensor& decay) {   // [B] int32 tokens over which the strength fades after those
  check_all_on(kCuda, {{&logits, "logits"}, {&history, "history"}, {&rep, "rep"}, {&freq, "freq"}, {&pres, "pres"},
                       {&sustain, "sustain"}, {&decay, "decay"}});
  const c10::cuda::CUDAGuard guard(logits.device());
  const PenaltyParams p = apply_penalties_args(logits, history, rep, freq, pres, sustain, decay);
  FOLIO_CHECK_VALUE(p.history_len <= cuda::kMaxPenaltyHistory, "argument 'history' has ", p.history_len,
                    " columns; the CUDA penalty kernel takes at most ", cuda::kMaxPenaltyHistory,
                    " (pass only the penalty window)");
  C10_CUDA_CHECK(cuda::apply_penalties(p, current_stream(logits)));
}

void mask_tokens(const at::Tensor& logits,      // [B, V] float32, modified in place
                 const at::Tensor& token_ids) {  // [B, K] int64 ids set to -inf, -1 = padding
  check_all_on(kCuda, {{&logits, "logits"}, {&token_ids, "token_ids"}});
  const c10::cuda::CUDAGuard guard(logits.device());
  const MaskTokensParams p = mask_tokens_args(logits, token_ids);
  C10_CUDA_CHECK(cuda::mask_tokens(p, current_stream(logits)));
}

// What linear and linear_fp8 check alike (dtypes are their own): everything on x's CUDA device; x [M, K] with
// M <= kLinearMaxRows, weight [N, K], last dims dense; weight_scale (FP8) a contiguous [N]; bias None or a contiguous
// [N] of x's dtype; silu_gate needs N even ([gate; up] halves).
void check_gemv_args(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor* weight_scale,
                     const at::Tensor* bias, bool silu_gate) {
  check_all_on(kCuda, {{&x, "x"}, {&weight, "weight"}});
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{weight_scale, "weight_scale"},
                                std::pair<const at::Tensor*, const char*>{bias, "bias"}}) {
    if (t != nullptr) check_all_on(kCuda, {{&x, "x"}, {t, name}});
  }
  check_dim(x, "x", 2, "[num_rows, in_features]");
  check_dim(weight, "weight", 2, "[out_features, in_features]");
  check_size(weight, "weight", 1, x.size(1), "in_features (x.size(1))");
  if (weight_scale != nullptr) {
    check_dim(*weight_scale, "weight_scale", 1, "[out_features]");
    check_size(*weight_scale, "weight_scale", 0, weight.size(0), "out_features (weight.size(0))");
    check_contiguous(*weight_scale, "weight_scale");
  }
  FOLIO_CHECK_VALUE(x.size(0) <= cuda::kLinearMaxRows, "CUDA ", op, " is a matrix-vector product for decode: 'x' may "
                    "have at most ", cuda::kLinearMaxRows, " rows, got shape ", shape_str(x),
                    " (use torch.nn.functional.linear)");
  check_inner_contiguous(x, "x");
  check_inner_contiguous(weight, "weight");
  if (bias != nullptr) {
    check_same_dtype(*bias, "bias", x, "x");
    check_dim(*bias, "bias", 1, "[out_features]");
    check_size(*bias, "bias", 0, weight.size(0), "out_features (weight.size(0))");
    check_contiguous(*bias, "bias");
  }
  FOLIO_CHECK_VALUE(!silu_gate || weight.size(0) % 2 == 0, "CUDA ", op, "'s silu_gate needs 'weight' of [gate; up] "
                    "halves (an even number of rows), got shape ", shape_str(weight));
}

// The output of a decode GEMV, [M, N] (silu_gate: [M, N / 2]) in x's dtype, contiguous, and the fields of its
// params both GEMVs share (the weight's pointer, typed per GEMV, is the caller's).
template <typename Params>
at::Tensor gemv_out(Params& p, const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias, bool silu_gate) {
  const auto out = at::empty({x.size(0), weight.size(0) / (silu_gate ? 2 : 1)}, x.options());
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.x_row_stride = x.stride(0);
  p.weight_row_stride = weight.stride(0);
  p.bias = bias != nullptr ? bias->data_ptr() : nullptr;
  p.num_rows = x.size(0);
  p.out_features = weight.size(0);
  p.in_features = x.size(1);
  p.silu_gate = silu_gate;
  return out;
}

// linear for decode: x [M, K] with M <= kLinearMaxRows, weight [N, K] (F.linear's layout), bias [N] or None; all of
// one float dtype on one device, last dims dense (any row strides and alignment; the fast path wants 16-byte aligned
// rows and K % 8 == 0, float32 K % 4 == 0). folio.ops.linear_supported says when the model calls it: these checks
// plus the fast-path conditions. silu_gate (16-bit x only): weight is gate_up ([gate; up]) and the result is
// silu_and_mul of the product, [M, N / 2], bit-identical to running silu_and_mul after it.
at::Tensor linear(const at::Tensor& x,                    // [M, K] float
                  const at::Tensor& weight,               // [N, K] x's dtype
                  const std::optional<at::Tensor>& bias,  // [N] x's dtype, or None
                  bool silu_gate, bool pdl) {
  const at::Tensor* b = bias.has_value() ? &*bias : nullptr;
  cuda::LinearParams p{};
  p.dtype = float_type(x, "x");
  check_same_dtype(weight, "weight", x, "x");
  if (silu_gate) {
    FOLIO_CHECK_VALUE(x.scalar_type() != at::kFloat, "CUDA linear's silu_gate takes float16 or bfloat16 'x', got ",
                      x.scalar_type());
  }
  check_gemv_args("linear", x, weight, nullptr, b, silu_gate);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor out = gemv_out(p, x, weight, b, silu_gate);
  p.weight = weight.data_ptr();
  C10_CUDA_CHECK(cuda::linear(p, launch_on(x, pdl)));
  return out;
}

// linear with FP8 weights for decode (folio.model.fp8): x [M, K] float16/bfloat16 with M <= kLinearMaxRows, weight
// [N, K] float8_e4m3fn, weight_scale [N] float32, bias [N] of x's dtype or None; y = x @ (weight * scale).T + bias.
// Any K and row strides (last dims dense); the fast path wants 16-byte aligned rows and K % 16 == 0
// (folio.model.fp8.gemv_supported). silu_gate: as linear's.
at::Tensor linear_fp8(const at::Tensor& x,                    // [M, K] float16/bfloat16
                      const at::Tensor& weight,               // [N, K] float8_e4m3fn
                      const at::Tensor& weight_scale,         // [N] float32
                      const std::optional<at::Tensor>& bias,  // [N] x's dtype, or None
                      bool silu_gate, bool pdl) {
  const at::Tensor* b = bias.has_value() ? &*bias : nullptr;
  cuda::LinearFp8Params p{};
  p.dtype = float_type(x, "x");
  FOLIO_CHECK_TYPE(x.scalar_type() != at::kFloat, "CUDA linear_fp8 takes float16 or bfloat16 'x', got ",
                   x.scalar_type());
  check_dtype(weight, "weight", at::kFloat8_e4m3fn);
  check_dtype(weight_scale, "weight_scale", at::kFloat);
  check_gemv_args("linear_fp8", x, weight, &weight_scale, b, silu_gate);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor out = gemv_out(p, x, weight, b, silu_gate);
  p.weight = static_cast<const uint8_t*>(weight.data_ptr());
  p.weight_scale = weight_scale.data_ptr<float>();
  C10_CUDA_CHECK(cuda::linear_fp8(p, launch_on(x, pdl)));
  return out;
}

// Per-row dynamic FP8 quantization of x [M, K] float16/bfloat16 (last dim dense): (codes [M, K] float8_e4m3fn,
// scales [M, 1] float32), folio.reference_ops.quantize_rows_fp8's arithmetic (the _scaled_mm path's activations).
std::tuple<at::Tensor, at::Tensor> quantize_rows_fp8(const at::Tensor& x,  // [M, K] float16/bfloat16
                                                     bool pdl) {
  check_all_on(kCuda, {{&x, "x"}});
  check_dim(x, "x", 2, "[num_rows, width]");
  check_inner_contiguous(x, "x");
  cuda::QuantizeRowsFp8Params p{};
  p.dtype = float_type(x, "x");
  FOLIO_CHECK_TYPE(x.scalar_type() != at::kFloat, "CUDA quantize_rows_fp8 takes float16 or bfloat16 'x', got ",
                   x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  const at::Tensor scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  p.out = static_cast<uint8_t*>(out.data_ptr());
  p.out_row_stride = out.stride(0);
  p.scale = scale.data_ptr<float>();
  p.x = x.data_ptr();
  p.x_row_stride = x.stride(0);
  p.num_rows = x.size(0);
  p.width = x.size(1);
  C10_CUDA_CHECK(cuda::quantize_rows_fp8(p, launch_on(x, pdl)));
  return {out, scale};
}

// The current stream of `device`'s device (any tensor on it) waits until the host writes a value >= `value` into
// `flag` (a pinned host int64 tensor of one element); see native/cuda/host_gate.cu.
void wait_host_value(const at::Tensor& device, const at::Tensor& flag, int64_t value, int64_t timeout_ns) {
  check_all_on(kCuda, {{&device, "device"}});
  FOLIO_CHECK_VALUE(flag.device().is_cpu() && flag.is_pinned(), "argument 'flag' must be a pinned host tensor");
  FOLIO_CHECK_TYPE(flag.scalar_type() == at::kLong && flag.numel() == 1, "argument 'flag' must hold one int64, got ",
                   flag.numel(), " of ", flag.scalar_type());
  FOLIO_CHECK_VALUE(timeout_ns >= 0, "argument 'timeout_ns' must be >= 0, got ", timeout_ns);
  const c10::cuda::CUDAGuard guard(device.device());
  C10_CUDA_CHECK(cuda::wait_host_value(flag.data_ptr<int64_t>(), value, timeout_ns, current_stream(device)));
}

}  // namespace

void define_peer_all_reduce(pybind11::module_& m);  // peer_all_reduce.cpp

}  // namespace folio::bind

PYBIND11_MODULE(_native_cuda, m) {
  namespace py = pybind11;
  using namespace folio::bind;
  m.doc() = "folio CUDA kernels (see native/); signatures match folio.reference_ops, plus keyword-only launch options";
  FOLIO_NATIVE_OPS(FOLIO_DEF_CUDA)
  m.attr("LINEAR_MAX_ROWS") = folio::cuda::kLinearMaxRows;
  define_peer_all_reduce(m);
}
