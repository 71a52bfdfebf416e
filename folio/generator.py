"""DynamicGenerator: many concurrent jobs over one paged KV cache.

The generator joins the parts: the scheduler decides what each step computes, the model computes it, the sampler
picks tokens, and each job turns its tokens into results. See DESIGN.md "How a request flows".
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from folio import ops
from folio.cache import PagePool
from folio.job import DynamicJob, JobState, _TokenExtras
from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.decode_graphs import DecodeGraphs
from folio.model.model import Model
from folio.results import Result
from folio.sampling import RowParams, SamplerSettings, sample
from folio.sampling.device_history import DeviceHistories
from folio.sampling.host import to_device
from folio.sampling.penalties import window_size
from folio.sampling.rng import uniform, uniforms
from folio.sampling.sampler import SampleOutput
from folio.scheduler import Chunk, Scheduler, SeqState, StepPlan, validate_fits
from folio.tokenizer import Tokenizer

DEFAULT_MAX_CHUNK_TOKENS = 2048
MAX_DERIVED_BATCH_SIZE = 256
MAX_BUFFERED_PAGE_EVENTS = 1 << 16
# Device memory that CUDA libraries take at their first use beside torch's tensors, kept free with the activations
# (activation_reserve_bytes): cuBLAS's workspaces (32 MiB a handle on Hopper), cuDNN's plans and the code of
# kernels loaded lazily at their first launch.
LIBRARY_RESERVE_BYTES = 256 << 20


@dataclass
class _Staged:
    """A sampled token between `_stage` (appended to its sequence) and `_emit` (handed to its job)."""

    seq: SeqState
    token_id: int
    extras: _TokenExtras
    failure: Result | None = None  # the job failed at staging: emit this result instead


@dataclass
class _Ahead:
    """A step launched before the tokens it feeds were read back (decode_ahead): its plan, its logits (None when
    no chunk wants any, or the forward pass failed: then `error`), and for each chunk its row of the logits (-1:
    none)."""

    plan: StepPlan
    logits: torch.Tensor | None
    logit_rows: list[int]
    error: Exception | None = None


class _SampledOnHost:
    """A step's sampler outputs that the host reads, copied to the host as soon as they are computed: on CUDA into
    pinned memory without blocking, with an event to wait on; on the CPU they are already there."""

    def __init__(self, output: SampleOutput, probs: bool, top: bool, logits_rows: list[int]):
        device = output.token_ids.device
        self._event = None
        self._logits_rows = {row: k for k, row in enumerate(logits_rows)}
        self.token_ids = self._fetch(output.token_ids)
        self.probs = self._fetch(output.token_probs) if probs else None
        self.top_tokens = self._fetch(output.top_k_tokens) if top else None
        self.top_probs = self._fetch(output.top_k_probs) if top else None
        self.logits = None
        if logits_rows:
            rows = logits_rows if len(logits_rows) < output.logits.shape[0] else slice(None)
            if isinstance(rows, list):
                rows = to_device(rows, torch.int64, device)
            self.logits = self._fetch(output.logits[rows])
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    @staticmethod
    def _fetch(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def logits_of(self, row: int) -> torch.Tensor:
        """Row `row`'s processed logits, fp32 on the CPU (a copy: the pinned buffer is not handed out)."""
        return self.logits[self._logits_rows[row]].to(torch.float32, copy=True)


def resolve_max_chunk_size(max_chunk_size: int | None, page_size: int) -> int:
    """DynamicGenerator's max_chunk_size: the given one, checked, or the default rounded to whole pages."""
    if max_chunk_size is None:
        return max(page_size, DEFAULT_MAX_CHUNK_TOKENS - DEFAULT_MAX_CHUNK_TOKENS % page_size)
    if not isinstance(max_chunk_size, int) or max_chunk_size < page_size or max_chunk_size % page_size:
        raise ValueError(f"max_chunk_size must be a positive multiple of the page size ({page_size}), "
                         f"got {max_chunk_size!r}")
    return max_chunk_size


