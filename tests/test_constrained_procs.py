"""folio.constrain.procs: grammar masks made by worker processes equal the in-process ones, and a worker that dies
or hangs gives a clear error (then fill_bitmasks goes back in process) instead of a hang.

Two workers over the demo tokenizer (its own Tokenizer object, so that its vocabulary and pool are this module's).
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time

import numpy as np
import pytest

from folio.constrain import (
    ChoiceFilter,
    GrammarFilterBase,
    JsonSchemaFilter,
    RegexFilter,
    bitmask_words,
    fill_bitmasks,
    grammar,
    procs,
)
from folio.demo import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, train_demo_tokenizer
from folio.tokenizer import Tokenizer
from tests.json_schemas import SCHEMAS, allowed_ids

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    hf = train_demo_tokenizer(1000)
    return Tokenizer(hf.to_str(), bos_token_id=hf.token_to_id(BOS_TOKEN), eos_token_ids=[hf.token_to_id(EOS_TOKEN)],
                     pad_token_id=hf.token_to_id(PAD_TOKEN))


@pytest.fixture()
def pool(tok: Tokenizer):
    p = procs.MaskProcesses(grammar.vocabulary(tok, tok.padded_vocab_size).pool_init(), 2, max_rows=64)
    p.start()
    yield p
    p.close()


def make_filters(tok: Tokenizer) -> list[GrammarFilterBase]:
    schemas = list(SCHEMAS.values())
    filters: list[GrammarFilterBase] = [JsonSchemaFilter(s) for s in schemas[:8]]
    filters += [JsonSchemaFilter(schemas[0]) for _ in range(4)]
    filters += [RegexFilter(r"[a-z]{1,6}( [0-9]+)*"), ChoiceFilter(["yes", "no", "maybe"])]
    for f in filters:
        f.bind(tok, tok.padded_vocab_size)
    return filters


def in_process(f: GrammarFilterBase, vocab_size: int) -> np.ndarray:
    row = np.zeros(bitmask_words(vocab_size), dtype=np.int32)
    f.fill_bitmask(row)
    return row


def walk(filters: list, fill, vocab_size: int, steps: int, seed: int = 0) -> None:
    """Random walks (with a reset and rollbacks on the way), each step's masks from `fill` checked against the
    filters' own."""
    rng = random.Random(seed)
    bitmask = np.zeros((len(filters) + 3, bitmask_words(vocab_size)), dtype=np.int32)
    for step in range(steps):
        bitmask[:] = 0
        fill(filters, bitmask)
        for i, f in enumerate(filters):
            assert np.array_equal(bitmask[i], in_process(f, vocab_size)), (step, i)
            ids = allowed_ids(bitmask[i], vocab_size)
            if not f.is_finished() and ids.size:
                f.feed(int(ids[rng.randrange(ids.size)]))
        if step % 2 and len(filters) > 4 and filters[4]._fed:  # (rejected drafts: a token back, often)
            filters[4].rollback(1)
        if step == 5:
            filters[1].reset()
            filters[2].rollback(min(2, len(filters[2]._fed)))
        if step == 8:
            filters[3].rollback(len(filters[3]._fed))


def test_process_masks_equal_in_process_masks(tok: Tokenizer, pool: procs.MaskProcesses) -> None:
    vocab_size = tok.padded_vocab_size

    def fill(filters, bitmask):
        assert pool.fill([(f, i) for i, f in enumerate(filters)], bitmask) == []

    filters = make_filters(tok)
    walk(filters, fill, vocab_size, 14)
    shadow = filters[4]._shadow
    assert shadow[3] == filters[4]._epoch == 1  # rolled back by rollbacks, not built again
    assert sorted(pool._load) == [len(filters) // 2] * 2
    # filters that go are dropped from their workers; new ones take their places
    del filters[:4]
    gc.collect()
    assert sum(pool._load) == len(filters)
    walk(filters + make_filters(tok)[:4], fill, vocab_size, 6, seed=1)


def test_fill_bitmasks_uses_the_processes_once_ready(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "PROCESSES", 2)
    monkeypatch.setattr(procs, "MIN_ROWS", 4)
    vocab = grammar.vocabulary(tok, tok.padded_vocab_size)
    try:
        filters = make_filters(tok)
        walk(filters, fill_bitmasks, tok.padded_vocab_size, 2)  # the pool starts meanwhile
        assert vocab.pool is not None and vocab.pool.ready.wait(120), vocab.pool.error
        walk(filters, fill_bitmasks, tok.padded_vocab_size, 8, seed=2)
        assert all(f._shadow is not None for f in filters)
        # fewer rows than MIN_ROWS: in process
        few = make_filters(tok)[:3]
        walk(few, fill_bitmasks, tok.padded_vocab_size, 3)
        assert all(f._shadow is None for f in few)
    finally:
        if vocab.pool is not None:
            vocab.pool.close()
        vocab.pool = None


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_stuck_worker_is_a_clear_error_then_masks_go_in_process(
        how: str, tok: Tokenizer, pool: procs.MaskProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab_size = tok.padded_vocab_size
    monkeypatch.setattr(procs, "STEP_TIMEOUT_S", 2.0)
    filters = make_filters(tok)
    bitmask = np.zeros((len(filters), bitmask_words(vocab_size)), dtype=np.int32)
    items = [(f, i) for i, f in enumerate(filters)]
    assert pool.fill(items, bitmask) == []
    victim = pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(procs.MaskProcessError, match="exited with code|gave no answer") as error:
        pool.fill(items, bitmask)
    assert time.monotonic() - start < 30
    assert str(victim.pid) in str(error.value)
    assert not pool.procs and victim.poll() is not None  # every worker is stopped, the stuck one killed
    with pytest.raises(procs.MaskProcessError):  # the pool stays closed
        pool.fill(items, bitmask)


def test_fill_bitmasks_goes_in_process_when_a_worker_dies(tok: Tokenizer, pool: procs.MaskProcesses,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    vocab_size = tok.padded_vocab_size
    vocab = grammar.vocabulary(tok, vocab_size)
    monkeypatch.setattr(procs, "PROCESSES", 2)
    monkeypatch.setattr(procs, "MIN_ROWS", 4)
    monkeypatch.setattr(vocab, "pool", pool)
    filters = make_filters(tok)
    walk(filters, fill_bitmasks, vocab_size, 2)
    assert all(f._shadow is not None for f in filters)
    os.kill(pool.procs[0].pid, signal.SIGKILL)
    walk(filters, fill_bitmasks, vocab_size, 3, seed=3)  # the masks still right
    assert pool.error is not None and "exited" in pool.error
    assert "grammar masks go back in process" in caplog.text
