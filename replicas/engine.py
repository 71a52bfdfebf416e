"""The engine side of a generator replica: building it from a ServeConfig, running one request as a stream of
Chunks, and reading its state. No Ray here, so it can be tested without a cluster.

Imports torch (through folio's engine): import it only where a model runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from folio import (
    Cache,
    DynamicGenerator,
    DynamicGeneratorAsync,
    DynamicJobAsync,
    GeneratorClosed,
    JobState,
    Model,
    QueueFull,
    Stage,
    StepStats,
    StreamingResult,
    Tokenizer,
)
from folio.cache.manager import PrefixCacheStats
from folio.constrain.base import FilterError
from folio.lora import LoraInfo, load_peft_adapter
from folio.model.architectures import SUPPORTED_ARCHITECTURES
from folio.model.fp8 import Fp8Weight
from folio.router.digest import build_digest
from folio.router.events import CacheEvents
from folio.router.rates import ReplicaRates
from folio.serve.adapters import AdapterInfo
from folio.serve.build import build_generator, close_tensor_parallel, load_model  # noqa: F401 (load_model re-exported)
from folio.serve.config import KV_FORMAT_OF_DTYPE, ServeConfig
from folio.serve.errors import (
    InvalidRequest,
    Overloaded,
    ReplicaUnavailable,
)
from folio.serve.job_request import constraint_field, job_kwargs_of, refused_job, request_error
from folio.serve.pacing import StreamPacer
from folio.serve.schema import (
    Chunk,
    EngineRequest,
    Finish,
    ModelInfo,
    Timings,
    TopTokens,
    Usage,
)

logger = logging.getLogger(__name__)


@dataclass
class StepTotals:
    """Running sums of the engine's StepStats: added on the engine thread (DynamicGeneratorAsync's on_step),
    published as Ray metrics by the replica (GeneratorMetrics.record_steps). Reads from the event loop may see a
    step half added; metrics tolerate that."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (not those reused from the cache)
    num_decode_rows: int = 0
    num_sampled: int = 0
    num_preemptions: int = 0
    num_failed: int = 0
    num_drafted: int = 0  # tokens drafted into verify rows (speculative decoding)
    num_accepted_drafts: int = 0  # drafted tokens the target accepted
    busy_s: float = 0.0  # wall time inside steps
    num_running: int = 0  # after the last step
    num_waiting: int = 0
    rates: ReplicaRates = field(default_factory=ReplicaRates)  # measured speeds, for routers

    def add(self, stats: StepStats) -> None:
        self.num_steps += 1
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_decode_rows += stats.num_decode_rows
        self.num_sampled += stats.num_sampled
        self.num_drafted += stats.num_drafted  # before the accepted ones (GeneratorMetrics reads them the other way)
        self.num_accepted_drafts += stats.num_accepted_drafts
        self.num_preemptions += stats.num_preemptions
        self.num_failed += stats.num_failed
        self.busy_s += stats.total_s
        self.rates.observe_step(stats.num_prompt_tokens, stats.num_decode_rows, stats.total_s)
        self.num_running, self.num_waiting = stats.num_running, stats.num_waiting


