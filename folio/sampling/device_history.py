"""DeviceHistories: every running job's prompt + sampled ids, kept on the sampler's device for the penalties.

Re-sending each row's penalty window from the host every step costs more host time than the rest of a decode step
at large batches (a 256 x 2048 window array built and copied per step). Here a job's prompt is copied once when
it starts, each sampled id is written on the device by the step that sampled it (no host round trip), and a step's
windows are gathered on the device from (slot, length) pairs: one small transfer per step.

Rows live in a [slots, capacity] int64 buffer; both dimensions grow by doubling when a job needs more.
"""

from __future__ import annotations

from collections.abc import Hashable, KeysView, Sequence

import torch

from folio.sampling.host import to_device

_INITIAL_SLOTS = 8
_INITIAL_CAPACITY = 1024


class DeviceHistories:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._ids = torch.zeros(_INITIAL_SLOTS, _INITIAL_CAPACITY, dtype=torch.int64, device=self.device)
        self._slots: dict[Hashable, int] = {}
        self._free = list(range(_INITIAL_SLOTS - 1, -1, -1))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    @property
    def holders(self) -> KeysView:
        """The keys that hold a history, as a live view (`key in holders` without a method call: asked per row)."""
        return self._slots.keys()

    def add(self, key: Hashable, token_ids: Sequence[int], max_len: int) -> None:
        """Give `key` a row holding `token_ids`, with room for `max_len` ids in all."""
        if key in self._slots:
            raise KeyError(f"{key!r} already has a history")
        if max_len < len(token_ids):
            raise ValueError(f"max_len {max_len} is below the {len(token_ids)} ids given")
        self._grow(max_len)
        if not self._free:
            self._grow_slots()
        slot = self._free.pop()
        self._slots[key] = slot
        if token_ids:
            self._ids[slot, : len(token_ids)] = to_device(token_ids, torch.int64, self.device)

    def remove(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def append(self, keys: Sequence[Hashable], lengths: Sequence[int], token_ids: torch.Tensor) -> None:
        """Write token_ids[i] (a device tensor) at position lengths[i] of keys[i]'s row; no host sync."""
        index = to_device([self._slots[k] for k in keys] + list(lengths), torch.int64, self.device)
        n = len(keys)
        self._ids[index[:n], index[n:]] = token_ids

    def windows(self, keys: Sequence[Hashable | None], lengths: Sequence[int], sizes: Sequence[int],
                dump_column: int) -> torch.Tensor:
        """[B, width] ids with width = max(sizes): row i holds the last sizes[i] of the first lengths[i] ids of
        keys[i], right-aligned (newest last) and left-padded with `dump_column`; ids outside [0, dump_column)
        also become `dump_column` (the layout folio.sampling.penalties expects)."""
        width = max(sizes)
        n = len(keys)
        # a key of None: a row without history (its size must be 0), read from any slot and masked whole
        slots = [0 if k is None else self._slots[k] for k in keys]
        packed = to_device(slots + list(lengths) + list(sizes), torch.int64, self.device)
        slots, ends, counts = packed[:n, None], packed[n:2 * n, None], packed[2 * n:, None]
        column = torch.arange(width, device=self.device)[None, :]
        position = ends - width + column
        ids = self._ids[slots, position.clamp(min=0)]
        keep = (column >= width - counts) & (ids >= 0) & (ids < dump_column)
        return torch.where(keep, ids, dump_column)

    def _grow(self, max_len: int) -> None:
        capacity = self._ids.shape[1]
        if max_len <= capacity:
            return
        while capacity < max_len:
            capacity *= 2
        grown = torch.zeros(self._ids.shape[0], capacity, dtype=torch.int64, device=self.device)
        grown[:, : self._ids.shape[1]] = self._ids
        self._ids = grown

    def _grow_slots(self) -> None:
        slots = self._ids.shape[0]
        grown = torch.zeros(2 * slots, self._ids.shape[1], dtype=torch.int64, device=self.device)
        grown[:slots] = self._ids
        self._ids = grown
        self._free.extend(range(2 * slots - 1, slots - 1, -1))
