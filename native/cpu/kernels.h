// CPU kernels: plain loops over raw pointers, no torch, no pybind11.
//
// Each kernel handles one slice [begin, end) of its op's independent work items (rows, tokens, or
// (query, head) pairs, as each declaration says), so the binding layer can spread the items over torch's
// intra-op thread pool while the kernels stay free of any threading library.
#pragma once

#include <cstdint>

#include "../common/params.h"

namespace folio::cpu {

// Items: rows. Plain rms_norm when p.residual == nullptr, fused residual-add + rms_norm otherwise.
void rms_norm(const RmsNormParams& p, int64_t begin, int64_t end);

// Items: rows.
void silu_and_mul(const SiluAndMulParams& p, int64_t begin, int64_t end);

// Items: tokens.
void rotary_cache_write(const RotaryCacheWriteParams& p, int64_t begin, int64_t end);

// Items: (token, query head) pairs, item = token * Hq + head. token_seq[t] is the sequence of token t
// (the binding derives it from cu_seqlens_q, which it has already validated on the host).
void paged_attention(const PagedAttentionParams& p, const int32_t* token_seq, int64_t begin, int64_t end);

// Items: (sequence, query head) pairs, item = seq * Hq + head.
void paged_attention_decode(const PagedAttentionParams& p, int64_t begin, int64_t end);

// Items: layers.
void copy_page_slots(const PageCopyParams& p, int64_t begin, int64_t end);

// Items: rows. Sampling semantics, per row b (the CUDA kernel and the torch reference implement the same):
//  1. temperature[b] < kGreedyTemperature: the first index of the largest logit (NaN logits never win).
//  2. z = logits / temperature; weight w_i = exp(z_i - max z) in [0, 1] (-inf logits get 0);
//     key_i = the bit pattern of w_i (monotone in w_i since w_i >= 0); mass_i = floor(w_i * 2^40).
//  3. top-k (0 < k < V): keep key_i >= the k-th largest key (ties at the boundary are all kept).
//  4. top-p (top_p < 1): among the kept, keep key_i >= t, where t is the largest key such that the kept mass
//     with key >= t reaches max(1, floor(top_p * kept mass)): the smallest head of the sorted distribution
//     whose mass reaches p (ties kept; p <= 0 keeps the top token and its ties).
//  5. min-p (min_p > 0): keep w_i >= min_p (w is already relative to the most likely token).
//  6. target = floor(u * M) with M the kept mass; the token is the first kept index i whose inclusive prefix
//     sum of kept mass exceeds target (u in [0, 1), so one always does when M > 0; M == 0 cannot happen
//     unless every logit is -inf or NaN, and then the result is index 0).
void sample_rows(const SampleParams& p, int64_t begin, int64_t end);

// Items: rows. For every distinct id t in history[b] (ids outside [0, V) ignored) occurring c_t times:
//   l = logits[b, t]; l = (l > 0 ? l / rep : l * rep); l -= freq * c_t + pres; logits[b, t] = l.
void apply_penalties(const PenaltyParams& p, int64_t begin, int64_t end);

// Items: rows. logits[b, id] = -inf for every id in token_ids[b] inside [0, V).
void mask_tokens(const MaskTokensParams& p, int64_t begin, int64_t end);

}  // namespace folio::cpu
