"""folio.speculative.ngram: the incremental drafter against a brute-force re-derivation from the whole history."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from folio.speculative.ngram import NgramDraft

# --- the oracle: each proposal recomputed from the full history, by scanning it --------------------------------------


def oracle_lookup(history: list[int], num_tokens: int, min_match: int, max_match: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix of min_match..max_match tokens."""
    num_history = len(history)
    for num_match in range(max_match, min_match - 1, -1):
        suffix_ids = history[num_history - num_match :]
        # an earlier occurrence starts before the suffix does (it may overlap it)
        for start_idx in range(num_history - num_match - 1, -1, -1):
            if history[start_idx : start_idx + num_match] == suffix_ids:
                return history[start_idx + num_match : start_idx + num_match + num_tokens]
    return []


def oracle_next_token(history: list[int], context_ids: list[int]) -> int | None:
    """The most frequent token after `context_ids` in the history, ties to the one whose last occurrence is latest."""
    num_context = len(context_ids)
    count_by_id: dict[int, int] = {}
    last_idx_by_id: dict[int, int] = {}
    for idx in range(num_context, len(history)):
        if history[idx - num_context : idx] == context_ids:
            count_by_id[history[idx]] = count_by_id.get(history[idx], 0) + 1
            last_idx_by_id[history[idx]] = idx
    if not count_by_id:
        return None
    return max(count_by_id, key=lambda token_id: (count_by_id[token_id], last_idx_by_id[token_id]))


def oracle_statistics(history: list[int], draft_ids: list[int], num_tokens: int, max_ngram: int) -> list[int]:
    scratch_ids = history + draft_ids
    predicted_ids: list[int] = []
    while len(predicted_ids) < num_tokens:
        next_id = None
        for num_context in range(min(max_ngram - 1, len(scratch_ids)), 0, -1):
            next_id = oracle_next_token(history, scratch_ids[-num_context:])
            if next_id is not None:
                break
        if next_id is None:
            break
        predicted_ids.append(next_id)
        scratch_ids.append(next_id)
    return predicted_ids


def oracle_propose(history: list[int], num_tokens: int, max_ngram: int, min_match: int, max_match: int):
    """(prompt lookup's part, the statistics' part) of the proposal."""
    lookup_ids = oracle_lookup(history, num_tokens, min_match, max_match)
    return lookup_ids, oracle_statistics(history, lookup_ids, num_tokens - len(lookup_ids), max_ngram)


def drafted(history: list[int], num_tokens: int, **kwargs) -> list[int]:
    draft = NgramDraft(**kwargs)
    draft.extend(history)
    return draft.propose(num_tokens)


# --- random streams ----------------------------------------------------------------------------------------------


def random_events(rng: random.Random, vocab_size: int, num_steps: int):
    """Histories as a job would pass them: mostly one token appended, at times a few, at times a rollback. A fifth of
    the time a span of the history is copied (copy-heavy output), so that long suffixes match too."""
    history: list[int] = []
    copy_ids: list[int] = []
    for _ in range(num_steps):
        if history and rng.random() < 0.03:
            history = history[: max(0, len(history) - rng.randint(1, 20))]
            copy_ids = []
        else:
            for _ in range(rng.choice((1, 1, 1, 1, 2, 3))):
                if not copy_ids and len(history) > 12 and rng.random() < 0.2:
                    start_idx = rng.randrange(len(history) - 12)
                    copy_ids = history[start_idx : start_idx + rng.randint(3, 12)]
                history.append(copy_ids.pop(0) if copy_ids else rng.randrange(vocab_size))
        yield list(history)


