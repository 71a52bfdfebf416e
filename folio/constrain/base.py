"""Filter: what a job's output may be, one token at a time.

The engine drives a filter through its life: `bind` once at enqueue (compile here: a grammar that does not compile
fails the enqueue with its message), then, per sampled token, `fill_bitmask` (which tokens may come next; run on a
worker thread while the device computes the step's forward) and `feed` (the token that came). After a token,
`is_finished` says the constrained output is complete: the job ends with EOS reason "end_filter". `rollback` undoes
the last fed tokens (banned strings rewind through it).

The bitmask is the format of the grammar engines: a row of ceil(vocab_size / 32) int32 words, bit (t % 32) of word
t // 32 set when token t is allowed. A subclass overrides either `fill_bitmask` or the simpler `allowed_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from folio.tokenizer import Tokenizer


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask over vocab_size tokens."""
    return (vocab_size + 31) // 32


def set_bits(row: np.ndarray, token_ids: Iterable[int]) -> None:
    """Set the bits of token_ids in a bitmask row (an int32 numpy view)."""
    ids = np.fromiter(token_ids, dtype=np.int64)
    if ids.size == 0:
        return
    bits = np.zeros(row.size * 32, dtype=bool)
    bits[ids] = True
    # little-endian words: bit b of byte j of word w is token 32 w + 8 j + b
    row[:] |= np.packbits(bits, bitorder="little").view("<i4")


class FilterError(ValueError):
    """A filter that cannot be built (a schema or grammar that does not compile), or that allows no token."""


class Filter:
    """Base class of folio's filters; subclass it for your own.

    A filter instance belongs to one job (it keeps that job's state). Override:
    - `bind(tokenizer, vocab_size)`: once, before the first token (call super().bind).
    - `allowed_tokens()` -> the ids that may come next, or None for no constraint; or `fill_bitmask(row)` directly.
    - `feed(token_id)`: the token that came.
    - `is_finished()`: True once the output is complete (the job ends with "end_filter").
    - `rollback(num_tokens)`: undo the last fed tokens; the default resets and feeds the kept ones again, which
      needs `reset()`.
    A class may also define a static `fill_many(filters, bitmask)` that fills the rows of a [B, W] int32 bitmask
    for B of its instances at once (the grammar filters: the grammar engine's thread pool); the engine uses it for
    jobs whose only filter is of that class.
    """

    def __init__(self) -> None:
        self.tokenizer: Tokenizer | None = None
        self.vocab_size = 0
        self._fed: list[int] = []

    def bind(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def allowed_tokens(self) -> Iterable[int] | None:
        raise NotImplementedError(f"{type(self).__name__} must override allowed_tokens() or fill_bitmask()")

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed set into `row`, an int32 array of bitmask_words(vocab_size) words (all bits clear
        on entry)."""
        allowed = self.allowed_tokens()
        if allowed is None:
            row[:] = -1
        else:
            set_bits(row, (t for t in allowed if 0 <= t < self.vocab_size))

    def feed(self, token_id: int) -> None:
        self._fed.append(token_id)

    def is_finished(self) -> bool:
        return False

    def reset(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot roll back: override rollback() or reset()")

    def rollback(self, num_tokens: int) -> None:
        kept = self._fed[:len(self._fed) - num_tokens]
        self.reset()
        self._fed = []
        for token_id in kept:
            self.feed(token_id)
