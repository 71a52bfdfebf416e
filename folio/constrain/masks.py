"""MaskWorker: the token bitmasks of filtered jobs, computed on CPU threads while the device runs the forward.

A sequence's mask depends only on its filters' state, which changes when a token is fed (at staging). The
generator asks for masks twice: right after staging (while the launched-ahead forward runs) and right after
planning a step (for sequences about to sample their first token). Each request runs on the worker pool; `collect`
waits for the ones the step samples and hands the sampler one [B, W] int32 bitmask on the device. A request made
before the last feed is stale and is recomputed (each is tagged with the sequence's sampled-token count).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from folio.constrain.base import bitmask_words
from folio.sequence import Sequence

logger = logging.getLogger(__name__)


class MaskWorker:
    def __init__(self, vocab_size: int, eos_token_ids: Seq[int], max_workers: int | None = None):
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        workers = max_workers if max_workers is not None else max(1, min(8, (os.cpu_count() or 2) - 1))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="folio-masks")
        self._pending: dict[Sequence, tuple[int, Future, int | None]] = {}  # (num_sampled, task, row in it)
        # totals since construction, for benchmarks: masks made, worker seconds making them, and seconds the step
        # waited for them in collect (the part not hidden behind the forward)
        self.num_masks = 0
        self.mask_s = 0.0
        self.wait_s = 0.0

    @staticmethod
    def constrained(seq: Sequence) -> bool:
        return bool(seq.job.active_filters())

    def prepare(self, seqs: Seq[Sequence]) -> None:
        """Start computing the next-token masks of the constrained, live sequences among seqs. Sequences whose one
        filter's class fills many at once (`fill_many`: the grammar engine's own thread pool, GIL released) go
        together as one task; the others one task each."""
        todo = []
        for seq in seqs:
            if not seq.is_live or not self.constrained(seq):
                continue
            pending = self._pending.get(seq)
            if pending is not None and pending[0] == seq.num_sampled:
                continue
            todo.append(seq)
        groups: dict[Any, list[Sequence]] = {}
        for seq in todo:
            fill_many = self._fill_many(seq)
            if fill_many is None:
                self._pending[seq] = (seq.num_sampled, self._pool.submit(self.mask_row, seq), None)
            else:
                groups.setdefault(fill_many, []).append(seq)
        for fill_many, group in groups.items():
            future = self._pool.submit(self._mask_group, fill_many, group)
            for i, seq in enumerate(group):
                self._pending[seq] = (seq.num_sampled, future, i)

    @staticmethod
    def _fill_many(seq: Sequence) -> Any:
        filters = seq.job.active_filters()
        if len(filters) != 1 or seq.job.filter_prefer_eos:
            return None
        return getattr(type(filters[0]), "fill_many", None)

    def _mask_group(self, fill_many: Any, seqs: list[Sequence]) -> np.ndarray:
        start = time.perf_counter()
        masks = np.zeros((len(seqs), self.num_words), dtype=np.int32)
        fill_many([s.job.active_filters()[0] for s in seqs], masks)
        self.num_masks += len(seqs)
        self.mask_s += time.perf_counter() - start
        return masks

    def collect(self, seqs: Seq[Sequence], device: torch.device
                ) -> tuple[torch.Tensor | None, list[BaseException | None]]:
        """The rows' masks, [len(seqs), W] int32 on `device` (unconstrained rows: all bits set), or None when no row
        is constrained; and per row the error its filter raised (its row is then all clear: nothing to pick)."""
        if not any(self.constrained(s) for s in seqs):
            return None, [None] * len(seqs)
        start = time.perf_counter()
        masks = np.full((len(seqs), self.num_words), -1, dtype=np.int32)
        errors: list[BaseException | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            if not self.constrained(seq):
                continue
            pending = self._pending.pop(seq, None)
            try:
                row = self._pending_row(pending, seq.num_sampled)
                masks[i] = row if row is not None else self.mask_row(seq)
            except Exception as error:  # noqa: BLE001 - one job's filter fails that job, not the batch
                errors[i] = error
                masks[i] = 0
        self.wait_s += time.perf_counter() - start
        pinned = torch.from_numpy(masks)
        if device.type == "cuda":
            pinned = pinned.pin_memory()
        return pinned.to(device, non_blocking=True), errors

    @staticmethod
    def _pending_row(pending: tuple | None, num_sampled: int) -> np.ndarray | None:
        """A pending task's row for a sequence at num_sampled tokens; None when stale, missing, or when its group
        failed (the caller then computes the row alone, so the error, if any, is that row's own)."""
        if pending is None or pending[0] != num_sampled:
            return None
        if pending[2] is None:
            return pending[1].result()
        try:
            return pending[1].result()[pending[2]]
        except Exception:  # noqa: BLE001 - recomputed alone by the caller
            return None

    def mask_row(self, seq: Sequence) -> np.ndarray:
        """One sequence's next-token mask: the intersection of its filters' bitmasks (on a worker thread)."""
        start = time.perf_counter()
        job = seq.job
        row = np.full(self.num_words, -1, dtype=np.int32)
        scratch = np.zeros(self.num_words, dtype=np.int32)
        for f in job.active_filters():
            scratch[:] = 0
            f.fill_bitmask(scratch)
            row &= scratch
        if job.filter_prefer_eos:
            allowed_eos = [t for t in self.eos_token_ids if row[t // 32] >> (t % 32) & 1]
            if allowed_eos:
                row[:] = 0
                for t in allowed_eos:
                    row[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(1 << 31))
        self.num_masks += 1  # (+= from worker threads: a benchmark's counter, not exact under races)
        self.mask_s += time.perf_counter() - start
        return row

    def forget(self, seq: Sequence) -> None:
        self._pending.pop(seq, None)

    def discard(self, seq: Sequence) -> None:
        """Drop seq's pending mask, waiting for it to finish (its filters are about to change: a rollback)."""
        pending = self._pending.pop(seq, None)
        if pending is not None:
            try:
                pending[1].result()
            except Exception:  # noqa: BLE001, S110 - the mask is dropped either way; collect recomputes it
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

