"""bench/tp_engine.py at the tiny shape on the CPU (gloo): the script runs end to end, two ranks give one process's
greedy tokens, and the numbers it reports are positive."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.mark.timeout(300)
def test_tp_engine_bench_tiny(tmp_path, monkeypatch):
    # imported by name (bench/ as a namespace package): the spawned ranks unpickle its functions
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.syspath_prepend(str(Path(ROOT) / "bench"))
    bench = importlib.import_module("bench.tp_engine")
    monkeypatch.setenv("OUT", str(tmp_path))
    result = bench.main(["--shape", "tiny", "--tp", "2", "--device", "cpu", "--kernel-report"])
    assert result["outputs_equal"]
    # every rank recorded its run: the all-reduces of each layer's two sums (gloo's on the CPU) among them
    report = result["kernel_report"]["ranks"]
    assert set(report) == {0, 1}
    assert all(r["all_reduce_us"]["calls"] > 0 and r["kernels"] for r in report.values())
    for run in (result["single_graphs_False"], result["tp_run"]):
        assert set(run) == {"W1", "B64"}
        assert all(r["tok_s"] > 0 and r["ms_per_token"] > 0 for r in run.values())
    assert (tmp_path / "tp_engine.json").exists()


def test_make_checkpoint_writes_a_servable_model(tmp_path, monkeypatch):
    """bench/make_checkpoint.py: a sharded random checkpoint of a bench shape with the demo tokenizer, which folio
    loads whole and a tensor-parallel rank loads a layer at a time."""
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.syspath_prepend(str(Path(ROOT) / "bench"))
    make = importlib.import_module("bench.make_checkpoint")
    import folio
    from folio.model.tensor_parallel import TensorParallel

    out = make.write_checkpoint("tiny", tmp_path / "ck", device="cpu")
    model = folio.Model.from_pretrained(out, progress=False, dtype=torch.float32)
    tokenizer = folio.Tokenizer.from_pretrained(out)
    assert model.config.num_layers == 2 and model.config.vocab_size == tokenizer.vocab_size
    cache = folio.Cache(model, num_tokens=64, page_size=16)
    gen = folio.DynamicGenerator(model, cache, tokenizer)
    text = gen.generate("Once upon a time", max_new_tokens=4, gen_settings=folio.SamplerSettings.greedy())
    assert isinstance(text, str) and len(text) > 0
    rank = folio.Model.from_pretrained(out, progress=False, dtype=torch.float32, tensor_parallel=TensorParallel(1, 2))
    assert rank.config.num_kv_heads == 1
