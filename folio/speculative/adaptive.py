"""How many tokens each sequence drafts this step.

Per sequence, the acceptance rate a (the chance that a drafted token is accepted, given that the one before was) is
tracked as a decaying average of accepted drafts over tested drafts. A step that verifies k drafts yields on average
E(k) = 1 + a + a^2 + ... + a^k tokens and costs 1 + o + k * c plain steps, where c is a draft token's cost (the
drafter's forward, relative to the target's, plus the verify row's extra token) and o what a step loses by not being
launched ahead (the next step's drafts wait for this step's tokens); the sequence drafts the k that maximises
E(k) / (1 + o + k c), which is 0 (no speculation) when a is low. A sequence at 0 probes with one draft every
`probe_interval` steps so that it notices when its text turns predictable; a probe that fails doubles its interval
(up to MAX_PROBE_INTERVAL), so that a job that never accepts costs almost nothing. Intervals are powers of two times
the base and probes fall on multiples of them, so the probes of many sequences share steps and the other steps stay
plain decode steps, which the launch-ahead pipeline overlaps. A step drafts at all only when its drafts' expected
extra tokens outweigh what every row of the step loses by its not being launched ahead.

At large batches a step is bound by compute rather than by reading the weights, and a drafted token costs about what
a sequence's own token does: the drafts of a step are capped so that decode rows plus drafts stay within
`step_token_budget`, keeping the drafts worth the most (the highest a^j) first.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.sequence import Sequence

DECAY = 0.7  # weight of the past in the running counts (about the last three steps count)
INITIAL_RATE = 0.6  # what a sequence is assumed to accept before its first verify step
# What a step that is not launched ahead (and runs the drafting and verification's host work) loses, relative to a
# plain step: STEP_OVERHEAD + STEP_OVERHEAD_PER_ROW * rows. The 8B runs of bench/speculative.py on an H200 lost about
# 5-10% at batch 1 and 25-35% at batch 32 (per-row host work: drafts, verify rows, acceptance, staging).
STEP_OVERHEAD = 0.1
STEP_OVERHEAD_PER_ROW = 0.006
MAX_PROBE_INTERVAL = 256


@dataclass
class _Rate:
    accepted: float = INITIAL_RATE
    tested: float = 1.0
    probe_interval: int = 0  # 0: the base interval

    @property
    def value(self) -> float:
        return self.accepted / self.tested if self.tested > 0 else 0.0


class DraftLengths:
    def __init__(self, max_draft_tokens: int, draft_token_cost: float, adaptive: bool = True,
                 probe_interval: int = 32, step_token_budget: int | None = 256):
        self.max_draft_tokens = max_draft_tokens
        self.draft_token_cost = draft_token_cost
        self.adaptive = adaptive
        self.probe_interval = probe_interval
        self.step_token_budget = step_token_budget
        self._rates: dict[Sequence, _Rate] = {}

    def rate(self, seq: Sequence) -> float:
        return self._rates.get(seq, _Rate()).value

    def best_length(self, rate: float) -> int:
        """The k in [0, max_draft_tokens] with the most tokens per unit of cost at acceptance rate `rate`."""
        best_k, best_gain, expected = 0, 1.0, 1.0
        for k in range(1, self.max_draft_tokens + 1):
            expected += rate ** k
            gain = expected / (1.0 + STEP_OVERHEAD + k * self.draft_token_cost)
            if gain > best_gain + 1e-9:
                best_k, best_gain = k, gain
        return best_k

    def lengths(self, seqs: list[Sequence], limits: list[int], step_idx: int, num_rows: int = 0) -> list[int]:
        """Drafts per sequence this step; limits[i] is the most sequence i may draft (its remaining token budget
        and max_q_size); num_rows: the step's decode rows (at least len(seqs)), all of which wait when it drafts."""
        if not self.adaptive:
            wanted = [min(self.max_draft_tokens, m) for m in limits]
        else:
            wanted, probing = [], False
            for seq, limit in zip(seqs, limits):
                k = self.best_length(self.rate(seq))
                if k == 0 and self._probe_due(seq, step_idx):
                    k, probing = 1, True
                wanted.append(min(k, limit))
            if not probing and not self._step_pays(seqs, wanted, num_rows):
                return [0] * len(seqs)
        return self._within_budget(seqs, wanted)

    def _step_pays(self, seqs: list[Sequence], wanted: list[int], num_rows: int) -> bool:
        """Whether the expected extra tokens of the drafts outweigh what the whole step loses by speculating (it is
        not launched ahead: every row waits), in tokens: the step's rows times the lost fraction of a step."""
        extra = sum(self.rate(seq) ** j for seq, k in zip(seqs, wanted) for j in range(1, k + 1))
        if extra == 0:
            return False
        rows = max(num_rows, len(seqs))
        return extra >= rows * (STEP_OVERHEAD + STEP_OVERHEAD_PER_ROW * rows)

    def _within_budget(self, seqs: list[Sequence], wanted: list[int]) -> list[int]:
        budget = self.step_token_budget
        if budget is None or len(seqs) + sum(wanted) <= budget:
            return wanted
        room = max(0, budget - len(seqs))
        # the j-th draft of a sequence is worth rate^j extra tokens: keep the `room` most valuable
        values = sorted(((self.rate(seq) ** j, i) for i, (seq, k) in enumerate(zip(seqs, wanted))
                         for j in range(1, k + 1)), key=lambda entry: (-entry[0], entry[1]))
        kept = [0] * len(seqs)
        for _, i in values[:room]:
            kept[i] += 1
        return kept

    def _probe_due(self, seq: Sequence, step_idx: int) -> bool:
        rate = self._rates.get(seq)
        interval = rate.probe_interval if rate is not None and rate.probe_interval else self.probe_interval
        return step_idx % interval == 0

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """A verify step of `seq` accepted num_accepted of num_drafted drafts: each accepted draft passed a test,
        and the first rejected one (if any) failed one; drafts after it were never tested."""
        if num_drafted == 0:
            return
        tested = num_accepted + (num_accepted < num_drafted)
        rate = self._rates.setdefault(seq, _Rate())
        was_off = self.best_length(rate.value) == 0
        rate.accepted = DECAY * rate.accepted + num_accepted
        rate.tested = DECAY * rate.tested + tested
        if num_accepted:
            rate.probe_interval = 0
        elif was_off:  # a failed probe
            rate.probe_interval = min(MAX_PROBE_INTERVAL, 2 * (rate.probe_interval or self.probe_interval))


    def forget(self, seq: Sequence) -> None:
        self._rates.pop(seq, None)

    def any_drafting(self, seqs: list[Sequence], limits: list[int], next_step_idx: int, num_rows: int) -> bool:
        """Whether some of `seqs` may draft in step next_step_idx (then it cannot be launched ahead)."""
        return bool(seqs) and any(self.lengths(seqs, limits, next_step_idx, num_rows))
