"""DynamicGenerator: many concurrent jobs over one paged KV cache.

Each step: the scheduler plans (admission, prefix reuse, chunks, pages), the model runner executes and samples, the
emitter turns tokens into results; the launch-ahead pipeline overlaps one step's host work with the next step's
device work. See docs/architecture.md.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from folio import cfg, convenience, isolation, job_binding, sizing
from folio.cache.manager import CacheSnapshot, KVCacheManager, PrefixCacheStats
from folio.constrain.gate import HostGate
from folio.constrain.masks import MaskWorker
from folio.emitter import Emitter
from folio.host_pages import build_host_pages
from folio.job import DynamicJob, JobState
from folio.kv_cache import Cache
from folio.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraInfo, LoraRegistry
from folio.model.model import Model
from folio.model.windows import released_window
from folio.options import EngineOptions
from folio.pipeline import LaunchAhead
from folio.results import Result
from folio.runner import ModelRunner
from folio.scheduler import Chunk, Scheduler
from folio.sequence import SeqStatus
from folio.sizing import positive_int, resolve_max_batch_size, resolve_max_chunk_size, resolve_max_seq_len
from folio.speculative.build import build_speculator, target_graph_rows
from folio.speculative.verify_step import verify_and_emit
from folio.stats import StepStats
from folio.tokenizer import Tokenizer
from folio.unadmittable import fail_unadmittable

logger = logging.getLogger(__name__)
MAX_BUFFERED_PAGE_EVENTS = 1 << 16


class QueueFull(RuntimeError):
    """More jobs are waiting than the generator's `max_queued_jobs` allows; retry once some have started."""


class StepOutput(NamedTuple):
    results: list[Result]
    stats: StepStats


