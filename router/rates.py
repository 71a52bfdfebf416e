"""A replica's measured speeds, for the router's time-to-first-token estimate (folio.router.cost): prompt tokens
prefilled per second, seconds per decode step, and tokens generated per finished job. Replica side, fed from the
engine's step statistics; engine-free.

Exponentially weighted averages over steps (weight `alpha` per observation) rather than lifetime means: the rates
move with batch size and prompt lengths, and the router wants the current ones. Unknown until observed (0.0). Each
comes with its count of observations: the first few steps of a replica set an average alone (one prompt in a step
of fixed overhead reads as a few times slower than four), and a router trusts a replica's own value over the fleet's
only as far as its observations go (folio.router.cost).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ALPHA = 0.05


@dataclass
class ReplicaRates:
    alpha: float = DEFAULT_ALPHA
    prefill_tokens_per_s: float = 0.0  # over steps that prefilled: tokens prefilled / step seconds
    decode_step_s: float = 0.0  # over steps that only decoded
    mean_new_tokens: float = 0.0  # tokens generated per finished job
    prefill_samples: int = 0  # observations behind each average
    decode_samples: int = 0
    finished_samples: int = 0

    def observe_step(self, num_prefill_tokens: int, num_decode_rows: int, seconds: float) -> None:
        """One engine step that prefilled `num_prefill_tokens` prompt tokens and decoded `num_decode_rows`
        sequences in `seconds`. A step that did both is charged to prefill (the decode rows ride along)."""
        if seconds <= 0:
            return
        if num_prefill_tokens > 0:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, num_prefill_tokens / seconds, self.alpha)
            self.prefill_samples += 1
        elif num_decode_rows > 0:
            self.decode_step_s = _ewma(self.decode_step_s, seconds, self.alpha)
            self.decode_samples += 1

    def observe_finished(self, num_new_tokens: int) -> None:
        self.mean_new_tokens = _ewma(self.mean_new_tokens, float(num_new_tokens), self.alpha)
        self.finished_samples += 1

    def fields(self) -> dict[str, float | int]:
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_step_s": self.decode_step_s,
                "mean_new_tokens": self.mean_new_tokens, "prefill_samples": self.prefill_samples,
                "decode_samples": self.decode_samples, "finished_samples": self.finished_samples}


def _ewma(current: float, sample: float, alpha: float) -> float:
    return sample if current == 0.0 else current + alpha * (sample - current)
