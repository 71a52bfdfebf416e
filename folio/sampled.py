"""A step's sampler outputs on their way to the host: SampledStep (sampled rows) and VerifiedStep (verify rows)
hold the device results and the pinned copies queued behind them; `read` is the step's one intended host sync."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from folio.sampling.host import to_device
from folio.sampling.sampler import SampleOutput
from folio.scheduler import Chunk
from folio.speculative.acceptance import Verdicts, num_accepted


@dataclass
class SampledTokens:
    """A step's sampled tokens on the host, one entry per sampled row."""

    token_ids: list[int]
    probs: list[float] | None
    top_tokens: list[list[int]] | None
    top_probs: list[list[float]] | None
    logits: dict[int, torch.Tensor]  # row -> processed logits, fp32 on the CPU (rows that asked for them)


class SampledStep:
    """A step's sampler outputs: `token_ids` stays on the device (a step launched ahead feeds on it); what the
    host reads is copied as soon as it is computed, on CUDA into pinned memory without blocking."""

    def __init__(self, output: SampleOutput, probs: bool, top: bool, logits_rows: list[int]):
        self.token_ids = output.token_ids
        device = output.token_ids.device
        self._event = None
        self._logits_rows = logits_rows
        self._host = [self._fetch(output.token_ids),
                      self._fetch(output.token_probs) if probs else None,
                      self._fetch(output.top_k_tokens) if top else None,
                      self._fetch(output.top_k_probs) if top else None]
        self._logits = None
        if logits_rows:
            rows = logits_rows if len(logits_rows) < output.logits.shape[0] else slice(None)
            if isinstance(rows, list):
                rows = to_device(rows, torch.int64, device)
            self._logits = self._fetch(output.logits[rows])
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

    def read(self) -> SampledTokens:
        """The one intended host sync of a step: the sampled ids decide what every job does next."""
        if self._event is not None:
            self._event.synchronize()
        ids, probs, top_ids, top_probs = (None if t is None else t.tolist() for t in self._host)
        logits = {row: self._logits[k].to(torch.float32, copy=True) for k, row in enumerate(self._logits_rows)}
        return SampledTokens(ids, probs, top_ids, top_probs, logits)


class VerifiedStep:
    """The verdicts of a step's verify rows, on the device until `read`."""

    def __init__(self, chunks: Seq[Chunk], verdicts: Verdicts):
        self.chunks = chunks
        self._host = [SampledStep._fetch(verdicts.accepted), SampledStep._fetch(verdicts.emitted_ids)]
        self._event = None
        if verdicts.accepted.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> list[list[int]]:
        """Per verify row, the tokens it yields: its accepted drafts, then the token drawn where it stopped (a
        host sync: these decide what each job does next)."""
        if self._event is not None:
            self._event.synchronize()
        accepted, emitted = (t.tolist() for t in self._host)
        num_drafts = [len(c.drafts) for c in self.chunks]
        tokens, offset = [], 0
        for chunk, n in zip(self.chunks, num_accepted(accepted, num_drafts)):
            tokens.append(list(chunk.drafts[:n]) + [emitted[offset + n]])
            offset += len(chunk.drafts) + 1
        return tokens
