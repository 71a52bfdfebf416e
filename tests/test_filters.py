"""folio.constrain's grammar filters (llguidance) driven without a model.

Each filter is driven by tests/json_schemas.random_walk: a seeded walk that picks uniformly among the tokens the
filter's bitmask allows, then (past a soft cap of tokens) steers toward the end of the document by preferring
EOS, then a closing '}', ']' or '"' (at random), then one-byte tokens. Every finished document must parse and validate.
The tokenizer is the demo's byte-level BPE (1000 tokens, trained locally), bound over a padded 1024-id vocabulary.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from folio.constrain import (
    ChoiceFilter,
    Filter,
    FilterError,
    GrammarFilter,
    JsonSchemaFilter,
    RegexFilter,
    bitmask_words,
    fill_bitmasks,
)
from folio.demo import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, train_demo_tokenizer
from folio.tokenizer import Tokenizer
from tests.json_schemas import SCHEMAS, allowed_ids, random_walk

WALKS_PER_SCHEMA = 10


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    hf = train_demo_tokenizer(1000)
    return Tokenizer(hf.to_str(), bos_token_id=hf.token_to_id(BOS_TOKEN), eos_token_ids=[hf.token_to_id(EOS_TOKEN)],
                     pad_token_id=hf.token_to_id(PAD_TOKEN))


@pytest.fixture(scope="module")
def vocab_size(tok: Tokenizer) -> int:
    return tok.padded_vocab_size


@pytest.fixture(scope="module")
def token_bytes(tok: Tokenizer, vocab_size: int) -> list[bytes]:
    return [tok.token_bytes(i) if i < tok.vocab_size else b"" for i in range(vocab_size)]


def bound(f: Filter, tok: Tokenizer, vocab_size: int) -> Filter:
    f.bind(tok, vocab_size)
    return f


def mask_of(f: Filter, vocab_size: int) -> np.ndarray:
    row = np.zeros(bitmask_words(vocab_size), dtype=np.int32)
    f.fill_bitmask(row)
    return row


def walk(f: Filter, tok: Tokenizer, token_bytes: list[bytes], seed: int, **kwargs) -> tuple[bytes, bool]:
    ids, finished = random_walk(f.fill_bitmask, f.feed, f.is_finished, token_bytes, tok.eos_token_ids,
                                random.Random(seed), **kwargs)
    return b"".join(token_bytes[t] for t in ids), finished


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_walks_are_valid(name: str, tok: Tokenizer, vocab_size: int, token_bytes: list[bytes]) -> None:
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for seed in range(WALKS_PER_SCHEMA):
        f = bound(JsonSchemaFilter(schema), tok, vocab_size)
        text, finished = walk(f, tok, token_bytes, seed)
        assert finished, f"{name} seed {seed}: walk did not finish: {text[:200]!r}"
        doc = json.loads(text)
        errors = [e.message for e in validator.iter_errors(doc)]
        assert not errors, f"{name} seed {seed}: {text!r} violates the schema: {errors}"


def test_schema_as_text_and_booleans(tok: Tokenizer, vocab_size: int, token_bytes: list[bytes]) -> None:
    f = bound(JsonSchemaFilter(json.dumps(SCHEMAS["string_enum"])), tok, vocab_size)
    text, finished = walk(f, tok, token_bytes, 0)
    assert finished and json.loads(text) in SCHEMAS["string_enum"]["enum"]
    f = bound(JsonSchemaFilter(True), tok, vocab_size)
    text, finished = walk(f, tok, token_bytes, 0)
    assert finished
    json.loads(text)
    with pytest.raises(FilterError, match="admits no value"):
        JsonSchemaFilter(False)


def test_eos_allowed_only_when_accepting_and_feeding_it_finishes(tok: Tokenizer, vocab_size: int) -> None:
    eos = tok.eos_token_ids[0]
    f = bound(RegexFilter(r"[0-9]{1,3}"), tok, vocab_size)
    assert eos not in allowed_ids(mask_of(f, vocab_size), vocab_size)
    for t in tok.encode("4"):
        f.feed(t)
    assert not f.is_finished()
    assert eos in allowed_ids(mask_of(f, vocab_size), vocab_size)
    f.feed(eos)
    assert f.is_finished()
    # A closed document stops the matcher by itself: finished with no EOS, and the mask then allows only EOS.
    f = bound(JsonSchemaFilter(SCHEMAS["string_enum"], options={"whitespace_flexible": False}), tok, vocab_size)
    for t in tok.encode('"red"'):
        f.feed(t)
    assert f.is_finished()
    assert allowed_ids(mask_of(f, vocab_size), vocab_size).tolist() == [eos]


@pytest.mark.parametrize("pattern", [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)!?",
                                     r"[A-F0-9]{8}"])
def test_regex_walks_fullmatch(pattern: str, tok: Tokenizer, vocab_size: int, token_bytes: list[bytes]) -> None:
    for seed in range(5):
        f = bound(RegexFilter(pattern), tok, vocab_size)
        text, finished = walk(f, tok, token_bytes, seed)
        assert finished and re.fullmatch(pattern, text.decode()), (pattern, text)


def test_choice_walks_give_an_option(tok: Tokenizer, vocab_size: int, token_bytes: list[bytes]) -> None:
    options = ["yes", "no", "not sure", "no way", 'say "hi"\n']
    for seed in range(10):
        f = bound(ChoiceFilter(options), tok, vocab_size)
        text, finished = walk(f, tok, token_bytes, seed, soft_cap=2)
        assert finished and text.decode() in options


LARK_ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
GBNF_LIST = r"""
root ::= "[" item ("," item)* "]"
item ::= [a-c]+
"""


@pytest.mark.parametrize("grammar,check", [
    (LARK_ARITH, re.compile(r"[0-9()+\-]+")),
    (GBNF_LIST, re.compile(r"\[[a-c]+(,[a-c]+)*\]")),
])
def test_grammar_walks(grammar: str, check: re.Pattern, tok: Tokenizer, vocab_size: int,
                       token_bytes: list[bytes]) -> None:
    for seed in range(5):
        f = bound(GrammarFilter(grammar), tok, vocab_size)
        text, finished = walk(f, tok, token_bytes, seed)
        assert finished and check.fullmatch(text.decode()), text
        if grammar is LARK_ARITH:
            eval(text.decode())  # balanced and well formed  # noqa: S307


@pytest.mark.parametrize("make,message", [
    (lambda: JsonSchemaFilter({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (lambda: JsonSchemaFilter({"type": "strin"}), "strin"),
    (lambda: RegexFilter("[a-z"), "unclosed"),
    (lambda: GrammarFilter("start: foo\n"), "foo"),
    (lambda: GrammarFilter('root ::= "a" undefined_rule'), "undefined_rule"),
])
def test_bad_input_raises_filter_error_with_library_message(make, message: str, tok: Tokenizer,
                                                             vocab_size: int) -> None:
    with pytest.raises(FilterError, match=message):
        make().bind(tok, vocab_size)


def test_rejected_token_raises_and_keeps_state(tok: Tokenizer, vocab_size: int) -> None:
    f = bound(RegexFilter("ab+"), tok, vocab_size)
    f.feed(tok.encode("a")[0])
    before = mask_of(f, vocab_size)
    with pytest.raises(FilterError, match="not allowed"):
        f.feed(tok.encode("z")[0])
    assert np.array_equal(mask_of(f, vocab_size), before)


def test_rollback_restores_the_mask(tok: Tokenizer, vocab_size: int, token_bytes: list[bytes]) -> None:
    f = bound(JsonSchemaFilter(SCHEMAS["tool_call"]), tok, vocab_size)
    ids = tok.encode('{"name": "search", "arguments": {"query": "cats", "limit": 5}}')
    masks = []
    for t in ids:
        masks.append(mask_of(f, vocab_size))
        f.feed(t)
    assert f.is_finished()
    for n in (1, 3, len(ids) - 1):
        f.rollback(n)
        assert np.array_equal(mask_of(f, vocab_size), masks[len(ids) - n]), n
        for t in ids[len(ids) - n:]:
            f.feed(t)
    f.reset()
    assert np.array_equal(mask_of(f, vocab_size), masks[0])


def test_batched_masks_equal_single_masks(tok: Tokenizer, vocab_size: int, token_bytes: list[bytes]) -> None:
    """More grammars than fill_bitmasks' threads (several to a thread), copies of one template (one family, filled
    together), a regex, a choice and an unconstrained row."""
    first = next(iter(SCHEMAS.values()))
    filters: list[Filter | None] = [bound(JsonSchemaFilter(s), tok, vocab_size) for s in SCHEMAS.values()]
    filters += [bound(JsonSchemaFilter(first), tok, vocab_size) for _ in range(3)]
    filters += [bound(RegexFilter(r"\d+"), tok, vocab_size), bound(ChoiceFilter(["a", "bb"]), tok, vocab_size), None]
    families = {f.family for f in filters if f is not None}
    assert len(families) == len(SCHEMAS) + 2 and filters[0].family == filters[len(SCHEMAS)].family
    rng = random.Random(0)
    bitmask = np.zeros((len(filters) + 2, bitmask_words(vocab_size)), dtype=np.int32)
    for _step in range(12):
        bitmask[:] = 0
        fill_bitmasks(filters, bitmask)
        assert (bitmask[len(filters) - 1] == -1).all()
        for i, f in enumerate(filters):
            if f is None:
                continue
            assert np.array_equal(bitmask[i], mask_of(f, vocab_size)), i
            ids = allowed_ids(bitmask[i], vocab_size)
            if not f.is_finished() and ids.size:
                f.feed(int(ids[rng.randrange(ids.size)]))


def test_vocabulary_and_grammar_caches(tok: Tokenizer, vocab_size: int) -> None:
    from folio.constrain import grammar

    a = bound(JsonSchemaFilter(SCHEMAS["flat_object"]), tok, vocab_size)
    b = bound(JsonSchemaFilter(SCHEMAS["flat_object"]), tok, vocab_size)
    vocab = grammar.vocabulary(tok, vocab_size)
    assert vocab is grammar.vocabulary(tok, vocab_size)
    assert len([g for g in vocab.templates if "flat" in g or "name" in g]) >= 1
    a.feed(tok.encode("{")[0])  # independent matchers: b is still at the start
    assert not np.array_equal(mask_of(a, vocab_size), mask_of(b, vocab_size))


@pytest.mark.parametrize("max_length", [3, 9, 24])
def test_string_slices_leave_masks_as_the_full_walk_makes_them(max_length: int, tok: Tokenizer, vocab_size: int,
                                                               token_bytes: list[bytes]) -> None:
    """folio's finer string slices (grammar.STRING_SLICES) are a shortcut: over walks through bounded strings each
    mask equals the one llguidance computes with no slices at all (every token walked)."""
    import llguidance
    import llguidance.numpy as llnp

    from folio.constrain import grammar

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": max_length},
                                               "b": {"type": "array", "items": {"type": "string",
                                                                                "maxLength": max_length}}},
              "required": ["a", "b"], "additionalProperties": False}
    f = bound(JsonSchemaFilter(schema), tok, vocab_size)
    unsliced = llguidance.LLMatcher(grammar.vocabulary(tok, vocab_size).lltok.with_slices([]),
                                    f.llguidance_grammar(), log_level=0)
    rng = random.Random(max_length)
    expected = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    for _step in range(60):
        if f.is_finished():
            break
        llnp.fill_next_token_bitmask(unsliced, expected, 0)
        row = mask_of(f, vocab_size)
        assert np.array_equal(row, expected[0])
        ids = allowed_ids(row, vocab_size)
        token = int(ids[rng.randrange(ids.size)])
        f.feed(token)
        assert unsliced.consume_token(token)