@dataclass
class Engine:
    """One replica's model, tokenizer, cache and running generator."""

    config: ServeConfig
    model: Model
    tokenizer: Tokenizer
    cache: Cache
    generator: DynamicGenerator
    runner: DynamicGeneratorAsync
    info: ModelInfo
    totals: StepTotals
    draft_model: Model | None = None  # speculative decoding's draft model (config.draft_model_path)
    cache_events: CacheEvents | None = None  # the pool's routing keys, batched for routers (engine thread only)
    _num_dropped_page_events: int = 0
    num_received: int = 0  # requests start_job was given (routers tell their share of the traffic from it)
    static_adapters: tuple[AdapterInfo, ...] = ()  # the config's LoRA adapters, loaded by build
    # the prefix cache's counters (host tier's included) as of the last routing report, read on the engine thread
    cache_stats: PrefixCacheStats | None = None
    pacer: StreamPacer = field(default_factory=lambda: StreamPacer(0.0))  # (build: the config's bound)

    def __post_init__(self) -> None:
        if self.cache_events is None:
            self.cache_events = CacheEvents(self.config.page_size,
                                            self.config.routing_block_tokens)

    @classmethod
    def build(cls, config: ServeConfig, num_replicas: int | None = None) -> Engine:
        """Load model (and draft model) -> tokenizer -> allocate cache -> generator -> warm up -> start the engine
        thread."""
        model, draft_model, tokenizer, cache, generator = build_generator(config)
        # the config's adapters before the warm-up: their first load recaptures the decode graphs with LoRA
        static = tuple(replace(adapter_info(generator.load_lora(name, path), path), static=True)
                       for name, path in (config.lora_adapters or {}).items())
        if config.warmup:
            generator.warmup()  # before the engine thread owns the generator
        totals = StepTotals()
        runner = DynamicGeneratorAsync(generator=generator, on_step=totals.add)
        info = describe(config, model, tokenizer, generator, num_replicas or config.num_replicas)
        return cls(config, model, tokenizer, cache, generator, runner, info, totals, draft_model,
                   static_adapters=static, pacer=StreamPacer(config.max_stream_messages_per_s))

    # --- state (attribute reads from the event loop; the page pool is read on the engine thread) ---

    @property
    def num_remaining(self) -> int:
        return self.runner.num_remaining_jobs

    @property
    def is_alive(self) -> bool:
        return self.runner.is_alive

    @property
    def last_step_time(self) -> float:
        """time.monotonic() at the end of the engine's last step."""
        return self.generator.last_step_time

    @property
    def last_progress_time(self) -> float:
        """time.monotonic() when the engine thread last made progress: the end of a step, or of commands it applied
        (enqueues, cancels, run_in_engine calls such as routing_digest's)."""
        return self.runner.last_progress_time

    async def routing_digest(self, epoch: int, instance_id: str) -> dict[str, Any]:
        """The replica's routing report (folio.router.digest's format: load, measured rates, and a batch of the
        cache's routing-key events since the last report), built on the engine thread between two steps: the page
        pool and the queues are only consistent there."""
        if not self.runner.is_alive:
            raise ReplicaUnavailable("the engine thread is not running")
        runner, events = self.runner, self.cache_events

        def build(generator: DynamicGenerator) -> dict[str, Any]:
            snapshot = generator.cache_snapshot()
            self.cache_stats = generator.prefix_cache_stats()
            events.add(generator.drain_page_events())
            if generator.num_dropped_page_events != self._num_dropped_page_events:
                self._num_dropped_page_events = generator.num_dropped_page_events
                events.resync(snapshot.ready_hashes)
            running = generator.num_remaining_jobs() - generator.num_pending_jobs()
            queued = runner.num_remaining_jobs - running  # the scheduler's queue + enqueues not applied yet
            return build_digest(snapshot, events, running=running, queued=queued, epoch=epoch,
                                instance_id=instance_id, max_running=generator.max_batch_size,
                                num_prefill_tokens=num_prefill_tokens(generator),
                                num_received=self.num_received, rates=self.totals.rates)

        return await runner.run_in_engine(build)

    # --- LoRA adapters (folio.serve.adapters decides which; these run them) ---

    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Read and check the adapter off the engine thread (its files may take a while), then add it between two
        steps. InvalidRequest naming `path` when it is not an adapter folio can apply to this model."""
        model = self.model
        try:
            adapter = await asyncio.to_thread(load_peft_adapter, name, path, model.config, model.device, model.dtype)
        except (OSError, ValueError) as error:  # AdapterError is a ValueError
            raise InvalidRequest("path", f"{path}: {error}") from None
        try:
            info = await self.runner.run_in_engine(lambda generator: generator.loras.add(adapter))
        except ValueError as error:  # AdapterError: over the replica's max_loras or max_lora_rank
            raise InvalidRequest("path", f"{path}: {error}") from None
        return adapter_info(info, path)

    async def unload_lora(self, name: str) -> bool:
        """Drop the adapter between two steps; False (kept) while queued or running jobs use it."""
        def unload(generator: DynamicGenerator) -> bool:
            try:
                generator.unload_lora(name)
            except RuntimeError:  # jobs use it
                return False
            return True

        return await self.runner.run_in_engine(unload)

    # --- requests ---

    def start_job(self, request: EngineRequest) -> DynamicJobAsync:
        """Enqueue; raises InvalidRequest (the engine rejects it), Unimplemented (a feature this engine lacks),
        Overloaded (queue full), ReplicaUnavailable. The response_format's filter compiles at enqueue, on the engine
        thread: one that does not compile ends the stream with InvalidRequest before any chunk (see stream)."""
        self.num_received += 1
        job_kwargs = job_kwargs_of(request)
        try:
            ajob = DynamicJobAsync(self.runner, **job_kwargs)
        except QueueFull as e:
            raise Overloaded(f"the replica's queue is full ({self.config.max_ongoing_requests} requests); "
                             "retry later") from e
        except GeneratorClosed as e:
            raise ReplicaUnavailable("the replica is shutting down; retry") from e
        except FilterError as e:
            raise InvalidRequest(constraint_field(request), str(e)) from None
        except (TypeError, ValueError) as e:
            raise refused_job(e) from None
        ajob.constraint_field = constraint_field(request)  # names the request's constraint in its errors
        return ajob

    async def stream(self, job: DynamicJobAsync, arrival_s: float) -> AsyncIterator[Chunk]:
        """The job's results as Chunks. Results that piled up while the consumer was busy, or while the stream
        waited its turn (folio.serve.pacing: a replica bounds the messages it streams per second), are merged into
        one Chunk. Leaving early (the caller was cancelled or closed the stream) cancels the job, releasing its
        pages."""
        last_sent_s: float | None = None  # the first tokens go at once
        try:
            with self.pacer.stream():
                while True:
                    try:
                        results = await job.next_results()
                        hold_s = self.pacer.hold_s(last_sent_s)
                        if hold_s > 0 and results and not results[-1].eos:
                            await asyncio.sleep(hold_s)
                            results += job.ready_results()
                    except asyncio.CancelledError:
                        raise
                    except BaseException as error:  # noqa: BLE001 - the job's error, as the request's
                        raise request_error(error, job) from None
                    if not results:  # ended without a final result (cancelled, or the engine stopped)
                        raise ReplicaUnavailable("the replica stopped before the request finished; retry")
                    chunk = merged_chunk(results, arrival_s)
                    if chunk is not None:
                        yield chunk
                        last_sent_s = time.monotonic()
                    if chunk is not None and chunk.finish is not None:
                        return
        finally:
            if job.job.state not in (JobState.FINISHED, JobState.CANCELLED):
                await _cancel(job)

    async def close(self, drain_timeout_s: float) -> None:
        """Let running jobs finish (at most drain_timeout_s), then stop the engine thread."""
        deadline = time.monotonic() + drain_timeout_s
        while self.num_remaining and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_remaining:
            logger.warning("closing the generator with %d unfinished jobs", self.num_remaining)
        await self.runner.close()
        close_tensor_parallel(self.cache)  # (a tensor-parallel replica's other ranks; nothing otherwise)


async def _cancel(job: DynamicJobAsync) -> None:
    # The cancel command reaches the engine's inbox before the first await, so even if this task is cancelled
    # again while waiting, the job's pages are released.
    try:
        await asyncio.shield(job.cancel())
    except (asyncio.CancelledError, GeneratorClosed):
        pass


def num_prefill_tokens(generator: DynamicGenerator) -> int:
    """Prompt tokens the engine has still to prefill, over running and queued jobs. Engine thread only."""
    return generator.num_prefill_tokens()


def merged_chunk(results: list[Any], arrival_s: float) -> Chunk | None:
    """One Chunk of a stream's results (its streaming ones, in order; None when they release nothing yet: text
    held back for UTF-8, a possible stop or banned string)."""
    streaming = [r for r in results if r.stage == Stage.STREAMING]
    if not streaming:
        return None
    merged = chunk_of(streaming[0], arrival_s) if len(streaming) == 1 else _merged_results(streaming, arrival_s)
    if not merged.token_ids and not merged.text and not merged.suppressed_text and merged.finish is None:
        return None
    return merged


def _merged_results(results: list[StreamingResult], arrival_s: float) -> Chunk:
    """chunk_of for several results: those carrying per-token extras (probabilities, top tokens) or undone text
    go through Chunk.extend; the usual ones (text and ids only) are joined once instead of chunk by chunk."""
    if any(r.token_probs is not None or r.top_k_tokens is not None or r.suppressed_text for r in results):
        merged = chunk_of(results[0], arrival_s)
        for result in results[1:]:
            merged.extend(chunk_of(result, arrival_s))
        return merged
    last = chunk_of(results[-1], arrival_s)  # (its finish, if any)
    last.text = "".join(r.text for r in results)
    last.token_ids = [t for r in results for t in r.token_ids]
    return last


def chunk_of(result: StreamingResult, arrival_s: float) -> Chunk:
    top = None
    if result.top_k_tokens is not None:
        top = [TopTokens(list(ids), list(probs)) for ids, probs in zip(result.top_k_tokens, result.top_k_probs)]
    chunk = Chunk(text=result.text, token_ids=list(result.token_ids),
                  token_probs=None if result.token_probs is None else list(result.token_probs), top_tokens=top,
                  suppressed_text=result.suppressed_text)
    if result.eos:
        now = time.monotonic()
        job = result.job
        first_token = job.time_first_token if job.time_first_token is not None else now
        chunk.finish = Finish(
            reason=result.eos_reason, stop_token_id=result.eos_triggering_token_id,
            stop_string=result.eos_triggering_string,
            usage=Usage(prompt_tokens=result.prompt_tokens or 0, cached_tokens=result.cached_tokens or 0,
                        completion_tokens=result.new_tokens or 0,
                        accepted_draft_tokens=result.accepted_draft_tokens or 0,
                        rejected_draft_tokens=result.rejected_draft_tokens or 0),
            timings=Timings(queued_s=result.time_enqueued or 0.0, prefill_s=result.time_prefill or 0.0,
                            generate_s=result.time_generate or 0.0,
                            time_to_first_token_s=max(0.0, first_token - arrival_s), total_s=now - arrival_s))
    return chunk


def adapter_info(info: LoraInfo, path: str) -> AdapterInfo:
    return AdapterInfo(name=info.name, path=str(path), rank=info.rank, scale=info.scale,
                       target_modules=tuple(info.target_modules), adapter_id=info.adapter_id)


def describe(config: ServeConfig, model: Model, tokenizer: Tokenizer, generator: DynamicGenerator,
             num_replicas: int) -> ModelInfo:
    return ModelInfo(
        model_name=Path(config.model_path).resolve().name,
        architecture=model.config.architecture,
        dtype=str(model.dtype).removeprefix("torch."),
        vocab_size=min(tokenizer.vocab_size, model.config.vocab_size),
        max_seq_len=generator.max_seq_len,
        page_size=generator.page_size,
        num_pages=generator.cache.num_pages,
        max_batch_size=generator.max_batch_size,
        num_replicas=num_replicas,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
        bos_token_id=tokenizer.bos_token_id,
        add_bos_token=tokenizer.add_bos_token,
        supported_architectures=SUPPORTED_ARCHITECTURES,
        hidden_size=model.config.hidden_size,
        weight_format=weight_format_of(model),
        kv_format=generator.cache.kv_format or KV_FORMAT_OF_DTYPE[str(model.dtype).removeprefix("torch.")],
        bytes_per_page=generator.cache.bytes_per_page,
        num_host_pages=generator.host_pages.num_host_pages if generator.host_pages else 0,
        host_cache_bytes=generator.host_pages.bytes if generator.host_pages else 0,
        host_write_through=generator.host_write_through if generator.host_pages else False,
        tensor_parallel_size=model.tensor_parallel.world_size if model.tensor_parallel is not None else 1,
    )


def weight_format_of(model: Model) -> str:
    """"fp8" where the model's projections hold FP8 weights (folio.model.fp8), else "dense"."""
    return "fp8" if any(isinstance(layer.qkv, Fp8Weight) for layer in model.weights.layers) else "dense"
