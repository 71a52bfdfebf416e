"""MaskWorker: the token bitmasks of filtered jobs, computed while the device runs the forward.

A sequence's mask depends only on its filters' state, which changes when a token is fed (at staging). The
generator asks for masks when the device is busy and the host would otherwise wait: right after staging a step's
tokens when the next step's forward was launched ahead, and right after launching a forward otherwise. The masks
of jobs whose one filter is a grammar filter are filled in one call that the grammar engine spreads over its own
threads with the GIL released (`fill_many`); other filters fill theirs one by one. `collect` then hands the sampler
one [B, W] int32 bitmask on the device, computing now any mask not ready (a sequence's first token after prefill
in a launched-ahead step, or a mask made before the last feed: each is tagged with the sampled-token count).

On CUDA, with a HostGate (folio.constrain.gate), `collect_later` returns at once: the device waits for the masks,
which the worker thread writes into pinned memory once made, opening the gate itself. Until `release`, which
waits for that and returns the filters' errors, the generator queues the sampler and the next step's forward
behind the gate and hands the previous step's tokens to their jobs.

With background=True (after staging, while the next forward runs) the grammar filters' one call runs on a worker
thread: the grammar engine holds no GIL while it works, so the step's own thread meanwhile hands the previous step's
tokens to their jobs (the generator emits before it samples when masks are pending). Filters of other classes are
Python and hold the GIL: they are made on the step's thread (a worker thread per filter would make the step wait
for every hand-back of the GIL, up to the interpreter's switch interval each time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from folio.constrain.base import bitmask_words
from folio.constrain.gate import HostGate
from folio.sequence import Sequence

LATER_SLOTS = 2  # pinned buffers collect_later alternates between (one step's copy may still be queued)


class MaskWorker:
    def __init__(self, vocab_size: int, eos_token_ids: Seq[int]):
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        # seq -> (num_sampled when made, its mask row, the error its filter raised, or (a worker's task, its row))
        self._ready: dict[Sequence, tuple[int, Any]] = {}
        self._worker: ThreadPoolExecutor | None = None
        # the live sequences whose jobs have filters (or heal their first token): with none, every call returns at
        # once, so that unconstrained batches pay no per-row check
        self._members: set[Sequence] = set()
        self._pinned: torch.Tensor | None = None  # reused host staging buffer for the device copy
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy from it
        self.gate: HostGate | None = None  # (set by the generator on CUDA: collect_later)
        self._later_slots: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._later: Future | None = None  # the worker's writing of the masks the gate waits for
        # totals since construction, for benchmarks: masks made, seconds making them, and seconds the step spent
        # in collect (waiting for, or making, masks not ready: what the forward did not hide)
        self.num_masks = 0
        self.mask_s = 0.0
        self.wait_s = 0.0
        self.fill_s = 0.0  # of which the grammar engine's batched calls (on the worker thread or not)

    def add(self, seq: Sequence) -> None:
        """A sequence entered the engine: track it if its job may ever be constrained."""
        if seq.job.may_constrain:
            self._members.add(seq)

    def constrained(self, seq: Sequence) -> bool:
        return seq in self._members and bool(seq.job.active_filters())

    def prepare(self, seqs: Seq[Sequence], background: bool = False) -> None:
        """Make the next-token masks of the constrained, live sequences among seqs whose mask is not ready;
        background: the grammar filters' on the worker thread (`collect` waits for them)."""
        if not self._members:
            return
        todo = []
        for seq in seqs:
            if not seq.is_live or not self.constrained(seq):
                continue
            ready = self._ready.get(seq)
            if ready is None or ready[0] != seq.num_sampled:
                todo.append(seq)
        if todo:
            self._make(todo, background)

    def pending(self, seqs: Seq[Sequence]) -> bool:
        """Some of seqs' masks are being made on the worker thread."""
        if not self._members:
            return False
        return any(isinstance(self._ready.get(s, (0, None))[1], tuple) for s in seqs)

    def _make(self, seqs: list[Sequence], background: bool = False) -> None:
        start = time.perf_counter()
        groups: dict[Any, list[Sequence]] = {}
        for seq in seqs:
            fill_many = self._fill_many(seq)
            if fill_many is None:
                self._ready[seq] = (seq.num_sampled, self._attempt(self.mask_row, seq))
            else:
                groups.setdefault(fill_many, []).append(seq)
        for fill_many, group in groups.items():
            if background:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-masks")
                task = self._worker.submit(self._fill_group, fill_many, group)
                for i, seq in enumerate(group):
                    self._ready[seq] = (seq.num_sampled, (task, i))
                continue
            masks = self._fill_group(fill_many, group)
            for i, seq in enumerate(group):
                self._ready[seq] = (seq.num_sampled, masks[i] if masks is not None else
                                    self._attempt(self.mask_row, seq))
        self.num_masks += len(seqs)
        self.mask_s += time.perf_counter() - start

    def _fill_group(self, fill_many: Any, group: list[Sequence]) -> np.ndarray | None:
        """The masks of a group of sequences in one call; None when it raised (each is then made alone, so that
        each error is its own sequence's)."""
        start = time.perf_counter()
        masks = np.zeros((len(group), self.num_words), dtype=np.int32)
        try:
            fill_many([s.job.active_filters()[0] for s in group], masks)
        except Exception:  # noqa: BLE001 - see the docstring
            return None
        finally:
            self.fill_s += time.perf_counter() - start
        return masks

    @staticmethod
    def _attempt(make: Any, seq: Sequence) -> np.ndarray | BaseException:
        try:
            return make(seq)
        except Exception as error:  # noqa: BLE001 - one job's filter fails that job, not the batch
            return error

    @staticmethod
    def _fill_many(seq: Sequence) -> Any:
        filters = seq.job.active_filters()
        if len(filters) != 1 or seq.job.filter_prefer_eos:
            return None
        return getattr(type(filters[0]), "fill_many", None)

    def collect(self, seqs: Seq[Sequence], device: torch.device
                ) -> tuple[torch.Tensor | None, list[BaseException | None]]:
        """The rows' masks, [len(seqs), W] int32 on `device` (unconstrained rows: all bits set), or None when no row
        is constrained; and per row the error its filter raised (its row is then all clear: nothing to pick)."""
        if not self._members or not any(self.constrained(s) for s in seqs):
            return None, [None] * len(seqs)
        start = time.perf_counter()
        host = self._host_buffer(len(seqs), device)
        errors = self._fill(seqs, host.numpy())
        self.wait_s += time.perf_counter() - start
        on_device = host.to(device, non_blocking=True)
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return on_device, errors

    def collect_later(self, seqs: Seq[Sequence], device: torch.device) -> torch.Tensor | None:
        """What `collect` returns, returned before the masks are made: the device's stream waits (HostGate) until
        the worker thread has written them, after the masks it is making, and opened the gate. So the caller may
        queue more work behind the gate, and wait on the device, before `release`. None when no row is
        constrained (and nothing to release)."""
        if not self._members or not any(self.constrained(s) for s in seqs):
            return None
        if len(self._later_slots) < LATER_SLOTS or self._later_slots[0][0].shape[0] < len(seqs):
            rows = max(len(seqs), 64)
            self._later_slots = [(torch.empty((rows, self.num_words), dtype=torch.int32).pin_memory(), None)
                                 for _ in range(LATER_SLOTS)]
        (buffer, copied), *rest = self._later_slots
        if copied is not None:
            copied.synchronize()  # (two steps back: its gate opened then, its tokens were read since)
        host = buffer[: len(seqs)]
        self.prepare(seqs)  # (masks not made yet, made here; those being made stay on the worker)
        made = [self._ready.pop(seq, None) for seq in seqs]
        value = self.gate.arm()
        try:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-masks")
            # behind the fills it waits for, on the same thread: nothing there waits on this thread or the device
            self._later = self._worker.submit(self._write_and_open, seqs, made, host.numpy(), value)
        except BaseException:
            self.gate.open(value)
            raise
        on_device = host.to(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._later_slots = [*rest, (buffer, copied)]
        return on_device

    def _write_and_open(self, seqs: Seq[Sequence], made: list[Any], masks: np.ndarray, value: int
                        ) -> dict[Sequence, BaseException]:
        """(the worker thread) The masks collect_later promised into its pinned rows, then the gate opened."""
        try:
            errors = self._write_rows(seqs, made, masks)
            return {seq: error for seq, error in zip(seqs, errors) if error is not None}
        finally:
            self.gate.open(value)

    def release(self) -> dict[Sequence, BaseException]:
        """Wait until the masks `collect_later` promised are on their way to the device; the errors the rows'
        filters raised, by sequence (nothing when nothing waits)."""
        later, self._later = self._later, None
        if later is None:
            return {}
        start = time.perf_counter()
        try:
            return later.result()
        finally:
            self.wait_s += time.perf_counter() - start

    def _fill(self, seqs: Seq[Sequence], masks: np.ndarray) -> list[BaseException | None]:
        """The rows' masks into `masks` (unconstrained rows: all bits set); per row the error its filter raised
        (its row then all clear: nothing to pick)."""
        self.prepare(seqs)
        return self._write_rows(seqs, [self._ready.pop(seq, None) for seq in seqs], masks)

    def _write_rows(self, seqs: Seq[Sequence], made: list[Any], masks: np.ndarray) -> list[BaseException | None]:
        """`made` (the rows' entries taken from the ready map, None for an unconstrained row) into `masks`."""
        masks.fill(-1)
        errors: list[BaseException | None] = [None] * len(seqs)
        for i, (seq, ready) in enumerate(zip(seqs, made)):
            if ready is None:
                continue
            if isinstance(ready[1], tuple):  # made on the worker thread
                task, row = ready[1]
                group = task.result()
                ready = (ready[0], group[row] if group is not None else self._attempt(self.mask_row, seq))
            if isinstance(ready[1], BaseException):
                errors[i] = ready[1]
                masks[i] = 0
            else:
                masks[i] = ready[1]
        return errors

    def _host_buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """A [num_rows, W] int32 host tensor to copy to the device from: on CUDA, a view of one pinned buffer kept
        between steps. The last copy from it has normally finished long before (the step read its tokens since,
        after the sampler that used the mask); the event wait covers calls within one step (rows sampled one by
        one after a failure)."""
        if device.type != "cuda":
            return torch.empty((num_rows, self.num_words), dtype=torch.int32)
        if self._copied is not None:
            self._copied.synchronize()
        if self._pinned is None or self._pinned.shape[0] < num_rows:
            self._pinned = torch.empty((max(num_rows, 64), self.num_words), dtype=torch.int32).pin_memory()
        return self._pinned[:num_rows]

    def mask_row(self, seq: Sequence) -> np.ndarray:
        """One sequence's next-token mask: the intersection of its filters' bitmasks."""
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
        return row

    def forget(self, seq: Sequence) -> None:
        """seq left: drop its mask (a worker still making it finishes on its own; nothing reads the row)."""
        self._ready.pop(seq, None)
        self._members.discard(seq)

    def discard(self, seq: Sequence) -> None:
        """Drop seq's ready mask (its filters are about to change: a rollback), waiting for a worker making it."""
        ready = self._ready.pop(seq, None)
        if ready is not None and isinstance(ready[1], tuple):
            ready[1][0].result()
