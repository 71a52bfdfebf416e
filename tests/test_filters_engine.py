"""Filters in the engine (folio.constrain): masks computed on worker threads and applied in the sampler, the
"end_filter" finish, filter_prefer_eos, a filter that allows nothing failing only its job, filtered and
unfiltered jobs side by side. Uses a plain custom Filter (the grammar filters have their own tests)."""

from __future__ import annotations

import pytest
from test_generator import GREEDY, prompts, run_to_end

import folio
from folio.constrain.base import Filter, FilterError
from folio.results import EosReason, Stage


class Cycle(Filter):
    """Allows exactly one token per step, cycling through `allowed`; finished after `length` tokens."""

    def __init__(self, allowed: list[int], length: int):
        super().__init__()
        self.allowed, self.length = allowed, length

    def allowed_tokens(self):
        return [self.allowed[len(self._fed) % len(self.allowed)]]

    def feed(self, token_id: int) -> None:
        if token_id != self.allowed[len(self._fed) % len(self.allowed)]:
            raise FilterError(f"token {token_id} not allowed")
        super().feed(token_id)

    def is_finished(self) -> bool:
        return len(self._fed) >= self.length

    def reset(self) -> None:
        self._fed = []


class Subset(Filter):
    """Allows a fixed set of tokens forever."""

    def __init__(self, allowed: set[int]):
        super().__init__()
        self.allowed = allowed

    def allowed_tokens(self):
        return self.allowed


class Nothing(Filter):
    def allowed_tokens(self):
        return []


class Broken(Filter):
    def allowed_tokens(self):
        raise RuntimeError("filter exploded")


def streamed(results):
    return [t for r in results if r.stage == Stage.STREAMING for t in r.token_ids]


@pytest.mark.parametrize("settings", [GREEDY, folio.SamplerSettings(temperature=1.0, top_k=0, top_p=1.0)])
def test_forced_tokens_end_with_end_filter(peaked, settings):
    gen = peaked.generator()
    ids = prompts(peaked.tokenizer, 1)[0]
    job = folio.DynamicJob(input_ids=ids, max_new_tokens=50, gen_settings=settings, stop_conditions=[],
                           filters=[Cycle([5, 17, 42], length=7)], seed=3)
    res = run_to_end(gen, [job])[job.serial]
    assert streamed(res) == [5, 17, 42, 5, 17, 42, 5]
    assert res[-1].eos and res[-1].eos_reason == EosReason.END_FILTER


def test_subset_filter_only_picks_allowed_and_mixed_batch_equals_alone(peaked):
    allowed = set(range(40, 80))
    token_lists = prompts(peaked.tokenizer, 4)
    sampled = folio.SamplerSettings(temperature=1.0, top_k=0, top_p=1.0)

    def make(i, ids):
        filters = [Subset(allowed)] if i % 2 == 0 else []
        return folio.DynamicJob(input_ids=ids, max_new_tokens=20, gen_settings=GREEDY if i < 2 else sampled,
                                stop_conditions=[], filters=filters, seed=100 + i)

    alone = []
    for i, ids in enumerate(token_lists):
        job = make(i, ids)
        run_to_end(peaked.generator(), [job])
        alone.append(job.generated_ids)
    jobs = [make(i, ids) for i, ids in enumerate(token_lists)]
    run_to_end(peaked.generator(), jobs)
    assert [j.generated_ids for j in jobs][:2] == alone[:2]  # greedy: batch-shape independent
    for i in (0, 2):
        assert set(jobs[i].generated_ids) <= allowed and len(jobs[i].generated_ids) == 20
    assert not set(jobs[1].generated_ids) <= allowed  # the unfiltered greedy job is not constrained


def test_prefer_eos_ends_as_soon_as_eos_is_allowed(peaked):
    eos = peaked.tokenizer.eos_token_ids[0]
    ids = prompts(peaked.tokenizer, 1)[0]
    job = folio.DynamicJob(input_ids=ids, max_new_tokens=20, gen_settings=GREEDY, filters=[Subset({7, 9, eos})],
                           filter_prefer_eos=True)
    res = run_to_end(peaked.generator(), [job])[job.serial]
    assert job.generated_ids == [eos] and res[-1].eos_reason == EosReason.STOP_TOKEN


@pytest.mark.parametrize("bad", [Nothing, Broken])
def test_filter_that_allows_nothing_fails_only_its_job(peaked, bad):
    token_lists = prompts(peaked.tokenizer, 3)
    jobs = [folio.DynamicJob(input_ids=ids, max_new_tokens=10, gen_settings=GREEDY, stop_conditions=[],
                             filters=[bad()] if i == 1 else []) for i, ids in enumerate(token_lists)]
    res = run_to_end(peaked.generator(), jobs)
    failed = res[jobs[1].serial][-1]
    assert failed.eos_reason == EosReason.ERROR
    assert ("allow no token" in str(failed.error)) if bad is Nothing else ("filter exploded" in str(failed.error))
    assert all(len(jobs[i].generated_ids) == 10 for i in (0, 2))


def test_filters_are_refused_when_not_filters():
    with pytest.raises(TypeError, match="Filter"):
        folio.DynamicJob(input_ids=[1, 2], max_new_tokens=3, filters=["json"])
    f = Subset({1})
    with pytest.raises(ValueError, match="twice"):
        folio.DynamicJob(input_ids=[1, 2], max_new_tokens=3, filters=[f, f])


def test_bitmask_applies_on_every_cpu_path():
    """sample(allowed=...) on the CPU: greedy rows pick the argmax over the allowed tokens, sampled rows (and rows
    asking for top tokens) only allowed tokens; bits past the last word mask their columns."""
    import random

    import torch

    from folio.constrain.base import bitmask_words, set_bits
    from folio.sampling import RowParams, SamplerSettings, sample

    num_rows, num_columns = 24, 1000
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(0)) * 3
    rng = random.Random(1)
    masks = torch.zeros(num_rows, bitmask_words(num_columns), dtype=torch.int32)
    allowed = []
    for b in range(num_rows):
        ids = rng.sample(range(num_columns), rng.choice([1, 3, 40]))
        allowed.append(set(ids))
        set_bits(masks[b].numpy(), ids)
    variants = [SamplerSettings.greedy(), SamplerSettings(temperature=1.0, top_k=0, top_p=1.0), SamplerSettings()]
    rows = [RowParams(variants[b % 3], (b * 0.37) % 1.0, return_top_tokens=b % 2) for b in range(num_rows)]
    before = logits.clone()
    out = sample(logits, rows, allowed=masks).token_ids.tolist()
    assert torch.equal(logits, before)  # not in place: the caller's logits are untouched
    assert all(t in allowed[b] for b, t in enumerate(out))
    for b in range(0, num_rows, 3):
        assert out[b] == max(allowed[b], key=lambda t: logits[b, t].item())
