"""Classifier-free guidance (folio.cfg) end to end on the CPU: a job of two prompts samples from
s * log_softmax(positive) + (1 - s) * log_softmax(negative). Greedy outputs are checked against transformers and
against the same jobs run alone; the pair shares pages, is preempted, cancelled and retired together, and leaks
none. The page pool's invariants are checked after every step."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_generator import run_to_end
from tiny_models import hf_logits, load_hf_model

import folio
from folio.results import Stage

GREEDY = folio.SamplerSettings.greedy()


def cfg_job(pos, neg, scale, max_new_tokens=20, **kwargs):
    settings = kwargs.pop("gen_settings", GREEDY)
    return folio.DynamicJob(input_ids=[pos, neg], max_new_tokens=max_new_tokens, stop_conditions=[],
                            gen_settings=dataclasses.replace(settings, cfg_scale=scale),
                            **kwargs)


def plain_job(ids, max_new_tokens=20, **kwargs):
    return folio.DynamicJob(input_ids=ids, max_new_tokens=max_new_tokens, stop_conditions=[], gen_settings=GREEDY,
                            **kwargs)


def pair_prompts(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    return [(tokenizer.encode(f"The keeper of lighthouse {i} wrote a cheerful letter about the sea"),
             tokenizer.encode(f"A gloomy note {'on storms ' * (i % 3)}number {i}"))
            for i in range(n)]


def assert_no_pages_held(gen) -> None:
    assert gen.num_remaining_jobs() == 0
    assert not gen.scheduler.active and not gen.scheduler.pending
    assert gen.cache_manager.num_in_use == 0
    gen.cache_manager.check()


@pytest.fixture(scope="module")
def hf_model(peaked):
    return load_hf_model(peaked.path)


def oracle(hf_model, pos, neg, scale, vocab_size, n):
    """Greedy CFG over transformers' logits: both prompts run whole at every step."""
    pos, neg, out = list(pos), list(neg), []
    for _ in range(n):
        lp = torch.log_softmax(hf_logits(hf_model, pos)[-1, :vocab_size], dim=0)
        ln = torch.log_softmax(hf_logits(hf_model, neg)[-1, :vocab_size], dim=0)
        token = int(torch.argmax(scale * lp + (1 - scale) * ln))
        out.append(token)
        pos.append(token)
        neg.append(token)
    return out


def test_scale_one_is_the_positive_prompt_alone(peaked):
    (pos, neg), = pair_prompts(peaked.tokenizer, 1)
    alone = plain_job(pos)
    run_to_end(peaked.generator(), [alone])
    guided = cfg_job(pos, neg, 1.0)
    res = run_to_end(peaked.generator(), [guided])
    assert guided.generated_ids == alone.generated_ids
    assert len(guided.generated_ids) == 20
    # one result stream: one start, the positive's prefill progress only, then tokens
    stages = [r.stage for r in res[guided.serial]]
    assert stages.count(Stage.STARTED) == 1
    prefill = [r for r in res[guided.serial] if r.stage == Stage.PREFILL]
    assert all(r.max_progress == len(pos) for r in prefill)


@pytest.mark.parametrize("scale", [1.5, -0.5])
def test_guided_greedy_matches_transformers(peaked, hf_model, scale):
    (pos, neg), = pair_prompts(peaked.tokenizer, 1)
    gen = peaked.generator()
    job = cfg_job(pos, neg, scale)
    run_to_end(gen, [job])
    want = oracle(hf_model, pos, neg, scale, gen.vocab_size, 20)
    assert job.generated_ids == want
    alone = plain_job(pos)
    run_to_end(peaked.generator(), [alone])
    assert job.generated_ids != alone.generated_ids  # the guidance changed something
    # the negative sequence took every sampled token
    negative = job.sequence.cfg_partner
    assert negative.token_ids == neg + job.generated_ids
    assert_no_pages_held(gen)


@pytest.mark.parametrize("longer", ["negative", "positive"])
def test_prompts_of_different_lengths_prefilled_in_chunks_match_transformers(peaked, hf_model, longer):
    """One prompt finishes its prefill steps before the other: its last token waits for its partner's, and the
    pair samples its first token in the same step."""
    tok = peaked.tokenizer
    short = tok.encode("Write about the sea.")
    long = tok.encode("Write nothing about storms, wrecks, drowned sailors or the grey cold winter sea. " * 2)
    pos, neg = (short, long) if longer == "negative" else (long, short)
    gen = peaked.generator(max_chunk_size=16)
    job = cfg_job(pos, neg, 1.5, max_new_tokens=12)
    run_to_end(gen, [job])
    assert job.generated_ids == oracle(hf_model, pos, neg, 1.5, gen.vocab_size, 12)
    assert_no_pages_held(gen)


