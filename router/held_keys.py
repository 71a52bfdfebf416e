"""Which replica slots hold which routing keys, exact, for folio.router.index: applying a replica's batch of stored /
evicted keys, replacing its keys with a snapshot, and finding, for a prompt's keys, the deepest one each slot holds.

Two implementations with one interface (HeldKeys):
  - folio._native_cpu.KeyIndex (native/cpu/key_index.cpp, used as it is): one open-addressing table from key to the
    slots holding it (inline for up to four; slots below 65,534), a count per slot; batches and snapshots are
    buffers of uint64 (array('Q')). Listing or clearing one slot's keys scans the table (a replica restart, a
    snapshot resync). It also reads most reports whole (apply_report: the report's dict checked, its new batches
    decoded and applied, in one call; folio.router.index), which the Python twin leaves to folio.router.digest.
  - PyHeldKeys: the same in Python (a dict from key to a bitmask of slots, a set per slot), where the native module
    was not built. Tests run both against the same oracles.
A router applies every replica's events every report period. Both wait on memory with hundreds of thousands of keys
(bench/RESULTS.md: the native table applies an event in about 0.1 us, the Python twin in about 1.0 us).
`make_held_keys()` picks the native one when it is there.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol


class HeldKeys(Protocol):
    def apply(self, slot: int, stored: array, evicted: array) -> None: ...
    def replace(self, slot: int, keys: array) -> None: ...
    def clear(self, slot: int) -> None: ...
    def holds(self, slot: int, key: int) -> bool: ...
    def keys_of(self, slot: int) -> list[int]: ...
    def num_keys(self, slot: int) -> int: ...
    def __len__(self) -> int: ...
    def match(self, keys: Sequence[int]) -> list[tuple[int, int]]: ...


class PyHeldKeys:
    def __init__(self) -> None:
        self._masks: dict[int, int] = {}  # key -> bitmask of slots holding it
        self._keys: dict[int, set[int]] = {}  # slot -> keys

    def apply(self, slot: int, stored: array, evicted: array) -> None:
        # Set operations find the keys that change (in C); only those touch the shared masks.
        bit = 1 << slot
        keep = ~bit
        masks, keys = self._masks, self._keys.setdefault(slot, set())
        gone = keys.intersection(evicted)
        keys -= gone
        for key in gone:
            mask = masks[key] & keep
            if mask:
                masks[key] = mask
            else:
                del masks[key]
        new = set(stored)
        new -= keys
        keys |= new
        get = masks.get
        for key in new:
            masks[key] = get(key, 0) | bit

    def replace(self, slot: int, keys: Iterable[int]) -> None:
        held = self._keys.setdefault(slot, set())
        wanted = set(keys)
        self.apply(slot, array("Q", wanted - held), array("Q", held - wanted))

    def clear(self, slot: int) -> None:
        self.apply(slot, array("Q"), array("Q", self._keys.get(slot, ())))

    def holds(self, slot: int, key: int) -> bool:
        return key in self._keys.get(slot, ())

    def keys_of(self, slot: int) -> list[int]:
        return list(self._keys.get(slot, ()))

    def num_keys(self, slot: int) -> int:
        return len(self._keys.get(slot, ()))

    def __len__(self) -> int:
        return len(self._masks)

    def match(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        return deepest_in_masks(self._masks, keys)


def deepest_in_masks(masks: dict[int, int], keys: Sequence[int]) -> list[tuple[int, int]]:
    """For each slot whose bit is set in the mask of any of `keys`: (slot, 1-based position of the deepest such
    key)."""
    found: list[tuple[int, int]] = []
    seen = 0
    for depth in range(len(keys), 0, -1):
        new = masks.get(keys[depth - 1], 0) & ~seen
        if new:
            seen |= new
            while new:
                low = new & -new
                found.append((low.bit_length() - 1, depth))
                new ^= low
    return found


def make_held_keys(native: bool | None = None) -> HeldKeys:
    """The native implementation when the CPU module is built (native=None), or the one asked for."""
    if native is False:
        return PyHeldKeys()
    from folio.ops import native_key_index

    native_class = native_key_index()
    if native_class is None:
        if native:
            raise RuntimeError("folio._native_cpu.KeyIndex is not built (pip install --no-build-isolation -e .)")
        return PyHeldKeys()
    return native_class()
