"""The generator deployment: one replica = one model + KV cache + DynamicGeneratorAsync (folio.serve.engine).

Methods (called through a DeploymentHandle; arguments and results are folio.serve.schema dataclasses):
    generate(EngineRequest)      async generator of Chunks (handle.options(stream=True)); closing the stream
                                 cancels the job and releases its pages
    tokenize(text, ...)          token ids
    model_info()                 ModelInfo
    load_lora(name, path)        LoadLora: load an adapter here, then record it in the application's registry
                                 (folio.serve.adapters), from which the other replicas load it
    record_routing_stats()       what routers learn about this replica (polled by the Serve controller; the
                                 prefix-aware router, folio.router.ray_router, reads it)
    check_health()               raises when the engine thread died or made no progress while it had work
Shutdown (async __del__) lets in-flight jobs finish, bounded by graceful_shutdown_timeout_s.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from folio.serve.adapters import AdapterInfo, ReplicaAdapters, registry_handle
from folio.serve.config import ServeConfig
from folio.serve.errors import ReplicaUnavailable
from folio.serve.schema import Chunk, EngineRequest, ModelInfo
from folio.serve.token_channel import ChannelSender

logger = logging.getLogger(__name__)


@serve.deployment(name="Generator")
class Generator:
    def __init__(self, config: ServeConfig):
        from folio.serve.engine import Engine  # torch and the model load in the replica only
        from folio.serve.metrics import GeneratorMetrics

        self.config = config
        self.instance_id = uuid.uuid4().hex  # changes when the replica restarts: routers drop what they knew
        self.epoch = 0  # counts routing-stats reports
        self.engine = Engine.build(config)
        self.replica_tag = _replica_tag()
        self.metrics = GeneratorMetrics(config.app_name, self.replica_tag)
        self.metrics.record_formats(self.engine.info)
        self._last_enqueue_s = time.monotonic()
        self.channel = ChannelSender()  # streamed chunks to ingresses that ask for them (config.token_channel)
        # the config's adapters were loaded by Engine.build (a bad one fails the replica's start); recorded here
        registry = registry_handle(config.app_name, config.max_loras)
        self.adapters = ReplicaAdapters(registry, self.engine.load_lora, self.engine.unload_lora,
                                        self.engine.static_adapters)
        ray.get([registry.add.remote(info) for info in self.engine.static_adapters])
        logger.info("generator replica ready: %s", self.engine.info)

    # --- requests ---

    async def generate(self, request: EngineRequest) -> AsyncIterator[Chunk]:
        arrival_s = time.monotonic()
        if request.lora is not None:
            await self.adapters.ensure(request.lora, request.lora_adapter_id)
        # the ingress's token channel, or (it cannot be reached from here) the call's own stream
        reply_to = request.reply_to if request.reply_to and await self.channel.reachable(request.reply_to) else ""
        job = self.engine.start_job(request)
        self._last_enqueue_s = time.monotonic()
        try:
            whole: Chunk | None = None
            async for chunk in self.engine.stream(job, arrival_s):
                if chunk.finish is not None:
                    chunk.finish.replica_id = self.replica_tag
                if reply_to:
                    self.channel.send(reply_to, request.request_id, chunk, since_s=arrival_s)
                elif request.stream:
                    yield chunk
                elif whole is None:
                    whole = chunk
                else:
                    whole.extend(chunk)
            if reply_to:  # (the call ends once its chunks are written)
                await self.channel.flush(reply_to, since_s=arrival_s)
            if whole is not None:
                yield whole
        except ConnectionError as error:  # the token channel lost chunks
            raise ReplicaUnavailable(f"{error}; retry") from None
        finally:
            if job.job.new_tokens:
                self.engine.totals.rates.observe_finished(job.job.new_tokens)
            self.metrics.record_job(prompt_tokens=len(request.input_ids) if job.job.new_tokens else 0,
                                    cached_tokens=job.job.cached_tokens if job.job.new_tokens else 0,
                                    generated_tokens=job.job.new_tokens)

    def tokenize(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = False) -> list[int]:
        tokenizer = self.engine.tokenizer
        add_bos = tokenizer.add_bos_token if add_bos is None else add_bos
        return tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=encode_special_tokens)

    def model_info(self) -> ModelInfo:
        return self.engine.info

    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        return await self.adapters.load_new(name, path)

    # --- Serve hooks ---

    async def record_routing_stats(self) -> dict[str, Any]:
        """What routers learn about this replica (folio.router.digest's format; sent to every router every
        request_routing_stats_period_s): job counts, page counts, measured speeds, an instance id and epoch, and the
        routing keys its cache stored and evicted since the last reports. Built on the engine thread."""
        self.epoch += 1
        await self.adapters.sync()  # adapters loaded or unloaded elsewhere, before the report that lists them
        digest = await self.engine.routing_digest(self.epoch, self.instance_id)
        num_pages, num_allocatable = digest["num_pages"], digest["num_allocatable_pages"]
        self.metrics.record_pages(num_in_use=num_pages - num_allocatable,
                                  num_cached=num_allocatable - digest["num_free_pages"], num_pages=num_pages)
        self.metrics.record_steps(self.engine.totals)
        if self.engine.cache_stats is not None:  # read by routing_digest on the engine thread
            self.metrics.record_prefix_cache(self.engine.cache_stats)
        self.metrics.refresh()  # every gauge, those set only when a request ends included: none goes stale
        return digest

    def check_health(self) -> None:
        """Raises when the engine thread died, or made no progress (no step, no command applied) for
        stall_timeout_s while it had jobs to run. Only jobs count: an idle engine with routing-stats calls waiting
        (they queue on the engine thread) is healthy however long ago its last step was."""
        engine = self.engine
        if not engine.is_alive:
            raise RuntimeError("the engine thread is dead")
        num_jobs = engine.num_remaining
        if num_jobs:
            last_progress_s = max(engine.last_progress_time, self._last_enqueue_s)
            stalled_s = time.monotonic() - last_progress_s
            if stalled_s > self.config.stall_timeout_s:
                raise RuntimeError(f"the engine made no progress for {stalled_s:.0f} s with {num_jobs} jobs to run")

    async def __del__(self) -> None:
        # Serve calls this after draining ongoing requests (up to graceful_shutdown_timeout_s); whatever the
        # engine still runs gets the rest of that budget.
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.close(drain_timeout_s=self.config.graceful_shutdown_timeout_s / 2)


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 — outside a replica (tests of the class itself)
        return "local"