@pytest.mark.parametrize(
    "max_ngram, min_match, max_match, vocab_size, num_steps, seed",
    [
        (4, 2, 8, 6, 900, 0),
        (4, 2, 8, 12, 800, 6),  # a wider vocabulary: fewer matches, more for the statistics
        (3, 1, 4, 5, 800, 1),
        (2, 3, 3, 8, 800, 2),
        (5, 2, 6, 4, 700, 3),
        (4, 6, 8, 3, 700, 4),  # long matches only: the statistics draft most tokens
        (1, 2, 8, 6, 500, 5),  # no statistics
        (6, 1, 2, 4, 700, 7),  # contexts longer than the matches
    ],
)
def test_matches_brute_force_after_every_append(max_ngram, min_match, max_match, vocab_size, num_steps, seed):
    rng = random.Random(seed)
    draft = NgramDraft(max_ngram=max_ngram, min_match=min_match, max_match=max_match)
    num_lookup_drafts = num_statistics_drafts = num_empty_drafts = num_rollbacks = num_mixed = 0
    prev_history: list[int] = []
    for history in random_events(rng, vocab_size, num_steps):
        num_rollbacks += len(history) < len(prev_history)
        prev_history = history
        draft.extend(history)
        assert draft.num_indexed == len(history)
        num_tokens = rng.randint(0, 7)
        lookup_ids, statistics_ids = oracle_propose(history, num_tokens, max_ngram, min_match, max_match)
        proposed_ids = draft.propose(num_tokens)
        assert proposed_ids == lookup_ids + statistics_ids, (history, num_tokens)
        if max_ngram >= 2:
            # once anything predicts, the statistics carry the draft to the end (the module's comment says why)
            assert len(proposed_ids) in (0, num_tokens)
        num_lookup_drafts += bool(lookup_ids)
        num_statistics_drafts += bool(statistics_ids)
        num_empty_drafts += num_tokens > 0 and not proposed_ids
        num_mixed += bool(lookup_ids and statistics_ids)
    # every path was taken, so the agreement above is not vacuous
    assert num_lookup_drafts > 50 and num_rollbacks > 5 and num_empty_drafts > 0
    if max_ngram >= 2:
        assert num_statistics_drafts >= 15 and num_mixed >= 1
    else:
        assert num_statistics_drafts == 0


# --- prompt lookup -------------------------------------------------------------------------------------------------


def test_copy_heavy_output_proposes_the_copied_continuation():
    prompt_ids = list(range(100, 160))
    draft = NgramDraft()
    for num_copied in range(2, 30):
        # the output so far repeats prompt_ids[20 : 20 + num_copied]
        draft.extend(prompt_ids + prompt_ids[20 : 20 + num_copied])
        assert draft.propose(6) == prompt_ids[20 + num_copied : 26 + num_copied]


def test_lookup_prefers_the_longest_match_then_the_most_recent_occurrence():
    # [2, 3] last occurred before 5, but the longer [1, 2, 3] before 4
    assert drafted([1, 2, 3, 4, 9, 2, 3, 5, 9, 1, 2, 3], 1) == [4]
    # [7, 8] occurred before 1 and, later, before 2
    assert drafted([7, 8, 1, 7, 8, 2, 7, 8], 3) == [2, 7, 8]
    # a match shorter than min_match does not count; max_match caps the suffix that is looked up
    assert drafted([7, 8, 1, 7, 8], 1, max_ngram=1, min_match=3) == []
    history = [1, 2, 3, 4, 6, 9, 2, 3, 4, 7, 1, 2, 3, 4]
    assert drafted(history, 1) == [6]
    assert drafted(history, 1, max_match=3) == [7]


