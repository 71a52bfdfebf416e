"""Banned strings: text a job must never produce, matched case-insensitively.

Text that could still grow into a banned string is held (never released), and held from the start of the token
whose text it begins in, so that the whole of that token's text is still held. When a banned string matches in
full, the job is rolled back to that token: the text stream rewinds (`TextStream.rewind`), and the engine rolls back
the sequence (`KVCacheManager.rollback`: the K/V of the earlier tokens stay, nothing is recomputed but the new last
token), the filters, the penalty history (indexed by the sampled count) and the sampler state. The token that began
the match joins the tokens explored at that position, which the sampler blocks there from then on; when every
token is blocked there the job fails ("nothing to pick").

The checkpoint therefore lives in the held text itself: every held token remembers the stream's state before it
(`_HeldToken.byte_start/char_start/decoder_state`), and `BannedStrings.explored` keeps, per position (the count of
sampled tokens before it), the first tokens already tried and rejected there.
"""

from __future__ import annotations

from collections.abc import Iterable

from folio.text import TextEvent, TextStream, TokenBytesSource


def fold(text: str) -> tuple[str, list[int]]:
    """`text` lower-cased char by char, and for each char of the result the index of the char it came from (a
    char may lower-case to several)."""
    folded, origin = [], []
    for i, c in enumerate(text):
        low = c.lower()
        folded.append(low)
        origin.extend([i] * len(low))
    return "".join(folded), origin


def validate_banned_strings(strings: Iterable[str] | None) -> tuple[str, ...]:
    if strings is None:
        return ()
    if isinstance(strings, str) or not isinstance(strings, Iterable):
        raise TypeError("banned_strings must be a list of strings")
    result: list[str] = []
    for s in strings:
        if not isinstance(s, str):
            raise TypeError(f"banned_strings must hold only str, found {s!r}")
        if not s:
            raise ValueError("banned_strings must not contain an empty string")
        low = fold(s)[0]
        if low not in result:
            result.append(low)
    return tuple(result)


class BannedStrings:
    """A job's banned strings (lower-cased) and the tokens explored and rejected at each position."""

    def __init__(self, strings: tuple[str, ...]):
        self.strings = strings
        self.max_len = max(len(s) for s in strings)
        self._prefixes = frozenset(s[:n] for s in strings for n in range(1, len(s)))
        self.explored: dict[int, set[int]] = {}
        self.num_rollbacks = 0

    def blocked_at(self, position: int) -> frozenset[int] | set[int]:
        return self.explored.get(position, frozenset())

    def reject(self, position: int, token_id: int) -> None:
        """The job rolled back to `position`, where token_id began a banned string: never pick it there again.
        What was explored after it no longer applies (the text before those positions changes)."""
        for p in [p for p in self.explored if p > position]:
            del self.explored[p]
        self.explored.setdefault(position, set()).add(token_id)
        self.num_rollbacks += 1

    def forget_before(self, position: int) -> None:
        """Tokens before `position` were released: the job never rolls back there."""
        for p in [p for p in self.explored if p < position]:
            del self.explored[p]

    def first_match(self, folded: str) -> int | None:
        """Index in `folded` where the earliest full match begins."""
        found = [i for i in (folded.find(s) for s in self.strings) if i >= 0]
        return min(found) if found else None

    def first_partial(self, folded: str) -> int | None:
        """Index in `folded` of the longest suffix that is a proper prefix of a banned string."""
        for start in range(max(0, len(folded) - self.max_len + 1), len(folded)):
            if folded[start:] in self._prefixes:
                return start
        return None


class BannedTextStream(TextStream):
    """A TextStream that also holds text that could become a banned string, and rewinds when one matches: the
    event then has no text, and carries the undone tokens and their text (`suppressed_*`)."""

    def __init__(self, tokenizer: TokenBytesSource, banned: BannedStrings, stop_strings: Iterable[str] = (),
                 decode_special_tokens: bool = False):
        super().__init__(tokenizer, stop_strings, decode_special_tokens)
        self.banned = banned

    def push_text(self, token_id: int) -> str | None:
        return None  # (any token's text may be the start of a banned string: push holds it)

    def push(self, token_id: int, skip_bytes: int = 0) -> TextEvent:
        self._check_open("push")
        self._append(token_id, skip_bytes)
        folded, origin = fold(self._held_text)
        match = self.banned.first_match(folded)
        if match is not None:
            stop = self._find_stop_string() if self.stop_strings else None
            # a stop string that begins first ends the output before the banned string
            if stop is None or origin[match] < stop[0]:
                text, token_ids = self.rewind(self._num_tokens_from(origin[match]))
                return TextEvent(suppressed_text=text, suppressed_token_ids=token_ids)
        partial = self.banned.first_partial(folded)
        keep = None
        if partial is not None:
            held = self._held_tokens[len(self._held_tokens) - self._num_tokens_from(origin[partial])]
            keep = max(0, held.char_start - self._num_released_chars)
        return self._settle(keep)

    def _num_tokens_from(self, char_idx: int) -> int:
        """How many of the last held tokens make up the text from held char char_idx on: from the first whose text
        reaches past it (or is still incomplete)."""
        at = self._num_released_chars + char_idx
        for k, held in enumerate(self._held_tokens):
            if held.char_end is None or held.char_end > at:
                return len(self._held_tokens) - k
        raise AssertionError("held text without a held token")
