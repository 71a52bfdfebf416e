"""TextStream: UTF-8 hold-back, stop strings across token boundaries, special tokens, flush.

Tokens come from a fake tokenizer whose byte table is built by each test, so multi-byte characters split across
tokens, invalid bytes and special tokens can be constructed exactly. The oracle for stop strings is a direct
computation on the whole text pushed so far."""

from __future__ import annotations

import itertools
import random

import pytest

from folio.text import TextEvent, TextStream


class FakeTokenizer:
    """Only the interface TextStream may use: token_bytes(id), special_ids, id_to_piece(id)."""

    def __init__(self) -> None:
        self._bytes: list[bytes] = []
        self._pieces: dict[int, str] = {}
        self.special_ids: frozenset[int] = frozenset()

    def ids(self, *chunks: bytes | str) -> list[int]:
        """Register each chunk as a token (str is UTF-8 encoded) and return their ids."""
        result = []
        for chunk in chunks:
            self._bytes.append(chunk.encode() if isinstance(chunk, str) else chunk)
            result.append(len(self._bytes) - 1)
        return result

    def special(self, piece: str) -> int:
        self._bytes.append(b"")
        token_id = len(self._bytes) - 1
        self._pieces[token_id] = piece
        self.special_ids = frozenset(self._pieces)
        return token_id

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def id_to_piece(self, token_id: int) -> str:
        if token_id in self._pieces:
            return self._pieces[token_id]
        return self._bytes[token_id].decode("utf-8", errors="replace")


def run(stream: TextStream, token_ids: list[int]) -> list[TextEvent]:
    return [stream.push(t) for t in token_ids]


def released(events: list[TextEvent]) -> tuple[str, list[int]]:
    return "".join(e.text for e in events), [t for e in events for t in e.token_ids]


def splits(data: bytes, max_cuts: int | None = None):
    """Every way of cutting `data` into consecutive non-empty chunks (optionally with at most max_cuts cuts)."""
    n = len(data)
    for k in range(0, n if max_cuts is None else min(n, max_cuts + 1)):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0, *cuts, n)
            yield [data[a:b] for a, b in zip(bounds, bounds[1:])]


# --- plain text and tokens ---

def test_plain_text_is_released_with_each_token():
    tok = FakeTokenizer()
    ids = tok.ids("Hel", "lo", " world")
    events = run(TextStream(tok), ids)
    assert [(e.text, e.token_ids) for e in events] == [("Hel", [ids[0]]), ("lo", [ids[1]]), (" world", [ids[2]])]
    assert all(e.stop_string is None and e.held_text == "" for e in events)


# --- stop strings ---

def expected_stop(chunks: list[str], stops: list[str]):
    """Oracle: the push at which a stop string first occurs in the text so far, the earliest match position there
    (shorter string on ties), and the text before it. None when no stop string occurs."""
    text = ""
    for n, chunk in enumerate(chunks):
        text += chunk
        hits = [(text.find(s), len(s), s) for s in stops if s in text]
        if hits:
            pos, _, s = min(hits)
            return n, pos, s, text
    return None


def expected_release(text: str, stops: list[str]) -> str:
    """Oracle: all text except the longest suffix that is a proper prefix of a stop string."""
    for start in range(len(text)):
        if any(s.startswith(text[start:]) and len(s) > len(text) - start for s in stops):
            return text[:start]
    return text


def check_stream(chunks: list[str], stops: list[str]) -> None:
    tok = FakeTokenizer()
    ids = tok.ids(*chunks)
    stream = TextStream(tok, stops)
    expected = expected_stop(chunks, stops)
    pushed_text = ""
    events = []
    for n, (token_id, chunk) in enumerate(zip(ids, chunks)):
        events.append(stream.push(token_id))
        pushed_text += chunk
        if expected is not None and n == expected[0]:
            break
        assert events[-1].stop_string is None
        assert released(events)[0] == expected_release(pushed_text, stops), (chunks, stops)
    text, token_ids = released(events)
    if expected is None:
        events.append(stream.flush())
        assert released(events) == ("".join(chunks), ids)
        return
    n, pos, stop, full = expected
    last = events[-1]
    assert last.stop_string == stop, (chunks, stops)
    assert text == full[:pos] and last.held_text == full[pos:], (chunks, stops)
    # All held tokens come out with the match, so every pushed token was released exactly once, in order.
    assert token_ids == ids[: n + 1]
    assert stream.ended
    with pytest.raises(RuntimeError, match="stop string"):
        stream.push(ids[0])


def test_stop_string_every_split():
    data = "abcSTOPxyz"
    for pieces in splits(data.encode()):
        check_stream([p.decode() for p in pieces], ["STOP"])


def test_stop_string_first_or_last_in_token():
    check_stream(["STOP", "after"], ["STOP"])
    check_stream(["before STO", "P and more"], ["STOP"])
    check_stream(["x", "S", "T", "O", "P"], ["STOP"])


