"""Speculator: the drafting side of a step, between the scheduler and the model runner.

Before a step is planned it says how many tokens each decoding sequence drafts (folio.speculative.adaptive) and, for
n-gram drafting, which (host-side, from the sequence's own tokens); the scheduler plans verify rows for them. A draft
model drafts after planning, into the verify rows' pages (`fill`). After verification `settle` records what was
accepted.
"""

from __future__ import annotations

import itertools

from folio.embeddings import is_placeholder
from folio.scheduler import Chunk, StepPlan
from folio.sequence import SeqStatus, Sequence
from folio.speculative.adaptive import DraftLengths
from folio.speculative.draft_model import DraftModelRunner
from folio.speculative.ngram import NgramDraft


class Speculator:
    def __init__(self, lengths: DraftLengths, max_q_size: int, draft_runner: DraftModelRunner | None = None,
                 max_ngram: int = 4):
        self.lengths = lengths
        self.max_q_size = max_q_size
        self.draft_runner = draft_runner
        self.max_ngram = max_ngram
        self._ngrams: dict[Sequence, NgramDraft] = {}
        self._has_proposal: dict[Sequence, bool] = {}  # n-gram: as of the sequence's last staged token
        self._followed: dict[Sequence, list] = {}  # n-gram: [tokens seen with a successor, tokens observed]
        self.num_drafted = 0
        self.num_accepted = 0

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """A decoding sequence whose job takes drafts: jobs that return per-token probabilities, top tokens or
        logits decode without them (those are reported for the sampled token of a one-token row)."""
        return (seq.status is SeqStatus.RUNNING and seq.num_sampled > 0 and seq.num_uncached_tokens == 1
                and Speculator._job_takes_drafts(seq))

    def limit(self, seq: Sequence) -> int:
        """The most seq may draft: a verify row yields up to drafts + 1 tokens, never past max_new_tokens."""
        return max(0, min(self.max_q_size - 1, seq.job.max_new_tokens - seq.num_sampled - 1))

    def drafts(self, active: list[Sequence], step_idx: int) -> dict[Sequence, tuple[int, ...]]:
        """The drafts to plan this step: n-gram proposals, or placeholders (-1) that `fill` replaces."""
        seqs = [s for s in active if self.eligible(s)]
        if not seqs:
            return {}
        if self.draft_runner is None:
            seqs = [s for s in seqs if self._has_proposal.get(s, True)]
        ks = self.lengths.lengths(seqs, [self.limit(s) for s in seqs], step_idx, len(active))
        planned = {}
        for seq, k in zip(seqs, ks):
            if k == 0:
                continue
            if self.draft_runner is not None:
                planned[seq] = (-1,) * k
                continue
            index = self._ngram_index(seq)
            # a placeholder of injected embeddings (folio.embeddings) is never sampled: drafting stops before one
            proposal = tuple(itertools.takewhile(lambda t: not is_placeholder(t), index.propose(k)))
            if proposal:
                planned[seq] = proposal
        return planned

    def fill(self, plan: StepPlan) -> None:
        """Draft into the plan's verify rows (a draft model's pass): their drafts, and the drafter's distributions
        at them for sampled jobs."""
        chunks = [c for c in plan.chunks if c.verify]
        if self.draft_runner is None or not chunks:
            return
        out = self.draft_runner.draft(chunks, [len(c.drafts) for c in chunks])
        for chunk, ids, probs in zip(chunks, out.token_ids, out.probs):
            chunk.drafts, chunk.draft_probs = tuple(ids), probs

    def settle(self, chunk: Chunk, num_accepted: int) -> None:
        num_drafted = len(chunk.drafts)
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        job = chunk.seq.job
        job.accepted_draft_tokens += num_accepted
        job.rejected_draft_tokens += num_drafted - num_accepted
        self.lengths.record(chunk.seq, num_drafted, num_accepted)
        if self.draft_runner is not None:
            self.draft_runner.settle(chunk.seq, chunk.end, num_accepted)

    def _ngram_index(self, seq: Sequence) -> NgramDraft:
        index = self._ngrams.get(seq)
        if index is None:
            index = self._ngrams[seq] = NgramDraft(max_ngram=self.max_ngram)
        index.extend(seq.token_ids)
        return index

    def any_drafting(self, seqs: list[Sequence], next_step_idx: int) -> bool:
        """Whether some of `seqs` (whose next tokens are being sampled) may draft in step next_step_idx: then that
        step is not launched ahead."""
        candidates = [s for s in seqs if self._job_takes_drafts(s) and self.limit(s) > 1]
        if self.draft_runner is None:
            candidates = [s for s in candidates if self._has_proposal.get(s, True)]
        return self.lengths.any_drafting(candidates, [self.limit(s) - 1 for s in candidates], next_step_idx,
                                         len(seqs))

    def observe(self, seq: Sequence) -> None:
        """seq's tokens grew (staging, while the device runs the next step): for n-gram drafting, note whether its
        last token occurred before with a successor, which is exactly when the n-gram drafter has something to
        propose (every longer match ends in that one-token context). Only such sequences draft (or stop the next
        step from being launched ahead): text without repeats costs a set lookup per token, and a sequence that
        starts repeating itself drafts at once. The full n-gram index is built only when a sequence drafts."""
        if self.draft_runner is not None or not self._job_takes_drafts(seq):
            return
        tokens = seq.token_ids
        followed = self._followed.get(seq)
        if followed is None:
            followed = self._followed[seq] = [set(tokens[:-1]), len(tokens)]
        seen, num_seen = followed
        if len(tokens) < num_seen:  # rolled back: start over
            seen.clear()
            seen.update(tokens[:-1])
        else:
            seen.update(tokens[num_seen - 1:-1])
        followed[1] = len(tokens)
        self._has_proposal[seq] = tokens[-1] in seen

    @staticmethod
    def _job_takes_drafts(seq: Sequence) -> bool:
        return seq.job.takes_drafts and seq.cfg_partner is None

    def forget(self, seq: Sequence) -> None:
        self._ngrams.pop(seq, None)
        self._has_proposal.pop(seq, None)
        self._followed.pop(seq, None)
        self.lengths.forget(seq)
        if self.draft_runner is not None:
            self.draft_runner.forget(seq)
            if seq.cfg_partner is not None:  # a CFG job's other sequence: its chunks were mirrored too
                self.draft_runner.forget(seq.cfg_partner)
