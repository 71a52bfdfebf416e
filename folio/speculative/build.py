"""Speculative decoding: tokens drafted cheaply (a draft model, or n-grams of the job's own text) and verified by
the target in one forward, kept by exact rejection sampling. See docs/architecture.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from folio.sizing import positive_int
from folio.speculative.adaptive import DraftLengths
from folio.speculative.speculator import Speculator

if TYPE_CHECKING:
    from folio.kv_cache import Cache
    from folio.model.model import Model

# A draft token's verify cost beside its drafting, relative to a one-token step of the target, at small batches
# (a few more rows through memory-bound matmuls).
VERIFY_TOKEN_COST = 0.03
NGRAM_DRAFT_COST = 0.0  # host work, overlapped with nothing but small


MAX_GRAPH_ROWS = 512  # the largest decode-graph bucket (folio.model.decode_graphs.BATCH_BUCKETS)


def target_graph_rows(max_batch_size: int, num_draft_tokens: int | None) -> int:
    """Token rows the target's decode graphs are captured for: every sequence's verify row (1 + drafts) with
    speculation (num_draft_tokens not None), one row each without."""
    if num_draft_tokens is None:
        return max_batch_size
    return max(max_batch_size, min(MAX_GRAPH_ROWS, max_batch_size * (1 + num_draft_tokens)))


def draft_graph_rows(max_batch_size: int) -> int:
    """Token rows the draft model's graphs are captured for: a draft pass's first forward feeds two per sequence."""
    return max(max_batch_size, min(MAX_GRAPH_ROWS, 2 * max_batch_size))


def build_speculator(model: Model, cache: Cache, draft_model: Model | None, draft_cache: Cache | None,
                     num_draft_tokens: int, use_ngram_draft: bool, max_ngram: int, adaptive_draft: bool,
                     max_q_size: int, max_seq_len: int, vocab_size: int, max_batch_size: int,
                     cuda_graphs: bool, step_token_budget: int | None) -> tuple[Speculator | None, Cache | None]:
    """The generator's speculator (None without a drafter), and the draft cache (made to match `cache` when not
    given). Raises ValueError on settings that cannot work together."""
    if draft_model is None and draft_cache is not None:
        raise ValueError("draft_cache was given without draft_model")
    if draft_model is None and not use_ngram_draft:
        return None, None
    if draft_model is not None and use_ngram_draft:
        raise ValueError("use_ngram_draft and draft_model exclude each other: choose one drafter")
    num_draft_tokens = positive_int("num_draft_tokens", num_draft_tokens)
    if max_q_size < 1 + num_draft_tokens:
        raise ValueError(f"max_q_size ({max_q_size}) must be at least 1 + num_draft_tokens ({num_draft_tokens}): "
                         f"a verify row feeds the last token and every draft")
    if draft_model is None:
        max_ngram = positive_int("max_ngram", max_ngram)
        lengths = DraftLengths(num_draft_tokens, NGRAM_DRAFT_COST + VERIFY_TOKEN_COST, adaptive_draft,
                               step_token_budget=step_token_budget)
        return Speculator(lengths, max_q_size, max_ngram=max_ngram), None
    draft_cache = _check_draft_model(model, cache, draft_model, draft_cache, max_seq_len)
    from folio.speculative.draft_model import DraftModelRunner

    runner = DraftModelRunner(draft_model, draft_cache, draft_graph_rows(max_batch_size), max_seq_len, vocab_size,
                              cuda_graphs)
    # a draft token costs one draft forward per row: about the draft's weight bytes over the target's at the
    # memory-bound batch sizes where speculation pays
    cost = _decode_bytes(draft_model) / max(1, _decode_bytes(model)) + VERIFY_TOKEN_COST
    lengths = DraftLengths(num_draft_tokens, cost, adaptive_draft, step_token_budget=step_token_budget)
    return Speculator(lengths, max_q_size, draft_runner=runner), draft_cache


def _decode_bytes(model: Model) -> int:
    """Weight bytes a one-token step reads: every layer and the output head."""
    import dataclasses

    import torch

    weights = model.weights
    total = weights.lm_head.numel() * weights.lm_head.element_size()
    for layer in weights.layers:
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _check_draft_model(model: Model, cache: Cache, draft_model: Model, draft_cache: Cache | None,
                       max_seq_len: int) -> Cache:
    from folio.kv_cache import Cache

    target_vocab, draft_vocab = model.config.vocab_size, draft_model.config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
                         f"({target_vocab}): a draft model must use the target's tokenizer")
    if draft_model.device != model.device:
        raise ValueError(f"the draft model is on {draft_model.device}, the target on {model.device}")
    if draft_model.config.max_position_embeddings < max_seq_len:
        raise ValueError(f"the draft model's context ({draft_model.config.max_position_embeddings} tokens) is "
                         f"shorter than max_seq_len ({max_seq_len})")
    if draft_cache is None:
        return Cache(draft_model, num_tokens=cache.num_tokens, page_size=cache.page_size)
    if draft_cache.page_size != cache.page_size or draft_cache.num_pages != cache.num_pages:
        raise ValueError(f"the draft cache ({draft_cache.num_pages} pages of {draft_cache.page_size}) must match "
                         f"the cache ({cache.num_pages} pages of {cache.page_size}): it shares its page tables")
    return draft_cache



