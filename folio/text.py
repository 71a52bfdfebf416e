"""Streaming detokenization for one job: token bytes -> text, UTF-8 hold-back, stop strings across tokens.

Each sampled token is pushed once. The stream releases text as soon as it is final:
- bytes go through an incremental UTF-8 decoder, so a character split over several tokens is released when its
  last byte arrives. Invalid bytes become U+FFFD right away; an incomplete sequence holds at most 3 bytes, and a
  following byte that cannot continue it turns it into U+FFFD, so decoding never stalls.
- text is held only while a suffix of it could still grow into a stop string. A stop string therefore never
  straddles released and held text, and matching only ever looks at the (short) held text.
- a token is released together with the last of its text; tokens whose text is still held stay held with it.

Only `token_bytes(id)`, `special_ids` and `id_to_piece(id)` of the tokenizer are used.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class TokenBytesSource(Protocol):
    special_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...

    def id_to_piece(self, token_id: int) -> str: ...


@dataclass(slots=True)  # (not frozen: one is made per sampled token, and a frozen one takes 3x as long to build)
class TextEvent:
    """What one push (or flush) released.

    `text` / `token_ids`: released now. `stop_string`: the stop string that matched (the stream has ended), else None.
    `held_text`: on a match, the matched stop string plus whatever text followed it in the same tokens."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None
    held_text: str = ""
    # a banned string matched (folio.banned): these last pushed tokens were undone, and their (held) text dropped
    suppressed_text: str = ""
    suppressed_token_ids: list[int] = field(default_factory=list)


@dataclass
class _HeldToken:
    token_id: int
    byte_end: int  # stream byte offset just past this token's bytes
    # stream char offset at which all text this token produced has been decoded; None while some of its bytes still
    # sit in the decoder's incomplete-sequence buffer
    char_end: int | None
    # the stream before this token (what `rewind` restores): byte and char offsets, the decoder's state
    byte_start: int = 0
    char_start: int = 0
    decoder_state: tuple[bytes, int] = (b"", 0)


def _validate_stop_strings(stop_strings: Iterable[str]) -> tuple[str, ...]:
    if isinstance(stop_strings, str):
        raise TypeError(f"stop_strings must be a sequence of strings, not a single string ({stop_strings!r})")
    result: list[str] = []
    for s in stop_strings:
        if not isinstance(s, str):
            raise TypeError(f"stop_strings must contain only str, found {s!r}")
        if not s:
            raise ValueError("stop_strings must not contain an empty string (it would match before any text)")
        if s not in result:
            result.append(s)
    return tuple(result)


