// CUDA launchers: host functions over raw device pointers (no torch, no pybind11). Every launcher enqueues its
// kernels on `stream`, never synchronizes with the host, and returns the launch status (cudaGetLastError()).
// Safe to call while a CUDA graph is being captured on `stream`. Launchers that take a `Launch` may launch with
// programmatic dependent launch (launch.cuh) where it asks for it, on sm_90+: each kernel may then start while the
// previous kernel on the stream finishes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/params.h"

namespace folio::cuda {

// How a launcher enqueues its kernels. Given per call by the binding (its `pdl` argument, EngineOptions.pdl), never
// read from the environment or a global.
struct Launch {
  cudaStream_t stream;
  bool pdl;  // programmatic dependent launch where the device supports it (sm_90+); false: plain stream order
};

cudaError_t rms_norm(const RmsNormParams& p, const Launch& launch);

cudaError_t silu_and_mul(const SiluAndMulParams& p, const Launch& launch);

cudaError_t rotary_cache_write(const RotaryCacheWriteParams& p, const Launch& launch);

// rotary_cache_write with quantized caches (rotary_quant.cu): p.quant names the format and the scale tensors; the
// caches hold uint8 codes. 16-bit q/k/v, head_dim <= 512 (a multiple of 32 for q8 / q4). paged_attention reads
// such caches when p.quant.format != kNone (16-bit q).
cudaError_t rotary_cache_write_quant(const RotaryCacheWriteParams& p, const Launch& launch);

// Paged attention for decode (p.cu_seqlens_q == nullptr: one query row per sequence) and prefill (one row per
// token of cu_seqlens_q). num_rows = B or T. The context of each row may be split over several thread blocks
// (flash-decoding); their partial results go to `workspace` and a second kernel merges them. decode_mma: decode rows
// run on the tensor-core kernel (attention_mma.cuh) where it applies, else on the CUDA-core one (EngineOptions.
// decode_attention, for A/B timing); prefill rows always run on the CUDA-core kernel.
//
// The split is planned from the block-table width, which under CUDA graphs is max_seq_len's pages (131,072 keys for
// a Llama 3 context) whatever the rows hold. So each row divides its keys into the splits that the plan's cost rule
// gives a context of its length (splits_by_length, by the power-of-two bucket of its visible keys, at most
// num_splits): its other blocks return at once and the merge reads only the partials written.
constexpr int kSplitLengthBuckets = 16;  // bucket k: up to 64 << k visible keys (the last also takes longer rows)
struct SplitsByLength {
  uint8_t splits[kSplitLengthBuckets];
};
struct AttentionPlan {
  int num_splits;                // thread blocks per (row, kv head group): the most any row uses
  int64_t workspace_floats;      // floats of workspace needed (0 when num_splits == 1)
  SplitsByLength by_length;      // splits of a row by its length (1 <= splits <= num_splits)
};
// Head-dim / alignment support of the CUDA kernels; returns nullptr when supported, else the reason.
const char* attention_unsupported_reason(const PagedAttentionParams& p);
// decode_mma: as paged_attention's (the 16-bit tensor-core kernel is planned by its own occupancy).
AttentionPlan plan_paged_attention(const PagedAttentionParams& p, int64_t num_rows, int num_sms, bool decode_mma);
cudaError_t paged_attention(const PagedAttentionParams& p, int64_t num_rows, const AttentionPlan& plan,
                            float* workspace, bool decode_mma, const Launch& launch);

cudaError_t copy_page_slots(const PageCopyParams& p, cudaStream_t stream);

cudaError_t sample_rows(const SampleParams& p, cudaStream_t stream);

// The CUDA penalty kernel sorts each row's history in shared memory; rows longer than this are refused by the
// binding (callers cap the penalty window).
constexpr int64_t kMaxPenaltyHistory = 16384;
cudaError_t apply_penalties(const PenaltyParams& p, cudaStream_t stream);

cudaError_t mask_tokens(const MaskTokensParams& p, cudaStream_t stream);

// host_gate.cu: the stream waits until the pinned host word *flag (a unified address) is >= value; traps after
// timeout_ns (0: never).
cudaError_t wait_host_value(int64_t* flag, int64_t value, int64_t timeout_ns, cudaStream_t stream);

// linear for decode-sized inputs (gemv.cu): out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for
// m < num_rows <= kLinearMaxRows, accumulated in fp32 and rounded once. One launch, no workspace, no atomics; the
// result does not depend on num_rows or out_features (the summation order is fixed by in_features).
// Any in_features, row strides and alignment work; the fast path needs 16-byte aligned rows of x and weight and
// in_features a multiple of 8 (float32: 4). Returns cudaErrorInvalidValue for num_rows > kLinearMaxRows.
constexpr int64_t kLinearMaxRows = 8;
struct LinearParams {
  void* out;                  // [num_rows, out_features] dtype, contiguous
  const void* x;              // [num_rows, in_features] dtype
  int64_t x_row_stride;
  const void* weight;         // [out_features, in_features] dtype (F.linear's layout)
  int64_t weight_row_stride;
  const void* bias;           // [out_features] dtype; nullptr: none
  int64_t num_rows, out_features, in_features;
  ScalarType dtype;           // float32, float16 or bfloat16 (float16/bfloat16 need sm_80+: tensor-core mma)
  // 16-bit types: weight is [gate; up] (out_features = 2I rows) and out [num_rows, I] gets silu(gate) * up, each
  // factor rounded to dtype first (bit-identical to the product followed by silu_and_mul).
  bool silu_gate;
};
cudaError_t linear(const LinearParams& p, const Launch& launch);

// linear with FP8 weights for decode-sized inputs (gemv_fp8.cu): out[m, n] = weight_scale[n] * sum_k x[m, k] *
// weight[n, k] (+ bias[n]), weight float8 e4m3 with one fp32 scale per output channel, x float16/bfloat16,
// accumulated in fp32 and rounded once; silu_gate as LinearParams'. Any in_features and strides; the fast path needs
// 16-byte aligned rows of x and weight and in_features a multiple of 16. cudaErrorInvalidValue for num_rows >
// kLinearMaxRows or a float32 dtype.
struct LinearFp8Params {
  void* out;                  // [num_rows, out_features] dtype, contiguous (silu_gate: [num_rows, out_features / 2])
  const void* x;              // [num_rows, in_features] dtype
  int64_t x_row_stride;
  const uint8_t* weight;      // [out_features, in_features] float8 e4m3 (F.linear's layout)
  int64_t weight_row_stride;
  const float* weight_scale;  // [out_features] fp32
  const void* bias;           // [out_features] dtype; nullptr: none
  int64_t num_rows, out_features, in_features;
  ScalarType dtype;           // of x, out and bias: float16 or bfloat16 (tensor-core mma: sm_80+)
  bool silu_gate;
};
cudaError_t linear_fp8(const LinearFp8Params& p, const Launch& launch);

// Per-row dynamic FP8 quantization of activations (quantize_fp8.cu), folio.reference_ops.quantize_rows_fp8's
// arithmetic: scale[m] = max(max_k |x[m, k]| / 448, 1e-12) (fp32), out[m, k] = e4m3(x[m, k] / scale[m]) with
// round-to-nearest-even and saturation. x float16/bfloat16 (cudaErrorInvalidValue for float32), last dim dense.
struct QuantizeRowsFp8Params {
  uint8_t* out;               // [num_rows, width] float8 e4m3
  int64_t out_row_stride;
  float* scale;               // [num_rows] fp32
  const void* x;              // [num_rows, width] dtype
  int64_t x_row_stride;
  int64_t num_rows, width;
  ScalarType dtype;
};
cudaError_t quantize_rows_fp8(const QuantizeRowsFp8Params& p, const Launch& launch);

}  // namespace folio::cuda