def test_shared_prefix_pages_are_shared_and_chunked_prefill_equals_whole(peaked):
    tok = peaked.tokenizer
    shared = tok.encode("A long preamble about ships and harbours and the sea, told twice over. " * 3)
    pos, neg = shared + tok.encode(" Be kind."), shared + tok.encode(" Be rude.")
    num_shared_pages = (len(shared) - 1) // 16
    assert num_shared_pages >= 3
    want = None
    for chunk in (2048, 16):
        gen = peaked.generator(max_chunk_size=chunk)
        job = cfg_job(pos, neg, 2.0, max_new_tokens=8)
        gen.enqueue(job)
        shared_seen = 0
        while gen.num_remaining_jobs():
            gen.step()
            gen.cache_manager.check()
            seq, negative = job.sequence, job.sequence.cfg_partner
            if seq.block_table and negative.block_table:
                common = 0
                for a, b in zip(seq.block_table, negative.block_table):
                    if a != b:
                        break
                    common += 1
                shared_seen = max(shared_seen, common)
        assert shared_seen >= num_shared_pages
        stats = gen.prefix_cache_stats()
        assert stats.num_hit_pages >= num_shared_pages  # the negative's, from the positive's pages
        assert stats.num_queried_tokens == len(pos) + len(neg)
        assert_no_pages_held(gen)
        if want is None:
            want = job.generated_ids
        else:
            assert job.generated_ids == want


def test_mixed_batch_gives_each_job_what_it_gives_alone(peaked):
    pairs = pair_prompts(peaked.tokenizer, 3)
    scales = [1.5, -0.5, 3.0]

    def make():
        jobs = [cfg_job(p, n, s) for (p, n), s in zip(pairs, scales)]
        plains = [plain_job(n) for _, n in pairs]
        return [j for pair in zip(jobs, plains) for j in pair]

    alone = []
    for job in make():
        run_to_end(peaked.generator(), [job])
        alone.append(job.generated_ids)
    gen = peaked.generator(max_batch_size=5)  # two CFG jobs and a plain one at a time
    batched = make()
    run_to_end(gen, batched)
    assert [j.generated_ids for j in batched] == alone
    assert_no_pages_held(gen)


def test_preempted_pairs_equal_uninterrupted_and_leak_nothing(peaked):
    pairs = pair_prompts(peaked.tokenizer, 4)

    def make():
        return [plain_job(pairs[0][1], max_new_tokens=40)] + [
            cfg_job(p, n, 1.5 + k, max_new_tokens=40) for k, (p, n) in enumerate(pairs)]

    reference = make()
    run_to_end(peaked.generator(), reference)
    small = peaked.generator(num_tokens=16 * 16)
    got = make()
    for job in got:
        small.enqueue(job)
    preempted = []
    real_preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda victim, plan: (preempted.append(victim), real_preempt(victim, plan))
    while small.num_remaining_jobs():
        small.step()
        small.cache_manager.check()
        for job in got[1:]:
            seq, negative = job.sequence, job.sequence.cfg_partner
            if seq.is_live:  # the pair is always in one place, its two token lists one sampled suffix
                assert (seq in small.scheduler.active) == (negative in small.scheduler.active)
                assert (seq in small.scheduler.pending) == (negative in small.scheduler.pending)
                assert negative.num_sampled == seq.num_sampled
                assert negative.token_ids[len(negative.token_ids) - negative.num_sampled:] == \
                    seq.token_ids[len(seq.token_ids) - seq.num_sampled:]
    assert any(v.cfg_partner is not None for v in preempted), "no CFG pair was preempted"
    assert small.scheduler.num_preemptions > 0
    assert [j.generated_ids for j in got] == [j.generated_ids for j in reference]
    assert_no_pages_held(small)


def test_cancel_releases_both_sequences(peaked):
    (pos, neg), = pair_prompts(peaked.tokenizer, 1)
    for cancel_after in (0, 1, 5):  # queued, prefilling, decoding
        gen = peaked.generator()
        job = cfg_job(pos, neg, 1.5)
        other = plain_job(neg)
        gen.enqueue([job, other])
        for _ in range(cancel_after):
            gen.step()
        gen.cancel(job)
        assert job.sequence not in gen.scheduler.active and job.sequence.cfg_partner not in gen.scheduler.active
        assert not job.sequence.is_live and not job.sequence.cfg_partner.is_live
        while gen.num_remaining_jobs():
            gen.step()
            gen.cache_manager.check()
        assert_no_pages_held(gen)
        assert len(other.generated_ids) == 20


