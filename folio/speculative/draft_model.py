"""DraftModelRunner: a smaller model with the target's vocabulary that drafts tokens for verify rows.

Its K/V live in a cache of its own with the target's page size and page count, addressed through the target's page
tables: page i of the draft cache holds the draft model's K/V of the tokens that page i of the target's holds. Every
prompt chunk the target ingests is ingested here too (`mirror`), and every slot copy is repeated, so prefix reuse and
copy-on-write carry over page for page. Decode rows are not mirrored (that would cost a draft forward per token of
sequences that are not drafting); the first forward of a draft pass catches a sequence up instead, from the first
position whose draft K/V may be missing or stale, and always feeds at least the last two tokens so that every row of
that forward has the same shape in the common case (a captured graph serves it). What the draft cache holds only
ever changes the drafts, never the output: a page reused from the prefix cache whose tokens were generated while
their sequence was not drafting has no draft K/V for them, and drafts over it are accepted less.

A draft pass for rows with k_i drafts: one forward of each row's catch-up tokens, then k_max - 1 forwards of one
token per still-drafting row. Greedy jobs draft the argmax; sampled jobs draw from q, the draft's distribution under
the job's temperature and truncation, which the acceptance test then divides by (a better match to the target than a
point mass, so more is accepted).
The rows' positions are the target's: the scheduler has already allocated the verify rows' pages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.decode_graphs import DecodeGraphs
from folio.model.model import Model
from folio.sampling.distribution import draw, probabilities
from folio.sampling.host import to_device
from folio.sampling.rng import uniforms
from folio.sampling.rows import RowParams
from folio.scheduler import Chunk, StepPlan
from folio.sequence import Sequence
from folio.speculative.streams import draft_counter


@dataclass
class Drafts:
    """A draft pass's output: per row its drafted ids (host), and for rows of sampled jobs the drafter's
    distribution at each drafted position ([k_i, V] on the device; None for point masses)."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None]


