"""Speculative decoding (folio.speculative) on the CPU: greedy output equals decoding without drafts in every mode
of the engine, sampled output follows the target's distribution (chi-square against transformers' logits), pages
never leak, and bad settings are refused."""

from __future__ import annotations

import pytest
import torch
from test_generator import GREEDY, make_jobs, prompts, run_to_end
from tiny_models import hf_logits, load_hf_model, make_hf_model

import folio
from folio.job_inputs import split_stop_conditions
from folio.speculative.acceptance import verdicts

# chi-square tests reject at this p-value: with fixed seeds each test is deterministic, and a correct sampler
# fails one for a given seed set with this probability
P_VALUE_FLOOR = 1e-3

NGRAM = dict(use_ngram_draft=True, adaptive_draft=False)


@pytest.fixture(scope="module")
def near_model(peaked_dir, tmp_path_factory):
    """The target with noise on its output head: a draft whose top tokens mostly agree with the target's but whose
    probabilities differ, so that sampled drafts are often accepted and often not."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near-model")
    for item in peaked_dir.iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    (weights_file,) = path.glob("*.safetensors")
    weights = load_file(weights_file)
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    noise = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(7))
    weights[name] = weights[name] + 0.5 * weights[name].std() * noise
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return folio.Model.from_pretrained(path, progress=False)


@pytest.fixture(scope="module")
def drafters(peaked, demo, near_model):
    """Drafter settings by name: n-gram, another model (the demo model: same vocabulary, other weights), a model
    near the target, and the target itself (every draft accepted)."""
    return {"ngram": NGRAM,
            "draft_model": dict(draft_model=demo.model, adaptive_draft=False),
            "near_draft": dict(draft_model=near_model, adaptive_draft=False),
            "self_draft": dict(draft_model=peaked.model, adaptive_draft=False)}


def repetitive_prompts(tokenizer, n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so that n-gram drafting has material (prompt lookup matches)."""
    base = prompts(tokenizer, n)
    return [ids + ids[2:] + ids[2:] for ids in base]


def run_greedy(generator, token_lists, max_new_tokens=32, **kwargs) -> list[list[int]]:
    jobs = make_jobs(token_lists, max_new_tokens=max_new_tokens, **kwargs)
    run_to_end(generator, jobs)
    return [job.generated_ids for job in jobs]


# --- greedy: token for token the output without drafts ---

@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "self_draft"])
@pytest.mark.parametrize("page_size", [16, 32])
def test_greedy_equals_plain(peaked, drafters, drafter, page_size):
    token_lists = repetitive_prompts(peaked.tokenizer, 5)
    want = run_greedy(peaked.generator(page_size=page_size), token_lists)
    gen = peaked.generator(page_size=page_size, **drafters[drafter])
    assert run_greedy(gen, token_lists) == want
    assert gen.speculator.num_drafted > 0
    if drafter == "self_draft":
        # the draft is the target: only a near-tie flipped by another batch shape can reject one
        assert gen.speculator.num_accepted >= 0.9 * gen.speculator.num_drafted


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_greedy_equals_plain_chunked_prefill_and_prefix_reuse(peaked, drafters, drafter):
    shared = peaked.tokenizer.encode("Every harbour has its own story to tell, and ours is long. " * 3)
    token_lists = [shared + peaked.tokenizer.encode(f" Chapter {i}: the keeper") for i in range(4)]
    want = run_greedy(peaked.generator(max_chunk_size=2048), token_lists)
    gen = peaked.generator(max_chunk_size=32, **drafters[drafter])
    first = run_greedy(gen, token_lists[:1])
    rest = run_greedy(gen, token_lists[1:])  # reuse the first job's prompt pages
    assert first + rest == want
    assert gen.prefix_cache_stats().num_hit_tokens > 0
    assert gen.speculator.num_drafted > 0


