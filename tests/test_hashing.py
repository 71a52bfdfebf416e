"""folio.hashing: known answers computed independently with hashlib, chaining, the prompt variant."""

from __future__ import annotations

import ast
import hashlib
import pathlib
import struct

import pytest

from folio.hashing import HASH_SIZE, ROOT_MARKER, hash_page, page_hashes, prompt_page_hashes

REPO = pathlib.Path(__file__).resolve().parent.parent


def independent_hash(prev: bytes | None, token_ids: list[int], namespace: bytes) -> bytes:
    """The documented byte layout, written out by hand."""
    message = (prev if prev is not None else b"folio.page.root\x00")
    message += struct.pack("<Q", len(namespace)) + namespace
    message += b"".join(struct.pack("<q", token_id) for token_id in token_ids)
    return hashlib.blake2b(message, digest_size=16).digest()


def test_known_answer_first_page():
    assert hash_page(None, [1, 2, 3, 4]) == independent_hash(None, [1, 2, 3, 4], b"")
    # A fixed value pins the format: changing the layout invalidates every router index, so it must be deliberate.
    assert hash_page(None, [1, 2, 3, 4]).hex() == "5b61434146b63abeb316f99abf75bc42"
    assert len(hash_page(None, [1, 2, 3, 4])) == HASH_SIZE == 16
    assert ROOT_MARKER == b"folio.page.root\x00"


def test_known_answer_chain_with_namespace_and_wide_ids():
    tokens = [0, 1, 2**40, -5, 127, 128, 255, 256, 2**63 - 1, 7]
    first = independent_hash(None, tokens[:5], b"lora:a")
    second = independent_hash(first, tokens[5:], b"lora:a")
    assert page_hashes(tokens, 5, b"lora:a") == [first, second]
    assert hash_page(first, tokens[5:], b"lora:a") == second


def test_page_hashes_only_full_pages():
    tokens = list(range(11))
    assert len(page_hashes(tokens, 4)) == 2
    assert len(page_hashes(tokens[:8], 4)) == 2
    assert len(page_hashes(tokens[:7], 4)) == 1
    assert page_hashes([], 4) == []


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_prompt_page_hashes_exclude_the_page_of_the_last_token(num_tokens, expected):
    tokens = [t * 3 + 1 for t in range(num_tokens)]
    hashes = prompt_page_hashes(tokens, 4, b"ns")
    assert len(hashes) == expected == max(num_tokens - 1, 0) // 4
    assert hashes == page_hashes(tokens, 4, b"ns")[:expected]


def test_equal_hash_iff_equal_whole_prefix():
    base = [5, 6, 7, 8, 9, 10, 11, 12]
    hashes = page_hashes(base, 4)
    # Same second page, different first page: the second hash differs because it names the whole prefix.
    other = page_hashes([5, 6, 7, 99] + base[4:], 4)
    assert other[1] != hashes[1] and other[0] != hashes[0]
    # Same tokens, same namespace: equal; any namespace change: all differ.
    assert page_hashes(list(base), 4) == hashes
    assert all(a != b for a, b in zip(page_hashes(base, 4, b"x"), hashes))
    assert page_hashes(base, 4, b"x") != page_hashes(base, 4, b"y")
    # Order matters; so does where the page boundaries fall.
    assert page_hashes(base[::-1], 4)[1] != hashes[1]
    assert page_hashes(base, 2)[1] != hashes[0]


def test_namespace_length_keeps_fields_apart():
    # Without the length prefix, namespace b"\x01" + tokens could be re-split into another namespace/tokens pair.
    assert hash_page(None, [1], b"") != hash_page(None, [], b"\x01\x00\x00\x00\x00\x00\x00\x00")


def test_many_pages_are_distinct():
    tokens = [1] * (4 * 200)  # identical page contents: only the chain tells the pages apart
    hashes = page_hashes(tokens, 4)
    assert len(set(hashes)) == 200


def test_accepts_tuples_and_ranges():
    assert page_hashes(tuple(range(8)), 4) == page_hashes(list(range(8)), 4) == page_hashes(range(8), 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="page_size"):
        prompt_page_hashes([1, 2], -4)
    with pytest.raises(ValueError, match="prev_hash"):
        hash_page(b"short", [1])
    with pytest.raises(OverflowError):
        hash_page(None, [2**63])


def test_torch_free_modules():
    """folio.hashing and folio.cache are imported by the router and the torch-free scheduler."""
    paths = [REPO / "folio" / "hashing.py", *sorted((REPO / "folio" / "cache").glob("*.py"))]
    assert len(paths) > 3
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] in {"__future__", "folio", "array", "bisect", "hashlib", "struct", "sys",
                                              "collections", "dataclasses", "enum", "heapq", "typing"}, \
                    f"{path.name} imports {name}"
                assert not name.startswith("folio.") or name.startswith(
                    ("folio.cache", "folio.hashing", "folio.sequence")), f"{path.name} imports {name}"


def test_cache_manager_and_scheduler_import_without_torch():
    """The page side of the engine runs where torch cannot even be imported."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "import folio.hashing, folio.cache, folio.cache.manager, folio.sequence, folio.scheduler\n"
            "assert sys.modules['torch'] is None")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
