"""A served replica split over tensor-parallel processes (ServeConfig.tensor_parallel_size, folio.serve.build): the
config's checks, and a replica of the demo model at 2 ranks (gloo on the CPU) generating what one process does, its
other rank's process gone once the replica closes."""

from __future__ import annotations

import time

import pytest
from test_generator import make_jobs, run_to_end

from folio.serve.build import build_generator, close_tensor_parallel
from folio.serve.config import ServeConfig
from folio.serve.config_values import ConfigError


def test_tensor_parallel_config_checks(demo_dir):
    base = dict(model_path=str(demo_dir), num_gpus=0, page_size=16, cache_tokens=1024)
    assert ServeConfig(**base).tensor_parallel_size == 1
    assert ServeConfig(**base, tensor_parallel_size=2).tensor_parallel_size == 2  # CPU ranks: gloo, no GPUs
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ServeConfig(**base, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="num_gpus 2"):  # one GPU a rank
        ServeConfig(**{**base, "num_gpus": 1}, tensor_parallel_size=2)
    assert ServeConfig(**{**base, "num_gpus": 2}, tensor_parallel_size=2).num_gpus == 2
    with pytest.raises(ConfigError, match="draft model"):
        ServeConfig(**base, tensor_parallel_size=2, draft_model_path=str(demo_dir))


@pytest.mark.timeout(300)
def test_a_replica_at_two_ranks_generates_what_one_process_does(demo_dir):
    config = dict(model_path=str(demo_dir), device="cpu", num_gpus=0, page_size=16, cache_tokens=2048,
                  max_batch_size=4, max_queue_size=8)
    _, _, tokenizer, _, one = build_generator(ServeConfig(**config))
    prompts = [tokenizer.encode(text) for text in ("Once upon a time", "The keeper of the lighthouse",
                                                   "Once upon a time there was")]  # (a shared prefix)
    want = _generate(one, prompts)
    model, _, _, cache, split = build_generator(ServeConfig(**config, tensor_parallel_size=2))
    try:
        assert model.tensor_parallel is not None and model.config.num_kv_heads == 1  # the demo's 2 kv heads, halved
        ranks = cache.mirror.local_ranks
        assert len(ranks.processes) == 1 and ranks.processes[0].is_alive()
        got = _generate(split, prompts)
        assert got == want and all(len(ids) == 12 for ids in got)
    finally:
        close_tensor_parallel(cache)
    deadline = time.monotonic() + 30
    while ranks.processes[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ranks.processes[0].is_alive()


def _generate(generator, prompts):
    jobs = make_jobs(prompts, max_new_tokens=12)
    run_to_end(generator, jobs)
    return [list(job.generated_ids) for job in jobs]


def test_tensor_parallel_layouts_that_cannot_work_are_refused(demo_dir):
    base = dict(model_path=str(demo_dir), num_gpus=2, page_size=16, cache_tokens=1024, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="names one GPU"):  # rank r runs on the replica's GPU r
        ServeConfig(**base, device="cuda:1")
    with pytest.raises(ConfigError, match="LoRA"):
        ServeConfig(**base, lora_admin=True)


@pytest.mark.timeout(120)
def test_a_worker_rank_that_cannot_load_is_reported_and_everything_is_released(tmp_path):
    """A rank that fails to load its shard reports its traceback to rank 0 (LocalRanks.wait_ready) instead of leaving
    rank 0 in a collective; close() then ends the processes and the process group."""
    import torch.distributed as dist

    from folio.tp_launch import start_local_ranks

    ranks = start_local_ranks(tmp_path / "no-such-model", 2, {"device": "cpu"}, num_threads=1)
    try:
        with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*no-such-model"):
            ranks.wait_ready(timeout_s=60)
    finally:
        ranks.close(grace_s=5.0)
    assert not ranks.processes[0].is_alive() and not dist.is_initialized()


@pytest.mark.timeout(120)
def test_a_replica_that_fails_to_build_releases_its_ranks(demo_dir, tmp_path, monkeypatch):
    """build_generator fails after the other ranks started (here: a model whose 3 kv heads do not split in 2): their
    processes and the process group go too."""
    import json
    import shutil

    import torch.distributed as dist

    from folio import tp_launch

    bad = tmp_path / "three-kv-heads"
    shutil.copytree(demo_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw.update(num_key_value_heads=3, num_attention_heads=9)
    (bad / "config.json").write_text(json.dumps(raw))
    started = []
    original = tp_launch.start_local_ranks
    monkeypatch.setattr(tp_launch, "start_local_ranks", lambda *a, **k: started.append(original(*a, **k))
                        or started[-1])
    config = ServeConfig(model_path=str(bad), device="cpu", num_gpus=0, page_size=16, cache_tokens=1024,
                         tensor_parallel_size=2)
    with pytest.raises(Exception, match="kv"):
        build_generator(config)
    assert started and not started[0].processes[0].is_alive() and not dist.is_initialized()


def test_model_info_tells_the_tensor_parallel_size(demo_dir):
    """ModelInfo (and gRPC's ModelInfoResponse, both ways) carries how many GPUs a replica spans."""
    pytest.importorskip("grpc")
    from folio.serve.engine import describe
    from folio.serve.grpc_convert import model_info_from_proto, model_info_to_proto

    config = ServeConfig(model_path=str(demo_dir), device="cpu", num_gpus=0, page_size=16, cache_tokens=1024,
                         tensor_parallel_size=2)
    model, _, tokenizer, cache, generator = build_generator(config)
    try:
        info = describe(config, model, tokenizer, generator, num_replicas=1)
    finally:
        close_tensor_parallel(cache)
    assert info.tensor_parallel_size == 2
    assert model_info_from_proto(model_info_to_proto(info)).tensor_parallel_size == 2
    one = ServeConfig(model_path=str(demo_dir), device="cpu", num_gpus=0, page_size=16, cache_tokens=1024)
    model, _, tokenizer, _, generator = build_generator(one)
    assert describe(one, model, tokenizer, generator, num_replicas=1).tensor_parallel_size == 1
