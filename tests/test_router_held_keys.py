"""folio.router.held_keys: the native key index (folio._native_cpu.KeyIndex) and its Python twin against a plain
model (a set of keys per slot), under random batches, snapshots and clears."""

from __future__ import annotations

import random
import struct
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
    and keeps keys held by five slots or more apart; every query must still answer as PyHeldKeys does."""
    native, python = build("native"), PyHeldKeys()
    rng = random.Random(seed)
    # Uniform keys, plus structured ones (equal low bits, equal high bits) that would collide under raw bits.
    universe = [rng.getrandbits(64) for _ in range(3000)] + [i << 44 for i in range(400)] + list(range(400))
    universe += [2**64 - 1]
    slots = [0, 1, 2, 3, 4, 6, 7, 70]
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


def test_the_native_index_lists_a_keys_holders_in_the_order_they_came_inline_or_not():
    """Four holders fit in a key's entry, more go to a side list and back when they drop to four: through both,
    match lists a key's holders in the order they came to hold it, and keys_of never takes a side list's index for
    a holder."""
    held = build("native")
    order: list[int] = []

    def store(slot: int, *keys: int) -> None:
        held.apply(slot, array("Q", keys), array("Q"))
        order.append(slot)

    def evict(slot: int, *keys: int) -> None:
        held.apply(slot, array("Q"), array("Q", keys))
        order.remove(slot)

    for slot in (5, 3, 65533, 1, 7, 0):
        store(slot, 42)
        assert held.match([42]) == [(s, 1) for s in order]
    for slot in range(8):  # side lists 0 .. 7 (their index in the entry): never read as slots 0 .. 7
        for other in (11, 12, 13, 14, 15):
            held.apply(other, array("Q", [1000 + slot]), array("Q"))
    for slot, back in ((65533, 9), (7, None), (5, 2), (0, None), (3, None)):
        evict(slot, 42)
        assert held.match([42]) == [(s, 1) for s in order]
        if back is not None:
            store(back, 42)
            assert held.match([42]) == [(s, 1) for s in order]
    for slot in range(16):
        assert sorted(held.keys_of(slot)) == ([42] if slot in order else []) + (
            list(range(1000, 1008)) if slot >= 11 else []), slot
    for wrong in (-1, 65534, 2**31 - 1):
        with pytest.raises(ValueError, match="slot"):
            held.apply(wrong, array("Q", [1]), array("Q"))
        assert not held.holds(wrong, 42) and held.keys_of(wrong) == [] and held.num_keys(wrong) == 0


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


def report_with(batches: list, seq: int, changes: dict | None = None) -> dict:
    """A report as build_digest writes it (folio.router.digest's COMMON_REPORT_FIELDS, of their kinds)."""
    from folio.router.digest import COMMON_REPORT_FIELDS

    report = dict.fromkeys(COMMON_REPORT_FIELDS, 1)
    report.update(v=2, instance_id="a", epoch=seq, prefill_tokens_per_s=1000.0, decode_step_s=0.02,
                  mean_new_tokens=0.0, seq=seq, snapshot=None, batches=batches)
    return report | (changes or {})


def fields_of(report: dict) -> tuple:
    """What apply_report returns of a report's fields: ReplicaDigest's, in its order."""
    from folio.router.digest import COMMON_REPORT_FIELDS

    return tuple(report[name] for name in COMMON_REPORT_FIELDS[:-2])


def test_apply_report_decodes_reports_batches_as_the_python_decoder_does():
    """KeyIndex.apply_report against folio.router.events.pack/unpack: every new batch applied in order, the ones
    at or before after_seq skipped; anything malformed (or seqs not increasing up to the report's seq), a field
    missing or mistyped: nothing applied (None)."""
    from folio.router.digest import COMMON_REPORT_FIELDS, COMMON_REPORT_KINDS
    from folio.router.events import pack

    index = build("native")

    def apply(report, after_seq: int, want_stored: bool, kinds: str = COMMON_REPORT_KINDS):
        return index.apply_report(3, report, COMMON_REPORT_FIELDS, kinds, after_seq, want_stored)

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
        want_stored = rng.random() < 0.5
        report = report_with(old + batches, seq)
        applied = apply(report, seq - len(batches), want_stored)
        assert applied is not None
        fields, first, last, num_batches, _, stored_keys = applied
        assert fields[:-1] == fields_of(report)
        assert fields[-1] == struct.pack(f"={len(fields) - 2}d", *fields[1:-1])  # the numbers, packed
        assert num_batches == len(batches) and (first, last) == ((batches[0][0], seq) if batches else (0, 0))
        assert sorted(index.keys_of(3)) == sorted(model)
        assert stored_keys == (all_stored if want_stored else None)
    good = pack([7, 8])
    for bad in (["!" + good[1:]], [good[:-1]], [good[:4] + "=" + good[5:]], ["AAAAAA=="], [5],
                [b"AAAAAAAAAAA="]):
        before = sorted(index.keys_of(3))
        assert apply(report_with([[seq + 1, good, pack([])], [seq + 2, *bad, pack([])]], seq + 2), seq, False) is None
        assert sorted(index.keys_of(3)) == before, bad
    assert apply(report_with([[seq + 2, good, good], [seq + 1, good, good]], seq + 2), seq, False) is None
    assert apply(report_with([[seq + 1, good, pack([])]], seq), seq, False) is None  # newer than the report
    # fields missing or not of their kind: nothing applied either
    new = [[seq + 1, good, pack([])]]
    for changes in ({"seq": True}, {"seq": -1}, {"page_size": 0}, {"epoch": -3}, {"epoch": -(2**70)},
                    {"epoch": 4.0}, {"num_running": 1.0}, {"decode_step_s": float("nan")},
                    {"mean_new_tokens": float("inf")}, {"prefill_tokens_per_s": -1.0}, {"prefill_tokens_per_s": 5},
                    {"instance_id": b"a"}, {"num_pages": 10**400}, {"snapshot": {}}, {"batches": tuple(new)}):
        assert apply(report_with(new, seq + 1, changes), seq, False) is None, changes
        assert apply({k: v for k, v in report_with(new, seq + 1).items() if k != next(iter(changes))}, seq,
                     False) is None
    assert apply(list(report_with(new, seq + 1).items()), seq, False) is None  # not a dict
    assert sorted(index.keys_of(3)) == before
    big = report_with(new, seq + 1, {"num_received": 2**70})  # past int64: still a count
    fields, first, last = apply(big, seq, False)[:3]
    assert (fields[:-1], first, last) == (fields_of(big), seq + 1, seq + 1)
    assert struct.unpack(f"={len(fields) - 2}d", fields[-1])[COMMON_REPORT_FIELDS.index("num_received") - 1] == 2**70
    assert {7, 8} <= set(index.keys_of(3))
    for wrong in (COMMON_REPORT_KINDS[:-1] + "x", COMMON_REPORT_KINDS[:-1]):
        with pytest.raises(ValueError, match="kind"):
            apply(big, seq + 1, False, wrong)
