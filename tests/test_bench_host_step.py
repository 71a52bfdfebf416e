"""bench/host_step.py --host-only on the CPU: the step's host code runs as on a GPU (the sampler's plain path, the
decode graphs' input staging) with the device's work stubbed, and every phase is timed."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import folio
from folio.model.decode_graphs import DecodeGraphs
from folio.sampling import plain

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.mark.timeout(300)
def test_host_only_steps_take_the_gpu_host_paths(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    bench = importlib.import_module("bench.host_step")
    path = bench.one_layer_demo(tmp_path)
    model = folio.Model.from_pretrained(path, progress=False)
    tokenizer = folio.Tokenizer.from_pretrained(path)
    calls = {"plain": 0, "staged": 0}
    plain_rows, run = plain.plain_rows, DecodeGraphs.run

    def counted_plain(*args):
        rows = plain_rows(*args)
        calls["plain"] += rows is not None
        return rows

    def counted_run(self, *args, **kwargs):
        calls["staged"] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(plain, "plain_rows", counted_plain)
    monkeypatch.setattr(DecodeGraphs, "run", counted_run)
    phases = bench.run(model, tokenizer, batch=8, steps=6, host_only=True)
    assert {"plan", "forward", "sample", "launch_ahead", "emit", "wait_tokens", "step"} <= set(phases)
    assert all(value >= 0 for value in phases.values()) and phases["step"] > 0
    assert calls["plain"] >= 6 and calls["staged"] >= 6  # every timed decode step (and the ones before)
