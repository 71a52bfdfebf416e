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

# Bounds of the extended samplers' values: past them nothing changes any more (a skew of 100 already maps every draw
# to ~1, a mirostat mu of 2 * 100 bits keeps every token), and within them no intermediate overflows float64.
MIN_TEMP_EXPONENT = 1e-3
MAX_TEMP_EXPONENT = 1e3
MAX_SMOOTHING_FACTOR = 1e4
MAX_SKEW = 100.0
MAX_MIROSTAT_TAU = 100.0
MAX_MIROSTAT_ETA = 10.0
MAX_DRY_BASE = 1e3
MAX_CFG_SCALE = 1e3
# The strings that make a token a DRY sequence breaker when dry_sequence_breakers is None (the reference's set).
DRY_DEFAULT_BREAKERS = (".", ",", "!", "?", "<", ">", "[", "]", "(", ")", "{", "}", "\n", "\t", '"')


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

    The extended samplers (all off by default; the order they run in: folio.sampling.sampler's docstring):
    temperature_last: apply `temperature` after truncation, as p^(1/T) renormalised, instead of to the logits.
    min_temp, max_temp, temp_exponent: dynamic temperature, on when max_temp > min_temp: after truncation (and after
        temperature_last), T = min_temp + (max_temp - min_temp) * (H / log n)^temp_exponent with H the entropy of the
        n remaining candidates, applied as p^(1/T). `temperature` still applies as well (set it to 1 to have the
        dynamic one alone), as in the reference.
    smoothing_factor: quadratic sampling: the logits l become -smoothing_factor * (l - max l)^2 (before the
        temperature, which divides them as usual unless temperature_last) (0 = off).
    top_a: keep tokens with p >= top_a * p_max^2 (0 = off).
    tfs: tail-free sampling with parameter z: cut the sorted tail where the cumulative normalised absolute second
        difference of the probabilities first exceeds z (0 or 1 = off).
    typical: locally typical sampling: keep the tokens whose surprise -log p is closest to the entropy, the smallest
        such set reaching mass `typical` (0 or 1 = off).
    skew: the draw u becomes u^(e^-skew) over the candidates sorted by probability; > 0 favours less probable ones.
    mirostat: 0 off, 1 Mirostat v1 (Zipf-estimated top-k), 2 Mirostat v2 (keep p >= 2^-mu); mu starts at
        2 * mirostat_tau and after each token becomes mu - mirostat_eta * (-log2 p - mirostat_tau) with p the sampled
        token's final probability. mu is per job, on its Sequence (folio.sampling.state), never on these settings.
    dry_multiplier, dry_base, dry_allowed_length, dry_sequence_breakers, dry_range, dry_max_ngram: DRY ("don't
        repeat yourself"), on when dry_multiplier > 0: a token t gets dry_multiplier * dry_base^(n -
        dry_allowed_length) subtracted from its logit, n the length (capped at dry_max_ngram) of the longest suffix
        of the context that occurred earlier followed by t, when n >= dry_allowed_length. Matches never include a
        sequence breaker, nor is a breaker penalised: a token is a breaker when its text contains one of the
        strings of dry_sequence_breakers (None: DRY_DEFAULT_BREAKERS plus the tokenizer's special tokens).
        dry_range: only the newest dry_range tokens of prompt + output take part (0 = all).
    xtc_threshold, xtc_probability: XTC ("exclude top choices"), on when xtc_probability > 0: when at least two
        tokens have p >= xtc_threshold, all of them but the least probable are excluded with probability
        xtc_probability. Done in expectation, which is the same distribution for the one draw per token: those
        tokens are scaled by (1 - xtc_probability) and every other token by 1 + xtc_probability * m / (1 - m),
        m the excluded tokens' mass.
    cfg_scale: classifier-free guidance weight (None = off); validated here, applied by the generator.

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
    temperature_last: bool = False
    min_temp: float = 0.0
    max_temp: float = 0.0
    temp_exponent: float = 1.0
    smoothing_factor: float = 0.0
    top_a: float = 0.0
    tfs: float = 0.0
    typical: float = 0.0
    skew: float = 0.0
    mirostat: int = 0
    mirostat_tau: float = 1.5
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] | None = None
    dry_range: int = 0
    dry_max_ngram: int = 20
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
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
        self._check_extended()

    def _check_extended(self) -> None:
        if not isinstance(self.temperature_last, bool):
            raise ValueError(f"SamplerSettings.temperature_last must be a bool, got {self.temperature_last!r}")
        self._check_real("min_temp", low=0.0, high=MAX_TEMPERATURE)
        self._check_real("max_temp", low=0.0, high=MAX_TEMPERATURE)
        if self.max_temp < self.min_temp:
            raise ValueError(f"SamplerSettings.max_temp ({self.max_temp!r}) must be >= min_temp ({self.min_temp!r}); "
                             "dynamic temperature is on when max_temp > min_temp")
        self._check_real("temp_exponent", low=MIN_TEMP_EXPONENT, high=MAX_TEMP_EXPONENT)
        self._check_real("smoothing_factor", low=0.0, high=MAX_SMOOTHING_FACTOR)
        for name in ("top_a", "tfs", "typical", "xtc_threshold", "xtc_probability"):
            self._check_real(name, low=0.0, high=1.0)
        self._check_real("skew", low=-MAX_SKEW, high=MAX_SKEW)
        if not _is_int(self.mirostat) or self.mirostat not in (0, 1, 2):
            raise ValueError(f"SamplerSettings.mirostat must be 0 (off), 1 or 2, got {self.mirostat!r}")
        self._check_real("mirostat_tau", low=0.0, high=MAX_MIROSTAT_TAU)
        if self.mirostat and self.mirostat_tau <= 0.0:
            raise ValueError(f"SamplerSettings.mirostat_tau must be > 0 with mirostat on, got {self.mirostat_tau!r}")
        self._check_real("mirostat_eta", low=0.0, high=MAX_MIROSTAT_ETA)
        self._check_real("dry_multiplier", low=0.0, high=MAX_LOGIT_OFFSET)
        self._check_real("dry_base", low=1.0, high=MAX_DRY_BASE)
        for name, low in (("dry_allowed_length", 1), ("dry_range", 0), ("dry_max_ngram", 1)):
            value = getattr(self, name)
            if not _is_int(value) or not low <= value <= MAX_INT32:
                raise ValueError(f"SamplerSettings.{name} must be an int in [{low}, {MAX_INT32}], got {value!r}")
        if self.dry_max_ngram < self.dry_allowed_length:
            raise ValueError(f"SamplerSettings.dry_max_ngram ({self.dry_max_ngram}) must be >= dry_allowed_length "
                             f"({self.dry_allowed_length}): shorter repeats are never penalised")
        breakers = self.dry_sequence_breakers
        if breakers is not None:
            if isinstance(breakers, str) or not isinstance(breakers, (tuple, list, set, frozenset)):
                raise ValueError("SamplerSettings.dry_sequence_breakers must be None or a collection of strings, "
                                 f"got {breakers!r}")
            if not all(isinstance(b, str) and b for b in breakers):
                raise ValueError("SamplerSettings.dry_sequence_breakers must hold non-empty strings, "
                                 f"got {breakers!r}")
            ordered = sorted(set(breakers)) if isinstance(breakers, (set, frozenset)) else dict.fromkeys(breakers)
            object.__setattr__(self, "dry_sequence_breakers", tuple(ordered))
        if self.cfg_scale is not None:
            self._check_real("cfg_scale", low=-MAX_CFG_SCALE, high=MAX_CFG_SCALE)

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
                                   token_presence_penalty=0.0, token_bias=(), dry_multiplier=0.0, mirostat=0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def dynamic_temperature(self) -> bool:
        return self.max_temp > self.min_temp

    @functools.cached_property  # (asked per row and step)
    def dry_active(self) -> bool:
        return self.dry_multiplier > 0.0

    @functools.cached_property
    def uses_extended_samplers(self) -> bool:
        """Whether a sampled (not greedy) row needs the torch sampler: the native kernel knows temperature, top-k,
        top-p and min-p only. (DRY is a logit penalty that both paths apply.)"""
        return not self.is_greedy and (
            self.temperature_last or self.dynamic_temperature or self.smoothing_factor > 0.0 or self.top_a > 0.0
            or 0.0 < self.tfs < 1.0 or 0.0 < self.typical < 1.0 or self.skew != 0.0 or self.mirostat != 0
            or self.xtc_probability > 0.0)

    @property
    def speculation_safe(self) -> bool:
        """Whether verify rows can reproduce this sampler: not with per-token state (mirostat's mu, DRY's
        history) or a skewed draw, which the rejection sampler's distributions do not model."""
        return not (self.mirostat or self.dry_active or (self.skew != 0.0 and not self.is_greedy))

    @property
    def top_p_active(self) -> bool:
        return 0.0 < self.top_p < 1.0

    @functools.cached_property  # (asked per row and step)
    def penalty_window(self) -> int | None:
        """How many of the most recent tokens the penalties look at (None: the whole history; 0: penalties off)."""
        if (self.token_repetition_penalty == 1.0 and self.token_frequency_penalty == 0.0
                and self.token_presence_penalty == 0.0):
            return 0
        if self.token_repetition_range == -1:
            return None
        return self.token_repetition_range + self.token_repetition_decay