@pytest.mark.parametrize("drafter", ["ngram", "self_draft"])
def test_greedy_equals_plain_under_preemption(peaked, drafters, drafter):
    token_lists = repetitive_prompts(peaked.tokenizer, 6)
    want = run_greedy(peaked.generator(num_tokens=4096), token_lists, max_new_tokens=40)
    longest = max(len(t) for t in token_lists) + 40
    small = peaked.generator(num_tokens=16 * (-(-longest // 16) + 8), **drafters[drafter])
    assert run_greedy(small, token_lists, max_new_tokens=40) == want
    assert small.scheduler.num_preemptions > 0
    assert small.speculator.num_drafted > 0


@pytest.mark.parametrize("drafter", ["ngram", "self_draft"])
def test_stop_strings_tokens_and_lengths_as_without_drafts(peaked, drafters, drafter):
    """A stop string or token inside a run of accepted drafts ends the job there; no job gets more than
    max_new_tokens tokens."""
    token_lists = repetitive_prompts(peaked.tokenizer, 4)
    plain = run_greedy(peaked.generator(), token_lists, max_new_tokens=30)
    stop_token = plain[0][7]
    stop_text = peaked.tokenizer.decode(plain[1][10:13])
    conditions = [stop_token, stop_text] if stop_text.strip() else [stop_token]

    def finals(generator, max_new_tokens):
        jobs = make_jobs(token_lists, max_new_tokens=max_new_tokens)
        for job in jobs:
            job.stop_tokens, job.stop_strings = split_stop_conditions(conditions)
        results = run_to_end(generator, jobs)
        return [(r[-1].eos_reason, r[-1].full_completion, job.generated_ids) for job, r in
                zip(jobs, (results[j.serial] for j in jobs))]

    for max_new_tokens in (1, 2, 5, 30):
        want = finals(peaked.generator(), max_new_tokens)
        got = finals(peaked.generator(**drafters[drafter]), max_new_tokens)
        assert got == want
        assert all(len(ids) <= max_new_tokens for _, _, ids in got)


def test_mixed_batch_with_sampled_penalised_and_prefilling_jobs(peaked, drafters):
    """Verify rows beside plain decode rows (a job returning probabilities takes no drafts), penalised greedy jobs
    (their penalty history holds the drafts) and prompt chunks of jobs admitted later."""
    tok = peaked.tokenizer
    token_lists = repetitive_prompts(tok, 6)
    penalised = folio.SamplerSettings.greedy(token_repetition_penalty=1.3, token_frequency_penalty=0.2)

    def run(generator):
        jobs = make_jobs(token_lists[:3], max_new_tokens=30)
        jobs += [folio.DynamicJob(input_ids=token_lists[3], max_new_tokens=30, gen_settings=penalised,
                                  stop_conditions=[]),
                 folio.DynamicJob(input_ids=token_lists[4], max_new_tokens=30, gen_settings=GREEDY,
                                  stop_conditions=[], return_probs=True)]
        late = make_jobs([token_lists[5]], max_new_tokens=20)
        for job in jobs:
            generator.enqueue(job)
        for _ in range(3):
            generator.step()
        run_to_end(generator, late)
        while generator.num_remaining_jobs():
            generator.step()
            generator.cache_manager.check()
        return [j.generated_ids for j in jobs + late]

    for drafter in ("ngram", "draft_model"):
        gen = peaked.generator(max_chunk_size=16, **drafters[drafter])
        assert run(gen) == run(peaked.generator(max_chunk_size=16))
        assert gen.speculator.num_drafted > 0


def test_results_report_draft_counts(peaked, drafters):
    gen = peaked.generator(**drafters["self_draft"])
    jobs = make_jobs(repetitive_prompts(peaked.tokenizer, 2), max_new_tokens=20)
    results = run_to_end(gen, jobs)
    finals = [results[j.serial][-1] for j in jobs]
    assert sum(r.accepted_draft_tokens for r in finals) == gen.speculator.num_accepted > 0
    assert sum(r.accepted_draft_tokens + r.rejected_draft_tokens for r in finals) == gen.speculator.num_drafted
    plain = run_to_end(peaked.generator(), make_jobs(repetitive_prompts(peaked.tokenizer, 1)))
    final = next(iter(plain.values()))[-1]
    assert (final.accepted_draft_tokens, final.rejected_draft_tokens) == (0, 0)


# --- no leaks ---

@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_no_page_leaks_after_1000_speculative_jobs(peaked, drafters, drafter):
    tok = peaked.tokenizer
    gen = peaked.generator(num_tokens=2048, **drafters[drafter])
    bases = repetitive_prompts(tok, 8)
    sampled = folio.SamplerSettings(temperature=1.0, top_k=20)
    stop_token = tok.encode(" the")[-1]
    jobs = [folio.DynamicJob(input_ids=bases[i % 8][: 10 + i % 17], max_new_tokens=1 + i % 13,
                             gen_settings=GREEDY if i % 3 else sampled, seed=i,
                             stop_conditions=[stop_token] if i % 4 == 0 else [])
            for i in range(1000)]
    done = 0
    pending = list(jobs)
    while pending or gen.num_remaining_jobs():
        while pending and gen.num_pending_jobs() < 64:
            gen.enqueue(pending.pop())
        done += sum(r.eos for r in gen.step().results)
        if gen.num_steps % 50 == 0:
            gen.cache_manager.check()
    assert done == 1000
    assert gen.speculator.num_drafted > (2000 if drafter == "draft_model" else 100)
    manager = gen.cache_manager
    manager.check()
    assert manager.num_in_use == 0
    assert manager.num_free + manager.num_cached == manager.num_pages
    for job in jobs:
        assert job.new_tokens <= job.max_new_tokens


# --- sampled: the target's distribution ---

def _chi_square_p_value(counts: dict, probs: dict) -> float:
    """Pearson's test of observed counts against expected probabilities; cells expected below 5 are pooled."""
    total = sum(counts.values())
    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for cell, p in probs.items():
        if p * total < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += p * total
        else:
            observed.append(counts.get(cell, 0))
            expected.append(p * total)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert sum(counts.get(c, 0) for c in probs) == total, "a sample fell outside the target's support"
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_verdicts_emit_the_target_distribution():
    """The acceptance rule alone: whatever the drafter's q, the first emitted token is distributed as p."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 200_000
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, 0)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, 0)
    for dense in (True, False):
        drafted = torch.multinomial(q, n, replacement=True, generator=gen) if dense else \
            torch.full((n,), int(q.argmax()))
        u = torch.rand(2, n, generator=gen, dtype=torch.float64)
        v = verdicts(p.expand(n, vocab), drafted, q.expand(n, vocab) if dense else None, u[0], u[1])
        first = torch.where(v.accepted, drafted, v.emitted_ids)
        counts = dict(enumerate(torch.bincount(first, minlength=vocab).tolist()))
        assert _chi_square_p_value(counts, dict(enumerate(p.tolist()))) > P_VALUE_FLOOR
        accepted = v.accepted.double().mean().item()
        want = float(torch.minimum(p, q).sum()) if dense else float(p[q.argmax()])
        assert abs(accepted - want) < 0.01  # min(p, q) mass is the acceptance rate


def _target_sequence_probs(hf_model, prompt, settings, length):
    """P(t1..t_length) under the sampler's temperature and top-k, from transformers' logits."""
    probs = {}

    def step_probs(ids):
        logits = hf_logits(hf_model, ids)[-1].double()
        top = torch.topk(logits, settings.top_k)
        weights = torch.softmax(top.values / settings.temperature, 0)
        return dict(zip(top.indices.tolist(), weights.tolist()))

    def walk(ids, prob, depth):
        if depth == length:
            probs[tuple(ids[len(prompt):])] = prob
            return
        for token, p in step_probs(ids).items():
            walk(ids + [token], prob * p, depth + 1)

    walk(list(prompt), 1.0, 0)
    return probs


@pytest.mark.parametrize("drafter", ["ngram", "near_draft", "self_draft"])
def test_sampled_output_follows_the_target_distribution(peaked, peaked_dir, drafters, drafter):
    """4,000 jobs, 3 tokens each (the 2nd and 3rd come out of verify rows): the joint frequencies of the 27
    possible outputs against transformers' probabilities."""
    tok = peaked.tokenizer
    # the model's own greedy continuation (random weights fall into cycles): the likely tokens then recur in the
    # prompt with their likely successors, so n-gram drafts are sometimes right
    base = prompts(tok, 1)[0]
    prompt = base + run_greedy(peaked.generator(), [base], max_new_tokens=40)[0]
    settings = folio.SamplerSettings(temperature=1.5, top_k=3, top_p=1.0, token_repetition_penalty=1.0)
    want = _target_sequence_probs(load_hf_model(peaked_dir), prompt, settings, 3)
    gen = peaked.generator(max_batch_size=128, **drafters[drafter])
    jobs = [folio.DynamicJob(input_ids=prompt, max_new_tokens=3, gen_settings=settings, seed=1000 + i,
                             stop_conditions=[]) for i in range(4000)]
    pending = list(jobs)
    while pending or gen.num_remaining_jobs():
        while pending and gen.num_pending_jobs() < 256:
            gen.enqueue(pending.pop())
        gen.step()
    counts: dict = {}
    for job in jobs:
        key = tuple(job.generated_ids)
        counts[key] = counts.get(key, 0) + 1
    assert gen.speculator.num_drafted >= 500  # many jobs verified drafts
    drafted, accepted = gen.speculator.num_drafted, gen.speculator.num_accepted
    if drafter == "self_draft":
        assert accepted >= 0.99 * drafted  # q is p (up to rounding): every draft passes
    else:
        assert accepted < drafted  # the residual draws ran
    if drafter == "near_draft":
        # (n-gram drafts of this model's near-uniform top 3 are rarely right: the acceptance branch is checked
        # with point-mass drafts by test_verdicts_emit_the_target_distribution)
        assert accepted > 0
    assert _chi_square_p_value(counts, want) > P_VALUE_FLOOR


# --- settings ---

def test_a_draft_model_with_another_vocabulary_is_refused(peaked, tmp_path):
    make_hf_model(tmp_path, "llama", vocab_size=512)
    other = folio.Model.from_pretrained(tmp_path, progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        peaked.generator(draft_model=other)


def test_bad_speculation_settings_are_refused(peaked):
    with pytest.raises(ValueError, match="exclude each other"):
        peaked.generator(draft_model=peaked.model, use_ngram_draft=True)
    with pytest.raises(ValueError, match="max_q_size"):
        peaked.generator(use_ngram_draft=True, num_draft_tokens=8, max_q_size=8)
    with pytest.raises(ValueError, match="draft_cache"):
        peaked.generator(draft_cache=folio.Cache(peaked.model, num_tokens=256, page_size=16))
    small = folio.Cache(peaked.model, num_tokens=256, page_size=16)
    with pytest.raises(ValueError, match="must match"):
        peaked.generator(draft_model=peaked.model, draft_cache=small)


def test_draft_lengths_follow_the_acceptance_rate():
    from folio.speculative.adaptive import DraftLengths

    lengths = DraftLengths(max_draft_tokens=6, draft_token_cost=0.15)
    ks = [lengths.best_length(a / 10) for a in range(11)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 6
    # free drafts: all of them once they beat the cost of a step that is not launched ahead
    free = DraftLengths(4, 0.0)
    assert free.best_length(0.5) == 4 and free.best_length(0.05) == 0
    # a sequence that accepts nothing stops drafting and probes once every probe_interval steps; each failed probe
    # doubles its interval
    seq = object()
    for _ in range(10):
        lengths.record(seq, 3, 0)
    from folio.speculative.adaptive import MAX_PROBE_INTERVAL

    base = lengths.probe_interval
    interval = lengths._rates[seq].probe_interval  # failures while off count as failed probes
    assert base < interval <= MAX_PROBE_INTERVAL and interval % base == 0
    interval = lengths._rates[seq].probe_interval = 2 * base
    assert lengths.lengths([seq], [6], step_idx=base) == [0]
    assert lengths.lengths([seq], [6], step_idx=interval) == [1]
    assert not lengths.any_drafting([seq], [6], base, 1) and lengths.any_drafting([seq], [6], interval, 1)
    lengths.record(seq, 1, 0)
    assert lengths._rates[seq].probe_interval == 2 * interval
    lengths.record(seq, 1, 1)  # an accepted probe: back to the base interval
    assert lengths._probe_due(seq, base)


def test_a_step_drafts_only_when_its_drafts_outweigh_what_its_rows_lose():
    from folio.speculative.adaptive import DraftLengths

    lengths = DraftLengths(max_draft_tokens=4, draft_token_cost=0.0, probe_interval=1 << 20)
    good, others = object(), [object() for _ in range(63)]
    for _ in range(5):
        lengths.record(good, 4, 4)
        for seq in others:
            lengths.record(seq, 4, 0)
    assert lengths.lengths([good], [4], step_idx=1, num_rows=1) == [4]
    # one predictable sequence among 64 decode rows: its few extra tokens do not pay for every row's wait
    assert lengths.lengths([good], [4], step_idx=1, num_rows=64) == [0]
    assert not lengths.any_drafting([good] + others, [4] * 64, 1, 64)


def test_step_budget_keeps_the_most_valuable_drafts():
    from folio.speculative.adaptive import DraftLengths

    lengths = DraftLengths(max_draft_tokens=4, draft_token_cost=0.0, step_token_budget=10)
    good, bad = object(), object()
    for _ in range(5):
        lengths.record(good, 4, 4)
        lengths.record(bad, 4, 1)
    seqs = [good, bad] * 3
    ks = lengths.lengths(seqs, [4] * 6, step_idx=1)
    assert len(seqs) + sum(ks) == 10
    assert ks == [2, 0, 1, 0, 1, 0]  # the good sequences' first drafts, then the next best: a second one


def test_async_generator_and_generate_take_the_same_settings(peaked):
    import asyncio

    from folio.aio import DynamicGeneratorAsync, DynamicJobAsync

    token_lists = repetitive_prompts(peaked.tokenizer, 2)
    want = run_greedy(peaked.generator(), token_lists, max_new_tokens=16)

    async def main():
        gen = DynamicGeneratorAsync(model=peaked.model, cache=folio.Cache(peaked.model, num_tokens=4096, page_size=16),
                                    tokenizer=peaked.tokenizer, use_ngram_draft=True, adaptive_draft=False)
        try:
            jobs = [DynamicJobAsync(gen, input_ids=ids, max_new_tokens=16, gen_settings=GREEDY, stop_conditions=[])
                    for ids in token_lists]
            finals = []
            for job in jobs:
                async for result in job:
                    if result.eos:
                        finals.append(result)
            return [job.job.generated_ids for job in jobs], finals, gen.generator.speculator.num_drafted
        finally:
            await gen.close()

    got, finals, num_drafted = asyncio.run(asyncio.wait_for(main(), 120))
    assert got == want and num_drafted > 0
    assert all(r.accepted_draft_tokens is not None for r in finals)
    text = peaked.tokenizer.decode(token_lists[0])
    gen = peaked.generator(use_ngram_draft=True, adaptive_draft=False)
    assert gen.generate(text, max_new_tokens=16, gen_settings=GREEDY, completion_only=True, stop_conditions=[]) == \
        peaked.generator().generate(text, max_new_tokens=16, gen_settings=GREEDY, completion_only=True,
                                    stop_conditions=[])
    assert gen.speculator.num_drafted > 0


def test_ngram_observation_agrees_with_the_drafter():
    """The cheap per-token check (the last token seen before with a successor) says whether the n-gram drafter has
    a proposal, token by token, over random streams with repeats."""
    import random

    from folio.speculative.adaptive import DraftLengths
    from folio.speculative.ngram import NgramDraft
    from folio.speculative.speculator import Speculator

    class Job:
        return_probs = return_top_tokens = return_logits = False
        takes_drafts = True

    class Seq:
        job = Job()
        cfg_partner = None

    rng = random.Random(0)
    for trial in range(20):
        spec = Speculator(DraftLengths(4, 0.0), max_q_size=8)
        seq = Seq()
        seq.token_ids = [rng.randrange(12) for _ in range(rng.randrange(1, 6))]
        index = NgramDraft()
        for _ in range(60):
            spec.observe(seq)
            index.extend(seq.token_ids)
            assert spec._has_proposal[seq] == bool(index.propose(1)), (trial, seq.token_ids)
            seq.token_ids = seq.token_ids + [rng.randrange(12)]


def test_a_verify_row_that_fails_fails_its_job_alone(peaked, monkeypatch):
    """A job whose verification raises fails with its error; the other jobs of the step finish as without it."""
    from folio.runner import ModelRunner

    token_lists = repetitive_prompts(peaked.tokenizer, 3)
    want = run_greedy(peaked.generator(), token_lists, max_new_tokens=12)
    gen = peaked.generator(**NGRAM)
    jobs = make_jobs(token_lists, max_new_tokens=12)
    bad = jobs[1]
    original = ModelRunner.verify

    def verify(self, chunks, logits):
        if any(c.seq.job is bad for c in chunks):
            raise RuntimeError("bad row")
        return original(self, chunks, logits)

    monkeypatch.setattr(ModelRunner, "verify", verify)
    results = run_to_end(gen, jobs)
    final = results[bad.serial][-1]
    assert final.eos and isinstance(final.error, RuntimeError)
    assert [jobs[0].generated_ids, jobs[2].generated_ids] == [want[0], want[2]]
    assert gen.cache_manager.num_in_use == 0