def test_stop_token_ends_the_pair(peaked):
    (pos, neg), = pair_prompts(peaked.tokenizer, 1)
    free = cfg_job(pos, neg, 1.5)
    run_to_end(peaked.generator(), [free])
    stop = free.generated_ids[6]
    first = free.generated_ids.index(stop)
    gen = peaked.generator()
    job = folio.DynamicJob(input_ids=[pos, neg], max_new_tokens=20, stop_conditions=[stop],
                           gen_settings=folio.SamplerSettings.greedy(cfg_scale=1.5))
    results = run_to_end(gen, [job])
    assert job.generated_ids == free.generated_ids[:first + 1]
    assert results[job.serial][-1].eos_reason == folio.EosReason.STOP_TOKEN
    assert_no_pages_held(gen)


def test_a_negative_prompt_that_breaks_the_forward_fails_its_job_alone(peaked):
    pairs = pair_prompts(peaked.tokenizer, 2)
    penalised = folio.SamplerSettings.greedy(token_repetition_penalty=1.3)
    want = plain_job(pairs[1][0])
    run_to_end(peaked.generator(), [want])
    gen = peaked.generator()
    bad = cfg_job(*pairs[0], 1.5, gen_settings=penalised)
    good = plain_job(pairs[1][0])
    gen.enqueue([bad, good])
    bad.sequence.cfg_partner.token_ids[2] = 10**9  # past the checks at enqueue: the embedding raises
    results = run_to_end(gen, [])
    assert results[bad.serial][-1].eos_reason == folio.EosReason.ERROR
    assert good.generated_ids == want.generated_ids
    assert not bad.sequence.is_live and not bad.sequence.cfg_partner.is_live
    assert bad.sequence not in gen.runner._histories
    assert_no_pages_held(gen)


def test_sampled_with_penalties_and_drafting_neighbours(peaked):
    """Sampled CFG rows with penalties (the positive's history) beside n-gram drafting jobs: CFG jobs never draft,
    and the negative tracks every token."""
    pairs = pair_prompts(peaked.tokenizer, 2)
    settings = folio.SamplerSettings(temperature=0.9, top_k=20, token_repetition_penalty=1.2)
    gen = peaked.generator(use_ngram_draft=True)
    jobs = [cfg_job(p, n, 1.5, max_new_tokens=30, gen_settings=settings, seed=7) for p, n in pairs]
    repeats = plain_job(peaked.tokenizer.encode("one two three one two three one two three one two"),
                        max_new_tokens=30)
    run_to_end(gen, jobs + [repeats])
    for job, (_, neg) in zip(jobs, pairs):
        assert len(job.generated_ids) == 30
        assert job.accepted_draft_tokens == job.rejected_draft_tokens == 0
        assert job.sequence.cfg_partner.token_ids == neg + job.generated_ids
    assert_no_pages_held(gen)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_speculative_neighbours_leave_cfg_jobs_undrafted_and_unchanged(peaked, drafter):
    pairs = pair_prompts(peaked.tokenizer, 2)
    loop = peaked.tokenizer.encode("one two three one two three one two three one two")

    def make():
        return [cfg_job(p, n, 1.5, max_new_tokens=24) for p, n in pairs] + [plain_job(loop, max_new_tokens=24)]

    want = make()
    run_to_end(peaked.generator(), want)
    kwargs = dict(use_ngram_draft=True) if drafter == "ngram" else dict(draft_model=peaked.model, adaptive_draft=False)
    gen = peaked.generator(**kwargs)
    got = make()
    run_to_end(gen, got)
    assert [j.generated_ids for j in got] == [j.generated_ids for j in want]
    assert all(j.accepted_draft_tokens == j.rejected_draft_tokens == 0 for j in got[:2])
    assert got[2].accepted_draft_tokens + got[2].rejected_draft_tokens > 0  # the plain job drafted
    if gen.speculator.draft_runner is not None:
        assert not gen.speculator.draft_runner._num_cached  # both sequences of each CFG job forgotten
    assert_no_pages_held(gen)


