"""Per-job sampler state that outlives a step: mirostat's mu. It lives on the job's Sequence
(`Sequence.sampler_state`), so that a preempted and resumed job continues where it was; the frozen SamplerSettings
never change. (DRY's state is the token history itself, `Sequence.token_ids`.) Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from folio.sampling.settings import SamplerSettings
    from folio.sequence import Sequence


@dataclass
class SamplerState:
    """mirostat_mu: the current target surprise bound in bits (None: not started, 2 * mirostat_tau)."""

    mirostat_mu: float | None = None


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
    state.mirostat_mu = mirostat_update(settings, mirostat_mu(settings, state), prob)
