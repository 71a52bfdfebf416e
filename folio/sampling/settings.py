"""SamplerSettings: one job's sampling parameters (the reference's names and defaults), frozen and validated."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from folio.limits import (  # noqa: F401 - the bounds, re-exported here
    MAX_INT32,
    MAX_LOGIT_OFFSET,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)

# Below this temperature a row is sampled greedily (the reference's rule).
GREEDY_TEMPERATURE = 0.01


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _freeze_bias(token_bias: object) -> tuple[tuple[int, float], ...]:
    """Mapping (or pairs) id -> additive logit bias, as a sorted tuple of (id, bias) pairs."""
    if token_bias is None:
        return ()
    pairs = token_bias.items() if isinstance(token_bias, Mapping) else token_bias
    frozen: dict[int, float] = {}
    for pair in pairs:
        try:
            token_id, bias = pair
        except (TypeError, ValueError):
            raise TypeError(f"SamplerSettings.token_bias: expected a mapping id -> bias, got entry {pair!r}") from None
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"SamplerSettings.token_bias: token id must be an int >= 0, got {token_id!r}")
        if not _is_real(bias) or math.isnan(bias) or bias == math.inf:
            raise ValueError(f"SamplerSettings.token_bias[{token_id}]: bias must be a finite number or -inf "
                             f"(to ban the token), got {bias!r}")
        if bias != -math.inf and abs(bias) > MAX_LOGIT_OFFSET:
            raise ValueError(f"SamplerSettings.token_bias[{token_id}]: bias must be in [{-MAX_LOGIT_OFFSET}, "
                             f"{MAX_LOGIT_OFFSET}], or -inf to ban the token, got {bias!r}")
        if token_id in frozen:
            raise ValueError(f"SamplerSettings.token_bias: token id {token_id} appears twice")
        frozen[token_id] = float(bias)
    return tuple(sorted(frozen.items()))


@dataclass(frozen=True)
class SamplerSettings:
    """Per-job sampling settings.

    temperature: logits are divided by it; < 0.01 means greedy.
    top_k: keep the k most probable tokens (0 = off).
    top_p: keep the smallest set of most probable tokens whose probability mass reaches p (0 or 1 = off).
    min_p: keep tokens with probability >= min_p * (highest probability) (0 = off).
    token_repetition_penalty: CTRL-style, for each distinct token in the window a positive logit is divided by it and
        a negative one multiplied (1 = off).
    token_repetition_range: the most recent tokens (prompt + output) penalised at full strength (-1 = all of them).
    token_repetition_decay: further tokens over which all three penalties fade linearly to zero.
    token_frequency_penalty: subtracted once per occurrence in the window.
    token_presence_penalty: subtracted once per distinct token in the window.
    token_bias: id -> value added to that logit (-inf bans the token); stored as a sorted tuple of (id, bias).
    cfg_scale: classifier-free guidance (folio.cfg): a job of two prompts samples from
        cfg_scale * log_softmax(positive) + (1 - cfg_scale) * log_softmax(negative); None: no guidance.

    Values that would overflow the sampler's fp32 logits are rejected: presence, frequency and bias beyond
    +-MAX_LOGIT_OFFSET (a bias of -inf stays allowed), repetition penalties outside [MIN_REPETITION_PENALTY,
    MAX_REPETITION_PENALTY], temperatures above MAX_TEMPERATURE, and integers beyond int32.
    """

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.8
    min_p: float = 0.0
    token_repetition_penalty: float = 1.025
    token_repetition_range: int = -1
    token_repetition_decay: int = 0
    token_frequency_penalty: float = 0.0
    token_presence_penalty: float = 0.0
    token_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    cfg_scale: float | None = None

    def __post_init__(self) -> None:
        # The bounds and the reasons for them: the constants at the top of this module.
        self._check_real("temperature", low=0.0, high=MAX_TEMPERATURE)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(f"SamplerSettings.top_k must be an int in [0, {MAX_INT32}] (0 = off), "
                             f"got {self.top_k!r}")
        self._check_real("top_p", low=0.0, high=1.0)
        self._check_real("min_p", low=0.0, high=1.0)
        self._check_real("token_repetition_penalty", low=MIN_REPETITION_PENALTY, high=MAX_REPETITION_PENALTY)
        if not _is_int(self.token_repetition_range) or not -1 <= self.token_repetition_range <= MAX_INT32:
            raise ValueError(f"SamplerSettings.token_repetition_range must be an int in [0, {MAX_INT32}], or -1 "
                             f"for the whole history, got {self.token_repetition_range!r}")
        if not _is_int(self.token_repetition_decay) or not 0 <= self.token_repetition_decay <= MAX_INT32:
            raise ValueError(f"SamplerSettings.token_repetition_decay must be an int in [0, {MAX_INT32}], "
                             f"got {self.token_repetition_decay!r}")
        self._check_real("token_frequency_penalty", low=-MAX_LOGIT_OFFSET, high=MAX_LOGIT_OFFSET)
        self._check_real("token_presence_penalty", low=-MAX_LOGIT_OFFSET, high=MAX_LOGIT_OFFSET)
        object.__setattr__(self, "token_bias", _freeze_bias(self.token_bias))
        if self.cfg_scale is not None:
            self._check_real("cfg_scale")

    def _check_real(self, name: str, low: float | None = None, high: float | None = None) -> None:
        value = getattr(self, name)
        if not _is_real(value) or not math.isfinite(value):
            raise ValueError(f"SamplerSettings.{name} must be a finite number, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"SamplerSettings.{name} must be in [{low}, {high if high is not None else 'inf'}], "
                             f"got {value!r}")

    @classmethod
    def greedy(cls, **overrides: object) -> SamplerSettings:
        """Always the most probable token: temperature 0, top_k 1, no truncation, no penalties."""
        base = cls(temperature=0.0, top_k=1, top_p=0.0, min_p=0.0, token_repetition_penalty=1.0)
        return dataclasses.replace(base, **overrides) if overrides else base

    @functools.cached_property
    def truncation_only(self) -> SamplerSettings:
        """These settings without penalties or bias: temperature and truncation alone (a draft model's)."""
        return dataclasses.replace(self, token_repetition_penalty=1.0, token_frequency_penalty=0.0,
                                   token_presence_penalty=0.0, token_bias=())

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def top_p_active(self) -> bool:
        return 0.0 < self.top_p < 1.0

    @property
    def penalty_window(self) -> int | None:
        """How many of the most recent tokens the penalties look at (None: the whole history; 0: penalties off)."""
        if (self.token_repetition_penalty == 1.0 and self.token_frequency_penalty == 0.0
                and self.token_presence_penalty == 0.0):
            return 0
        if self.token_repetition_range == -1:
            return None
        return self.token_repetition_range + self.token_repetition_decay
