"""The generator deployment: one replica = one model + KV cache + DynamicGeneratorAsync (replicas.engine).

Methods (called through a DeploymentHandle; arguments and results are replicas.schema dataclasses):
    generate(EngineRequest)      async generator of Chunks (handle.options(stream=True)); closing the stream
                                 cancels the job and releases its pages
    tokenize(text, ...)          token ids
    model_info()                 ModelInfo
    record_routing_stats()       what routers learn about this replica (polled by the Serve controller)
    check_health()               raises when the engine thread died or made no progress while it had work
Shutdown (async __del__) lets in-flight jobs finish, bounded by graceful_shutdown_timeout_s.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from replicas.config import ServeConfig
from replicas.schema import Chunk, EngineRequest, ModelInfo

logger = logging.getLogger(__name__)


@serve.deployment(name="Generator")
class Generator:
    def __init__(self, config: ServeConfig):
        from replicas.engine import Engine  # torch and the model load in the replica only
        from replicas.metrics import GeneratorMetrics

        self.config = config
        self.instance_id = uuid.uuid4().hex  # changes when the replica restarts: routers drop what they knew
        self.epoch = 0  # counts routing-stats reports
        self.engine = Engine.build(config)
        self.metrics = GeneratorMetrics(config.app_name, _replica_tag())
        self._last_enqueue_s = time.monotonic()
        self._record_pages()
        logger.info("generator replica ready: %s", self.engine.info)

    # --- requests ---

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        arrival_s = time.monotonic()
        job = self.engine.start_job(request)
        self._last_enqueue_s = time.monotonic()
        try:
            async for chunk in self.engine.stream(job, arrival_s):
                yield chunk
        finally:
            self.metrics.record_job(prompt_tokens=len(request.input_ids) if job.job.new_tokens else 0,
                                    cached_tokens=job.job.cached_tokens if job.job.new_tokens else 0,
                                    generated_tokens=job.job.new_tokens)
            self._record_pages()

    def tokenize(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = False) -> list[int]:
        tokenizer = self.engine.tokenizer
        add_bos = tokenizer.add_bos_token if add_bos is None else add_bos
        return tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=encode_special_tokens)

    def model_info(self) -> ModelInfo:
        return self.engine.info

    # --- Serve hooks ---

    def record_routing_stats(self) -> dict[str, Any]:
        """Compact state for the routers (sent to every router every period, so bounded in size):
        load, page counts, an epoch, and a digest of the cached page hashes.

        cached_page_hashes: the most recent `routing_digest_max_hashes` ready page hashes (cached or in use;
            folio.hashing, HASH_SIZE bytes each) concatenated, the newest last. num_ready_pages: how many there are
            in all (more than the digest holds when it was capped).
        instance_id / epoch: a replica restart changes instance_id; epoch counts reports of this instance.
        num_pages_stored / num_pages_evicted: page events since the previous report.
        """
        engine = self.engine
        pool = engine.generator.pool
        self.epoch += 1
        # Drained here so the pool's event log stays bounded; the counts tell routers how fast the cache churns.
        events = pool.drain_events()
        num_stored = sum(1 for e in events if e.kind.value == "stored")
        hashes = engine.recent_page_hashes(self.config.routing_digest_max_hashes)
        self._record_pages()
        return {
            "instance_id": self.instance_id,
            "epoch": self.epoch,
            "num_running": engine.num_running,
            "num_queued": engine.num_queued,
            "max_batch_size": engine.generator.max_batch_size,
            "page_size": pool.page_size,
            "num_pages": pool.num_pages,
            "num_free_pages": pool.num_free,
            "num_cached_pages": pool.num_cached,
            "num_in_use_pages": pool.num_in_use,
            "num_ready_pages": pool.num_cached + pool.num_in_use,
            "cached_page_hashes": b"".join(hashes),
            "num_pages_stored": num_stored,
            "num_pages_evicted": len(events) - num_stored,
        }

    def check_health(self) -> None:
        engine = self.engine
        if not engine.engine_thread_alive():
            raise RuntimeError("the engine thread is dead")
        if engine.num_remaining:
            last_progress_s = max(engine.generator.last_step_end_s, self._last_enqueue_s)
            stalled_s = time.monotonic() - last_progress_s
            if stalled_s > self.config.stall_timeout_s:
                raise RuntimeError(f"the engine made no progress for {stalled_s:.0f} s with "
                                   f"{engine.num_remaining} jobs to run")

    async def __del__(self) -> None:
        # Serve calls this after draining ongoing requests (up to graceful_shutdown_timeout_s); whatever the
        # engine still runs gets the rest of that budget.
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.close(drain_timeout_s=self.config.graceful_shutdown_timeout_s / 2)

    # --- helpers ---

    def _record_pages(self) -> None:
        pool = self.engine.generator.pool
        self.metrics.record_pages(pool.num_in_use, pool.num_cached, pool.num_pages)


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 — outside a replica (tests of the class itself)
        return "local"
