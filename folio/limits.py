"""The bounds of SamplerSettings' values (torch-free, so the serving ingress checks requests against them without
loading torch). Exported as folio.SAMPLER_LIMITS."""

from __future__ import annotations

from dataclasses import dataclass

# Bounds on the values that reach the sampler's fp32 logits (measured for issue 18 on folio.sampling.sample's torch
# path and on the native CPU kernels). Past them:
# - presence -1e308, frequency -1e300 or bias +1e308 turn into +inf logits; a row holding +inf has a NaN softmax,
#   and the torch path failed with "index -1 is out of bounds"; presence +1e308 with frequency -1e308 gave
#   inf - inf = NaN logits and no token at all (id -1);
# - a repetition penalty of 1e-38 or less is 0 in fp32 and divides positive logits by zero (the same index error);
#   1e300 is inf and turns a logit of exactly 0 into 0 * inf = NaN;
# - a temperature of 1e39 is inf in fp32: masked logits become -inf / inf = NaN (the same index error).
# Within them every logit stays finite: a model's logits (|l| ~ 1e2) scaled by a repetition penalty of 1e4 and
# shifted by 1e4 of presence, 1e4 of frequency per occurrence (windows < 1e7 tokens) and 1e4 of bias, over the
# smallest sampled temperature (0.01), stay below ~1e13, 25 orders of magnitude short of fp32's 3.4e38. They cost
# no expressiveness: an offset of 1e4 scales a probability by e^(1e4 / T), beyond fp32's range (exp underflows below
# -104) at any temperature under ~100, so larger offsets say nothing more; a bias of -inf bans a token exactly.
MAX_LOGIT_OFFSET = 1e4  # |token_presence_penalty|, |token_frequency_penalty|, |token_bias| (besides -inf)
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4
# Beyond ~1e2 a temperature flattens any model's distribution to uniform already; the bound keeps the divisor far
# from fp32's overflow.
MAX_TEMPERATURE = 1e4
# top_k, token_repetition_range and token_repetition_decay reach the native kernels as int32: at 2**31 they wrap,
# and with a range or decay of 2**31 the native CPU kernel dropped the penalty that the torch path applied.
MAX_INT32 = 2**31 - 1


@dataclass(frozen=True)
class SamplerLimits:
    max_logit_offset: float = MAX_LOGIT_OFFSET
    min_repetition_penalty: float = MIN_REPETITION_PENALTY
    max_repetition_penalty: float = MAX_REPETITION_PENALTY
    max_temperature: float = MAX_TEMPERATURE
    max_int32: int = MAX_INT32


SAMPLER_LIMITS = SamplerLimits()
