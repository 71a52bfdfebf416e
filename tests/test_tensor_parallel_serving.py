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