def test_partial_match_that_fails_is_released():
    tok = FakeTokenizer()
    ids = tok.ids("ab", "ST", "O", "X!", "SST")
    events = run(TextStream(tok, ["STOP"]), ids)
    assert [(e.text, e.token_ids) for e in events] == [
        ("ab", [ids[0]]), ("", []), ("", []), ("STOX!", ids[1:4]), ("S", []),
    ]


def test_overlapping_stop_strings():
    # "bc" completes inside "abcd" before "abcd" does.
    check_stream(["a", "b", "c", "d"], ["abcd", "bc"])
    # Both complete in one token: the earliest start wins.
    check_stream(["x", "abcd"], ["abcd", "cd"])
    check_stream(["ab", "cd"], ["bcd", "cd"])
    # Same start: the shorter one completed first.
    check_stream(["abc"], ["abc", "ab"])
    # A suffix of one stop string is a prefix of another.
    check_stream(["xa", "bab", "c"], ["abab", "babc"])


def test_held_text_after_match_includes_rest_of_token():
    tok = FakeTokenizer()
    ids = tok.ids("one </", "s> tail")
    events = run(TextStream(tok, ["</s>"]), ids)
    assert events[0] == TextEvent("one ", [])
    assert events[1] == TextEvent("", ids, stop_string="</s>", held_text="</s> tail")


def test_random_streams_against_oracle():
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
        bounds = (0, *cuts, len(text))
        chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        check_stream(chunks, stops)


def test_stop_strings_validation():
    tok = FakeTokenizer()
    with pytest.raises(ValueError, match="empty"):
        TextStream(tok, ["ok", ""])
    with pytest.raises(TypeError, match="single string"):
        TextStream(tok, "STOP")
    with pytest.raises(TypeError, match="only str"):
        TextStream(tok, ["a", 3])


# --- UTF-8 ---

@pytest.mark.parametrize("char", ["é", "€", "😀"])
def test_multibyte_character_every_split(char):
    data = ("a" + char + "b").encode()
    for pieces in splits(data):
        tok = FakeTokenizer()
        ids = tok.ids(*pieces)
        stream = TextStream(tok)
        events = run(stream, ids)
        assert released(events) == ("a" + char + "b", ids)
        # Oracle: a token is released by the first push (its own or later) that ends on a character boundary.
        boundaries = {len(("a" + char + "b")[:k].encode()) for k in range(4)}
        ends = list(itertools.accumulate(len(p) for p in pieces))
        release_at = [min(j for j in range(i, len(pieces)) if ends[j] in boundaries) for i in range(len(pieces))]
        for n, event in enumerate(events):
            assert "\ufffd" not in event.text
            assert event.token_ids == [ids[i] for i in range(len(ids)) if release_at[i] == n], pieces
            text_so_far = released(events[: n + 1])[0]
            assert text_so_far == data[: max((e for e in boundaries if e <= ends[n]), default=0)].decode()
        assert stream.flush() == TextEvent("", [])


def test_character_completed_by_token_with_more_text():
    tok = FakeTokenizer()
    ids = tok.ids(b"x\xe2\x82", b"\xacyz")
    events = run(TextStream(tok), ids)
    assert events[0] == TextEvent("x", [])
    assert events[1] == TextEvent("\u20acyz", ids)


def test_stop_string_with_multibyte_characters_split():
    data = "a€!b".encode()
    for pieces in splits(data):
        tok = FakeTokenizer()
        ids = tok.ids(*pieces)
        # The match comes with the token holding "!" (byte 4), the euro sign is never released.
        match_at = next(n for n in range(len(pieces)) if len(b"".join(pieces[: n + 1])) > 4)
        events = run(TextStream(tok, ["€!"]), ids[: match_at + 1])
        assert [e.stop_string for e in events[: match_at + 1]] == [None] * match_at + ["€!"], pieces
        assert released(events[: match_at + 1]) == ("a", ids[: match_at + 1])
        assert events[match_at].held_text == b"".join(pieces[: match_at + 1]).decode()[1:]


def test_invalid_bytes_become_replacement_characters_without_hanging():
    tok = FakeTokenizer()
    ids = tok.ids(b"\xff", b"ok", b"\xe2\x82", b"A", b"\x80\x80", b"\xf0", b"\xf0", b"\xf0\x9f\x98")
    stream = TextStream(tok)
    events = run(stream, ids)
    assert [e.text for e in events] == ["\ufffd", "ok", "", "\ufffdA", "\ufffd\ufffd", "", "\ufffd", "\ufffd"]
    # The trailing incomplete sequence is held (with its token) until flush turns it into U+FFFD.
    assert events[-1].token_ids == [ids[-2]]
    assert stream.flush() == TextEvent("\ufffd", [ids[-1]])


