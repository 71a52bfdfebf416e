"""Checks at enqueue: a job that could never run here is refused up front, with a ValueError naming the field.

What passes them is what the sampler and the cache accept, so that neither refuses a job later, in the middle of a
batch (the sampler rejects an out-of-range id for its whole call). SamplerSettings checks its own ranges when it is
built, including the bounds that keep fp32 logits finite (folio.sampling.settings); what is checked here needs the
engine's numbers: the vocabulary, the longest sequence and the cache's size.

Torch-free: importing this module loads no torch (whoever built the job has loaded it already).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from folio.job import DynamicJob


def validate_job(job: DynamicJob, *, vocab_size: int, max_seq_len: int, num_pages: int, page_size: int) -> None:
    """Raise ValueError, naming the offending field, if `job` can never run on this engine.

    vocab_size: the real vocabulary entries the sampler picks from (the smaller of the tokenizer's and the model's).
    max_seq_len: the longest sequence, prompt + new tokens, the engine runs.
    num_pages, page_size: the whole KV cache.

    Checks that the job was never enqueued; that prompt + max_new_tokens fits max_seq_len and the cache; that the
    ids of input_ids, stop_conditions and gen_settings.token_bias lie in [0, vocab_size) and return_top_tokens does
    not exceed vocab_size; and that some token is left to sample (a -inf token_bias, and stop tokens while below
    min_new_tokens, do not ban the whole vocabulary). With stop_conditions=None the stop tokens are the tokenizer's
    EOS ids, filled in when the job is bound after these checks: the tokenizer has checked them.
    """
    _check_new(job)
    _check_length(job, max_seq_len, num_pages, page_size)
    _check_vocabulary(job, vocab_size)
    _check_something_pickable(job, vocab_size)


def _check_new(job: DynamicJob) -> None:
    from folio.job import JobState  # here, not at the top: folio.job loads torch (its maker has loaded it already)

    if job.state != JobState.NEW:
        raise ValueError(f"job was already enqueued (state {job.state})")


def _check_length(job: DynamicJob, max_seq_len: int, num_pages: int, page_size: int) -> None:
    total = job.prompt_tokens + job.max_sampled_tokens  # (with token healing: the prompt's last token is sampled)
    if total > max_seq_len:
        raise ValueError(f"prompt ({job.prompt_tokens} tokens) + max_new_tokens ({job.max_new_tokens}) = "
                         f"{total} exceeds max_seq_len {max_seq_len}")
    pages = _pages_for_tokens(total, page_size)
    if pages > num_pages:
        raise ValueError(f"prompt ({job.prompt_tokens} tokens) + max_new_tokens ({job.max_new_tokens}) need {pages} "
                         f"pages of {page_size} tokens, but the whole cache has {num_pages}")


def _pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)  # ceil, in integers


def _check_vocabulary(job: DynamicJob, vocab_size: int) -> None:
    prompt = job.input_ids if job.healing_token_id is None else [*job.input_ids, job.healing_token_id]
    from folio.embeddings import PLACEHOLDER_BASE  # (loads torch: see _check_new)

    # DynamicJob has checked they are >= 0, and that ids from PLACEHOLDER_BASE on are its embeddings' placeholders
    bad = next((t for t in prompt if vocab_size <= t < PLACEHOLDER_BASE), None)
    if bad is not None:
        raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary of {vocab_size}")
    if job.return_top_tokens > vocab_size:
        raise ValueError(f"return_top_tokens={job.return_top_tokens} exceeds the model's vocabulary of {vocab_size}")
    _check_ids("stop_conditions", job.stop_tokens, vocab_size)
    _check_ids("gen_settings.token_bias", (t for t, _ in job.gen_settings.token_bias), vocab_size)


def _check_ids(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    bad = sorted(t for t in token_ids if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(f"{field}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")


def _check_something_pickable(job: DynamicJob, vocab_size: int) -> None:
    """The sampler finds nothing to pick when every token is banned (-inf bias) or, for the first min_new_tokens
    tokens, blocked as a stop token; the job would fail at its first sampled token. All ids are in range here."""
    banned = {t for t, bias in job.gen_settings.token_bias if bias == -math.inf}
    if len(banned) >= vocab_size:
        raise ValueError(f"gen_settings.token_bias bans every token of the vocabulary of {vocab_size} (-inf bias): "
                         "nothing is left to sample")
    if job.min_new_tokens > 0 and len(banned | job.stop_tokens) >= vocab_size:
        raise ValueError(f"stop_conditions: its stop tokens, blocked until min_new_tokens={job.min_new_tokens}, and "
                         f"the tokens gen_settings.token_bias bans cover the whole vocabulary of {vocab_size}: "
                         "nothing is left to sample")
