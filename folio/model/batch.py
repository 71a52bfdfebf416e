"""ForwardBatch: the device tensors of one forward pass, built from host-side per-sequence chunks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from folio.cache.window_release import RELEASED_PAGE
from folio.model import injection

if TYPE_CHECKING:
    from folio.lora import LoraBatch

LogitsMode = Literal["none", "last", "all"]
_LOGITS_MODES = ("none", "last", "all")


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence: token_ids sit at positions start_pos.. and their pages are already in
    block_table (block_table[i] is the page of positions [i*page_size, (i+1)*page_size))."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    logits: LogitsMode = "last"
    # embedding rows that replace some of these tokens' (placeholders of folio.embeddings), in token order
    injected: Sequence[injection.InjectedSpan] = ()


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat slot in [0, P*S)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with page 0 beyond each sequence's pages
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32, start_pos + len(token_ids)
    logits_idx: torch.Tensor  # [N] int64, rows of T whose logits forward() returns, in chunk order
    max_q_len: int
    max_context_len: int
    total_context_len: int = 0  # sum of context_lens (host int; sizes the flash prefill path's K/V gather)
    seq_q_lens: tuple[int, ...] = ()  # host copy of each sequence's new-token count (the flash prefill path)
    seq_context_lens: tuple[int, ...] = ()  # host copy of context_lens
    # rows of T whose token embeddings are replaced ([R] int64), and by what ([R, hidden_size]); None: no rows
    injected_rows: torch.Tensor | None = None
    injected_values: torch.Tensor | None = None
    lora: LoraBatch | None = None  # the rows' LoRA adapters, grouped (folio.lora); None: no row has one

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], page_size: int, device: torch.device | str) -> ForwardBatch:
        if not chunks:
            raise ValueError("a ForwardBatch needs at least one chunk")
        q_lens, context_lens, logits_idx = [], [], []
        num_tokens = 0
        for i, chunk in enumerate(chunks):
            q_len = _check_chunk(i, chunk, page_size)
            q_lens.append(q_len)
            context_lens.append(chunk.start_pos + q_len)
            if chunk.logits == "all":
                logits_idx.extend(range(num_tokens, num_tokens + q_len))
            elif chunk.logits == "last":
                logits_idx.append(num_tokens + q_len - 1)
            num_tokens += q_len

        # Index arithmetic in numpy: a prompt step of 16k tokens over hundreds of sequences is built while the
        # device waits (per-sequence torch calls and torch's CPU repeat_interleave cost tens of ms there).
        num_seqs = len(chunks)
        used = np.fromiter((-(-n // page_size) for n in context_lens), dtype=np.int64, count=num_seqs)  # pages read
        flat_pages = np.fromiter(
            itertools.chain.from_iterable(itertools.islice(c.block_table, int(u)) for c, u in zip(chunks, used)),
            dtype=np.int64, count=int(used.sum()))
        first_of_row = np.cumsum(used) - used
        block_tables = np.zeros((num_seqs, int(used.max())), dtype=np.int64)
        block_tables[np.repeat(np.arange(num_seqs), used),
                     np.arange(flat_pages.shape[0]) - np.repeat(first_of_row, used)] = flat_pages

        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        seq_idx = np.repeat(np.arange(num_seqs), q_lens_np)  # [T]: which chunk a row belongs to
        cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=cu_seqlens_q[1:])
        start_pos = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=num_seqs)
        positions = start_pos[seq_idx] + np.arange(num_tokens) - cu_seqlens_q[seq_idx]
        slot_mapping = block_tables[seq_idx, positions // page_size] * page_size + positions % page_size
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                count=num_tokens)

        on_cuda = torch.device(device).type == "cuda"

        def to_device(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            t = torch.from_numpy(a).to(dtype=dtype)
            # Pinned source: the copy is queued on the stream instead of making the host wait for the GPU.
            return (t.pin_memory() if on_cuda else t).to(device, non_blocking=True)

        injected_rows, injected_values = injection.gather([c.injected for c in chunks], q_lens, cu_seqlens_q,
                                                          input_ids, to_device)
        return cls(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            slot_mapping=to_device(slot_mapping, torch.int64),
            block_tables=to_device(block_tables, torch.int32),
            cu_seqlens_q=to_device(cu_seqlens_q, torch.int32),
            context_lens=to_device(np.asarray(context_lens, dtype=np.int64), torch.int32),
            logits_idx=to_device(np.asarray(logits_idx, dtype=np.int64), torch.int64),
            max_q_len=max(q_lens),
            max_context_len=max(context_lens),
            total_context_len=sum(context_lens),
            seq_q_lens=tuple(q_lens),
            seq_context_lens=tuple(context_lens),
            injected_rows=injected_rows,
            injected_values=injected_values,
        )


def _check_chunk(i: int, chunk: SeqChunk, page_size: int) -> int:
    """Validate one chunk; returns its number of new tokens."""
    q_len = len(chunk.token_ids)
    if q_len == 0:
        raise ValueError(f"chunk {i}: no token_ids")
    if chunk.start_pos < 0:
        raise ValueError(f"chunk {i}: start_pos={chunk.start_pos} is negative")
    if chunk.logits not in _LOGITS_MODES:
        raise ValueError(f"chunk {i}: logits={chunk.logits!r}, expected one of {_LOGITS_MODES}")
    needed = -(-(chunk.start_pos + q_len) // page_size)
    if len(chunk.block_table) < needed:
        raise ValueError(
            f"chunk {i}: positions up to {chunk.start_pos + q_len - 1} need {needed} pages of {page_size} "
            f"but block_table has {len(chunk.block_table)}"
        )
    # Leading RELEASED_PAGE entries: pages released before a sliding window (folio.cache.window_release), which no
    # kernel reads. Any other negative page id would silently index pages from the end of the cache.
    released = next((j for j, page in enumerate(chunk.block_table[:needed]) if page != RELEASED_PAGE), needed)
    if needed > released and min(chunk.block_table[released:needed]) < 0:
        raise ValueError(f"chunk {i}: negative page id in block_table {list(chunk.block_table[:needed])}")
    return q_len
