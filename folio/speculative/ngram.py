"""Drafting from a sequence's own tokens: prompt lookup, then n-gram statistics. Torch-free.

The history is the job's prompt followed by its output; both methods read only it, so a draft costs no model work.

Prompt lookup: take the longest suffix of the history, `max_match` tokens down to `min_match`, that occurred earlier
in the history, and propose the tokens that followed its most recent earlier occurrence. "Earlier" means starting
before the suffix; the occurrence may overlap the suffix (a short repeating period). The continuation is what the
history holds after that occurrence, so it is cut short where the history ends.

N-gram statistics: counts of every n-gram of `max_ngram` tokens or fewer over the history. For each context (the
n - 1 tokens before a position) the most frequent next token is kept, a tie going to the one seen most recently.
A draft position takes the longest context, `max_ngram - 1` tokens down to 1, that the history has seen followed,
predicts its most frequent next token, and appends that to a scratch copy of the context for the next position.

`propose` drafts with prompt lookup first (it is the better guess on copy-heavy work: quoting, editing code) and
continues with the statistics from the end of what it gave.

Costs: indexing one appended token updates `max_match - min_match + max_ngram` dict keys, each a tuple of at most
`max(max_match, max_ngram - 1)` tokens; a proposal of k tokens is at most `max_match - min_match + 1 + k *
(max_ngram - 1)` dict lookups. Memory grows by at most as many entries per token.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; `max_ngram=True` is a mistake, not a 1
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class _NextTokenCounts:
    """What followed one context: a count per next token, and the most frequent one (ties: the most recent)."""

    __slots__ = ("count_by_id", "best_id", "num_best")

    def __init__(self) -> None:
        self.count_by_id: dict[int, int] = {}
        self.best_id = -1
        self.num_best = 0

    def add(self, next_id: int) -> None:
        num_seen = self.count_by_id.get(next_id, 0) + 1
        self.count_by_id[next_id] = num_seen
        # Counts grow by one at a time, so a token reaching the top count is the top count's holder seen most
        # recently: `>=` keeps the tie rule without a scan over the other tokens.
        if num_seen >= self.num_best:
            self.best_id = next_id
            self.num_best = num_seen


class NgramDraft:
    """Per-sequence incremental state.

    `extend` receives the whole current history each time and indexes only what was appended since its last call.
    A history shorter than what was indexed is a rollback and rebuilds the index from it. The history must otherwise
    extend the one indexed: a rollback and a regrowth to the same or a greater length between two calls is not
    detected, so a caller that can do both calls `extend` in between or starts a fresh instance.

    `max_ngram=1` keeps no statistics (a context is at least one token), leaving prompt lookup alone.
    """

    def __init__(self, max_ngram: int = 4, min_match: int = 2, max_match: int = 8) -> None:
        self._max_ngram = _check_int("max_ngram", max_ngram, 1)
        self._min_match = _check_int("min_match", min_match, 1)
        self._max_match = _check_int("max_match", max_match, 1)
        if min_match > max_match:
            raise ValueError(f"min_match must be <= max_match, got min_match={min_match} > max_match={max_match}")
        self._reset()

    def _reset(self) -> None:
        # A copy of the indexed history: a continuation and the scratch context read it, and the caller's list may
        # change under us (a rollback) before we are told.
        self._token_ids: list[int] = []
        # n-gram (a tuple of n tokens, min_match <= n <= max_match) -> the latest start index at which it was
        # followed by at least one token. One dict serves every n: tuples of different lengths never compare equal.
        self._latest_start_idx: dict[tuple[int, ...], int] = {}
        # context (a tuple of 1 to max_ngram - 1 tokens) -> the tokens that followed it
        self._next_counts: dict[tuple[int, ...], _NextTokenCounts] = {}

    @property
    def num_indexed(self) -> int:
        """Tokens of the history indexed so far."""
        return len(self._token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of `token_ids` (the whole current history) appended since the last call."""
        if len(token_ids) < self.num_indexed:
            # A rollback: dropping entries would need each n-gram's previous start index, which is not kept.
            # Rebuilding is correct and rare.
            self._reset()
        for token_id in token_ids[self.num_indexed :]:
            self._token_ids.append(token_id)
            self._index_last()

    def _index_last(self) -> None:
        """Record the n-grams and contexts that the last token of the history follows."""
        token_ids = self._token_ids
        last_idx = len(token_ids) - 1
        for num_match in range(self._min_match, self._max_match + 1):
            start_idx = last_idx - num_match
            if start_idx < 0:
                break
            # Later starts overwrite earlier ones: a proposal copies from the most recent occurrence.
            self._latest_start_idx[tuple(token_ids[start_idx:last_idx])] = start_idx
        next_id = token_ids[last_idx]
        for num_context in range(1, self._max_ngram):
            start_idx = last_idx - num_context
            if start_idx < 0:
                break
            context_ids = tuple(token_ids[start_idx:last_idx])
            counts = self._next_counts.get(context_ids)
            if counts is None:
                counts = self._next_counts[context_ids] = _NextTokenCounts()
            counts.add(next_id)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafted tokens to follow the history; fewer, or none, where nothing predicts them."""
        _check_int("num_tokens", num_tokens, 0)
        if num_tokens == 0:
            return []
        draft_ids = self._lookup(num_tokens)
        if len(draft_ids) < num_tokens:
            draft_ids += self._predict(draft_ids, num_tokens - len(draft_ids))
        return draft_ids

    def _lookup(self, num_tokens: int) -> list[int]:
        """The continuation of the most recent earlier occurrence of the longest matching suffix."""
        token_ids = self._token_ids
        num_history = len(token_ids)
        # A suffix of n tokens needs an earlier start, so at least n + 1 tokens of history.
        for num_match in range(min(self._max_match, num_history - 1), self._min_match - 1, -1):
            start_idx = self._latest_start_idx.get(tuple(token_ids[num_history - num_match :]))
            if start_idx is not None:
                follow_idx = start_idx + num_match
                # never empty: a start is recorded only once a token follows its n-gram
                return token_ids[follow_idx : follow_idx + num_tokens]
        return []

    def _predict(self, draft_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens from the statistics, continuing the history followed by `draft_ids`."""
        max_context = self._max_ngram - 1
        if max_context == 0:
            return []
        # Only the last max_context tokens can form a context; the history copy is never appended to.
        scratch_ids = self._token_ids[-max_context:] + draft_ids[-max_context:]
        predicted_ids: list[int] = []
        while len(predicted_ids) < num_tokens:
            counts = None
            for num_context in range(min(max_context, len(scratch_ids)), 0, -1):
                counts = self._next_counts.get(tuple(scratch_ids[-num_context:]))
                if counts is not None:
                    break
            if counts is None:
                # No padding (say, with the last token): a draft nothing predicts is likely rejected, and every
                # drafted token costs a verify position. This can stop only the first position (the tests check
                # it): once a context matched, each predicted token occurs followed in the history, so its 1-token
                # context matches at the next position.
                break
            predicted_ids.append(counts.best_id)
            scratch_ids.append(counts.best_id)
        return predicted_ids
