"""folio.router.held_keys: the native key index (folio._native_cpu.KeyIndex) and its Python twin against a plain
model (a set of keys per slot), under random batches, snapshots and clears."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest

from folio.ops import native_key_index
from folio.router.held_keys import PyHeldKeys, make_held_keys

IMPLEMENTATIONS = ["python", "native"]


def build(kind: str):
    if kind == "python":
        return PyHeldKeys()
    native = native_key_index()
    if native is None:
        pytest.skip("folio._native_cpu is not built")
    return native()


def model_match(model: dict[int, set[int]], keys: list[int]) -> set[tuple[int, int]]:
    """Per slot holding any of keys: the 1-based position of the deepest one it holds."""
    found = set()
    for slot, held in model.items():
        depths = [d for d in range(1, len(keys) + 1) if keys[d - 1] in held]
        if depths:
            found.add((slot, max(depths)))
    return found


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(4))
def test_against_a_set_per_slot(kind, seed):
    rng = random.Random(seed)
    universe = [rng.getrandbits(64) for _ in range(300)] + [0, 2**64 - 1]  # the extremes of uint64 too
    held = build(kind)
    model: dict[int, set[int]] = {}
    for _ in range(400):
        slot = rng.randrange(40)  # slots beyond 31 and 63: wider than a machine word of bits
        keys = model.setdefault(slot, set())
        action = rng.random()
        if action < 0.7:
            stored = rng.sample(universe, rng.randrange(0, 12))
            evicted = rng.sample(universe, rng.randrange(0, 12))  # some held, some not
            held.apply(slot, array("Q", stored), np.array(evicted, dtype=np.uint64))
            keys -= set(evicted)
            keys |= set(stored)
        elif action < 0.9:
            snapshot = rng.sample(universe, rng.randrange(0, 30))
            held.replace(slot, array("Q", snapshot))
            model[slot] = set(snapshot)
        else:
            held.clear(slot)
            model[slot] = set()
        probe = rng.sample(universe, 10)
        assert set(held.match(probe)) == model_match(model, probe)
        assert sorted(held.keys_of(slot)) == sorted(model[slot]) and held.num_keys(slot) == len(model[slot])
        key = rng.choice(universe)
        assert held.holds(slot, key) == (key in model[slot])
        assert len(held) == len(set().union(*model.values()))


@pytest.mark.parametrize("seed", range(3))
def test_the_native_index_answers_as_the_python_one_through_growth_and_shrinking(seed):
    """Thousands of keys over a few slots: the native table grows, shrinks after clears, moves entries on deletion
    and keeps keys held by three slots or more apart; every query must still answer as PyHeldKeys does."""
    native, python = build("native"), PyHeldKeys()
    rng = random.Random(seed)
    # Uniform keys, plus structured ones (equal low bits, equal high bits) that would collide under raw bits.
    universe = [rng.getrandbits(64) for _ in range(3000)] + [i << 44 for i in range(400)] + list(range(400))
    universe += [2**64 - 1]
    slots = [0, 1, 2, 3, 4, 70]
    for step in range(240):
        slot = rng.choice(slots)
        action = rng.random()
        if step % 80 == 79:  # everything goes: the table shrinks back
            for each in slots:
                native.clear(each)
                python.clear(each)
            assert len(native) == len(python) == 0
        elif action < 0.75:
            held = python.keys_of(slot)
            evicted = rng.choices(universe, k=rng.randrange(20)) + rng.sample(held, min(len(held), rng.randrange(80)))
            stored = rng.choices(universe, k=rng.randrange(150))  # duplicates within a batch too
            native.apply(slot, array("Q", stored), array("Q", evicted))
            python.apply(slot, array("Q", stored), array("Q", evicted))
        elif action < 0.93:
            snapshot = array("Q", rng.choices(universe, k=rng.randrange(1200)))
            native.replace(slot, snapshot)
            python.replace(slot, snapshot)
        else:
            native.clear(slot)
            python.clear(slot)
        assert len(native) == len(python)
        for each in slots + [5, 1000]:  # 5 and 1000: never used
            assert native.num_keys(each) == python.num_keys(each)
            assert sorted(native.keys_of(each)) == sorted(python.keys_of(each))
        probe = rng.sample(universe, 30) + rng.sample(python.keys_of(slot), min(10, python.num_keys(slot)))
        rng.shuffle(probe)
        found = native.match(probe)
        assert sorted(found) == sorted(python.match(probe))
        assert [depth for _, depth in found] == sorted((depth for _, depth in found), reverse=True)  # deepest first
        for key in probe[:10]:
            assert [native.holds(each, key) for each in slots] == [python.holds(each, key) for each in slots]


@pytest.mark.parametrize("kind", IMPLEMENTATIONS)
def test_a_batch_that_stores_and_evicts_one_key_holds_it(kind):
    """Evictions apply before stores: a batch is net changes, and a key in both lists is held after it."""
    held = build(kind)
    held.apply(0, array("Q", [7]), array("Q", [7]))
    assert held.holds(0, 7)


def test_the_native_index_refuses_buffers_that_are_not_uint64():
    held = build("native")
    for wrong in (array("d", [1.0]), array("i", [1]), np.zeros((2, 2), dtype=np.uint64), np.zeros(4, np.uint64)[::2]):
        with pytest.raises(ValueError, match="uint64"):
            held.apply(0, wrong, array("Q"))


def test_make_held_keys_prefers_the_native_index_and_honours_a_request():
    assert isinstance(make_held_keys(native=False), PyHeldKeys)
    if native_key_index() is None:
        assert isinstance(make_held_keys(), PyHeldKeys)
        with pytest.raises(RuntimeError, match="not built"):
            make_held_keys(native=True)
    else:
        assert isinstance(make_held_keys(), native_key_index())


def test_apply_encoded_decodes_reports_batches_as_the_python_decoder_does():
    """KeyIndex.apply_encoded against folio.router.events.pack/unpack: every new batch applied in order, the ones
    at or before after_seq skipped; anything malformed (or seqs not increasing up to max_seq) applies nothing."""
    from folio.router.events import pack

    index = build("native")
    rng = random.Random(5)
    model: set[int] = set()
    seq = 0
    for _ in range(200):
        batches, all_stored = [], []
        for _ in range(rng.randrange(0, 4)):
            seq += 1
            stored = [rng.getrandbits(64) for _ in range(rng.randrange(0, 40))] + [0, 2**64 - 1][:rng.randrange(3)]
            evicted = rng.sample(sorted(model), min(len(model), rng.randrange(0, 20)))
            moved = [rng.getrandbits(64)]  # a fourth field: still held, changes nothing here
            batches.append([seq, pack(stored), pack(evicted)] + ([pack(moved)] if rng.random() < 0.3 else []))
            model = (model - set(evicted)) | set(stored)
            all_stored += stored
        old = [[s, pack([rng.getrandbits(64)]), pack([])] for s in range(max(1, seq - 8), seq - len(batches) + 1)]
        applied = index.apply_encoded(3, old + batches, seq - len(batches), seq, True)
        assert applied is not None
        first, last, num_batches, _, stored_keys = applied
        assert num_batches == len(batches) and (first, last) == ((batches[0][0], seq) if batches else (0, 0))
        assert sorted(index.keys_of(3)) == sorted(model)
        assert stored_keys == all_stored
    good = pack([7, 8])
    for bad in (["!" + good[1:]], [good[:-1]], [good[:4] + "=" + good[5:]], ["AAAAAA=="], [5],
                [b"AAAAAAAAAAA="]):
        before = sorted(index.keys_of(3))
        assert index.apply_encoded(3, [[seq + 1, good, pack([])], [seq + 2, *bad, pack([])]], seq, seq + 2,
                                   False) is None
        assert sorted(index.keys_of(3)) == before, bad
    assert index.apply_encoded(3, [[seq + 2, good, good], [seq + 1, good, good]], seq, seq + 2, False) is None
    assert index.apply_encoded(3, [[seq + 1, good, pack([])]], seq, seq, False) is None  # newer than the report
    assert index.apply_encoded(3, [[seq + 1, good, pack([])]], seq, seq + 1, False)[:2] == (seq + 1, seq + 1)
    assert {7, 8} <= set(index.keys_of(3))