class DraftModelRunner:
    def __init__(self, model: Model, cache: Cache, max_rows: int, max_seq_len: int, vocab_size: int,
                 cuda_graphs: bool):
        self.model, self.cache = model, cache
        self.page_size = cache.page_size
        self.vocab_size = vocab_size
        self.graphs = DecodeGraphs(model, cache, max_rows, max_seq_len) if cuda_graphs else None
        # tokens of each sequence whose draft K/V are known good (positions below it)
        self._num_cached: dict[Sequence, int] = {}
        self.num_forwards = 0

    # --- following the target's cache ---

    def mirror(self, plan: StepPlan, num_fed: int = 0) -> None:
        """The target runs `plan`: repeat its slot copies and ingest its prompt chunks (not the first num_fed
        chunks: decode rows fed from the device)."""
        for copy in plan.copies:
            self.cache.copy_page_slots(copy.src_page, copy.dst_page, copy.num_slots)
        chunks = [c for k, c in enumerate(plan.chunks) if k >= num_fed and not c.verify
                  and (c.is_prompt or c.seq.num_sampled == 0)]
        if not chunks:
            return
        batch = ForwardBatch.build([SeqChunk(c.token_ids, c.start, c.seq.block_table, logits="none")
                                    for c in chunks], self.page_size, self.model.device)
        self.model.forward(batch, self.cache)
        self.num_forwards += 1
        for c in chunks:
            # positions before the chunk were computed earlier or reused with their pages
            self._num_cached[c.seq] = c.end

    def forget(self, seq: Sequence) -> None:
        self._num_cached.pop(seq, None)

    def settle(self, seq: Sequence, first_draft_pos: int, num_accepted: int) -> None:
        """After verification: the draft K/V at first_draft_pos + num_accepted and beyond belong to rejected
        tokens."""
        if seq in self._num_cached:
            self._num_cached[seq] = min(self._num_cached[seq], first_draft_pos + num_accepted)

    # --- drafting ---

    def draft(self, chunks: list[Chunk], num_drafts: list[int]) -> Drafts:
        """Draft num_drafts[i] tokens after the last token of chunks[i].seq (each chunk a planned verify row, its
        pages allocated through position len(token_ids) + num_drafts[i] - 1). One host sync, reading the ids."""
        seqs = [c.seq for c in chunks]
        lengths = [len(s.token_ids) for s in seqs]
        logits = self._catch_up(seqs, lengths)
        picked, q = self._pick(logits, seqs, [0] * len(seqs))
        steps, step_q, active = [picked], [q], list(range(len(seqs)))
        for j in range(1, max(num_drafts)):
            keep = [i for i, r in enumerate(active) if num_drafts[r] > j]
            prev = steps[-1] if len(keep) == len(active) else steps[-1][to_device(keep, torch.int64,
                                                                                  picked.device)]
            active = [active[i] for i in keep]
            logits = self._one_token(prev, [seqs[r] for r in active], [lengths[r] + j - 1 for r in active])
            picked, q = self._pick(logits, [seqs[r] for r in active], [j] * len(active))
            steps.append(picked)
            step_q.append(q)
        # the one intended sync of a draft pass: the drafts are planned into the verify rows on the host
        host = [s.tolist() for s in steps]
        token_ids: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for j, ids in enumerate(host):
            active = [r for r in active if num_drafts[r] > j]
            for i, r in enumerate(active):
                token_ids[r].append(ids[i])
                if step_q[j] is not None and not seqs[r].job.gen_settings.is_greedy:
                    probs[r].append(step_q[j][i])
        for seq, n, k in zip(seqs, lengths, num_drafts):
            self._num_cached[seq] = n + k - 1
        return Drafts(token_ids, [torch.stack(p) if p else None for p in probs])

    def _catch_up(self, seqs: list[Sequence], lengths: list[int]) -> torch.Tensor:
        """Feed each sequence's tokens from its first position without good draft K/V (at most its last two):
        the logits after its last token."""
        starts = [max(0, min(self._num_cached.get(s, 0), n - 2)) for s, n in zip(seqs, lengths)]
        self.num_forwards += 1
        if self.graphs is not None and all(n - s == 2 for s, n in zip(starts, lengths)) \
                and self.graphs.bucket_for(2 * len(seqs)) is not None:
            ids = [t for s in seqs for t in s.token_ids[-2:]]
            positions = [p for n in lengths for p in (n - 2, n - 1)]
            tables = [s.block_table for s in seqs for _ in range(2)]
            return self.graphs.run(ids, positions, tables)[1::2]
        chunks = [SeqChunk(s.token_ids[start:], start, s.block_table, logits="last")
                  for s, start in zip(seqs, starts)]
        return self.model.forward(ForwardBatch.build(chunks, self.page_size, self.model.device), self.cache)

    def _one_token(self, ids: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
        self.num_forwards += 1
        if self.graphs is not None and self.graphs.bucket_for(len(seqs)) is not None:
            return self.graphs.run(ids, positions, [s.block_table for s in seqs])
        chunks = [SeqChunk((0,), p, s.block_table, logits="last") for s, p in zip(seqs, positions)]
        batch = ForwardBatch.build(chunks, self.page_size, self.model.device)
        batch = dataclasses.replace(batch, input_ids=ids.to(batch.input_ids.dtype))
        return self.model.forward(batch, self.cache)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows: the argmax; sampled rows: a draw from q, the draft's distribution under the job's
        temperature and truncation (top-k, top-p, min-p: the closer q is to the target's p, the more is
        accepted), which is also returned (penalties and bias are left to the target)."""
        logits = logits[:, :self.vocab_size].float()
        if all(s.job.gen_settings.is_greedy for s in seqs):
            return logits.argmax(dim=1), None
        rows = [RowParams.unchecked(settings=s.job.gen_settings.truncation_only, u=0.0, history_ids=(),
                                    blocked_ids=(), vocab_size=None, return_top_tokens=0, return_logits=False)
                for s in seqs]
        q = probabilities(logits, rows)
        u = uniforms([s.job.seed for s in seqs],
                     [draft_counter(s.num_sampled + j) for s, j in zip(seqs, offsets)])
        return draw(q, to_device(u, torch.float64, logits.device)), q
