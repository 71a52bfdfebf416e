"""LaunchAhead: the step pipeline's three overlap modes, in one object.

decode_ahead: the next step is planned and launched before this step's tokens are read back; its decode rows are
    fed the sampled ids straight from the device, so the device never waits for the host between steps. A job that
    a stop token or string ends has a step or two computed past its end, discarded.
prefill_ahead: with decode_ahead, steps that prefill prompts (admitting queued jobs, reusing cached prefixes) are
    launched ahead too; without it only steps in which every running job decodes are.
overlap_emit: a step's sampled tokens are handed to their jobs (text, stop strings, results) during the NEXT step,
    while the device computes it. Results arrive one step later; the tokens are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from folio.sampling.host import to_device
from folio.scheduler import Chunk, Scheduler, StepPlan
from folio.sequence import SeqStatus

if TYPE_CHECKING:
    from folio.runner import ModelRunner


@dataclass
class AheadStep:
    """A step launched before the tokens it feeds were read back: its plan, its logits (None when no chunk wants
    any, or the forward failed: then `error`), and for each chunk its first row of the logits (-1: none)."""

    plan: StepPlan
    logits: torch.Tensor | None
    logit_rows: list[int]
    used_graph: bool = False
    error: Exception | None = None


@dataclass
class LaunchAhead:
    decode_ahead: bool
    prefill_ahead: bool
    overlap_emit: bool
    step: AheadStep | None = None  # launched ahead, sampled by the next step
    staged: list[Any] = field(default_factory=list)  # sampled tokens not yet handed to their jobs (overlap_emit)
    num_steps_ahead: int = 0
    num_prefill_steps_ahead: int = 0  # of those, steps with prompt tokens

    def take(self) -> AheadStep | None:
        """The step launched ahead, without the chunks of sequences that ended or left since (their logits are
        dropped); None when there is none or nothing of it is still wanted."""
        ahead, self.step = self.step, None
        if ahead is None:
            return None
        plan = ahead.plan
        kept = [i for i, c in enumerate(plan.chunks) if c.seq.status is SeqStatus.RUNNING]
        if not kept and not plan.started and not plan.progressed:
            return None  # (jobs it admitted or advanced by prefix reuse must still get their results)
        if len(kept) < len(plan.chunks):
            rows = [ahead.logit_rows[i] + j for i in kept if ahead.logit_rows[i] >= 0
                    for j in range(max(1, plan.chunks[i].num_logits))]
            plan.chunks = [plan.chunks[i] for i in kept]
            if ahead.logits is not None:
                ahead.logits = ahead.logits[to_device(rows, torch.int64, ahead.logits.device)] if rows else None
        return ahead

    def launch(self, chunks: list[Chunk], token_ids: torch.Tensor, scheduler: Scheduler, runner: ModelRunner,
               max_batch_size: int) -> None:
        """Plan and launch the step that follows this one: `chunks` are this step's sampled rows, token_ids their
        sampled ids, on the device. Rows whose jobs do not end by length with this token become its decode rows,
        fed those ids; with prefill_ahead the rest of the step is planned as usual. Nothing is launched when the
        next step must be planned after this one's tokens are known: jobs are queued and this token ends one by
        length, some job prefills or is admitted and prefill_ahead is off, or the pages for it might run short
        (planning ahead never preempts)."""
        # (a sequence that ended since it was sampled, by a stop string found when earlier tokens were handed over
        # this step, has released its pages: it feeds nothing)
        rows = [i for i, c in enumerate(chunks) if c.seq.status is SeqStatus.RUNNING
                and c.seq.num_sampled + 1 < c.seq.job.max_sampled_tokens]
        # A job that this token ends by length frees its batch slot and pages only at staging: with jobs queued,
        # plan after it so that they get them at once. (One that a stop token ends is replaced a step later.)
        if scheduler.pending and len(rows) < len(chunks):
            return
        admits = scheduler.pending and len(scheduler.active) < max_batch_size
        if not self.prefill_ahead and (not rows or len(chunks) != len(scheduler.active) or admits):
            return
        plan = scheduler.plan_ahead([chunks[i].seq for i in rows])
        if plan is None or not (plan.chunks or plan.copies or plan.started or plan.progressed):
            return
        ids = None
        if rows:
            index = to_device(rows, torch.int64, token_ids.device) if len(rows) < len(chunks) else None
            # -1 (a row where nothing could be picked: that job fails at staging) must not reach the embedding
            ids = (token_ids if index is None else token_ids[index]).clamp(min=0)
        logit_rows, num_logits = [], 0
        for k, c in enumerate(plan.chunks):
            count = 1 if k < len(rows) else c.num_logits
            logit_rows.append(num_logits if count else -1)
            num_logits += count
        self.num_steps_ahead += 1
        self.num_prefill_steps_ahead += any(c.num_tokens > 1 for c in plan.chunks)
        try:
            logits, used_graph = runner.forward(plan, ids)
            self.step = AheadStep(plan, logits, logit_rows, used_graph)
        except Exception as error:  # noqa: BLE001 - the next step fails this one's jobs, as a planned step would
            self.step = AheadStep(plan, None, logit_rows, error=error)

    def take_staged(self) -> list[Any]:
        staged, self.staged = self.staged, []
        return staged

    def clear(self) -> None:
        self.step = None
        self.staged = []
