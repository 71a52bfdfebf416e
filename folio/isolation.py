"""When a step fails: its chunks or rows again, one at a time, so that only the jobs whose own chunk or row fails
again fail (with their own error) and the others go on. The generator never wedges on one job's bad input."""

from __future__ import annotations

import logging

import torch

from folio.emitter import Emitter
from folio.results import Result
from folio.runner import ModelRunner
from folio.scheduler import Chunk, StepPlan
from folio.sequence import SeqStatus

logger = logging.getLogger(__name__)


def forward_each(runner: ModelRunner, emitter: Emitter, plan: StepPlan,
                 error: Exception) -> tuple[torch.Tensor | None, list[Result]]:
    """The step's forward failed: run its chunks one at a time. Keeps the chunks that ran in the plan; returns
    their logits and the failed jobs' results."""
    logger.warning("a step's forward failed (%s); retrying its %d chunks one by one", error, len(plan.chunks))
    kept, parts, failed = [], [], []
    for chunk in plan.chunks:
        if chunk.seq.status is not SeqStatus.RUNNING:
            continue
        try:
            logits, _ = runner.forward(StepPlan(chunks=[chunk]))
        except Exception as own:  # noqa: BLE001 - this chunk's job fails, the others go on
            failed.append(emitter.fail(chunk.seq, own))
            continue
        kept.append(chunk)
        if logits is not None:
            parts.append(logits)
    plan.chunks = kept
    return (torch.cat(parts) if parts else None), failed


def sample_each(runner: ModelRunner, emitter: Emitter, chunks: list[Chunk], logits: torch.Tensor,
                error: Exception) -> list[Result]:
    """Sampling the batch failed: sample each row alone and emit what succeeds. (The batch sampled the logits in
    place; a failure after its first in-place kernel, which validated jobs do not reach, would leave those rows
    penalised twice.)"""
    logger.warning("sampling a step failed (%s); sampling its %d rows one by one", error, len(chunks))
    results = []
    for row, chunk in enumerate(chunks):
        try:
            sampled = runner.sample([chunk], logits[row:row + 1].clone()).read()
        except Exception as own:  # noqa: BLE001 - this row's job fails, the others go on
            results.append(emitter.fail(chunk.seq, own))
            continue
        results += emitter.emit(emitter.stage_all([chunk], sampled))
    return results


def verify_each(runner: ModelRunner, emitter: Emitter, plain: list[Chunk], plain_logits: torch.Tensor | None,
                verify: list[Chunk], verify_logits: torch.Tensor, error: Exception) -> list[Result]:
    """Sampling a step with verify rows failed: the plain rows one by one (sample_each), then each verify row
    alone; only the jobs whose own row fails again fail."""
    results = sample_each(runner, emitter, plain, plain_logits, error) if plain else []
    logger.warning("verifying a step failed (%s); verifying its %d rows one by one", error, len(verify))
    offset = 0
    for chunk in verify:
        rows = verify_logits[offset:offset + chunk.num_logits]
        offset += chunk.num_logits
        try:
            tokens = runner.verify([chunk], rows).read()[0]
        except Exception as own:  # noqa: BLE001 - this row's job fails, the others go on
            results.append(emitter.fail(chunk.seq, own))
            continue
        results += emitter.emit(emitter.stage_verified(chunk, tokens))
    return results
