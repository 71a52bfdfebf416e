"""bench/tp_engine.py at the tiny shape on the CPU (gloo): the script runs end to end, two ranks give one process's
greedy tokens, and the numbers it reports are positive."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.mark.timeout(300)
def test_tp_engine_bench_tiny(tmp_path, monkeypatch):
    # imported by name (bench/ as a namespace package): the spawned ranks unpickle its functions
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.syspath_prepend(str(Path(ROOT) / "bench"))
    bench = importlib.import_module("bench.tp_engine")
    monkeypatch.setenv("OUT", str(tmp_path))
    result = bench.main(["--shape", "tiny", "--tp", "2", "--device", "cpu"])
    assert result["outputs_equal"]
    for run in (result["single_graphs_False"], result["tp_run"]):
        assert set(run) == {"W1", "B64"}
        assert all(r["tok_s"] > 0 and r["ms_per_token"] > 0 for r in run.values())
    assert (tmp_path / "tp_engine.json").exists()