def test_an_overlapping_occurrence_counts_and_its_continuation_stops_at_the_history_end():
    # [1, 2, 1] first occurs at 0, overlapping the suffix; what followed it runs to the end of the history
    assert drafted([1, 2, 1, 2, 1], 2) == [2, 1]
    assert drafted([1, 2, 1, 2, 1], 5, max_ngram=1) == [2, 1]
    # the statistics continue from the scratch [..., 2, 1]
    assert drafted([1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]
    # There the scratch's tail equals the history's own; it differs only where contexts outreach matches
    # (max_ngram > max_match + 2). Drafted [1], the context (1, 1, 1) predicts 3, the history's (1, 1) would say 1.
    assert drafted([1, 1, 1, 1, 3, 1, 1], 3, max_ngram=6, min_match=1, max_match=1) == [1, 3, 1]


# --- n-gram statistics ---------------------------------------------------------------------------------------------


def test_statistics_predict_the_most_frequent_next_token_ties_to_the_most_recent():
    history = [1, 2, 1, 3, 1, 2, 1, 3, 1]  # after 1: 2 twice, 3 twice, 3 last
    no_lookup = {"max_ngram": 2, "min_match": 8, "max_match": 8}
    assert drafted(history, 1, **no_lookup) == [3]
    assert drafted(history + [2, 1], 1, **no_lookup) == [2]  # 2 now three times
    # a longer context wins over a shorter one: after [3, 1] came 2 every time
    assert drafted(history, 1, max_ngram=3, min_match=8, max_match=8) == [2]


def test_no_match_proposes_nothing_rather_than_padding():
    assert drafted([], 4) == []
    assert drafted([7], 4) == []
    assert drafted([1, 2, 3, 4, 5], 4) == []  # nothing recurs and 5 was never followed
    assert drafted([1, 2, 1, 2, 1], 0) == []


# --- state ---------------------------------------------------------------------------------------------------------


def test_rollback_rebuilds_from_the_shorter_history():
    draft = NgramDraft()
    draft.extend([10, 11, 12, 13, 10, 11])
    assert draft.propose(2) == [12, 13]
    draft.extend([10, 11, 12])  # a rollback
    assert draft.num_indexed == 3
    assert draft.propose(2) == []  # nothing of the dropped tail is remembered
    history = [10, 11, 12, 14, 10, 11, 12]
    draft.extend(history[:5])
    draft.extend(history)
    assert draft.num_indexed == len(history)
    assert draft.propose(3) == drafted(history, 3) == [14, 10, 11]


def test_extend_indexes_only_the_new_tail():
    whole = NgramDraft()
    whole.extend([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    piecewise = NgramDraft()
    for num_tokens in (0, 1, 4, 4, 7, 11, 11):
        piecewise.extend([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5][:num_tokens])
        assert piecewise.num_indexed == num_tokens
    for num_tokens in range(6):
        assert piecewise.propose(num_tokens) == whole.propose(num_tokens)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_ngram": 0}, "max_ngram must be >= 1, got 0"),
        ({"min_match": 0}, "min_match must be >= 1, got 0"),
        ({"max_match": 0, "min_match": 1}, "max_match must be >= 1, got 0"),
        ({"min_match": 5, "max_match": 4}, "min_match must be <= max_match, got min_match=5 > max_match=4"),
        ({"max_ngram": 2.0}, "max_ngram must be an int, got float 2.0"),
        ({"min_match": "2"}, "min_match must be an int, got str '2'"),
        ({"max_match": True}, "max_match must be an int, got bool True"),
        ({"max_ngram": None}, "max_ngram must be an int, got NoneType None"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as raised:
        NgramDraft(**kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize("num_tokens", [-1, 1.5, True, None])
def test_propose_rejects_bad_num_tokens(num_tokens):
    draft = NgramDraft()
    draft.extend([1, 2, 1, 2])
    with pytest.raises(ValueError, match="num_tokens must be"):
        draft.propose(num_tokens)


# --- cost ----------------------------------------------------------------------------------------------------------


class CountingDict(dict):
    """A dict that counts the lookups and stores made through it."""

    num_ops = 0

    def get(self, key, default=None):
        self.num_ops += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.num_ops += 1
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self.num_ops += 1
        super().__setitem__(key, value)

    def __contains__(self, key):
        self.num_ops += 1
        return super().__contains__(key)


class CountingTokens(Sequence):
    """A history that counts the token ids read from it."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.num_read = 0

    def __len__(self):
        return len(self.token_ids)

    def __getitem__(self, idx):
        got = self.token_ids[idx]
        self.num_read += len(got) if isinstance(idx, slice) else 1
        return got


def test_cost_per_token_and_per_proposal_does_not_grow_with_the_history():
    max_ngram, min_match, max_match = 4, 2, 8
    draft = NgramDraft(max_ngram=max_ngram, min_match=min_match, max_match=max_match)
    # White box: the two indexes swapped for counting ones while still empty.
    draft._latest_start_idx = lookup_index = CountingDict()
    draft._next_counts = statistics_index = CountingDict()
    rng = random.Random(7)
    history = CountingTokens([])
    # a store per n-gram of min_match..max_match tokens; a get, and a store if new, per context
    max_index_ops = (max_match - min_match + 1) + 2 * (max_ngram - 1)
    max_propose_ops = 0
    for _ in range(20_000):
        history.token_ids.append(rng.randrange(8))
        num_ops_before = lookup_index.num_ops + statistics_index.num_ops
        draft.extend(history)
        assert lookup_index.num_ops + statistics_index.num_ops - num_ops_before <= max_index_ops
        if len(history) % 1000 == 0:
            for num_tokens in (1, 5, 16):
                num_ops_before = lookup_index.num_ops + statistics_index.num_ops
                assert len(draft.propose(num_tokens)) == num_tokens
                num_ops = lookup_index.num_ops + statistics_index.num_ops - num_ops_before
                assert num_ops <= (max_match - min_match + 1) + num_tokens * (max_ngram - 1)
                max_propose_ops = max(max_propose_ops, num_ops)
    assert draft.num_indexed == 20_000
    assert history.num_read == 20_000  # each token read from the caller's history once
    assert max_propose_ops > 0
