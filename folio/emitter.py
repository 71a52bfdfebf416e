"""Emitter: from sampled tokens to results. Staging appends a token to its sequence (so the next step can be
planned) and retires a sequence that the token ends; emission hands the token to its job (stop strings, text) and
turns it into a result. With overlapped emission the two are a step apart (folio.pipeline)."""

from __future__ import annotations

from dataclasses import dataclass

from folio import cfg
from folio.constrain.base import FilterError
from folio.job import NO_EXTRAS, DynamicJob, JobState, TokenExtras
from folio.results import Result
from folio.runner import ModelRunner
from folio.sampled import SampledTokens
from folio.sampling.state import observe_sampled
from folio.scheduler import Chunk, Scheduler, StepPlan
from folio.sequence import SeqStatus, Sequence
from folio.speculative.speculator import Speculator
from folio.stats import StepStats


@dataclass
class StagedToken:
    """A sampled token between staging (appended to its sequence) and emission (handed to its job)."""

    seq: Sequence
    token_id: int
    extras: TokenExtras
    failure: Result | None = None  # the job failed at staging: emit this result instead
    filter_ended: bool = False  # the job's filter completed its output with this token


class Emitter:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, speculator: Speculator | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator
        self.live: dict[DynamicJob, Sequence] = {}  # enqueued jobs that have not ended, in enqueue order
        self.num_rolling_back = 0  # of those, jobs whose emitted tokens may undo sampled ones (DynamicJob.rolls_back)
        self.stats = StepStats()  # the current step's (the generator swaps in a new one each step)

    def add(self, seq: Sequence) -> None:
        self.live[seq.job] = seq
        self.num_rolling_back += seq.job.rolls_back
        self.runner.add_sequence(seq)
        self.scheduler.add(seq)

    def stage_all(self, chunks: list[Chunk], sampled: SampledTokens) -> list[StagedToken]:
        staged = []
        plain = sampled.probs is None and sampled.top_tokens is None and not sampled.logits
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if not seq.is_live:
                continue  # ended (stop string, error, cancel) while this step ran: its token is dropped
            if plain:  # (the usual step: no row reports anything but its token)
                extras = NO_EXTRAS
            else:
                k = seq.job.return_top_tokens
                extras = TokenExtras(
                    prob=sampled.probs[i] if sampled.probs is not None else None,
                    top_k_tokens=sampled.top_tokens[i][:k] if k else None,
                    top_k_probs=sampled.top_probs[i][:k] if k else None,
                    logits=sampled.logits.get(i))
            staged.append(self.stage(seq, sampled.token_ids[i], extras))
            if self.speculator is not None and seq.is_live:
                self.speculator.observe(seq)
        return staged

    def stage_verified(self, chunk: Chunk, token_ids: list[int]) -> list[StagedToken]:
        """Stage what a verify row yielded (its accepted drafts, then one drawn token) until one ends the job;
        then the accepted drafts' K/V, already written, count as cached and the pages of rejected ones go."""
        seq = chunk.seq
        if not seq.is_live:
            return []
        num_accepted = len(token_ids) - 1
        self.speculator.settle(chunk, num_accepted)
        self.stats.num_drafted += len(chunk.drafts)
        self.stats.num_accepted_drafts += num_accepted
        position = len(seq.token_ids)
        staged = []
        for token_id in token_ids:
            staged.append(self.stage(seq, token_id, NO_EXTRAS))
            if staged[-1].failure is not None or seq.status is not SeqStatus.RUNNING:
                break
        if seq.status is SeqStatus.RUNNING:
            self.runner.record_tokens(seq, position + num_accepted, token_ids[-1:])
            self.scheduler.commit_drafts(seq, chunk.end + num_accepted)
            self.speculator.observe(seq)
        return staged

    def stage(self, seq: Sequence, token_id: int, extras: TokenExtras) -> StagedToken:
        """Append a sampled token to its sequence; a job that this token ends (max_new_tokens, a stop token)
        leaves the scheduler now. Its text and result come at emission."""
        job = seq.job
        if token_id < 0:
            return StagedToken(seq, token_id, extras, failure=self.fail(seq, self._nothing_to_pick(seq)))
        filter_ended = False
        if job.may_constrain and job.active_filters():
            try:
                filter_ended = job.feed_filters(token_id)
            except Exception as error:  # noqa: BLE001 - one job's filter fails that job, not the batch
                return StagedToken(seq, token_id, extras, failure=self.fail(seq, error))
        seq.token_ids.append(token_id)
        seq.num_sampled += 1
        # (per row and step: the calls only where they can do something)
        if extras.prob is not None:
            observe_sampled(seq, extras.prob)  # per-job sampler state (mirostat's mu; it needs the probability)
        if seq.cfg_partner is not None:
            cfg.follow(seq, token_id)  # a CFG job's negative sequence takes the token too
        self.stats.num_sampled += 1
        # (a job that may roll back ends by length or filter at emission, right after: the token may be undone)
        ends = filter_ended or seq.num_sampled >= job.max_sampled_tokens
        if token_id in job.stop_tokens or (ends and not job.rolls_back):
            self.scheduler.remove(seq)
            seq.status = SeqStatus.FINISHED
        return StagedToken(seq, token_id, extras, filter_ended=filter_ended)

    def _nothing_to_pick(self, seq: Sequence) -> BaseException:
        error = self.runner.mask_errors.pop(seq, None)
        if error is not None:
            return error
        rejected = seq.job.rejected_at(seq.num_sampled)
        if rejected:
            return RuntimeError(f"every token the job may pick after its {seq.num_sampled} sampled tokens leads into "
                                f"a banned string ({len(rejected)} tried there): generation cannot continue")
        if seq.job.active_filters():
            return FilterError("the job's filters allow no token here (with its blocked tokens, bias and "
                                "vocabulary): generation cannot continue under its constraints")
        return RuntimeError("every token was masked for this job (blocked tokens, bias and vocabulary leave "
                            "nothing)")

    def emit(self, staged: list[StagedToken]) -> list[Result]:
        """Hand staged tokens to their jobs (stop checks, text); results in staging order."""
        results = []
        for entry in staged:
            if entry.failure is not None:
                results.append(entry.failure)
                continue
            seq, job = entry.seq, entry.seq.job
            if job not in self.live:
                continue  # cancelled or failed since it was staged
            try:
                result = job.receive_token(entry.token_id, entry.extras, entry.filter_ended)
            except Exception as error:  # noqa: BLE001 - one job's failure must not take down the batch
                results.append(self.fail(seq, error))
                continue
            results.append(result)
            if result.eos:
                self.retire(seq, SeqStatus.FINISHED)
            elif result.suppressed_tokens:
                try:
                    self.rollback(seq, len(result.suppressed_tokens))
                except Exception as error:  # noqa: BLE001 - a filter that cannot roll back fails its job
                    results.append(self.fail(seq, error))
        return results

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """The job undid its last num_tokens sampled tokens (a banned string): undo them in the sequence and its
        pages (folio.cache.manager.KVCacheManager.rollback; the K/V before them stay, the new last token is fed
        again), the sampled count (the penalty history on the device and the draws are indexed by it), the
        filters and the sampler state. Only between steps, with no step launched ahead holding the sequence."""
        job = seq.job
        if self.runner.masks is not None:
            self.runner.masks.discard(seq)  # a mask being computed reads the filters' state: wait for it
        job.rollback_filters(seq.num_sampled, num_tokens)
        if seq.sampler_state is not None:  # mirostat's mu (DRY's state is the token history, rolled back below)
            seq.sampler_state.rollback(num_tokens)
        for undone in (seq, seq.cfg_partner) if seq.cfg_partner is not None else (seq,):  # a CFG pair: both
            if undone.status is SeqStatus.RUNNING:
                self.scheduler.cache.rollback(undone, num_tokens)
            else:  # (waiting: its tokens are all prompt, and pages it has none)
                del undone.token_ids[len(undone.token_ids) - num_tokens:]
                self.scheduler.cache.start(undone)
            undone.num_sampled -= num_tokens
        if self.speculator is not None:
            self.speculator.forget(seq)  # (such a job does not draft: nothing of it is worth keeping)
        self.stats.num_rolled_back += num_tokens

    def started_results(self, plan: StepPlan) -> list[Result]:
        results = []
        for seq in plan.started:
            if seq.is_live:
                results.append(seq.job.started_result())
                seq.job.state = JobState.ACTIVE
        self.stats.num_started += len(results)
        return results

    def prefill_results(self, plan: StepPlan, any_prompt: bool = True) -> list[Result]:
        """Prompt progress of the sequences that prefilled this step and have sampled nothing yet. any_prompt:
        False when the caller knows that no chunk of the plan is a prompt chunk (then only plan.progressed counts)."""
        if not any_prompt and not plan.progressed:
            return []  # (a decode step: nothing prefilled)
        results = []
        seen: set[Sequence] = set()
        # (plan.progressed is a set: taken in admission order, so results come in the same order every run)
        progressed = [c.seq for c in plan.chunks if c.is_prompt] + [s for s in self.scheduler.active
                                                                    if s in plan.progressed]
        for seq in progressed:
            if seq in seen or seq.num_sampled > 0 or seq.status is not SeqStatus.RUNNING or seq.cfg_negative:
                continue
            seen.add(seq)
            target = seq.num_prefill_target
            results.append(seq.job.prefill_result(min(seq.num_cached_tokens, target), target))
        return results

    def fail(self, seq: Sequence, error: BaseException) -> Result:
        self.retire(seq, SeqStatus.FAILED)
        self.stats.num_failed += 1
        return seq.job.error_result(error)

    def retire(self, seq: Sequence, status: SeqStatus) -> None:
        """The job ended or was cancelled: forget it and release its pages (a CFG job's two sequences)."""
        seq = cfg.positive(seq)
        if self.live.pop(seq.job, None) is not None:
            self.stats.num_finished += status is not SeqStatus.CANCELLED
            self.num_rolling_back -= seq.job.rolls_back
        self.runner.remove_sequence(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        self.scheduler.remove(seq)
        seq.status = status
