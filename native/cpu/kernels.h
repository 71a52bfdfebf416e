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

// Items: rows. Sampling, per row (the CUDA kernel and tests/native_reference.py implement the same; it is
// folio.sampling's definition with exact integer masses):
//  * greedy (temperature < kGreedyTemperature or top_k == 1): the first index of the largest logit, prob 1.
//    Every logit -inf (or NaN): token -1, prob 0.
//  * z_i = logit_i / temperature; weight w_i = exp(z_i - max z) in [0, 1]; mass_i = floor(w_i * 2^40).
//    Candidates are ranked by w descending, ties by index ascending (a stable sort). Each filter keeps a prefix
//    of that ranking:
//      top-k (0 < k < V): the first k ranks;
//      top-p (top_p < 1): ranks 0..r where r is the first rank whose inclusive kept mass reaches
//        max(1, ceil((top_p - 1e-6) * kept mass)) (the smallest head reaching p; 1e-6 is folio.sampling's slack);
//      min-p (min_p > 0): ranks with w >= min_p (w is already relative to the most likely token).
//  * The token is the first kept rank whose inclusive mass exceeds floor(u * M), M the kept mass (inverse CDF
//    over the ranking); prob = its mass / M.
void sample_rows(const SampleParams& p, int64_t begin, int64_t end);

// Items: rows. For every distinct id t in history[b] (ids outside [0, V) ignored), with s = the strength of its
// newest occurrence and S = the sum of the strengths of all its occurrences (PenaltyParams):
//   f = 1 + (rep - 1) * s;  l = logits[b, t];  l = (l > 0 ? l / f : l * f);  logits[b, t] = l - pres * s - freq * S.
void apply_penalties(const PenaltyParams& p, int64_t begin, int64_t end);

// Items: rows. logits[b, id] = -inf for every id in token_ids[b] inside [0, V).
void mask_tokens(const MaskTokensParams& p, int64_t begin, int64_t end);

}  // namespace folio::cpu
