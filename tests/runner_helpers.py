"""Driving folio.runner.ModelRunner by hand: verify rows (every token's logits) against one-token steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import folio
from folio.cache.manager import KVCacheManager
from folio.runner import ModelRunner
from folio.scheduler import Chunk, StepPlan
from folio.sequence import Sequence

PAGE_SIZE = 16
# (prompt, drafted tokens): rows of different lengths, one crossing a page boundary, one starting a page
VERIFY_CASES = [(list(range(5, 40)), [11, 12, 13, 14]), (list(range(60, 77)), [3, 4]),
                ([7, 3, 9] * 10 + [5, 6], [21, 22, 23, 24])]


@dataclass(eq=False)
class _Job:
    prompt_tokens: int
    embeddings: None = None  # (folio.embeddings: none injected)


def _runner(model: folio.Model, graphs: bool, max_rows: int) -> tuple[ModelRunner, KVCacheManager]:
    cache = folio.Cache(model, num_tokens=64 * PAGE_SIZE, page_size=PAGE_SIZE)
    manager = KVCacheManager(cache.num_pages, PAGE_SIZE, prefix_cache=False)
    runner = ModelRunner(model, cache, max_batch_size=max_rows, max_seq_len=256, vocab_size=model.config.vocab_size,
                         max_q_size=5, cuda_graphs=graphs if model.device.type == "cuda" else None)
    return runner, manager


def _prefill(runner: ModelRunner, manager: KVCacheManager) -> list[Sequence]:
    """Each case's prompt but its last token, in the cache; its drafted tokens appended, not yet fed."""
    seqs = []
    for prompt, drafts in VERIFY_CASES:
        seq = Sequence(job=_Job(len(prompt)), token_ids=prompt + drafts)
        assert manager.allocate(seq, len(seq.token_ids))
        runner.forward(StepPlan(chunks=[Chunk(seq, 0, len(prompt) - 1)]))
        manager.commit(seq, len(prompt) - 1)
        seqs.append(seq)
    return seqs


def verify_rows_logits(path, device: str, dtype: torch.dtype, graphs: bool, options=None):
    """For every case: the logits of its verify row (the last prompt token and its drafts, one forward with the
    other cases' rows), the logits of the same tokens fed one step at a time, and whether the verify forward
    replayed a captured graph."""
    model = folio.Model.from_pretrained(path, device=device, dtype=dtype, progress=False, options=options)
    rows = sum(len(d) + 1 for _, d in VERIFY_CASES)
    runner, manager = _runner(model, graphs, rows + 1)
    seqs = _prefill(runner, manager)
    plan = StepPlan(chunks=[Chunk(s, len(p) - 1, len(s.token_ids), verify=True)
                            for s, (p, _) in zip(seqs, VERIFY_CASES)])
    logits, used_graph = runner.forward(plan)
    verify = list(logits.float().cpu().split([c.num_tokens for c in plan.chunks]))

    runner, manager = _runner(model, graphs, rows + 1)
    seqs = _prefill(runner, manager)
    steps = [[] for _ in seqs]
    for k in range(max(len(d) for _, d in VERIFY_CASES) + 1):
        chunks = [Chunk(s, len(p) - 1 + k, len(p) + k, verify=True)
                  for s, (p, _) in zip(seqs, VERIFY_CASES) if len(p) + k <= len(s.token_ids)]
        step_logits, _ = runner.forward(StepPlan(chunks=chunks))
        for chunk, row in zip(chunks, step_logits.float().cpu()):
            steps[seqs.index(chunk.seq)].append(row)
    return verify, [torch.stack(s) for s in steps], used_graph
