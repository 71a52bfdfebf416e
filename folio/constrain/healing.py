"""Token healing: the last prompt token is taken off the prompt and generated again, as any token whose bytes
start with its bytes, so that a prompt cut mid-word ("...the lighth") can complete the word with the token the
model prefers ("lighthouse") instead of continuing from an unusual split.

`HealingFilter` constrains a job's first sampled token only (DynamicJob(token_healing=True) hands it out as the
job's active filter for that one token; the user's filters start at the next token). The allowed ids come from a
per-tokenizer index of the vocabulary's byte strings, sorted, where the tokens starting with some bytes form one
contiguous run: built once per tokenizer and kept, and each prefix's answer cached.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable

import numpy as np

from folio.constrain.base import Filter, bitmask_words, set_bits
from folio.tokenizer import Tokenizer

_indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_indexes_lock = threading.Lock()


class PrefixIndex:
    """The ids of the (non-special) tokens whose bytes start with given bytes."""

    def __init__(self, tokenizer: Tokenizer):
        special = frozenset(tokenizer.special_ids)
        pairs = sorted((tokenizer.token_bytes(t), t) for t in range(tokenizer.vocab_size) if t not in special)
        pairs = [(b, t) for b, t in pairs if b]
        self._keys = [b for b, _ in pairs]
        self._ids = [t for _, t in pairs]
        self._cache: dict[bytes, tuple[int, ...]] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> PrefixIndex:
        """The index of `tokenizer`, built at the first call and kept as long as the tokenizer lives."""
        with _indexes_lock:
            index = _indexes.get(tokenizer)
            if index is None:
                index = _indexes[tokenizer] = cls(tokenizer)
            return index

    def starting_with(self, prefix: bytes) -> tuple[int, ...]:
        found = self._cache.get(prefix)
        if found is None:
            lo = bisect.bisect_left(self._keys, prefix)
            hi = lo
            while hi < len(self._keys) and self._keys[hi].startswith(prefix):
                hi += 1
            found = self._cache[prefix] = tuple(sorted(self._ids[lo:hi]))
        return found


class HealingFilter(Filter):
    """Allows the tokens whose bytes start with those of `token_id` (the prompt token taken off), and that token
    itself; a special token (no bytes) allows only itself. Feeding it records nothing: it constrains one token."""

    def __init__(self, token_id: int):
        super().__init__()
        self.token_id = token_id
        self.prefix = b""
        self._allowed: tuple[int, ...] = (token_id,)
        self._row: np.ndarray | None = None

    def bind(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().bind(tokenizer, vocab_size)
        self.prefix = b"" if token_id_is_special(tokenizer, self.token_id) else tokenizer.token_bytes(self.token_id)
        allowed = set(PrefixIndex.of(tokenizer).starting_with(self.prefix)) if self.prefix else set()
        allowed.add(self.token_id)
        self._allowed = tuple(sorted(t for t in allowed if t < vocab_size))
        row = np.zeros(bitmask_words(vocab_size), dtype=np.int32)
        set_bits(row, self._allowed)
        self._row = row

    def allowed_tokens(self) -> Iterable[int]:
        return self._allowed

    def fill_bitmask(self, row: np.ndarray) -> None:
        if self._row is None:
            raise RuntimeError("HealingFilter used before bind()")
        row[:] = self._row

    def feed(self, token_id: int) -> None:
        """Nothing to record: the filter constrains the first sampled token only, and the job stops asking it after
        that (DynamicJob.active_filters)."""

    def rollback(self, num_tokens: int) -> None:
        """Nothing to undo: feeding changed no state (a rollback to the healed token asks the same mask again)."""

    def num_skipped_bytes(self) -> int:
        """Leading bytes of the healed token that the prompt already had (not output again)."""
        return len(self.prefix) if self.prefix else 1 << 30  # a special token heals only into itself: no text


def token_id_is_special(tokenizer: Tokenizer, token_id: int) -> bool:
    return token_id in tokenizer.special_ids or not tokenizer.token_bytes(token_id)
