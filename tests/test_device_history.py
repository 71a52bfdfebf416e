"""DeviceHistories against the host-side windows of folio.sampling.penalties (the layout the penalties expect),
through growth of both its dimensions, slot reuse and rows without a history."""

from __future__ import annotations

import random

import pytest
import torch

from folio.sampling.device_history import DeviceHistories
from folio.sampling.penalties import history_windows

DUMP = 50  # ids >= DUMP (and negative ones) count as outside the vocabulary


def test_windows_equal_host_windows_through_growth_and_reuse():
    rng = random.Random(0)
    device_hist = DeviceHistories("cpu")
    host: dict[int, list[int]] = {}
    for key in range(20):  # more keys than the initial slots
        prompt = [rng.randrange(-2, DUMP + 5) for _ in range(rng.randrange(0, 40))]
        host[key] = prompt
        device_hist.add(key, prompt, max_len=len(prompt) + 2000)  # beyond the initial capacity
    for step in range(30):
        keys = rng.sample(sorted(host), 12)
        tokens = [rng.randrange(0, DUMP + 3) for _ in keys]
        device_hist.append(keys, [len(host[k]) for k in keys], torch.tensor(tokens))
        for k, t in zip(keys, tokens):
            host[k].append(t)
        if step % 7 == 3:  # a job leaves, another takes its slot
            gone = keys[0]
            device_hist.remove(gone)
            del host[gone]
            new_key = 100 + step
            host[new_key] = [rng.randrange(0, DUMP) for _ in range(5)]
            device_hist.add(new_key, host[new_key], max_len=100)
        rows = sorted(host)
        sizes = [min(len(host[k]), rng.choice([0, 3, 17, 10_000])) for k in rows]
        if not any(sizes):
            continue
        want = history_windows([host[k] for k in rows], sizes, max(sizes), DUMP, torch.device("cpu"))
        got = device_hist.windows(rows, [len(host[k]) for k in rows], sizes, DUMP)
        assert torch.equal(got, want)


def test_rows_without_history_and_errors():
    h = DeviceHistories("cpu")
    h.add("a", [1, 2, 3], max_len=8)
    got = h.windows([None, "a"], [0, 3], [0, 2], DUMP)
    assert got.tolist() == [[DUMP, DUMP], [2, 3]]
    with pytest.raises(KeyError):
        h.add("a", [1], max_len=4)
    with pytest.raises(ValueError):
        h.add("b", [1, 2, 3], max_len=2)
    assert "a" in h and "b" not in h
    h.remove("a")
    assert "a" not in h