class TextStream:
    """Per-job streaming detokenizer. See the module docstring for the rules."""

    def __init__(self, tokenizer: TokenBytesSource, stop_strings: Iterable[str] = (),
                 decode_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._special_ids = frozenset(tokenizer.special_ids)
        self.decode_special_tokens = decode_special_tokens
        self.stop_strings = _validate_stop_strings(stop_strings)
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        # Every proper prefix of every stop string: held text is kept from the earliest suffix found here.
        self._stop_prefixes = frozenset(s[:n] for s in self.stop_strings for n in range(1, len(s)))
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held_text = ""
        self._held_tokens: deque[_HeldToken] = deque()
        self._num_bytes = 0  # bytes pushed into the decoder so far
        self._num_chars = 0  # chars the decoder has produced so far
        self._num_released_chars = 0
        self._matched: str | None = None

    @property
    def ended(self) -> bool:
        """True once a stop string has matched; the stream accepts nothing after that."""
        return self._matched is not None

    def push(self, token_id: int, skip_bytes: int = 0) -> TextEvent:
        """Add one sampled token; return what it releases. skip_bytes: leading bytes of the token that are not
        output (token healing: the part of the healed token that the prompt already had)."""
        if not self.stop_strings and not self._held_tokens:
            return self._push_unheld(token_id, skip_bytes)
        self._check_open("push")
        self._append(token_id, skip_bytes)
        return self._settle()

    def push_text(self, token_id: int) -> str | None:
        """`push` for the commonest token: no stop strings, nothing held and ASCII bytes, so its whole text is
        released at once; returns that text (the event's, with token_ids [token_id]). None, with nothing done,
        for any other token (call push). A subclass that holds text for other reasons overrides it."""
        if self.stop_strings or self._held_tokens:
            return None
        data = self._bytes_of(token_id)
        return self._release_ascii(data) if data.isascii() else None

    def _release_ascii(self, data: bytes) -> str:
        """Release ASCII bytes pushed with nothing held (the decoder holds no bytes then: a char a byte)."""
        self._num_bytes += len(data)
        self._num_chars += len(data)
        self._num_released_chars = self._num_chars
        return data.decode("ascii")

    def _push_unheld(self, token_id: int, skip_bytes: int) -> TextEvent:
        """push with no stop strings and nothing held (so no text held and no bytes in the decoder): the usual case,
        once per sampled token of most jobs, which mostly releases the token's text at once. The same as `_append`
        and `_settle`, without their bookkeeping where it would be undone at once."""
        data = self._bytes_of(token_id)[skip_bytes:]
        if data.isascii():
            return TextEvent(self._release_ascii(data), [token_id])
        byte_start, char_start = self._num_bytes, self._num_chars
        new_text = self._decoder.decode(data)
        self._num_bytes += len(data)
        self._num_chars += len(new_text)
        if not self._decoder.getstate()[0]:  # every byte decoded: the token's text is final
            self._num_released_chars = self._num_chars
            return TextEvent(new_text, [token_id])
        # its last character is incomplete: the token is held until a later byte completes it (its text so far goes)
        self._held_tokens.append(_HeldToken(token_id, self._num_bytes, None, byte_start, char_start, (b"", 0)))
        self._held_text += new_text
        return self._settle()

    def rewind(self, num_tokens: int) -> tuple[str, list[int]]:
        """Undo the last num_tokens pushes, as if they had never come; none of their text may have been released.
        Returns the text they produced (held until now) and their ids."""
        self._check_open("rewind")
        if num_tokens == 0:
            return "", []
        if not 0 < num_tokens <= len(self._held_tokens):
            raise ValueError(f"rewind of {num_tokens} tokens: {len(self._held_tokens)} are held")
        first = self._held_tokens[-num_tokens]
        cut = first.char_start - self._num_released_chars
        if cut < 0:
            raise ValueError("rewind: part of the text of those tokens was released already")
        token_ids = [self._held_tokens.pop().token_id for _ in range(num_tokens)][::-1]
        text = self._held_text[cut:]
        self._held_text = self._held_text[:cut]
        self._decoder.setstate(first.decoder_state)
        self._num_bytes, self._num_chars = first.byte_start, first.char_start
        decoded_bytes = first.byte_start - len(first.decoder_state[0])
        for held in self._held_tokens:  # tokens whose bytes wait in the restored decoder buffer again
            if held.byte_end > decoded_bytes:
                held.char_end = None
        return text, token_ids

    def flush(self) -> TextEvent:
        """Release everything held: a partial stop string, and an incomplete UTF-8 sequence as U+FFFD."""
        self._check_open("flush")
        tail = self._decoder.decode(b"", final=True)
        self._num_chars += len(tail)
        self._held_text += tail
        event = TextEvent(self._held_text, [t.token_id for t in self._held_tokens])
        self._num_released_chars = self._num_chars
        self._held_text = ""
        self._held_tokens.clear()
        return event

    # --- steps ---

    def _check_open(self, what: str) -> None:
        if self._matched is not None:
            raise RuntimeError(f"TextStream.{what}() after stop string {self._matched!r} ended the stream")

    def _append(self, token_id: int, skip_bytes: int = 0) -> None:
        """Decode one token's bytes into the held text and hold the token."""
        data = self._bytes_of(token_id)[skip_bytes:]
        held = _HeldToken(token_id, self._num_bytes + len(data), None, self._num_bytes, self._num_chars,
                          self._decoder.getstate())
        new_text = self._decoder.decode(data)
        self._num_bytes += len(data)
        self._num_chars += len(new_text)
        self._held_text += new_text
        self._held_tokens.append(held)
        self._resolve_decoded_tokens()

    def _settle(self, keep_at_most: int | None = None) -> TextEvent:
        """After a push: end at a stop string, or release the held text that can no longer start one (and at most
        keep_at_most chars of it: a subclass holds more)."""
        if self.stop_strings:
            match = self._find_stop_string()
            if match is not None:
                return self._end_at(*match)
            keep_from = self._start_of_held_suffix()
        else:
            keep_from = len(self._held_text)
        if keep_at_most is not None:
            keep_from = min(keep_from, keep_at_most)
        return self._release(keep_from)

    def _bytes_of(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            # A special token's piece is text, not part of the byte stream; it still goes through the decoder so
            # that an incomplete sequence before it becomes U+FFFD ahead of the piece, in order.
            return self._tokenizer.id_to_piece(token_id).encode("utf-8") if self.decode_special_tokens else b""
        return self._tokenizer.token_bytes(token_id)

    def _resolve_decoded_tokens(self) -> None:
        """Give a char_end to held tokens whose bytes have all left the decoder's buffer.

        Their text may have come out together with text of later bytes in the same decode call; they are given the
        end of everything decoded so far, which holds them no longer than the text they helped produce."""
        decoded_bytes = self._num_bytes - len(self._decoder.getstate()[0])
        for held in self._held_tokens:
            if held.char_end is not None:
                continue
            if held.byte_end > decoded_bytes:
                break  # this token's bytes (and so everything after it) still wait for the rest of a character
            held.char_end = self._num_chars

    def _find_stop_string(self) -> tuple[int, str] | None:
        """Earliest full match in the held text (ties: the shorter string, which completed first)."""
        best: tuple[int, int, str] | None = None
        for s in self.stop_strings:
            pos = self._held_text.find(s)
            if pos >= 0 and (best is None or (pos, len(s)) < best[:2]):
                best = (pos, len(s), s)
        return None if best is None else (best[0], best[2])

    def _start_of_held_suffix(self) -> int:
        """Index of the longest suffix of the held text that is a proper prefix of a stop string (len if none)."""
        text = self._held_text
        for start in range(max(0, len(text) - self._max_stop_len + 1), len(text)):
            if text[start:] in self._stop_prefixes:
                return start
        return len(text)

    def _release(self, num_chars: int) -> TextEvent:
        text = self._held_text[:num_chars]
        self._held_text = self._held_text[num_chars:]
        self._num_released_chars += num_chars
        token_ids: list[int] = []
        while self._held_tokens:
            char_end = self._held_tokens[0].char_end
            if char_end is None or char_end > self._num_released_chars:
                break
            token_ids.append(self._held_tokens.popleft().token_id)
        return TextEvent(text, token_ids)

    def _end_at(self, match_pos: int, stop_string: str) -> TextEvent:
        """A stop string matched: release the text before it and every held token (as the reference does)."""
        self._matched = stop_string
        tail = self._decoder.decode(b"", final=True)
        event = TextEvent(
            text=self._held_text[:match_pos],
            token_ids=[t.token_id for t in self._held_tokens],
            stop_string=stop_string,
            held_text=self._held_text[match_pos:] + tail,
        )
        self._held_text = ""
        self._held_tokens.clear()
        return event
