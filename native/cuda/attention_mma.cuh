// Tensor-core paged attention for decode (attention_mma.cu, attention_mma_quant.cu), used by paged_attention()
// in attention.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/params.h"
#include "kernels.cuh"

namespace folio::cuda {

// A decode row's keys, [first_key, num_keys): its context clamped to the block-table row (malformed inputs, which
// only the CPU binding can afford to check, cannot make a kernel read past it), from the start of its window.
__device__ __forceinline__ void decode_row_keys(const PagedAttentionParams& p, int64_t row, int page_shift,
                                                int64_t& first_key, int64_t& num_keys) {
  num_keys = min(static_cast<int64_t>(p.context_lens[row]), p.max_blocks << page_shift);
  num_keys = max(num_keys, int64_t{0});
  first_key = first_visible_key(p, num_keys - 1);
}

// The splits a row of `visible` keys is divided into (AttentionPlan::by_length).
__device__ __forceinline__ int row_splits(const SplitsByLength& by_length, int64_t visible) {
  const int bucket = visible > 64 ? 64 - __clzll(static_cast<unsigned long long>(visible - 1)) - 6 : 0;  // ceil(log2)
  return by_length.splits[min(bucket, kSplitLengthBuckets - 1)];
}

// Split `split` of `splits` over keys [first_key, num_keys): whole runs of `granule` keys, the last split shorter
// (or empty).
__device__ __forceinline__ void split_keys(int64_t first_key, int64_t num_keys, int splits, int split,
                                           int64_t granule, int64_t& key_begin, int64_t& key_end) {
  const int64_t per_split = (num_keys - first_key + splits - 1) / splits;
  const int64_t split_len = (per_split + granule - 1) / granule * granule;
  key_begin = first_key + split * split_len;
  key_end = min(num_keys, key_begin + split_len);
}

// The keys [key_begin, key_end) of split `split` of decode row `row` (whole runs of `granule`, from the window's start:
// earlier pages are not read); returns the row's number of splits, or 0 when `split` is past them (that block has
// nothing to do: the row's keys take fewer splits than the grid has).
__device__ __forceinline__ int decode_split(const PagedAttentionParams& p, const SplitsByLength& by_length,
                                            int64_t row, int split, int page_shift, int64_t granule,
                                            int64_t& key_begin, int64_t& key_end) {
  int64_t first_key, num_keys;
  decode_row_keys(p, row, page_shift, first_key, num_keys);
  const int splits = row_splits(by_length, num_keys - first_key);
  if (split >= splits) return 0;
  split_keys(first_key, num_keys, splits, split, granule, key_begin, key_end);
  return splits;
}

// Decode rows (p.cu_seqlens_q == nullptr), head_dim 64 or 128, 16-bit types, at most 16 query heads per kv head.
// (Whether the caller wants this kernel at all is its own argument: paged_attention's decode_mma.)
bool decode_attention_mma_applies(const PagedAttentionParams& p);

// Same contract as the CUDA-core kernel: a row divided into more than one split (row_splits) has each split write its
// unnormalized partial to partial_acc [rows, Hq, plan.num_splits, D] and partial_ml [rows, Hq, plan.num_splits, 2]
// (max in log2 units, sum of exp2) for the caller's combine kernel; a row of one split writes p.out.
cudaError_t decode_attention_mma(const PagedAttentionParams& p, int64_t num_rows, const AttentionPlan& plan,
                                 int page_shift, float* partial_acc, float* partial_ml, const Launch& launch);

// Blocks of the 16-bit kernel decode_attention_mma() runs for p that one multiprocessor holds at once (0: unknown or
// quantized pages), for planning the splits in whole waves. Asked of the runtime once per kernel (the devices of a
// process are alike).
int decode_attention_mma_blocks_per_sm(const PagedAttentionParams& p);

// Quantized caches (attention_mma_quant.cu), reached through the two above: whether its copies fit the cache and
// scale tensors' strides and alignment, and the kernel with the same contract.
bool decode_attention_mma_quant_applies(const PagedAttentionParams& p);
cudaError_t decode_attention_mma_quant(const PagedAttentionParams& p, int64_t num_rows, const AttentionPlan& plan,
                                       int page_shift, float* partial_acc, float* partial_ml, const Launch& launch);

}  // namespace folio::cuda