class DynamicGenerator:
    """Paged dynamic generator.

    max_batch_size: most sequences active at once (None: one per cache page, at most 256).
    max_seq_len: longest prompt + max_new_tokens of any job (None: the model's context length).
    max_chunk_size: prompt tokens ingested per step over all jobs (None: 2048, rounded to whole pages).
    max_q_size: most tokens one sequence feeds in a decode forward (1 + drafted tokens of a verify row).
    max_queued_jobs: most jobs waiting to start; `enqueue` raises QueueFull beyond it (None: no bound).
    paged: False runs one job at a time (batch size 1); the page pool still reuses the previous job's prefix.
    prefix_cache: False never shares or keeps pages between jobs (to measure what the prefix cache is worth).
    cuda_graphs: capture decode steps in CUDA graphs (None: on a CUDA device, unless the ops are the reference's).
    overlap_emit, decode_ahead, prefill_ahead: the launch-ahead modes (folio.pipeline); None: on with CUDA graphs.
    gather_prompt_rows, gather_prompt_steps: while that many jobs decode, prompt tokens wait up to that many steps
        for a whole max_chunk_size of them (folio.scheduler.Scheduler). None: 128 rows and 4 steps with CUDA graphs,
        where a step with a prompt chunk costs the host an eager forward instead of a graph replay; else off.
    options: the engine's switches (folio.EngineOptions); they are the model's (None, or equal to them).
    max_loras, max_lora_rank: most LoRA adapters loaded at once and their largest rank (folio.lora.slots).
    host_cache_bytes: host memory keeping pages evicted from the cache, brought back on a prefix hit
        (folio.host_pages; pinned on CUDA). None: on CUDA a share of RAM (DEFAULT_HOST_RAM_FRACTION), 0 on the CPU.
    host_write_through: copy every page to the host tier once computed, beside the steps that follow, so that
        evicting it costs no copy later. False (the default: it measured faster, bench/host_tier.py): pages are
        copied as they are evicted, before the step that reuses them, and only those.

    Speculative decoding (folio.speculative): draft_model (a smaller model with the target's vocabulary; its cache,
    draft_cache, is made to match `cache` when not given) or use_ngram_draft (n-grams and prompt lookup over each
    job's own tokens, n-grams up to max_ngram) drafts up to num_draft_tokens tokens per decoding job and step, which
    the target verifies in one forward and keeps by exact rejection sampling. adaptive_draft: each job's draft
    length follows its acceptance rate (down to none), and a step's decode rows plus drafts stay within
    draft_step_token_budget (None: no cap), where larger steps are bound by compute and drafts stop paying.
    """

    def __init__(self, model: Model, cache: Cache, tokenizer: Tokenizer, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, max_chunk_size: int | None = None, max_q_size: int = 8,
                 max_queued_jobs: int | None = None, paged: bool = True, prefix_cache: bool = True,
                 cuda_graphs: bool | None = None, overlap_emit: bool | None = None, decode_ahead: bool | None = None,
                 prefill_ahead: bool = True, gather_prompt_rows: int | None = None,
                 gather_prompt_steps: int | None = None, options: EngineOptions | None = None,
                 draft_model: Model | None = None,
                 draft_cache: Cache | None = None, num_draft_tokens: int = 4, use_ngram_draft: bool = False,
                 max_ngram: int = 4, adaptive_draft: bool = True, draft_step_token_budget: int | None = 256,
                 max_loras: int = DEFAULT_MAX_LORAS, max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                 host_cache_bytes: int | None = None, host_write_through: bool = False):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        if options is not None and options != model.options:
            raise ValueError(f"options {options} differ from the model's {model.options}: the kernels run with the "
                             f"model's, so build the model with them (Model(..., options=...) or "
                             f"model.with_options(...))")
        self.options = model.options
        self.page_size = cache.page_size
        self.paged = paged
        self.max_seq_len = resolve_max_seq_len(max_seq_len, model.config.max_position_embeddings)
        self.max_batch_size = resolve_max_batch_size(max_batch_size, paged, cache.num_pages)
        self.max_chunk_size = resolve_max_chunk_size(max_chunk_size, self.page_size)
        self.max_q_size = positive_int("max_q_size", max_q_size)
        self.max_queued_jobs = None if max_queued_jobs is None else positive_int("max_queued_jobs", max_queued_jobs)
        self.vocab_size = min(tokenizer.vocab_size, model.config.vocab_size)
        # (a draft model reads the same block tables: pages go back early only where neither model reads them)
        window = released_window(*(m.config.layer_windows for m in (model, draft_model) if m is not None))
        # None: no host tier (tensor parallelism: rank 0's mirror builds every rank's, folio.tp_worker)
        host_pages_for = build_host_pages if cache.mirror is None else cache.mirror.build_host_pages
        self.host_pages = host_pages_for(cache, host_cache_bytes if prefix_cache else 0)
        self.host_write_through = bool(host_write_through)
        self.cache_manager = KVCacheManager(cache.num_pages, cache.page_size, prefix_cache, window=window,
                                            num_host_pages=self.host_pages.num_host_pages if self.host_pages else 0,
                                            host_write_through=self.host_write_through)
        self.scheduler = Scheduler(self.cache_manager, self.max_batch_size, self.max_chunk_size)
        if cuda_graphs is None and self.options.ops_backend == "reference":
            cuda_graphs = False  # the reference ops synchronize: they cannot be captured
        on_cuda = model.device.type == "cuda"
        graphs_wanted = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.speculator, self.draft_cache = build_speculator(
            model, cache, draft_model, draft_cache, num_draft_tokens, use_ngram_draft, max_ngram, adaptive_draft,
            self.max_q_size, self.max_seq_len, self.vocab_size, self.max_batch_size, graphs_wanted and on_cuda,
            draft_step_token_budget)
        self.draft_model = draft_model
        # verify rows replay in the decode graphs as one row per token
        graph_rows = target_graph_rows(self.max_batch_size, num_draft_tokens if self.speculator else None)
        self.runner = ModelRunner(model, cache, self.max_batch_size, self.max_seq_len, self.vocab_size,
                                  self.max_q_size, cuda_graphs, max_graph_rows=graph_rows)
        self.runner.host_pages = self.host_pages
        self.loras = self.runner.attach_loras(LoraRegistry(model, max_loras, max_lora_rank))  # (folio.lora)
        if self.speculator is not None and self.speculator.draft_runner is not None:
            self.runner.on_forward = self.speculator.draft_runner.mirror
        graphs = self.runner.graphs is not None
        self.scheduler.gather_rows = sizing.resolve_gather(
            gather_prompt_rows, sizing.DEFAULT_GATHER_PROMPT_ROWS * graphs, "gather_prompt_rows")
        self.scheduler.gather_steps = sizing.resolve_gather(
            gather_prompt_steps, sizing.DEFAULT_GATHER_PROMPT_STEPS * graphs, "gather_prompt_steps")
        self.pipeline = LaunchAhead(decode_ahead=graphs if decode_ahead is None else bool(decode_ahead),
                                    prefill_ahead=bool(prefill_ahead),
                                    overlap_emit=graphs if overlap_emit is None else bool(overlap_emit))
        self.masks = MaskWorker(self.vocab_size, tokenizer.eos_token_ids)
        # with launch-ahead steps on CUDA, a step queues its sampler before its grammar masks are made
        self.masks.gate = HostGate.for_device(model.ops, model.device) if self.pipeline.decode_ahead else None
        self.runner.masks = self.masks
        self.emitter = Emitter(self.scheduler, self.runner, self.speculator)
        self._serials = itertools.count()
        self._deferred: list[Result] = []  # results of other jobs collected while generate() ran
        # Page stored/evicted events, drained every step so the pool's log stays bounded; readers on other threads
        # take them with drain_page_events() (deque appends and pops are thread-safe).
        self._page_events: deque = deque(maxlen=MAX_BUFFERED_PAGE_EVENTS)
        self.num_dropped_page_events = 0  # lost to the buffer's bound since the start
        self.num_steps = 0
        self.last_step_stats = StepStats()
        self.last_step_time = time.monotonic()  # time.monotonic() at the end of the last step

    @property
    def decode_ahead(self) -> bool:
        return self.pipeline.decode_ahead

    @property
    def overlap_emit(self) -> bool:
        return self.pipeline.overlap_emit

    # --- queue ---

    def validate_job(self, job: DynamicJob) -> None:
        """Raise ValueError, naming the field, if `job` can never run here."""
        job_binding.check(self, job)

    def enqueue(self, job: DynamicJob | Iterable[DynamicJob]) -> int | list[int]:
        if isinstance(job, DynamicJob):
            return self._enqueue_one(job)
        return [self._enqueue_one(j) for j in job]

    def _enqueue_one(self, job: DynamicJob) -> int:
        self.validate_job(job)
        for f in job.filters:
            f.bind(self.tokenizer, self.vocab_size)  # compiles: a grammar that does not raises FilterError here
        if self.max_queued_jobs is not None and self.num_pending_jobs() >= self.max_queued_jobs:
            raise QueueFull(f"the generator's queue is full ({self.max_queued_jobs} waiting jobs); "
                            f"raise max_queued_jobs or wait for jobs to start")
        job_binding.bind(self, job, next(self._serials))
        self.emitter.add(job.sequence)
        return job.serial

    def num_pending_jobs(self) -> int:
        return len(self.scheduler.pending)

    def num_remaining_jobs(self) -> int:
        # the emitter's, not the scheduler's: a finished job leaves the scheduler before its last tokens are emitted
        return len(self.emitter.live)

    def num_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill over running and queued jobs: the backlog a new job waits behind."""
        return self.scheduler.num_prefill_tokens()

    def cancel(self, job: DynamicJob) -> None:
        """Drop a job in any state; its pages are released now. No result is emitted."""
        seq = self.emitter.live.get(job)
        if seq is not None:
            self.emitter.retire(seq, SeqStatus.CANCELLED)
            job.state = JobState.CANCELLED

    def clear_queue(self) -> None:
        for job in list(self.emitter.live):
            self.cancel(job)
        self.pipeline.clear()
        self._deferred.clear()

    # --- LoRA adapters (folio.lora): between steps, like every call on this object ---

    def load_lora(self, name: str, path: str) -> LoraInfo:
        """Load a PEFT adapter directory as `name`, for jobs with DynamicJob(lora=name)."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`. Refused (RuntimeError) while a queued or running job uses it."""
        self.loras.unload(name, list(self.emitter.live))

    def list_loras(self) -> list[LoraInfo]:
        return self.loras.infos()

    # --- the cache ---

    def cache_snapshot(self) -> CacheSnapshot:
        return self.cache_manager.snapshot()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.cache_manager.stats()

    def drain_page_events(self) -> list:
        """Page stored/evicted events (folio.cache.PageEvent) since the last call, oldest first. Safe to call from
        another thread. At most MAX_BUFFERED_PAGE_EVENTS are kept: a reader that falls behind loses the oldest."""
        events = []
        while self._page_events:
            events.append(self._page_events.popleft())
        return events

    def reset_page_table(self) -> None:
        """Forget every cached page (the queue must be empty)."""
        if self.num_remaining_jobs():
            raise RuntimeError("reset_page_table() needs an empty queue")
        self.pipeline.clear()
        self.cache_manager.reset()

    # --- blocking conveniences (folio.convenience) ---

    def generate(self, prompt: str | list[str], max_new_tokens: int, **kwargs: Any) -> Any:
        return convenience.generate(self, prompt, max_new_tokens, defer=self._deferred.append, **kwargs)

    generate.__doc__ = convenience.generate.__doc__

    def warmup(self) -> None:
        convenience.warmup(self)

    warmup.__doc__ = convenience.warmup.__doc__

    # --- the step ---

    def iterate(self) -> list[Result]:
        """Run one step; return the results it produced (and those held back while `generate()` ran)."""
        results, self._deferred = self._deferred, []
        results.extend(self.step().results)
        return results

    def step(self) -> StepOutput:
        """Run one step; its results and what it did."""
        stats = self.emitter.stats = StepStats(step_idx=self.num_steps)
        start = time.perf_counter()
        preemptions = self.scheduler.num_preemptions
        hits = self.cache_manager.stats().num_hit_tokens
        try:
            results = self._run_step(stats)
        finally:
            events = self.cache_manager.drain_events()
            self.num_dropped_page_events += max(0, len(self._page_events) + len(events) - MAX_BUFFERED_PAGE_EVENTS)
            self._page_events.extend(events)
            self.num_steps += 1
            self.last_step_time = time.monotonic()
            stats.total_s = time.perf_counter() - start
            stats.num_preemptions = self.scheduler.num_preemptions - preemptions
            stats.num_prefix_hit_tokens = self.cache_manager.stats().num_hit_tokens - hits
            stats.num_pages_in_use, stats.num_pages_cached, stats.num_pages_free = (
                self.cache_manager.num_in_use, self.cache_manager.num_cached, self.cache_manager.num_free)
            stats.num_running, stats.num_waiting = len(self.scheduler.active), len(self.scheduler.pending)
            self.last_step_stats = stats
        if stats.num_preemptions:
            logger.info("step %d preempted %d sequences", stats.step_idx, stats.num_preemptions)
        return StepOutput(results, stats)

    def _run_step(self, stats: StepStats) -> list[Result]:
        emitter, tick = self.emitter, time.perf_counter()
        ahead = self.pipeline.take()
        if ahead is not None:
            plan, logits, error, stats.used_graph, stats.launched_ahead = (
                ahead.plan, ahead.logits, ahead.error, ahead.used_graph, True)
        else:
            drafts = self.speculator.drafts(self.scheduler.active, self.num_steps) if self.speculator else None
            plan, logits, error = self.scheduler.plan(drafts), None, None
        results = emitter.started_results(plan)
        tick = stats.lap("plan", tick)
        if ahead is None:
            if plan.empty:
                results += emitter.emit(self.pipeline.take_staged())
                return results + fail_unadmittable(self, results)
            if self.speculator is not None:
                self._draft(plan)
                tick = stats.lap("draft", tick)
            try:
                logits, stats.used_graph = self.runner.forward(plan)
            except Exception as caught:  # noqa: BLE001 - retried chunk by chunk below
                error = caught
            else:  # masks of filtered sequences sampling this step, made while the device runs the forward
                self.masks.prepare([c.seq for c in plan.chunks if c.wants_logits])
        if error is not None:
            results += emitter.emit(self.pipeline.take_staged())
            logits, failed = isolation.forward_each(self.runner, emitter, plan, error)
            results += failed
        self.scheduler.commit(plan)
        stats.count_rows(plan.chunks)
        tick = stats.lap("forward", tick)
        results += emitter.prefill_results(plan, any_prompt=stats.num_prompt_tokens > 0)
        sampled = [c for c in plan.chunks if c.wants_logits]
        if any(c.verify for c in sampled):
            return results + verify_and_emit(self, sampled, logits, stats, tick)
        if sampled:
            return results + self._sample_and_emit(sampled, logits, stats, tick)
        return results + emitter.emit(self.pipeline.take_staged())

    def _draft(self, plan) -> None:
        """Drafts into the plan's verify rows; on failure the rows decode without them."""
        try:
            self.speculator.fill(plan)
        except Exception:  # noqa: BLE001 - drafting is an optimisation: the step goes on without it
            logger.exception("drafting failed; this step decodes without drafts")
            plan.chunks = [Chunk(c.seq, c.start, c.end) if c.verify else c for c in plan.chunks]

    def _sample_and_emit(self, chunks: list[Chunk], logits: torch.Tensor, stats: StepStats,
                         tick: float) -> list[Result]:
        emitter, pipeline = self.emitter, self.pipeline
        if self.scheduler.num_cfg_jobs:
            chunks, logits = cfg.mix(chunks, logits, self.vocab_size)  # a CFG job's two rows become one
            if not chunks:
                return emitter.emit(pipeline.take_staged())
        # While the grammar engine makes this step's masks on its worker thread, hand the previous step's tokens
        # to their jobs (otherwise done after the next launch): after queuing the sampler and the next step's
        # forward where the device waits for the masks (folio.constrain.gate), else before sampling.
        seqs = [c.seq for c in chunks]
        later = self.runner.masks_can_come_later(seqs)
        early = emitter.emit(pipeline.take_staged()) if not later and self.masks.pending(seqs) else []
        try:
            sampled = self.runner.sample(chunks, logits, masks_later=later)  # (on failure it released the masks)
        except Exception as error:  # noqa: BLE001 - find the rows that fail alone; the others go on
            return early + emitter.emit(pipeline.take_staged()) + isolation.sample_each(self.runner, emitter, chunks,
                                                                                         logits, error)
        try:
            tick = stats.lap("sample", tick)
            # A job that may roll back (banned strings) gets its tokens now, before the next step is planned.
            now = self.emitter.num_rolling_back > 0 and any(c.seq.job.rolls_back for c in chunks)
            if pipeline.decode_ahead and not now and not (self.speculator is not None and
                                                          self.speculator.any_drafting(seqs, self.num_steps + 1)):
                pipeline.launch(chunks, sampled.token_ids, self.scheduler, self.runner, self.max_batch_size)
                tick = stats.lap("launch_ahead", tick)
            if later:
                early = emitter.emit(pipeline.take_staged())
        finally:
            if later:
                self.runner.release_masks()
        # With overlap_emit the previous step's tokens go to their jobs now, while the device computes this step.
        results = early + (emitter.emit(pipeline.take_staged()) if pipeline.overlap_emit else [])
        tick = stats.lap("emit", tick)
        staged = emitter.stage_all(chunks, sampled.read())
        if pipeline.step is not None:  # the next step's forward runs now: make its masks meanwhile
            self.masks.prepare([c.seq for c in chunks], background=pipeline.overlap_emit)
        tick = stats.lap("wait_tokens", tick)
        if pipeline.overlap_emit and not now:
            pipeline.staged = staged
            return results
        results += emitter.emit(staged)
        stats.lap("emit", tick)
        return results
