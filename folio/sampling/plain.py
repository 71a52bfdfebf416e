"""The sampler's plain path: a step whose rows need nothing per row but their settings, their draw and their penalty
window (no filter, banned string, token bias, DRY, extended sampler, blocked token or extra output) goes to the native
kernels from one pass over its sequences, without a RowParams per row and the general path's passes over them (at
a batch of hundreds those passes are a large share of sampling's host time, and host time bounds a large batch's
step on a GPU once the device's step is short: a small model, or tensor parallelism).

The kernels, their inputs and their order are the general path's (folio.sampling.sampler._sample_native): the same
tokens and probabilities, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from folio.ops import OpSet
from folio.sampling.rng import uniforms
from folio.sampling.sampler import (
    MAX_NATIVE_PENALTY_WINDOW,
    SampleOutput,
    native_draw,
    native_entry,
    native_penalties,
    per_row_table,
    with_window,
)

_UNSET = object()


@dataclass
class PlainRows:
    """One step's rows on the plain path, as the kernels take them."""

    table: list[tuple]  # the distinct native entries (folio.sampling.sampler.native_entry)
    row_index: list[int]  # each row's entry
    seeds: list[int]
    counters: list[int]  # each row's draw counter: the tokens its sequence has sampled
    history_rows: list[int]  # the rows whose sequences keep a penalty history on the device
    keys: list[Any]  # per row: its sequence where it keeps one, else None (DeviceHistories.windows' keys)
    lengths: list[int]  # per row: its history length (prompt + sampled; 0 without one)
    sizes: list[int]  # per row: its window size (0: no penalty)
    return_probs: bool  # some row's job reports probabilities


def plain_job(job: Any) -> tuple[tuple, bool, int | None] | None:
    """(native entry, plain greedy, penalty window) for the rows of `job`, or None where they take the general path.
    Kept on the job: what decides it is fixed once the job is built (what changes per token, the healed token and
    the blocked stop tokens, plain_rows asks per row)."""
    cached = job.__dict__.get("_plain", _UNSET)
    if cached is not _UNSET:
        return cached
    s = job.gen_settings
    general = (job.filters or job.banned_strings or s.token_bias or s.dry_active or s.uses_extended_samplers
               or job.return_top_tokens or job.return_logits)
    window = s.penalty_window
    cached = None if general else (native_entry(s), s.is_greedy and window == 0, window)
    job.__dict__["_plain"] = cached
    return cached


def plain_rows(seqs: Sequence[Any], histories: Any) -> PlainRows | None:
    """seqs' rows for the plain path, or None when some row needs the general path, when every row is plain greedy
    (the general path's argmax is cheaper still) or when a window is wider than the native penalty kernel reads.
    histories: the runner's DeviceHistories."""
    table_index: dict[tuple, int] = {}
    row_index, seeds, counters, history_rows, keys, lengths, sizes = [], [], [], [], [], [], []
    all_greedy, return_probs = True, False
    held = histories.holders
    for b, seq in enumerate(seqs):
        job = seq.job
        plain = job.__dict__.get("_plain", _UNSET)
        if plain is _UNSET:
            plain = plain_job(job)
        if plain is None:
            return None
        num_sampled = seq.num_sampled
        if job.constrained_at(num_sampled):
            return None  # the healed token's mask, or blocked stop tokens
        entry, greedy, window = plain
        k = table_index.get(entry)
        if k is None:
            k = table_index[entry] = len(table_index)
        row_index.append(k)
        seeds.append(job.seed)
        counters.append(num_sampled)
        all_greedy = all_greedy and greedy
        return_probs = return_probs or job.return_probs
        if seq in held:
            history_rows.append(b)
            keys.append(seq)
            length = seq.prompt_len + num_sampled
            lengths.append(length)
            sizes.append(length if window is None else min(window, length))
        else:
            keys.append(None)
            lengths.append(0)
            sizes.append(0)
    if all_greedy or (history_rows and max(sizes) > MAX_NATIVE_PENALTY_WINDOW):
        return None
    return PlainRows(list(table_index), row_index, seeds, counters, history_rows, keys, lengths, sizes, return_probs)


def sample_plain(logits: torch.Tensor, rows: PlainRows, histories: Any, vocab_size: int | None,
                 ops: OpSet) -> SampleOutput:
    """What folio.sampling.sample gives these rows with in_place=True (`logits` is processed where it is): penalties
    over the device histories' windows, the columns past vocab_size masked, then the draw."""
    device, num_columns = logits.device, logits.shape[1]
    ids = histories.windows(rows.keys, rows.lengths, rows.sizes, num_columns) if rows.history_rows else None
    width = 0 if ids is None else ids.shape[1]
    table = [with_window(t, width) for t in rows.table]
    per_row, u = per_row_table(table, rows.row_index, uniforms(rows.seeds, rows.counters), device)
    floats, ints = per_row.float(), per_row.int()
    if width:
        native_penalties(ops, logits, ids, floats, ints)
    if vocab_size is not None and vocab_size < num_columns:
        logits[:, vocab_size:] = -math.inf
    token_ids, token_probs = native_draw(ops, logits, floats, ints, u)
    return SampleOutput(token_ids, token_probs)