def activation_reserve_bytes(model: Model, max_batch_size: int = MAX_DERIVED_BATCH_SIZE,
                             max_chunk_size: int | None = None, page_size: int = 256) -> int:
    """Device memory that a DynamicGenerator with these settings needs beside its cache (Cache's reserve_bytes):
    its largest eager step (a full prompt chunk with a decode row for every other running sequence) and, on
    CUDA, the memory pool of its captured decode graphs (one step of max_batch_size rows) and the libraries'
    own (LIBRARY_RESERVE_BYTES)."""
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    chunk = resolve_max_chunk_size(max_chunk_size, page_size)
    reserve = model.step_activation_bytes(chunk + max_batch_size, max_batch_size)
    if model.device.type == "cuda":
        # the decode graphs' pool (a graph runs the forward; the sampler runs eagerly after it), the libraries'
        reserve += model.step_activation_bytes(max_batch_size, max_batch_size, sampling=False)
        reserve += LIBRARY_RESERVE_BYTES
    return reserve


class QueueFull(RuntimeError):
    """More jobs are waiting than the generator's `max_q_size` allows; retry once some have started."""


class DynamicGenerator:
    """Paged dynamic generator.

    max_batch_size: most sequences active at once (None: one per cache page, at most 256).
    max_seq_len: longest prompt + max_new_tokens of any job (None: the model's context length).
    max_chunk_size: prompt tokens ingested per step over all jobs (None: 2048, rounded to whole pages).
    max_q_size: most jobs waiting in the queue; `enqueue` raises QueueFull beyond it.
    paged: False runs one job at a time (batch size 1); the page pool still reuses the previous job's prefix.
    prefix_cache: False never shares or keeps pages between jobs (to measure what the prefix cache is worth).
    cuda_graphs: capture decode steps in CUDA graphs (None: whenever the model is on a CUDA device).
    overlap_emit: hand a step's sampled tokens to their jobs (text, stop strings, results) during the NEXT step, while
        the device computes it, instead of before planning it (None: on with CUDA graphs). Results then arrive one
        step later; the tokens are the same. A job that a stop string ends gets one extra step computed, discarded.
    decode_ahead: launch the next step before reading back this step's tokens, feeding its decode rows the
        sampled ids straight from the device, so the device never waits for the host between steps (None: on
        with CUDA graphs). The tokens are the same; a job that a stop token or string ends has a step or two
        computed past its end, discarded. Not when jobs are queued and this step's token ends one by length.
    prefill_ahead: with decode_ahead, also launch steps ahead that prefill prompts (admitting queued jobs and
        reusing cached prefixes as planned steps do); False launches only steps in which every job decodes.
    """

    def __init__(self, model: Model, cache: Cache, tokenizer: Tokenizer, max_batch_size: int | None = None,
                 max_seq_len: int | None = None, max_chunk_size: int | None = None, max_q_size: int = 8,
                 paged: bool = True, prefix_cache: bool = True, cuda_graphs: bool | None = None,
                 overlap_emit: bool | None = None, decode_ahead: bool | None = None, prefill_ahead: bool = True):
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.page_size = cache.page_size
        self.paged = paged
        self.max_seq_len = self._resolve_max_seq_len(max_seq_len)
        self.max_batch_size = self._resolve_max_batch_size(max_batch_size)
        self.max_chunk_size = resolve_max_chunk_size(max_chunk_size, self.page_size)
        if not isinstance(max_q_size, int) or max_q_size < 1:
            raise ValueError(f"max_q_size must be an integer >= 1, got {max_q_size!r}")
        self.max_q_size = max_q_size
        self.pool = PagePool(cache.num_pages, cache.page_size)
        self.scheduler = Scheduler(self.pool, self.max_batch_size, self.max_chunk_size, prefix_cache)
        self.decode_graphs = self._capture_decode_graphs(cuda_graphs)
        self.overlap_emit = self.decode_graphs is not None if overlap_emit is None else bool(overlap_emit)
        self.decode_ahead = self.decode_graphs is not None if decode_ahead is None else bool(decode_ahead)
        self.prefill_ahead = bool(prefill_ahead)
        self._ahead: _Ahead | None = None  # the step launched ahead, sampled by the next iterate()
        self._serials = itertools.count()
        self._seqs: dict[int, SeqState] = {}  # id(job) -> its sequence
        # id(job) -> prompt + sampled ids on the model's device, for the penalties (only jobs that have any)
        self._penalty_ids = DeviceHistories(model.device)
        # id(job) -> tokens sampled so far; ahead of job.new_tokens while they wait in _staged (overlap_emit)
        self._num_sampled: dict[int, int] = {}
        self._staged: list[_Staged] = []  # sampled tokens not yet handed to their jobs
        self._deferred: list[Result] = []  # results of other jobs collected while generate() ran
        # Page stored/evicted events, drained from the pool every step so its log stays bounded; readers on other
        # threads take them with drain_page_events() (deque appends and pops are thread-safe).
        self._page_events: deque = deque(maxlen=MAX_BUFFERED_PAGE_EVENTS)
        self.num_steps = 0
        self.num_steps_ahead = 0  # steps launched ahead (decode_ahead)
        self.num_prefill_steps_ahead = 0  # of those, steps with prompt tokens (prefill_ahead)
        self.last_step_time = time.monotonic()  # time.monotonic() at the end of the last step

    # --- construction steps ---

    def _resolve_max_seq_len(self, max_seq_len: int | None) -> int:
        limit = self.model.config.max_position_embeddings
        if max_seq_len is None:
            return limit
        if max_seq_len < 1 or max_seq_len > limit:
            raise ValueError(f"max_seq_len must be in [1, {limit}] (the model's context), got {max_seq_len}")
        return max_seq_len

    def _resolve_max_batch_size(self, max_batch_size: int | None) -> int:
        if not self.paged:
            if max_batch_size not in (None, 1):
                raise ValueError("paged=False runs one job at a time: max_batch_size must be None or 1")
            return 1
        if max_batch_size is None:
            return max(1, min(self.cache.num_pages, MAX_DERIVED_BATCH_SIZE))
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        return max_batch_size

    def _capture_decode_graphs(self, cuda_graphs: bool | None) -> DecodeGraphs | None:
        on_cuda = self.model.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs=True needs a model on a CUDA device")
        if cuda_graphs is False or not on_cuda:
            return None
        return DecodeGraphs(self.model, self.cache, self.max_batch_size, self.max_seq_len)

    # --- queue ---

    def validate_job(self, job: DynamicJob) -> None:
        """Raise ValueError if `job` can never run here (too long, tokens outside the vocabulary)."""
        if job.state != JobState.NEW:
            raise ValueError(f"job was already enqueued (state {job.state})")
        total = job.prompt_tokens + job.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"prompt ({job.prompt_tokens} tokens) + max_new_tokens ({job.max_new_tokens}) = "
                             f"{total} exceeds max_seq_len {self.max_seq_len}")
        validate_fits(job.input_ids, job.max_new_tokens, self.cache.num_pages, self.page_size)
        vocab = self.model.config.vocab_size
        bad = next((t for t in job.input_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary of {vocab}")

    def enqueue(self, job: DynamicJob | Sequence[DynamicJob]) -> int | list[int]:
        if isinstance(job, DynamicJob):
            return self._enqueue_one(job)
        return [self._enqueue_one(j) for j in job]

    def _enqueue_one(self, job: DynamicJob) -> int:
        self.validate_job(job)
        if self.num_pending_jobs() >= self.max_q_size:
            raise QueueFull(f"the generator's queue is full ({self.max_q_size} pending jobs); "
                            f"raise max_q_size or wait for jobs to start")
        job.bind(next(self._serials), self.tokenizer)
        seq = SeqState(job=job, token_ids=list(job.input_ids))
        self._seqs[id(job)] = seq
        if job.gen_settings.penalty_window != 0:
            self._penalty_ids.add(id(job), job.input_ids, job.prompt_tokens + job.max_new_tokens)
        self._num_sampled[id(job)] = 0
        self.scheduler.add(seq)
        return job.serial

    def num_pending_jobs(self) -> int:
        return len(self.scheduler.pending)

    def num_remaining_jobs(self) -> int:
        # _seqs, not the scheduler: a finished job leaves the scheduler before its last tokens are emitted
        return len(self._seqs)

    def num_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill over running and queued jobs: the backlog a new job waits behind."""
        return self.scheduler.num_prefill_tokens()

    def cancel(self, job: DynamicJob) -> None:
        """Drop a job in any state; its pages are released now. No result is emitted."""
        seq = self._seqs.pop(id(job), None)
        self._penalty_ids.remove(id(job))
        self._num_sampled.pop(id(job), None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        job.state = JobState.CANCELLED

    def clear_queue(self) -> None:
        for seq in list(self._seqs.values()):
            self.cancel(seq.job)
        self._staged.clear()
        self._deferred.clear()
        self._ahead = None

    def reset_page_table(self) -> None:
        """Forget every cached page (the queue must be empty)."""
        if self.num_remaining_jobs():
            raise RuntimeError("reset_page_table() needs an empty queue")
        self._ahead = None
        self.pool.reset()

    def warmup(self) -> None:
        """Run a few short jobs so that the kernels a serving step uses are loaded and allocators initialised,
        leaving no cached pages behind (the queue must be empty).

        CUDA loads a kernel's code at its first launch, and that load waits for the work already queued on the
        device: a kernel first used under load stops the host from running ahead (on an H100, the first 16k-token
        prompt step's GEMM held the host for the whole 330 ms of the step before it). So besides a greedy job,
        the warm-up prefills one full chunk of prompt tokens (long prompt steps use other GEMM kernels than short
        ones), samples with the default settings (penalties, top-k, top-p) and runs a step that mixes one job's
        decode row with another job's prompt."""
        self.generate("Once upon a time,", max_new_tokens=8, gen_settings=SamplerSettings.greedy())
        self._prefill_one_full_chunk()
        ids = self.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
        ids = (list(ids) * 2)[:max(2, len(ids))]  # at least two tokens: a prompt chunk, not a decode row
        self.enqueue(DynamicJob(ids, max_new_tokens=6, gen_settings=SamplerSettings(), seed=0))
        self.iterate()  # its prompt; the next steps decode it while the second job's prompt joins them
        self.enqueue(DynamicJob(ids[::-1], max_new_tokens=2, gen_settings=SamplerSettings(), seed=1))
        while self.num_remaining_jobs():
            self.iterate()
        self.reset_page_table()

    def _prefill_one_full_chunk(self) -> None:
        """Prompts that fill one step's max_chunk_size (as far as max_seq_len, the batch and the pool allow), one
        greedy token each."""
        length = min(self.max_seq_len - 1, self.max_chunk_size)
        pages_each = -(-(length + 1) // self.page_size)
        count = min(self.max_chunk_size // max(length, 1), self.max_batch_size, self.pool.num_pages // pages_each)
        if length < 2 or count < 1:
            return
        vocab = min(self.tokenizer.vocab_size, self.model.config.vocab_size)
        # distinct first tokens: no prompt shares a page with another
        waiting = [DynamicJob([(k + 7 * i) % vocab for i in range(length)], max_new_tokens=1,
                              gen_settings=SamplerSettings.greedy()) for k in range(count)]
        while waiting or self.num_remaining_jobs():
            while waiting and self.num_pending_jobs() < self.max_q_size:
                self.enqueue(waiting.pop())
            self.iterate()

    # --- the step ---

    def iterate(self) -> list[Result]:
        """Run one step; return the results it produced (and those held back while `generate()` ran)."""
        results, self._deferred = self._deferred, []
        results.extend(self._step())
        return results

    def drain_page_events(self) -> list:
        """Page stored/evicted events (folio.cache.PageEvent) since the last call, oldest first. Safe to call from
        another thread. At most MAX_BUFFERED_PAGE_EVENTS are kept: a reader that falls behind loses the oldest."""
        events = []
        while self._page_events:
            events.append(self._page_events.popleft())
        return events

    def _step(self) -> list[Result]:
        try:
            return self._run_step()
        finally:
            self._page_events.extend(self.pool.drain_events())
            self.num_steps += 1
            self.last_step_time = time.monotonic()

    def _run_step(self) -> list[Result]:
        results: list[Result] = []
        ahead = self._take_ahead()
        if ahead is not None:
            plan, logits, error = ahead.plan, ahead.logits, ahead.error
        else:
            plan, logits, error = self.scheduler.plan(), None, None
        for seq in plan.started:
            if id(seq.job) in self._seqs:
                results.append(seq.job.started_result())
                seq.job.state = JobState.ACTIVE
        if ahead is None:
            if plan.empty:
                results.extend(self._emit(self._take_staged()))
                return results
            try:
                logits = self._forward(plan)
            except Exception as caught:  # noqa: BLE001 — fail this step's jobs, keep serving the rest
                error = caught
        if error is not None:
            results.extend(self._emit(self._take_staged()))
            for seq in {id(c.seq): c.seq for c in plan.chunks}.values():
                if id(seq.job) in self._seqs:
                    results.append(self._fail(seq, error))
            return results
        self.scheduler.commit(plan)
        results.extend(self._prefill_results(plan))
        sampled = [c for c in plan.chunks if c.wants_logits]
        if sampled:
            results.extend(self._sample_and_emit(sampled, logits))
        else:
            results.extend(self._emit(self._take_staged()))
        return results

    def _take_ahead(self) -> _Ahead | None:
        """The step launched ahead, without the chunks of jobs that ended or left since (their logits are
        dropped); None when there is none or nothing of it is still wanted."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        active = {id(seq) for seq in self.scheduler.active}
        kept = [i for i, c in enumerate(ahead.plan.chunks) if id(c.seq) in active]
        if not kept and not ahead.plan.started and not ahead.plan.progressed:
            return None  # (jobs it admitted or advanced by prefix reuse must still get their results)
        if len(kept) < len(ahead.plan.chunks):
            rows = [ahead.logit_rows[i] for i in kept if ahead.logit_rows[i] >= 0]
            ahead.plan.chunks = [ahead.plan.chunks[i] for i in kept]
            if ahead.logits is not None:
                ahead.logits = ahead.logits[to_device(rows, torch.int64, ahead.logits.device)] if rows else None
        return ahead

    def _launch_ahead(self, chunks: list[Chunk], token_ids: torch.Tensor) -> _Ahead | None:
        """Plan and launch the step that follows this one: `chunks` are this step's sampled rows, token_ids their
        sampled ids, on the device. Rows whose jobs do not end by length with this token become its decode rows,
        fed those ids; with prefill_ahead the rest of the step is planned as usual. None when the next step must
        be planned after this one's tokens are known: jobs are queued and this token ends one by length, some job
        prefills or is admitted and prefill_ahead is off, or the pages for it might run short (planning ahead
        never preempts)."""
        scheduler = self.scheduler
        rows = [i for i, c in enumerate(chunks)
                if self._num_sampled[id(c.seq.job)] + 1 < c.seq.job.max_new_tokens]
        # A job that this token ends by length frees its batch slot and pages only at staging: with jobs queued,
        # plan after it so that they get them at once. (One that a stop token ends is replaced a step later.)
        if scheduler.pending and len(rows) < len(chunks):
            return None
        admits = scheduler.pending and len(scheduler.active) < self.max_batch_size
        if not self.prefill_ahead and (not rows or len(chunks) != len(scheduler.active) or admits):
            return None
        plan = scheduler.plan_ahead([chunks[i].seq for i in rows])
        if plan is None or not (plan.chunks or plan.copies or plan.started or plan.progressed):
            return None
        ids = None
        if rows:
            index = to_device(rows, torch.int64, token_ids.device) if len(rows) < len(chunks) else None
            # -1 (a row where nothing could be picked: that job fails at staging) must not reach the embedding
            ids = (token_ids if index is None else token_ids[index]).clamp(min=0)
        logit_rows, num_logits = [], 0
        for k, c in enumerate(plan.chunks):
            wants = k < len(rows) or c.wants_logits
            logit_rows.append(num_logits if wants else -1)
            num_logits += wants
        self.num_steps_ahead += 1
        self.num_prefill_steps_ahead += any(c.end - c.start > 1 for c in plan.chunks)
        try:
            return _Ahead(plan, self._forward(plan, ids), logit_rows)
        except Exception as error:  # noqa: BLE001 — the next step fails this one's jobs, as a planned step would
            return _Ahead(plan, None, logit_rows, error)

    def _forward(self, plan: StepPlan, ahead_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the plan's chunks. ahead_ids: on the device, the input ids of the plan's first len(ahead_ids)
        chunks, decode rows planned ahead (plan_ahead) whose tokens are not in their sequences yet."""
        for copy in plan.copies:
            ops.copy_page_slots(self.cache.k, self.cache.v, copy.src_page, copy.dst_page, copy.num_slots)
        if not plan.chunks:
            return None
        num_ahead = 0 if ahead_ids is None else ahead_ids.shape[0]
        if self.decode_graphs is not None and all(c.end - c.start == 1 for c in plan.chunks) and (
                self.decode_graphs.bucket_for(len(plan.chunks)) is not None):
            known = [c.seq.token_ids[c.start] for c in plan.chunks[num_ahead:]]
            if num_ahead == 0:
                ids = known
            elif known:
                ids = torch.cat([ahead_ids, to_device(known, ahead_ids.dtype, ahead_ids.device)])
            else:
                ids = ahead_ids
            return self.decode_graphs.run(ids, [c.start for c in plan.chunks],
                                          [c.seq.block_table for c in plan.chunks])
        chunks = [SeqChunk(token_ids=(0,) if k < num_ahead else c.seq.token_ids[c.start:c.end],
                           start_pos=c.start, block_table=c.seq.block_table,
                           logits="last" if k < num_ahead or c.wants_logits else "none")
                  for k, c in enumerate(plan.chunks)]
        batch = ForwardBatch.build(chunks, self.page_size, self.model.device)
        if num_ahead:
            fed = ahead_ids.to(batch.input_ids.dtype)
            input_ids = fed if num_ahead == len(chunks) else torch.cat([fed, batch.input_ids[num_ahead:]])
            batch = dataclasses.replace(batch, input_ids=input_ids)
        return self.model.forward(batch, self.cache)

    def _prefill_results(self, plan: StepPlan) -> list[Result]:
        results = []
        seen: set[int] = set()
        progressed = [c.seq for c in plan.chunks if c.end - c.start > 1 or not c.wants_logits]
        progressed += [s for s in self.scheduler.active if id(s) in plan.progressed]
        for seq in progressed:
            if id(seq) in seen or self._num_sampled.get(id(seq.job), 0) > 0 or seq not in self.scheduler.active:
                continue
            seen.add(id(seq))
            target = seq.num_prefill_target
            results.append(seq.job.prefill_result(min(seq.num_cached_tokens, target), target))
        return results

    def _sample_and_emit(self, chunks: list[Chunk], logits: torch.Tensor) -> list[Result]:
        jobs = [c.seq.job for c in chunks]
        draws = uniforms([j.seed for j in jobs], [self._num_sampled[id(j)] for j in jobs])
        rows = [self._row_params(c.seq, u) for c, u in zip(chunks, draws)]
        # in place: these logits (a forward's output, or the decode graph's buffer, which the next replay
        # overwrites only after this step's sampler in stream order) are read by nothing else
        output = sample(logits, rows, self._penalty_windows(jobs, logits.shape[1]), in_place=True)
        self._record_sampled(jobs, output.token_ids)
        # Queue the copies of what the host reads before any step launched ahead: reading them then waits for this
        # step's sampler only, not for the step queued behind it.
        fetched = _SampledOnHost(output, any(j.return_probs for j in jobs), any(j.return_top_tokens for j in jobs),
                                 [i for i, j in enumerate(jobs) if j.return_logits])
        if self.decode_ahead:
            self._ahead = self._launch_ahead(chunks, output.token_ids)
        # With overlap_emit the previous step's tokens go to their jobs now, while the device computes this step.
        results = self._emit(self._take_staged()) if self.overlap_emit else []
        # The one intended host sync of a step: the sampled ids decide what every job does next.
        fetched.wait()
        token_ids = fetched.token_ids.tolist()
        probs = fetched.probs.tolist() if fetched.probs is not None else None
        top_tokens = fetched.top_tokens.tolist() if fetched.top_tokens is not None else None
        top_probs = fetched.top_probs.tolist() if fetched.top_probs is not None else None
        staged = []
        for i, chunk in enumerate(chunks):
            seq, job = chunk.seq, chunk.seq.job
            if id(job) not in self._seqs:
                continue  # ended (stop string, error, cancel) while this step ran: its token is dropped
            k = job.return_top_tokens
            extras = _TokenExtras(
                prob=probs[i] if probs is not None else None,
                top_k_tokens=top_tokens[i][:k] if k else None,
                top_k_probs=top_probs[i][:k] if k else None,
                logits=fetched.logits_of(i) if job.return_logits else None,
            )
            staged.append(self._stage(seq, token_ids[i], extras))
        if self.overlap_emit:
            self._staged = staged
            return results
        return results + self._emit(staged)

    def _penalty_windows(self, jobs: list[DynamicJob], num_columns: int) -> torch.Tensor | None:
        """The rows' penalty ids gathered on the device, or None when no row has penalties."""
        history = self._penalty_ids
        keys = [id(j) if id(j) in history else None for j in jobs]
        sizes = [0 if k is None else window_size(j.gen_settings, j.prompt_tokens + self._num_sampled[k])
                 for k, j in zip(keys, jobs)]
        if not any(sizes):
            return None
        lengths = [j.prompt_tokens + self._num_sampled[id(j)] for j in jobs]
        return history.windows(keys, lengths, sizes, num_columns)

    def _record_sampled(self, jobs: list[DynamicJob], token_ids: torch.Tensor) -> None:
        """Append each sampled id to its job's device history, on the device (a job that turns out to have ended
        leaves a harmless extra id past its end)."""
        history = self._penalty_ids
        rows = [i for i, j in enumerate(jobs) if id(j) in history]
        if not rows:
            return
        keys = [id(jobs[i]) for i in rows]
        lengths = [jobs[i].prompt_tokens + self._num_sampled[id(jobs[i])] for i in rows]
        if len(rows) < len(jobs):
            token_ids = token_ids[to_device(rows, torch.int64, token_ids.device)]
        history.append(keys, lengths, token_ids)

    def _stage(self, seq: SeqState, token_id: int, extras: _TokenExtras) -> _Staged:
        """Append a sampled token to its sequence so the next step can be planned; a job that this token ends
        (max_new_tokens, a stop token) leaves the scheduler now. Its text and result come in `_emit`."""
        job = seq.job
        if token_id < 0:
            return _Staged(seq, token_id, extras, failure=self._fail(seq, RuntimeError(
                "every token was masked for this job (blocked tokens, bias and vocabulary leave nothing)")))
        try:
            self.scheduler.append_token(seq, token_id)
        except Exception as error:  # noqa: BLE001 — one job's failure must not take down the batch
            return _Staged(seq, token_id, extras, failure=self._fail(seq, error))
        num_sampled = self._num_sampled[id(job)] = self._num_sampled[id(job)] + 1
        if num_sampled >= job.max_new_tokens or token_id in job.stop_tokens:
            self.scheduler.remove(seq)
        return _Staged(seq, token_id, extras)

    def _take_staged(self) -> list[_Staged]:
        staged, self._staged = self._staged, []
        return staged

    def _emit(self, staged: list[_Staged]) -> list[Result]:
        """Hand staged tokens to their jobs (stop checks, text); results in staging order."""
        results = []
        for entry in staged:
            if entry.failure is not None:
                results.append(entry.failure)
                continue
            seq, job = entry.seq, entry.seq.job
            if id(job) not in self._seqs:
                continue  # cancelled or failed since it was staged
            try:
                result = job.receive_token(entry.token_id, entry.extras)
            except Exception as error:  # noqa: BLE001 — one job's failure must not take down the batch
                results.append(self._fail(seq, error))
                continue
            results.append(result)
            if result.eos:
                self._forget(job)
                self.scheduler.remove(seq)
        return results

    def _row_params(self, seq: SeqState, u: float | None = None) -> RowParams:
        job = seq.job
        num_sampled = self._num_sampled[id(job)]
        return RowParams.unchecked(
            settings=job.gen_settings,
            u=uniform(job.seed, num_sampled) if u is None else u,
            history_ids=(),  # the penalties read DeviceHistories (see _penalty_windows)
            # stop tokens are blocked below min_new_tokens (job.blocked_tokens, counted at sampling time)
            blocked_ids=tuple(job.stop_tokens) if num_sampled < job.min_new_tokens else (),
            vocab_size=min(self.tokenizer.vocab_size, self.model.config.vocab_size),
            return_top_tokens=job.return_top_tokens,
            return_logits=job.return_logits,
        )

    def _forget(self, job: DynamicJob) -> None:
        self._seqs.pop(id(job), None)
        self._penalty_ids.remove(id(job))
        self._num_sampled.pop(id(job), None)

    def _fail(self, seq: SeqState, error: BaseException) -> Result:
        self._forget(seq.job)
        self.scheduler.remove(seq)
        return seq.job.error_result(error)

    # --- blocking convenience API ---

    def generate(self, prompt: str | Sequence[str], max_new_tokens: int, min_new_tokens: int = 0,
                 seed: int | None = None, gen_settings: SamplerSettings | Sequence[SamplerSettings] | None = None,
                 encode_special_tokens: bool = False, decode_special_tokens: bool = False,
                 stop_conditions: Sequence[int | str] | None = None, add_bos: bool = False,
                 abort_event: Any = None, completion_only: bool = False,
                 return_last_results: bool = False) -> Any:
        """Generate completions for one prompt (returns str) or a list (returns list[str]), running alongside any
        other jobs of this generator. Prompt i gets seed + i. With `abort_event` (a threading.Event) set, this
        call's jobs are cancelled and None is returned. Completions include text held when a stop token ended
        the job."""
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        if isinstance(gen_settings, SamplerSettings) or gen_settings is None:
            settings = [gen_settings] * len(prompts)
        else:
            settings = list(gen_settings)
            if len(settings) != len(prompts):
                raise ValueError(f"gen_settings has {len(settings)} entries for {len(prompts)} prompts")
        jobs = [DynamicJob(
            input_ids=self.tokenizer.encode(p, add_bos=add_bos, encode_special_tokens=encode_special_tokens),
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, stop_conditions=stop_conditions,
            gen_settings=s, seed=None if seed is None else seed + i, decode_special_tokens=decode_special_tokens,
            identifier=i) for i, (p, s) in enumerate(zip(prompts, settings))]
        for job in jobs:
            self.validate_job(job)
        last: dict[int, Result] = {}
        waiting = list(jobs)
        mine = {id(j) for j in jobs}
        while len(last) < len(jobs):
            while waiting and self.num_pending_jobs() < self.max_q_size:
                self.enqueue(waiting.pop(0))
            if abort_event is not None and abort_event.is_set():
                for job in jobs:
                    self.cancel(job)
                return None
            for result in self._step():
                if id(result.job) not in mine:
                    self._deferred.append(result)
                elif result.eos:
                    if result.error is not None:
                        for job in jobs:
                            self.cancel(job)
                        raise result.error
                    last[result.job.identifier] = result
        completions = [last[i].full_completion if completion_only else prompts[i] + last[i].full_completion
                       for i in range(len(jobs))]
        out: Any = completions[0] if single else completions
        if return_last_results:
            return out, ([last[0]] if single else [last[i] for i in range(len(jobs))])
        return out