def test_decode_ahead_with_cfg_equals_plain_steps(peaked):
    pairs = pair_prompts(peaked.tokenizer, 2)

    def make():
        return [cfg_job(p, n, 2.0) for p, n in pairs] + [plain_job(p, max_new_tokens=40) for p, _ in pairs]

    plain = make()
    run_to_end(peaked.generator(decode_ahead=False, overlap_emit=False), plain)
    gen = peaked.generator(decode_ahead=True, overlap_emit=True)
    ahead = make()
    run_to_end(gen, ahead)
    assert [j.generated_ids for j in ahead] == [j.generated_ids for j in plain]
    # nothing is launched ahead while a CFG job runs; once they are done the plain jobs decode ahead again
    assert gen.pipeline.num_steps_ahead > 0
    assert_no_pages_held(gen)


def test_bad_inputs_refused(peaked):
    ids = [5, 6, 7]
    with pytest.raises(ValueError, match="cfg_scale is None"):
        folio.DynamicJob(input_ids=[ids, ids], max_new_tokens=4)
    with pytest.raises(ValueError, match="needs two prompts"):
        folio.DynamicJob(input_ids=ids, max_new_tokens=4, gen_settings=folio.SamplerSettings(cfg_scale=1.5))
    with pytest.raises(ValueError, match="needs two prompts"):
        folio.DynamicJob(input_ids=[ids], max_new_tokens=4, gen_settings=folio.SamplerSettings(cfg_scale=1.5))
    with pytest.raises(ValueError, match="got 3 prompts"):
        folio.DynamicJob(input_ids=[ids, ids, ids], max_new_tokens=4,
                         gen_settings=folio.SamplerSettings(cfg_scale=1.5))
    for bad in (math.nan, math.inf, "2", True):
        with pytest.raises(ValueError, match="cfg_scale"):
            folio.SamplerSettings(cfg_scale=bad)
    with pytest.raises(ValueError, match="input_ids"):
        folio.DynamicJob(input_ids=[ids, []], max_new_tokens=4, gen_settings=folio.SamplerSettings(cfg_scale=1.5))
    # a (2, n) tensor is two prompts
    job = folio.DynamicJob(input_ids=torch.tensor([ids, ids]), max_new_tokens=4,
                           gen_settings=folio.SamplerSettings(cfg_scale=1.5))
    assert job.input_ids == ids and job.cfg_negative_ids == ids

    gen = peaked.generator(num_tokens=8 * 16)
    vocab = gen.vocab_size
    with pytest.raises(ValueError, match="negative prompt"):
        gen.enqueue(cfg_job(ids, [vocab], 1.5))
    with pytest.raises(ValueError, match="together"):  # each fits the cache alone, not both
        gen.enqueue(cfg_job(list(range(3, 60)), list(range(3, 60)), 1.5, max_new_tokens=8))
    with pytest.raises(ValueError, match="max_batch_size"):
        peaked.generator(paged=False).enqueue(cfg_job(ids, ids, 1.5))
    assert gen.num_remaining_jobs() == 0


def test_banned_strings_roll_back_both_sequences_of_a_pair(demo):
    """A CFG job with banned strings: rollbacks undo the token in the negative sequence too (the two stay
    aligned), no banned string appears, and no page is held at the end."""
    import random

    from test_banned_strings import check_clean, substrings

    tok = demo.tokenizer
    sampled = folio.SamplerSettings(temperature=1.0, top_k=40, top_p=0.95)
    pairs = pair_prompts(tok, 4)
    free = [cfg_job(p, n, 1.5, max_new_tokens=32, gen_settings=sampled, seed=i) for i, (p, n) in enumerate(pairs)]
    run_to_end(demo.generator(), free)
    rng = random.Random(2)
    banned = [substrings(f.full_completion, rng, 2) for f in free]
    jobs = [cfg_job(p, n, 1.5, max_new_tokens=32, gen_settings=sampled, seed=i, banned_strings=banned[i])
            for i, (p, n) in enumerate(pairs)]
    gen = demo.generator()
    steps = []
    results = run_to_end(gen, jobs, stats=steps)
    assert sum(s.num_rolled_back for s in steps) > 0  # the ban bit
    for job, words in zip(jobs, banned):
        check_clean(job, results[job.serial], words)
        pos, neg = job.sequence, job.sequence.cfg_partner
        assert pos.token_ids[len(job.input_ids):] == neg.token_ids[len(job.cfg_negative_ids):]
    assert_no_pages_held(gen)


def test_token_healing_with_cfg_is_refused():
    with pytest.raises(ValueError, match="token_healing"):
        folio.DynamicJob(input_ids=[[1, 2, 3], [1, 4]], max_new_tokens=4, token_healing=True,
                         gen_settings=folio.SamplerSettings(cfg_scale=1.5))
