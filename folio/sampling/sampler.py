"""Batched sampling on the logits' device, each row with its own settings.

Order of operations per row (the reference's, with the common top-p definition and the intended semantics where
the reference has bugs):
  repetition / frequency / presence penalties -> token bias -> blocked tokens (-inf) -> DRY -> mask beyond the real
  vocab -> greedy rows: argmax; other rows: temperature (unless temperature_last) and quadratic smoothing -> softmax
  over the top-k -> top-p -> min-p -> top-a -> tail-free -> locally typical -> mirostat (each renormalised)
  -> temperature_last, then dynamic temperature (p^(1/T) renormalised) -> XTC (in expectation) -> skew on the draw
  -> inverse-CDF pick with the row's uniform draw over the candidates sorted by probability.
The stages after min-p are folio.sampling.truncation's; DRY is folio.sampling.dry's; mirostat's mu comes from the
row's SamplerState (folio.sampling.state: the caller advances it with the sampled token's probability).

All rows are processed together with tensor ops; per-row parameters travel to the device as a few small tensors
built once per call (pinned, non-blocking on CUDA). Nothing here reads a device value back to the host: the caller
does that when it reads `token_ids`.

The native sampling kernels come from an op set (folio.ops.OpSet; a model's `ops`): under backend "reference", or
where the op set has no native kernel for the logits' device, the torch code below runs instead. The native kernel
knows temperature, top-k, top-p and min-p only: rows that use an extended sampler take the torch code (a batch with
both kinds of rows is split in two).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from folio.ops import DEFAULT as DEFAULT_OPS
from folio.ops import OpSet
from folio.sampling.bitmask import apply_bitmask
from folio.sampling.dry import apply_dry
from folio.sampling.host import to_device
from folio.sampling.penalties import apply_penalties, history_windows, window_size
from folio.sampling.rows import RowParams, SampleOutput, _check_call
from folio.sampling.settings import SamplerSettings
from folio.sampling.truncation import ExtendedParams, after_truncation, extended_params, pre_softmax, skewed

# Mass within this distance of top_p counts as reaching it: fp32 sums of probabilities that are exactly p in
# exact arithmetic land a few ulps either side of it.
_TOP_P_SLACK = 1e-6


def _first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(dim=1) of [B, W]: each row's largest value and its first index (NaN counts as largest, as in torch).
    A wide row is reduced in two stages, over 128 chunks and then over their maxima: the same answer (a chunk's
    first maximum, and the first chunk holding the row's), but spread over 128 blocks where a single reduction of
    a 128k vocabulary row runs in one block (27 us of one decode step's ~4.5 ms on an H200)."""
    rows, width = x.shape
    chunks = 128
    if width < 64 * chunks or width % chunks:
        return x.max(dim=1)
    chunk_values, chunk_ids = x.reshape(rows, chunks, width // chunks).max(dim=2)
    values, chunk = chunk_values.max(dim=1)
    ids = chunk * (width // chunks) + chunk_ids.gather(1, chunk[:, None]).squeeze(1)
    return values, ids


def sample(logits: torch.Tensor, rows: Sequence[RowParams], penalty_windows: torch.Tensor | None = None,
           in_place: bool = False, ops: OpSet | None = None, allowed: torch.Tensor | None = None) -> SampleOutput:
    """Pick one token per row of `logits` [B, V] fp32 (left unchanged unless in_place) following each row's
    RowParams. penalty_windows: the rows' penalty ids already on the device ([B, width], see
    DeviceHistories.windows, with V as the padding id), used instead of the rows' history_ids.
    in_place: the caller reads `logits` no more, so the CUDA kernels may process them where they are instead of
    in a copy (at batch 256 of a 128k vocabulary the copy moves 262 MB, ~60-90 us of a decode step) -- unless a
    row returns its processed logits, which then stay in a copy of their own.
    ops: where the native sampling kernels come from (the model's op set; None: folio.ops.DEFAULT, backend
    "auto").
    allowed: [B, W] int32 token bitmask on the logits' device (folio.sampling.bitmask; filters): tokens whose bit
    is clear are never picked. Applied first, so the penalties and bias of masked tokens do not matter."""
    _check_call(logits, rows)
    allowed_counts = None
    if allowed is not None:
        if not in_place:
            logits, in_place = logits.clone(), True
        with torch.inference_mode(logits.is_inference()):  # a forward's output may be an inference tensor
            allowed_counts = apply_bitmask(logits, allowed)
    num_columns = logits.shape[1]
    width = _plain_greedy_width(rows, num_columns)
    if width is not None:
        # Every row is plain greedy: the full path's result is the argmax (first index on ties) with
        # probability 1, so skip its working copy, masks and sort (one kernel instead of ~30; single-stream
        # decode pays for each launch).
        values, ids = _first_max(logits[:, :width])
        pickable = values > -math.inf  # False for rows of -inf (nothing to pick) or NaN, as in _pick
        return SampleOutput(torch.where(pickable, ids, -1), pickable.float())
    if logits.device.type == "cuda" and not any(row.return_top_tokens for row in rows):
        extended = [row.settings.uses_extended_samplers for row in rows]
        if any(extended) and not all(extended) and not any(row.return_logits for row in rows):
            return _sample_split(logits, rows, extended, penalty_windows, ops)
        ops = ops if ops is not None else DEFAULT_OPS
        native = None if any(extended) else _sample_native(ops, logits, rows, penalty_windows, in_place,
                                                             allowed_counts)
        if native is not None:
            return native
    # Working copy with one extra column: scatters aim the entries they must skip at it.
    work = torch.nn.functional.pad(logits, (0, 1))
    if penalty_windows is None:
        apply_penalties(work, [row.settings for row in rows], [row.history_ids for row in rows])
    else:
        apply_penalties(work, [row.settings for row in rows], windows=penalty_windows)
    _apply_bias_and_blocks(work, rows)
    apply_dry(work, rows, num_columns)
    x = work[:, :num_columns]
    if any(row.vocab_size is not None and row.vocab_size < num_columns for row in rows):
        vocab_sizes = to_device([row.vocab_size or num_columns for row in rows], torch.int64, x.device)
        x.masked_fill_(torch.arange(num_columns, device=x.device) >= vocab_sizes[:, None], -math.inf)
    token_ids, token_probs, candidate_ids, final_probs = _pick(x, rows)

    num_top = max(row.return_top_tokens for row in rows)
    top_k_tokens = candidate_ids[:, :num_top] if num_top else None
    top_k_probs = final_probs[:, :num_top] if num_top else None
    logits_out = x if any(row.return_logits for row in rows) else None
    return SampleOutput(token_ids, token_probs, top_k_tokens, top_k_probs, logits_out)


def _sample_native(ops: OpSet, logits: torch.Tensor, rows: Sequence[RowParams],
                   penalty_windows: torch.Tensor | None, in_place: bool = False,
                   allowed_counts: torch.Tensor | None = None) -> SampleOutput | None:
    """The same steps with the native kernels: one for the penalties, one for truncation and the draw (a radix
    select instead of a sort). On CUDA a step's sampling is then a handful of launches instead of ~90, which is
    what bounds large-batch decode on the host. None when the kernels are not available (the caller runs the torch
    code). Candidates are not reported (rows asking for top tokens take the torch code)."""
    device = logits.device
    if ops.native("sample_rows", device.type) is None or ops.native("apply_penalties", device.type) is None:
        return None
    num_columns = logits.shape[1]
    if penalty_windows is None:
        sizes = [window_size(row.settings, len(row.history_ids)) for row in rows]
        width = max(sizes)
    else:
        width = penalty_windows.shape[1]
    if width > MAX_NATIVE_PENALTY_WINDOW:
        return None
    per_row, u, _ = _per_row_settings(rows, native_entry, device, adjust=lambda t: with_window(t, width))
    floats, ints = per_row.float(), per_row.int()
    return_logits = any(row.return_logits for row in rows)
    work = logits if in_place and not return_logits else logits.clone()
    if width:
        ids = penalty_windows if penalty_windows is not None else history_windows(
            [row.history_ids for row in rows], sizes, width, num_columns, device)  # padding id V: ignored
        native_penalties(ops, work, ids, floats, ints)
    _apply_bias_and_blocks(work, rows)
    apply_dry(work, rows, num_columns)
    if any(row.vocab_size is not None and row.vocab_size < num_columns for row in rows):
        vocab_sizes = to_device([row.vocab_size or num_columns for row in rows], torch.int64, device)
        work.masked_fill_(torch.arange(num_columns, device=device) >= vocab_sizes[:, None], -math.inf)
    token_ids, token_probs = native_draw(ops, work, floats, ints, u, allowed_counts)
    return SampleOutput(token_ids, token_probs, None, None, work if return_logits else None)


def native_penalties(ops: OpSet, work: torch.Tensor, ids: torch.Tensor, floats: torch.Tensor,
                     ints: torch.Tensor) -> None:
    """The native penalty kernel over `work` in place: ids [B, width] (right-aligned windows padded with V), the
    rows' native entries as floats and ints [B, 9] (see native_entry; a range of -1 already resolved)."""
    ops.apply_penalties(work, ids, floats[:, 4].contiguous(), floats[:, 5].contiguous(), floats[:, 6].contiguous(),
                        ints[:, 7].contiguous(), ints[:, 8].contiguous())


def native_draw(ops: OpSet, work: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, u: torch.Tensor,
                allowed_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The native truncation and draw over the processed logits `work` (the rows' entries as in native_penalties):
    token ids and their probabilities. allowed_counts: per row, the tokens a filter leaves (None: no filter)."""
    top_k = ints[:, 3].contiguous()
    if allowed_counts is not None:
        # A row a filter leaves n <= top_k tokens (or with top-k off) keeps all n under top-k = n: the same
        # candidates, and the kernel's short-list path instead of radix passes that tie over the masked -inf.
        n = allowed_counts.to(torch.int32)
        shorter = (n <= _NATIVE_SHORT_LIST) & ((top_k == 0) | (n < top_k))
        top_k = torch.where(shorter, n, top_k)
    return ops.sample_rows(work, floats[:, 0].contiguous(), top_k, floats[:, 1].contiguous(),
                           floats[:, 2].contiguous(), u)


def _sample_split(logits: torch.Tensor, rows: Sequence[RowParams], extended: list[bool],
                  penalty_windows: torch.Tensor | None, ops: OpSet | None) -> SampleOutput:
    """Rows with extended samplers through the torch code, the others through the native kernels; merged."""
    token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    token_probs = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
    for flag in (True, False):
        picked = [b for b, e in enumerate(extended) if e is flag]
        index = to_device(picked, torch.int64, logits.device)
        windows = None if penalty_windows is None else penalty_windows[index]
        part = sample(logits[index], [rows[b] for b in picked], windows, in_place=True, ops=ops)
        token_ids.index_copy_(0, index, part.token_ids)
        token_probs.index_copy_(0, index, part.token_probs)
    return SampleOutput(token_ids, token_probs)


# The native sampling kernel finishes a row with top-k up to this many in shared memory (kCompactCap).
_NATIVE_SHORT_LIST = 1024

# The native penalty kernel reads at most this many ids per row (its shared-memory bound).
MAX_NATIVE_PENALTY_WINDOW = 16384


def _plain_greedy_width(rows: Sequence[RowParams], num_columns: int) -> int | None:
    """The vocabulary width shared by all rows when every row is greedy with nothing else to apply (no penalties,
    bias, blocked tokens or extra outputs); else None."""
    width = None
    for row in rows:
        s = row.settings
        if (not s.is_greedy or s.penalty_window != 0 or s.token_bias or row.blocked_ids or row.return_top_tokens
                or row.return_logits or s.dry_active):
            return None
        row_width = min(row.vocab_size or num_columns, num_columns)
        if width is not None and row_width != width:
            return None
        width = row_width
    return width


def _apply_bias_and_blocks(work: torch.Tensor, rows: Sequence[RowParams]) -> None:
    """Token bias (added), then blocked tokens (-inf), in place, addressed as flat indices into `work`."""
    stride = work.shape[1]
    flat = work.view(-1)
    bias_index: list[int] = []
    bias_values: list[float] = []
    for b, row in enumerate(rows):
        for token_id, bias in row.settings.token_bias:
            bias_index.append(b * stride + token_id)
            bias_values.append(bias)
    if bias_index:
        # Indices are unique (token_bias is a mapping), so the add is deterministic.
        flat.index_add_(0, to_device(bias_index, torch.int64, work.device),
                        to_device(bias_values, torch.float32, work.device))
    blocked_index = [b * stride + token_id for b, row in enumerate(rows) for token_id in row.blocked_ids]
    if blocked_index:
        flat.index_fill_(0, to_device(blocked_index, torch.int64, work.device), -math.inf)


_GREEDY = (1.0, 2.0, 0.0, 1)


def _truncation(s: SamplerSettings) -> tuple[float, float, float, int]:
    """(temperature, top_p, min_p, top_k) as `_pick` applies them: a greedy row is top_k 1 at temperature 1, and
    top_p 2.0 / min_p 0 / top_k 0 mean off."""
    if s.is_greedy:
        return _GREEDY
    return s.temperature, s.top_p if s.top_p_active else 2.0, s.min_p, s.top_k


@dataclass(frozen=True)
class _PickParams:
    """Per-row truncation parameters on the device, [B, 1] each, and what the host knows about them."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor  # 0 (off) already replaced by the number of columns
    u: torch.Tensor
    any_greedy: bool
    max_top_k: int | None  # None: some row has top-k off and needs the full sort
    extended: ExtendedParams | None = None  # the extended samplers' parameters (None: no row uses any)


def _per_row_settings(rows: Sequence[RowParams], entry, device: torch.device, adjust=None
                      ) -> tuple[torch.Tensor, torch.Tensor, list[tuple]]:
    """Per-row numbers derived from each row's settings, on the device: one table entry per distinct value of
    entry(settings) (a server's jobs each have their own settings object, mostly of a few values), gathered per row
    there; the table, the draws and the row -> entry index travel in a single transfer. entry: a module-level
    function of the settings (its value is kept on each settings object: it is asked per row and step); adjust:
    applied to each table entry after (what depends on the call). Returns [B, E] float64 per row, the draws [B]
    float32, and the host table."""
    table_index: dict[tuple, int] = {}
    row_index: list[int] = []
    for row in rows:
        values = _entry_of(row.settings, entry)
        k = table_index.get(values)
        if k is None:
            k = table_index[values] = len(table_index)
        row_index.append(k)
    table = list(table_index) if adjust is None else [adjust(t) for t in table_index]
    per_row, u = per_row_table(table, row_index, [row.u for row in rows], device)
    return per_row, u, table


def per_row_table(table: Sequence[tuple], row_index: list[int], draws: list[float], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """table[row_index[b]] for each row b as [B, E] float64 on the device, and the draws [B] float32: the table,
    the draws and the index in one transfer. Each column of the result is contiguous (a [E, B] tensor seen
    transposed), so a kernel taking one column per argument reads it without a copy."""
    flat = [v for t in table for v in t]
    packed = to_device(flat + draws + row_index, torch.float64, device)
    num_rows, table_size = len(row_index), len(flat)
    columns = packed[:table_size].view(len(table), -1).t()[:, packed[table_size + num_rows:].long()]
    return columns.t(), packed[table_size: table_size + num_rows].float()


def _entry_of(settings: SamplerSettings, entry) -> tuple:
    """entry(settings), computed once per settings object (frozen: its value never changes) and kept on it the way
    functools.cached_property keeps its values."""
    cache = settings.__dict__.setdefault("_row_entries", {})
    values = cache.get(entry)
    if values is None:
        values = cache[entry] = entry(settings)
    return values


def native_entry(s: SamplerSettings) -> tuple:
    """The native kernels' per-row numbers: truncation, then the penalties (a range of -1, the whole window, is
    resolved per call: with_window)."""
    return (*_truncation(s), s.token_repetition_penalty, s.token_frequency_penalty, s.token_presence_penalty,
            s.token_repetition_range, s.token_repetition_decay)


def with_window(entry: tuple, width: int) -> tuple:
    """A native entry with a repetition range of -1 (the whole history) resolved to the call's window width."""
    return entry if entry[7] >= 0 else (*entry[:7], width, *entry[8:])


def _pick_params(rows: Sequence[RowParams], num_columns: int, device: torch.device) -> _PickParams:
    per_row, u, table = _per_row_settings(rows, _truncation, device)
    columns = per_row.float().split(1, dim=1)
    top_ks = [t[3] for t in table]
    return _PickParams(temperature=columns[0], top_p=columns[1], min_p=columns[2],
                       top_k=torch.where(columns[3] == 0, float(num_columns), columns[3]), u=u[:, None],
                       any_greedy=any(t == _GREEDY for t in table),
                       max_top_k=None if 0 in top_ks else max(top_ks),
                       extended=extended_params(rows, _per_row_settings, num_columns, device))


def _pick(x: torch.Tensor, rows: Sequence[RowParams]) -> tuple[torch.Tensor, ...]:
    """Truncate, renormalise and draw. Returns token_ids, token_probs, candidate ids and final probabilities, the
    last two [B, C] sorted by probability."""
    device = x.device
    p = _pick_params(rows, x.shape[1], device)
    probs, candidate_ids, pickable = truncated_probs(x, rows, p)

    # Inverse CDF (zero-probability candidates are never picked); clamping to the last non-zero entry guards
    # against u * total rounding up to the very end. A row without one (NaN probabilities) gets -1: an error.
    cdf = probs.cumsum(dim=1)
    picked = torch.searchsorted(cdf, skewed(p.u, p.extended) * cdf[:, -1:], right=True)
    nonzero = probs > 0
    last_nonzero = probs.shape[1] - 1 - nonzero.flip(1).to(torch.int8).argmax(dim=1, keepdim=True)
    picked = torch.minimum(picked, torch.where(nonzero.any(dim=1, keepdim=True), last_nonzero, -1))
    token_ids = candidate_ids.gather(1, picked).squeeze(1)
    token_probs = probs.gather(1, picked).squeeze(1)

    if p.any_greedy:
        # Greedy means argmax exactly (first index on ties), whatever order sort/topk gave to equal logits.
        is_greedy = p.top_k[:, 0] == 1  # top_k 1 is greedy by definition
        argmax = x.argmax(dim=1)
        token_ids = torch.where(is_greedy, argmax, token_ids)
        # Keep the reported candidates consistent with it: swap argmax into the first slot (a tie, so the order by
        # probability is unchanged).
        first = candidate_ids[:, 0:1]
        swapped = torch.where(candidate_ids == argmax[:, None], first, candidate_ids)
        swapped[:, 0] = argmax
        candidate_ids = torch.where(is_greedy[:, None], swapped, candidate_ids)
    token_ids = torch.where(pickable, token_ids, -1)
    token_probs = torch.where(pickable, token_probs, 0.0)
    probs = torch.where(pickable[:, None], probs, 0.0)
    return token_ids, token_probs, candidate_ids, probs


def truncated_probs(x: torch.Tensor, rows: Sequence[RowParams], p: _PickParams | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p and min-p over logits `x` [B, V] that already carry penalties, bias and masks:
    the final probabilities [B, C] sorted descending (renormalised; a greedy row's is its top-1 at temperature 1,
    which the caller replaces by the argmax), their token ids [B, C], and which rows have anything to pick."""
    device = x.device
    num_columns = x.shape[1]
    if p is None:
        p = _pick_params(rows, num_columns, device)
    if p.max_top_k is None:
        sorted_logits, candidate_ids = x.sort(dim=1, descending=True, stable=True)
    else:
        # Every row's candidates lie within the widest top-k: a partial top-k instead of a full sort.
        width = min(num_columns, max(p.max_top_k, max(row.return_top_tokens for row in rows)))
        sorted_logits, candidate_ids = x.topk(width, dim=1, sorted=True)

    # A row whose logits are all -inf has nothing to pick; compute on zeros to keep NaNs out, report -1 below.
    pickable = sorted_logits[:, 0] > -math.inf
    scaled = pre_softmax(torch.where(pickable[:, None], sorted_logits, 0.0), p.temperature, p.extended)
    rank = torch.arange(sorted_logits.shape[1], device=device)[None, :]
    probs = torch.softmax(scaled.masked_fill(rank >= p.top_k, -math.inf), dim=1)

    # top-p: keep a token while the mass of the tokens before it has not reached p (the smallest set reaching p).
    mass_before = probs.cumsum(dim=1) - probs
    keep = (mass_before < p.top_p - _TOP_P_SLACK) | (rank == 0)
    keep &= probs >= p.min_p * probs[:, 0:1]
    probs = probs * keep
    probs = probs / probs.sum(dim=1, keepdim=True)
    if p.extended is not None:
        probs, candidate_ids = after_truncation(probs, candidate_ids, p.extended)
    return probs, candidate_ids, pickable
