"""A replica's engine on a CUDA device (no cluster): its cache, sized from free memory, leaves room for the steps
it runs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from folio.serve.config import ServeConfig
from folio.serve.schema import Completion, EngineRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model"])
def test_a_cache_of_all_free_memory_still_runs_full_chunks(demo_dir, drafter):
    """Run in a process of its own: what earlier tests of this session left allocated (module-scoped models, the
    allocator's cached blocks, CUDA library workspaces) counts as taken from the device's free memory, which this
    test measures. With a drafter the verify rows' larger steps, and with a draft model its weights, activations
    and cache, must fit beside the target's cache too (the demo model drafts for itself)."""
    import subprocess
    import sys

    code = ("import sys, pathlib; sys.path.insert(0, sys.argv[1]); import test_replica_engine_gpu as t; "
            "t.check_a_cache_of_all_free_memory_still_runs_full_chunks(pathlib.Path(sys.argv[2]), sys.argv[3])")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(demo_dir), drafter],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def check_a_cache_of_all_free_memory_still_runs_full_chunks(demo_dir: Path, drafter: str = "none") -> None:
    """cache_memory_fraction=1.0: the cache takes everything free but the activation reserve. The warm-up
    (which prefills a full chunk) and prompts as long as the chunk then run. With the reserve forced to 0
    (bench/check_reserve_off.py) this fails already in allocating the cache's V tensor (the allocator rounds the
    K tensor up), so it shows that a reserve is needed, not that its activation term is right: that is
    test_step_activation_bytes_bounds_the_allocator_peak's job."""
    from folio import activation_reserve_bytes
    from folio.serve.engine import Engine

    chunk = 2048
    spec = {"none": {}, "ngram": {"ngram": True}, "draft_model": {"draft_model_path": str(demo_dir)}}[drafter]
    config = ServeConfig(model_path=str(demo_dir), device="cuda", num_gpus=1, cache_memory_fraction=1.0,
                         page_size=256, max_batch_size=8, max_chunk_size=chunk, max_seq_len=4096, warmup=True,
                         **spec)
    engine = Engine.build(config)
    try:
        if drafter == "none":
            # the cache took all but the reserve (what the warm-up left in torch's allocator counts as taken)
            free_bytes, _ = torch.cuda.mem_get_info()
            assert free_bytes < activation_reserve_bytes(engine.model, 8, chunk, 256) + engine.cache.bytes_per_page
        else:
            assert engine.generator.speculator is not None

        async def run():
            requests = [EngineRequest(input_ids=tuple((i * 7 + j) % 900 + 3 for j in range(chunk - 8)),
                                      max_new_tokens=8, stop_conditions=(), sampler={"temperature": 0.0, "top_k": 1})
                        for i in range(3)]
            jobs = [engine.start_job(r) for r in requests]
            return [[c async for c in engine.stream(job, time.monotonic())] for job in jobs]

        for chunks in asyncio.run(run()):
            assert Completion.from_chunks(chunks).finish.usage.completion_tokens == 8
    finally:
        asyncio.run(engine.close(drain_timeout_s=5))
        del engine
        torch.cuda.empty_cache()


@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_memory_formats_on_a_gpu_replica(demo_dir, drafter):
    """weight_format fp8, kv_format q8 and a pinned host tier on CUDA (with a draft model: beside its unquantized
    cache): ModelInfo says so, the host tier stays within its bytes, and a prompt evicted to the host comes back
    generating what it generated first."""
    from folio.serve.engine import Engine

    spec = {"none": {}, "draft_model": {"draft_model_path": str(demo_dir)}}[drafter]
    config = ServeConfig(model_path=str(demo_dir), device="cuda", num_gpus=1, dtype="bfloat16",
                         cache_tokens=2048, page_size=16, max_batch_size=4, warmup=True,
                         weight_format="fp8", kv_format="q8", host_cache_bytes=64 << 20, **spec)
    engine = Engine.build(config)
    try:
        info, cfg = engine.info, engine.model.config
        page_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.head_dim + 2 * (cfg.head_dim // 32))
        assert (info.weight_format, info.kv_format, info.bytes_per_page) == ("fp8", "q8", page_bytes)
        assert engine.cache.k.dtype == torch.uint8 and info.num_pages == engine.cache.num_pages
        assert 0 < info.num_host_pages and info.host_cache_bytes <= 64 << 20
        if drafter == "draft_model":
            assert engine.generator.speculator is not None

        async def run(prompt):
            job = engine.start_job(EngineRequest(input_ids=prompt, max_new_tokens=8, stop_conditions=(),
                                                 sampler={"temperature": 0.0, "top_k": 1}))
            return Completion.from_chunks([c async for c in engine.stream(job, time.monotonic())])

        prompt = tuple(range(3, 103))  # 6 full pages and a partial one
        first = asyncio.run(run(prompt))
        # fill the GPU cache (128 pages) with other prompts until the first one's pages have left it for the host
        filler_len = 16 * 32
        for i in range(info.num_pages * 16 // filler_len + 2):
            asyncio.run(run(tuple((i * 131 + j) % 900 + 3 for j in range(filler_len))))
        again = asyncio.run(run(prompt))
        assert again.token_ids == first.token_ids and again.finish.usage.cached_tokens == 96
        assert engine.generator.prefix_cache_stats().num_host_hit_pages > 0
    finally:
        asyncio.run(engine.close(drain_timeout_s=5))
        del engine
        torch.cuda.empty_cache()