def test_random_bytes_match_bulk_decode_and_hold_at_most_three_bytes():
    rng = random.Random(99)
    alphabet = [b"a", b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xac", b"\xf0", b"\x9f", b"\x98", b"\x80", b"\xff",
                b"\xed", b"\xa0", b"\xf4", b"\x90", b"\xc0"]
    for _ in range(300):
        chunks = [b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 12))]
        tok = FakeTokenizer()
        ids = tok.ids(*chunks)
        stream = TextStream(tok)
        events = []
        for n, token_id in enumerate(ids):
            events.append(stream.push(token_id))
            _, out_ids = released(events)
            # Only tokens with bytes in the (at most 3 byte) incomplete-sequence buffer are held; the first of them
            # may also have produced released text.
            assert len(b"".join(chunks[len(out_ids) + 1: n + 1])) <= 3, chunks
        events.append(stream.flush())
        assert released(events) == (b"".join(chunks).decode("utf-8", errors="replace"), ids)


# --- special tokens ---

def test_special_tokens_hidden_by_default():
    tok = FakeTokenizer()
    a, b = tok.ids("a", "b")
    eot = tok.special("<|eot|>")
    events = run(TextStream(tok), [a, eot, b])
    assert [(e.text, e.token_ids) for e in events] == [("a", [a]), ("", [eot]), ("b", [b])]


def test_special_tokens_decoded_when_asked():
    tok = FakeTokenizer()
    a, = tok.ids("a")
    eot = tok.special("<|eot|>")
    events = run(TextStream(tok, decode_special_tokens=True), [a, eot])
    assert [(e.text, e.token_ids) for e in events] == [("a", [a]), ("<|eot|>", [eot])]


def test_special_token_piece_can_complete_a_stop_string():
    tok = FakeTokenizer()
    a, = tok.ids("a<|")
    eot = tok.special("<|eot|>")
    events = run(TextStream(tok, ["<|eot|>"], decode_special_tokens=True), [a, eot])
    assert events[0] == TextEvent("a", [])
    assert events[1] == TextEvent("<|", [a, eot], stop_string="<|eot|>", held_text="<|eot|>")


def test_special_token_after_incomplete_character():
    tok = FakeTokenizer()
    part, = tok.ids(b"\xe2\x82")
    eot = tok.special("<s>")
    assert run(TextStream(tok, decode_special_tokens=True), [part, eot])[1] == TextEvent("\ufffd<s>", [part, eot])
    # Hidden special token: it waits behind the incomplete character, keeping token order.
    events = run(TextStream(tok), [part, eot])
    assert events == [TextEvent("", []), TextEvent("", [])]


# --- flush ---

def test_flush_releases_partial_stop_string_and_incomplete_character():
    tok = FakeTokenizer()
    ids = tok.ids("text ST", b"\xe2\x82")
    stream = TextStream(tok, ["STOP"])
    events = run(stream, ids)
    assert events[0] == TextEvent("text ", [])
    assert events[1] == TextEvent("", [])
    assert stream.flush() == TextEvent("ST\ufffd", ids)
    assert stream.flush() == TextEvent("", [])


def test_flush_after_match_is_an_error():
    tok = FakeTokenizer()
    stream = TextStream(tok, ["x"])
    assert stream.push(tok.ids("x")[0]).stop_string == "x"
    with pytest.raises(RuntimeError, match="'x'"):
        stream.flush()


def test_long_stream_with_stop_strings_keeps_hold_short():
    tok = FakeTokenizer()
    ids = tok.ids(*["word "] * 2000, "STO", "P")
    stream = TextStream(tok, ["STOP", "never matches"])
    events = run(stream, ids)
    text, _ = released(events)
    assert text == "word " * 2000
    assert events[-1].stop_string == "STOP" and events[-1].held_text == "STOP"
    # Every plain word was released by its own push (nothing accumulates).
    assert all(e.text == "word " for e in events[:2000])


def test_push_text_releases_what_push_releases():
    """push_text (the usual token's shortcut) gives the text push would, leaves the stream where push leaves it, and
    declines (None, nothing done) split characters, held tokens, stop strings and the banned-string stream."""
    from folio.banned import BannedStrings, BannedTextStream

    tok = FakeTokenizer()
    ids = tok.ids("ab", " c", "é", b"\xc3", b"\xa9", "d", "\U0001F600", "x")
    special = tok.special("<s>")
    rng = random.Random(0)
    sequence = [rng.choice(ids + [special]) for _ in range(400)]
    quick, plain = TextStream(tok, decode_special_tokens=True), TextStream(tok, decode_special_tokens=True)
    declined = 0
    for token_id in sequence:
        text = quick.push_text(token_id)
        want = plain.push(token_id)
        if text is None:
            declined += 1
            got = quick.push(token_id)
            assert (got.text, got.token_ids) == (want.text, want.token_ids)
        else:
            assert (text, [token_id]) == (want.text, want.token_ids)
        assert vars(quick).keys() == vars(plain).keys()
        assert {k: v for k, v in vars(quick).items() if k != "_decoder"} == \
            {k: v for k, v in vars(plain).items() if k != "_decoder"}
    assert 0 < declined < len(sequence)
    assert quick.flush().text == plain.flush().text
    assert TextStream(tok, stop_strings=["zz"]).push_text(ids[0]) is None
    assert BannedTextStream(tok, BannedStrings(["qq"])).push_text(ids[0]) is None
