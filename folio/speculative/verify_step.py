"""A generator step with verify rows (speculative decoding): plain rows sampled, verify rows rejection-sampled,
their tokens staged; nothing is launched ahead (the next step's drafts depend on what is accepted now)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from folio import cfg, isolation
from folio.results import Result
from folio.sampling.host import to_device
from folio.scheduler import Chunk
from folio.stats import StepStats

if TYPE_CHECKING:
    from folio.generator import DynamicGenerator


def verify_and_emit(gen: DynamicGenerator, chunks: list[Chunk], logits: torch.Tensor, stats: StepStats,
                    tick: float) -> list[Result]:
    """The step's results from its sampled rows `chunks` (some of them verify rows) and their `logits`."""
    emitter, runner = gen.emitter, gen.runner
    rows, offset = [], 0
    for c in chunks:
        rows.append(offset)
        offset += c.num_logits
    plain = [i for i, c in enumerate(chunks) if not c.verify]
    verify = [i for i, c in enumerate(chunks) if c.verify]
    device = logits.device
    plain_chunks, verify_chunks = [chunks[i] for i in plain], [chunks[i] for i in verify]
    plain_logits = logits[to_device([rows[i] for i in plain], torch.int64, device)] if plain else None
    if plain and gen.scheduler.num_cfg_jobs:
        plain_chunks, plain_logits = cfg.mix(plain_chunks, plain_logits, gen.vocab_size)
        plain = plain if plain_chunks else []
    verify_rows = [[rows[i] + j for j in range(chunks[i].num_logits)] for i in verify]
    verify_logits = logits[to_device([r for row in verify_rows for r in row], torch.int64, device)]
    try:
        sampled = runner.sample(plain_chunks, plain_logits) if plain else None
        verified = runner.verify(verify_chunks, verify_logits)
    except Exception as error:  # noqa: BLE001 - find the rows that fail alone; the others go on
        return emitter.emit(gen.pipeline.take_staged()) + isolation.verify_each(
            runner, emitter, plain_chunks, plain_logits, verify_chunks, verify_logits, error)
    tick = stats.lap("sample", tick)
    results = emitter.emit(gen.pipeline.take_staged()) if gen.pipeline.overlap_emit else []
    staged = emitter.stage_all(plain_chunks, sampled.read()) if sampled is not None else []
    for chunk, tokens in zip(verify_chunks, verified.read()):
        staged += emitter.stage_verified(chunk, tokens)
    tick = stats.lap("wait_tokens", tick)
    if gen.pipeline.overlap_emit and not any(c.seq.job.rolls_back for c in plain_chunks):
        gen.pipeline.staged = staged
        return results
    results += emitter.emit(staged)
    stats.lap("emit", tick)
    return results
