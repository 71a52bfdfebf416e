"""Per-job sampler state that outlives a step: mirostat's mu. It lives on the job's Sequence
(`Sequence.sampler_state`), so that a preempted and resumed job continues where it was; the frozen SamplerSettings
never change. (DRY's state is the token history itself, `Sequence.token_ids`.) Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from folio.sampling.settings import SamplerSettings
    from folio.sequence import Sequence


@dataclass
class SamplerState:
    """mirostat_mu: the current target surprise bound in bits (None: not started, 2 * mirostat_tau).
    mu_before: mu before each token observed so far (None: the start), so a rollback (banned strings) can undo
    tokens."""

    mirostat_mu: float | None = None
    mu_before: list[float | None] = field(default_factory=list)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens observed tokens."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self.mu_before):
            raise ValueError(f"cannot roll back {num_tokens} tokens of {len(self.mu_before)} observed")
        self.mirostat_mu = self.mu_before[-num_tokens]
        del self.mu_before[-num_tokens:]


def mirostat_mu(settings: SamplerSettings, state: SamplerState | None) -> float:
    """The mu that the next token of a job with these settings and state is sampled under."""
    if state is None or state.mirostat_mu is None:
        return 2.0 * settings.mirostat_tau
    return state.mirostat_mu


def mirostat_update(settings: SamplerSettings, mu: float, prob: float) -> float:
    """mu after sampling a token of final probability `prob`: mu - eta * (surprise - tau), surprise = -log2 prob."""
    return mu - settings.mirostat_eta * (-math.log2(prob) - settings.mirostat_tau)


def observe_sampled(seq: Sequence, prob: float | None) -> None:
    """A token of final probability `prob` was staged for seq: advance its per-job state (a no-op unless the job
    uses mirostat). Called once per staged token, in order."""
    settings = seq.job.gen_settings
    if not settings.mirostat or prob is None or not prob > 0.0:
        return
    state = seq.sampler_state
    if state is None:
        state = seq.sampler_state = SamplerState()
    state.mu_before.append(state.mirostat_mu)
    state.mirostat_mu = mirostat_update(settings, mirostat_mu(settings, state), prob)
