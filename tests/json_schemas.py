"""JSON schemas for the grammar filters' tests and bench/grammar_libraries.py.

SCHEMAS: 20 schemas of the shapes structured-output requests use (nested objects, bounded arrays, enums, bounded
numbers, required and optional keys, $ref/$defs, patterns and formats, anyOf, booleans, nulls). Every one must
compile and every document a filter lets through must validate against it (tests/test_filters.py).

FEATURES: one small schema per JSON-schema feature, for the libraries' coverage table.

random_walk: the model-free driver both use to produce documents through a filter or a library's matcher.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SCHEMAS: dict[str, Any] = {
    "flat_object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "optional_keys": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "nickname": {"type": "string", "maxLength": 8},
            "active": {"type": "boolean"},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 10},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["first", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "string_enum": {"type": "string", "enum": ["red", "green", "blue", "light-blue"]},
    "mixed_enum": {"enum": ["on", "off", 1, 0, True, None]},
    "const_and_enum": {
        "type": "object",
        "properties": {"version": {"const": 2}, "mode": {"enum": ["fast", "safe"]}},
        "required": ["version", "mode"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -40, "maximum": 60},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["temperature", "ratio"],
        "additionalProperties": False,
    },
    "integer_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": 100, "maximum": 120},
        "minItems": 1,
        "maxItems": 3,
    },
    "refs_and_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "recursive_ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "minimum": 0, "maximum": 9},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["value"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "phone": {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{4}$"},
            "code": {"type": "string", "pattern": "^[a-f0-9]{4,6}$"},
        },
        "required": ["phone", "code"],
        "additionalProperties": False,
    },
    "string_formats": {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "host": {"type": "string", "format": "ipv4"},
        },
        "required": ["day", "id", "host"],
        "additionalProperties": False,
    },
    "string_lengths": {
        "type": "array",
        "items": {"type": "string", "minLength": 2, "maxLength": 5},
        "minItems": 1,
        "maxItems": 3,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "result": {
                "anyOf": [
                    {"type": "integer", "minimum": 0},
                    {"type": "string", "maxLength": 6},
                    {"type": "object", "properties": {"error": {"type": "string", "maxLength": 6}},
                     "required": ["error"], "additionalProperties": False},
                ]
            }
        },
        "required": ["result"],
        "additionalProperties": False,
    },
    "booleans_and_nulls": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": {"type": "null"},
                       "maybe": {"type": ["boolean", "null"]}},
        "required": ["ok", "reason", "maybe"],
        "additionalProperties": False,
    },
    "nullable_union": {
        "type": "array",
        "items": {"type": ["integer", "null", "string"], "maxLength": 4},
        "maxItems": 4,
    },
    "additional_properties_typed": {
        "type": "object",
        "properties": {"kind": {"const": "counts"}},
        "required": ["kind"],
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 3,
    },
    "tool_call": {
        "$defs": {
            "arg": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "number"}, {"type": "boolean"}]}
        },
        "type": "object",
        "properties": {
            "name": {"enum": ["search", "lookup", "send_mail"]},
            "arguments": {
                "type": "object",
                "properties": {"query": {"$ref": "#/$defs/arg"}, "limit": {"type": "integer", "minimum": 1,
                                                                            "maximum": 50}},
                "required": ["query"],
                "additionalProperties": False,
            },
            "parallel": {"type": "boolean"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

assert len(SCHEMAS) == 20

FEATURES: dict[str, Any] = {
    "$ref/$defs": SCHEMAS["refs_and_defs"],
    "recursive $ref": SCHEMAS["recursive_ref"],
    "enum": SCHEMAS["mixed_enum"],
    "const": SCHEMAS["const_and_enum"],
    "integer bounds": SCHEMAS["integer_bounds"],
    "number exclusive bounds": SCHEMAS["number_bounds"],
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "pattern": SCHEMAS["string_pattern"],
    "format date/uuid/ipv4": SCHEMAS["string_formats"],
    "format email": {"type": "string", "format": "email"},
    "min/maxLength": SCHEMAS["string_lengths"],
    "min/maxItems": SCHEMAS["bounded_array"],
    "anyOf": SCHEMAS["any_of"],
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "type list (nullable)": SCHEMAS["nullable_union"],
    "additionalProperties: false": SCHEMAS["flat_object"],
    "additionalProperties: schema": SCHEMAS["additional_properties_typed"],
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
                          "additionalProperties": False},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "min/maxProperties": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1,
                          "maxProperties": 2},
    "if/then/else": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}},
}


# ------------------------------------------------------------------------------------------------ random walk

CLOSERS = (b"}", b"]", b'"')


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bits are set in one int32 bitmask row."""
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].nonzero()[0]


def random_walk(fill: Callable[[np.ndarray], None], feed: Callable[[int], None], finished: Callable[[], bool],
                token_bytes: Sequence[bytes], eos_ids: Sequence[int], rng: random.Random, *, soft_cap: int = 24,
                hard_cap: int = 600, skip_whitespace: bool = True) -> tuple[list[int], bool]:
    """Drive a constrained decoder without a model: pick a token among the allowed ones, feed it, repeat.

    For the first `soft_cap` tokens the pick is uniform over the allowed set. After that the walk steers toward
    the end of the document, so that recursive or unbounded grammars finish: it takes an EOS id if one is allowed,
    else a one-byte closer ('}', ']' or '"', chosen at random), else a uniformly chosen one-byte token (short
    tokens end numbers and bounded strings soonest), else any allowed token. With skip_whitespace, tokens of only
    whitespace are left out of both picks while anything else is allowed (else documents are mostly indentation).
    Returns (tokens, finished); finished is False when the walk hit `hard_cap` tokens or reached an empty mask.
    """
    vocab_size = len(token_bytes)
    row = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    space = np.fromiter((b.isspace() for b in token_bytes), dtype=bool, count=vocab_size)
    one_byte = np.fromiter((len(b) == 1 for b in token_bytes), dtype=bool, count=vocab_size) & ~space
    closer_ids = {c: [i for i, b in enumerate(token_bytes) if b == c] for c in CLOSERS}
    eos = set(eos_ids)
    tokens: list[int] = []
    while len(tokens) < hard_cap:
        if finished():
            return tokens, True
        row[:] = 0
        fill(row)
        ids = allowed_ids(row, vocab_size)
        if ids.size == 0:
            return tokens, False
        if skip_whitespace:
            content = ids[~space[ids]]
            if content.size:
                ids = content
        if len(tokens) < soft_cap:
            token = int(ids[rng.randrange(ids.size)])
        else:
            token = _closing_choice(ids, one_byte, closer_ids, eos, rng)
        tokens.append(token)
        feed(token)
        if token in eos:
            return tokens, finished()
    return tokens, finished()


def _closing_choice(ids: np.ndarray, one_byte: np.ndarray, closer_ids: dict[bytes, list[int]], eos: set[int],
                    rng: random.Random) -> int:
    allowed = set(ids.tolist())
    for t in eos:
        if t in allowed:
            return t
    closers = [t for c in CLOSERS for t in closer_ids[c] if t in allowed]
    if closers:  # a random one: inside a string '}' is text, and only '"' ends it
        return rng.choice(closers)
    short = ids[one_byte[ids]]
    pool = short if short.size else ids
    return int(pool[rng.randrange(pool.size)])
