// Tensor-core paged attention for decode (attention_mma.cu, attention_mma_quant.cu), used by paged_attention()
// in attention.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/params.h"
#include "kernels.cuh"

namespace folio::cuda {

// Decode rows (p.cu_seqlens_q == nullptr), head_dim 64 or 128, 16-bit types, at most 16 query heads per kv head.
// (Whether the caller wants this kernel at all is its own argument: paged_attention's decode_mma.)
bool decode_attention_mma_applies(const PagedAttentionParams& p);

// Same contract as the CUDA-core kernel: with num_splits > 1 each split writes its unnormalized partial to
// partial_acc [rows, Hq, num_splits, D] and partial_ml [rows, Hq, num_splits, 2] (max in log2 units, sum of exp2)
// for the caller's combine kernel; with one split the result goes to p.out.
cudaError_t decode_attention_mma(const PagedAttentionParams& p, int64_t num_rows, int num_splits, int page_shift,
                                 float* partial_acc, float* partial_ml, const Launch& launch);

// Blocks of the 16-bit kernel decode_attention_mma() runs for p that one multiprocessor holds at once (0: unknown or
// quantized pages), for planning the splits in whole waves. Asked of the runtime once per kernel (the devices of a
// process are alike).
int decode_attention_mma_blocks_per_sm(const PagedAttentionParams& p);

// Quantized caches (attention_mma_quant.cu), reached through the two above: whether its copies fit the cache and
// scale tensors' strides and alignment, and the kernel with the same contract.
bool decode_attention_mma_quant_applies(const PagedAttentionParams& p);
cudaError_t decode_attention_mma_quant(const PagedAttentionParams& p, int64_t num_rows, int num_splits,
                                       int page_shift, float* partial_acc, float* partial_ml, const Launch& launch);

}  // namespace folio::cuda
