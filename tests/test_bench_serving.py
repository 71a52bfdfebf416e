"""bench/serving.py at a tiny size: one demo replica, a few requests in both arrival modes, and the engine alone;
the table's numbers must agree with what was asked (tokens = OK requests x new tokens, ordered percentiles)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

pytest.importorskip("grpc")
pytest.importorskip("ray.serve")

ROOT = str(Path(__file__).resolve().parent.parent)


def test_warmup_window_counts_steady_tokens_and_latencies(monkeypatch):
    """--warmup-s: tokens that arrived in [start + warmup, + duration) over the duration; TTFT from the requests
    sent after the warm-up only."""
    monkeypatch.syspath_prepend(ROOT)
    bench = importlib.import_module("bench.serving")
    from folio.serve.loadgen import CallRecord

    def call(start, first, times, tokens):
        return CallRecord(start, times[-1], "OK", completion_tokens=sum(tokens), message_s=[first, *times[1:]],
                          message_tokens=tokens)

    records = [call(100.0, 100.9, [100.9, 101.5, 103.0], [1, 4, 5]),  # the wave: slow first token
               call(101.5, 101.52, [101.52, 102.0, 104.5], [1, 3, 6])]  # sent after a 1 s warm-up
    row = bench.summarize("closed", records, 1e9, 1e9, steady_s=2.0, warmup_s=1.0)
    # in [101, 103): 4 (101.5) + 1 (101.52) + 3 (102.0); 103.0 is the window's end, excluded
    assert row["output_tok_s"] == pytest.approx(8 / 2.0)
    assert row["ttft_p50_ms"] == pytest.approx(20.0) and row["requests"] == 1 and row["warmup_s"] == 1.0
    whole = bench.summarize("closed", records, 1e9, 1e9, steady_s=2.0)
    assert whole["requests"] == 2 and whole["output_tok_s"] == pytest.approx((1 + 4 + 1) / 2.0)  # [100, 102)


@pytest.mark.ray
def test_serving_bench_tiny(tmp_path, monkeypatch, capsys):
    # imported by name (bench/ as a namespace package): the client processes (spawned) unpickle its functions
    monkeypatch.syspath_prepend(ROOT)
    bench = importlib.import_module("bench.serving")
    monkeypatch.setenv("OUT", str(tmp_path))
    result = bench.main(["--workload", "chat", "--scale", "32", "--turns", "2", "--concurrency", "1,2",
                         "--duration", "2", "--rate", "4", "--requests", "4", "--conversations", "2",
                         "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"])
    new_tokens = result["workload"]["new_tokens"]
    rows = {row["run"]: row for row in result["rows"]}
    assert set(rows) == {"server closed 1", "server closed 2", "server open", "engine closed 1", "engine closed 2",
                         "engine open"}
    for run, row in rows.items():
        assert row["ok"] == row["codes"].get("OK", 0) == row["requests"] > 0, (run, row["codes"])
        assert row["output_tokens"] == row["ok"] * new_tokens, run
        assert row["streamed_tokens"] == row["output_tokens"], run
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] <= row["itl_p99_ms"], run
        assert row["ttft_p50_ms"] > 0 and not math.isnan(row["itl_p50_ms"]), run
        assert 0.0 <= row["prefix_hit_rate"] <= 1.0, run
        # SLOs nobody misses: every OK request is good
        assert row["good_requests"] == row["ok"], run
        if run.endswith("open"):
            assert row["output_tok_s"] == pytest.approx(row["output_tokens"] / row["window_s"])
        else:  # tokens that arrived within the loop's 2 s: some, at most all of them
            assert 0 < row["output_tok_s"] * 2 <= row["output_tokens"], run
        if run.startswith("server"):  # every streamed call named its replica (trailing metadata): the only one
            assert row["replicas_seen"] == 1 and row["replica_share_max"] == pytest.approx(1.0), run
    assert rows["server open"]["requests"] == 4
    # chat turns repeat their system prompt and earlier turns: the open loop's second turns hit the cache
    assert rows["server open"]["prefix_hit_rate"] > 0 and rows["engine open"]["prefix_hit_rate"] > 0
    assert rows["server closed 2"]["client_cpu_ms_per_request"] > 0
    assert (tmp_path / "serving.json").exists()
    assert "| server closed 2 |" in capsys.readouterr().out


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_serving_bench_with_tensor_parallel_replicas(tmp_path, monkeypatch):
    """--tensor-parallel-size 2: each Serve replica (and the engine alone) is two processes (gloo on the CPU)."""
    monkeypatch.syspath_prepend(ROOT)
    bench = importlib.import_module("bench.serving")
    monkeypatch.setenv("OUT", str(tmp_path))
    result = bench.main(["--workload", "w2", "--scale", "32", "--tensor-parallel-size", "2", "--concurrency", "2",
                         "--duration", "2", "--rate", "0", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000"])
    rows = {row["run"]: row for row in result["rows"]}
    assert set(rows) == {"server closed 2", "engine closed 2"}
    for run, row in rows.items():
        assert row["ok"] == row["requests"] > 0, (run, row["codes"])
        assert row["output_tokens"] == row["ok"] * result["workload"]["new_tokens"], run
