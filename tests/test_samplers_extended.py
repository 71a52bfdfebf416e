"""The extended samplers (temperature_last, dynamic temperature, smoothing, top-a, tail-free, typical, skew,
mirostat, DRY, XTC) against independent one-row references written from the formulas in plain Python.

Statistical tests draw N_DRAWS tokens in one batched sample() call (distinct seeded uniforms, fixed seed) and compare
the counts with the reference probabilities by a chi-square test; a test fails below P_FLOOR, so a correct sampler
fails one test with probability 1e-4 (per test, per seed: the seeds are fixed, so the outcome is reproducible).
The mutation checks show that the same test does fail when a parameter is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import folio
from folio.sampling import RowParams, SamplerSettings, sample
from folio.sampling.distribution import probabilities
from folio.sampling.dry import breaker_ids, dry_penalties
from folio.sampling.sampler import _sample_split
from folio.sampling.state import SamplerState, mirostat_mu, observe_sampled

N_DRAWS = 20_000
P_FLOOR = 1e-4

# A base with the plain samplers off, so that each test turns on what it checks.
PLAIN = SamplerSettings(temperature=1.0, top_k=0, top_p=0.0, min_p=0.0, token_repetition_penalty=1.0)


def settings(**kw) -> SamplerSettings:
    return dataclasses.replace(PLAIN, **kw)


# ------------------------------------------------------------------------------------------ the reference


def _softmax(z: list[float]) -> list[float]:
    finite = [v for v in z if v != -math.inf]
    m = max(finite)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in z]
    s = sum(e)
    return [v / s for v in e]


def _norm(p: list[float]) -> list[float]:
    s = sum(p)
    return [v / s for v in p]


def _keep(p: list[float], keep: list[bool]) -> list[float]:
    """Truncate to `keep` (always keeping the most probable remaining token), renormalised."""
    best = max(range(len(p)), key=lambda i: (p[i], -i))
    return _norm([v if (k or i == best) else 0.0 for i, (v, k) in enumerate(zip(p, keep))])


def _power(p: list[float], t: float) -> list[float]:
    return _norm([v ** (1.0 / t) if v > 0 else 0.0 for v in p])


def _entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p if v > 0)


def ref_top_a(p, a):
    pmax = max(p)
    return _keep(p, [v >= a * pmax * pmax for v in p])


def ref_tfs(p, z):
    order = sorted(range(len(p)), key=lambda i: -p[i])
    q = [p[i] for i in order if p[i] > 0]
    n = len(q)
    if n <= 2:
        return p
    d2 = [abs(q[i] - 2 * q[i + 1] + q[i + 2]) for i in range(n - 2)]
    total = sum(d2)
    if total == 0:
        return p
    keep_n, cum = n, 0.0
    for i, d in enumerate(d2):
        cum += d / total
        if cum > z:
            keep_n = i + 1
            break
    kept = set(order[:keep_n])
    return _keep(p, [i in kept for i in range(len(p))])


def ref_typical(p, mass):
    h = _entropy(p)
    live = [i for i in range(len(p)) if p[i] > 0]
    live.sort(key=lambda i: (abs(-math.log(p[i]) - h), -p[i]))
    kept, cum = set(), 0.0
    for i in live:
        if cum >= mass:
            break
        kept.add(i)
        cum += p[i]
    return _norm([v if i in kept else 0.0 for i, v in enumerate(p)])


def ref_mirostat_v2(p, mu):
    return _keep(p, [v > 0 and -math.log2(v) <= mu for v in p])


def ref_mirostat_v1(p, mu, n_vocab):
    q = sorted((v for v in p if v > 0), reverse=True)[:100]
    num = den = 0.0
    for i in range(len(q) - 1):
        t = math.log((i + 2) / (i + 1))
        num += t * math.log(q[i] / q[i + 1])
        den += t * t
    s = max(num / den, 1e-6) if den > 0 else 1e-6
    eps = s - 1
    k = int(((eps * 2 ** mu) / (1 - n_vocab ** -eps)) ** (1 / s)) if abs(eps) > 1e-9 else int(
        (2 ** mu / math.log(n_vocab)) ** (1 / s))
    k = max(1, k)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept = {i for i in order[:k] if p[i] > 0}
    return _keep(p, [i in kept for i in range(len(p))])


def ref_xtc(p, threshold, probability):
    top = sorted((i for i in range(len(p)) if p[i] > 0 and p[i] >= threshold), key=lambda i: (-p[i], i))
    if len(top) < 2:
        return p
    excluded = set(top[:-1])
    m = sum(p[i] for i in excluded)
    return _norm([v * (1 - probability) if i in excluded else v * (1 + probability * m / (1 - m))
                  for i, v in enumerate(p)])


def ref_distribution(logits: list[float], s: SamplerSettings, mu: float | None = None) -> list[float]:
    """The final distribution of one row of (penalty-free) logits, in the documented order."""
    t_pre = 1.0 if s.temperature_last else s.temperature
    z = list(logits)
    if s.smoothing_factor > 0:
        lmax = max(z)
        z = [-s.smoothing_factor * (v - lmax) ** 2 for v in z]
    p = _softmax([v / t_pre for v in z])
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if s.top_k:
        kept = set(order[:s.top_k])
        p = _norm([v if i in kept else 0.0 for i, v in enumerate(p)])
    if 0 < s.top_p < 1:
        kept, cum = set(), 0.0
        for i in order:
            if cum >= s.top_p:
                break
            kept.add(i)
            cum += p[i]
        p = _norm([v if i in kept else 0.0 for i, v in enumerate(p)])
    if s.min_p:
        pmax = max(p)
        p = _norm([v if v >= s.min_p * pmax else 0.0 for v in p])
    if s.top_a:
        p = ref_top_a(p, s.top_a)
    if 0 < s.tfs < 1:
        p = ref_tfs(p, s.tfs)
    if 0 < s.typical < 1:
        p = ref_typical(p, s.typical)
    if s.mirostat:
        mu = 2 * s.mirostat_tau if mu is None else mu
        p = ref_mirostat_v1(p, mu, len(p)) if s.mirostat == 1 else ref_mirostat_v2(p, mu)
    if s.temperature_last:
        p = _power(p, s.temperature)
    if s.max_temp > s.min_temp:
        n = sum(v > 0 for v in p)
        if n > 1:
            t = s.min_temp + (s.max_temp - s.min_temp) * (_entropy(p) / math.log(n)) ** s.temp_exponent
            p = _power(p, max(t, 1e-4))
    if s.xtc_probability:
        p = ref_xtc(p, s.xtc_threshold, s.xtc_probability)
    return p


def ref_pick_probabilities(p: list[float], skew: float) -> list[float]:
    """The probability that each token is picked when the draw u becomes u^(e^-skew) over the candidates sorted
    by probability: P(u' <= x) = x^(e^skew)."""
    if skew == 0:
        return p
    c = math.exp(skew)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    out, cum = [0.0] * len(p), 0.0
    for i in order:
        out[i] = min(cum + p[i], 1.0) ** c - min(cum, 1.0) ** c
        cum += p[i]
    return out


# ------------------------------------------------------------------------------------------ statistics


def chi_square_p(counts: np.ndarray, probs: list[float]) -> float:
    """p-value of counts against probs (bins expected below 5 pooled into one); 0 when a token of probability 0
    was drawn."""
    probs = np.asarray(probs, dtype=np.float64)
    if counts[probs <= 1e-12].sum():
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    if expected[~big].sum() >= 5 or len(obs) < 2:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    elif expected[~big].sum() > 0:  # too little to stand alone: pooled with the smallest bin
        k = int(np.argmin(exp))
        obs[k] += counts[~big].sum()
        exp[k] += expected[~big].sum()
    obs, exp = np.asarray(obs, dtype=np.float64), np.asarray(exp, dtype=np.float64)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) < 2:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def draw_counts(logits: list[float], s: SamplerSettings, seed: int, n: int = N_DRAWS, state=None, history=(),
                breakers=frozenset()) -> np.ndarray:
    rng = random.Random(seed)
    rows = [RowParams.unchecked(settings=s, u=rng.random(), history_ids=history, blocked_ids=(), vocab_size=None,
                                return_top_tokens=0, return_logits=False, state=state, dry_breakers=breakers)
            for _ in range(n)]
    x = torch.tensor([logits] * n, dtype=torch.float32)
    out = sample(x, rows)
    ids = out.token_ids.numpy()
    assert (ids >= 0).all()
    return np.bincount(ids, minlength=len(logits))


LOGITS = [2.0, 1.6, 1.5, 1.1, 0.7, 0.6, 0.2, -0.3, -0.4, -1.0, -1.8, -2.5]

CASES = {
    "temperature_last": settings(temperature=0.6, temperature_last=True, top_p=0.9),
    "temperature_first": settings(temperature=0.6, top_p=0.9),
    "dynamic_temperature": settings(min_temp=0.3, max_temp=2.0, temp_exponent=0.7),
    "smoothing": settings(smoothing_factor=0.4, temperature=1.3),
    "top_a": settings(top_a=0.6),
    "tfs": settings(tfs=0.7),
    "typical": settings(typical=0.6),
    "mirostat1": settings(mirostat=1, mirostat_tau=2.0),
    "mirostat2": settings(mirostat=2, mirostat_tau=1.2),
    "xtc": settings(xtc_threshold=0.08, xtc_probability=0.6),
    "skew": settings(skew=0.8, top_k=6),
    "combined": settings(temperature=1.2, temperature_last=True, top_k=10, min_p=0.02, top_a=0.1, tfs=0.95,
                         typical=0.95, min_temp=0.5, max_temp=1.5, xtc_threshold=0.1, xtc_probability=0.5,
                         skew=-0.4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_draws_match_the_reference(name):
    s = CASES[name]
    counts = draw_counts(LOGITS, s, seed=hash(name) % 1000 + 1)
    expected = ref_pick_probabilities(ref_distribution(LOGITS, s), s.skew)
    assert chi_square_p(counts, expected) > P_FLOOR, (counts, np.round(np.asarray(expected) * N_DRAWS))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].skew == 0])
def test_dense_distribution_matches_the_reference(name):
    """probabilities() (what speculative decoding's verify rows use) is the same distribution."""
    s = CASES[name]
    row = RowParams(settings=s, u=0.0)
    dense = probabilities(torch.tensor([LOGITS]), [row])[0].double().numpy()
    np.testing.assert_allclose(dense, ref_distribution(LOGITS, s), atol=2e-6)


def test_mirostat_with_given_mu():
    s = CASES["mirostat2"]
    for mu in (0.5, 1.7, 3.3, 6.0):
        counts = draw_counts(LOGITS, s, seed=int(mu * 10), n=8000, state=SamplerState(mirostat_mu=mu))
        expected = ref_distribution(LOGITS, s, mu=mu)
        assert chi_square_p(counts, expected) > P_FLOOR, (mu, counts)


@pytest.mark.parametrize(("name", "wrong"), [
    ("typical", dict(typical=0.45)),
    ("tfs", dict(tfs=0.5)),
    ("xtc", dict(xtc_probability=0.45)),
    ("skew", dict(skew=0.6)),
    ("dynamic_temperature", dict(max_temp=1.6)),
])
def test_mutation_a_wrong_parameter_fails_the_test(name, wrong):
    s = CASES[name]
    counts = draw_counts(LOGITS, s, seed=7)
    mutated = dataclasses.replace(s, **wrong)
    expected = ref_pick_probabilities(ref_distribution(LOGITS, mutated), mutated.skew)
    assert chi_square_p(counts, expected) < P_FLOOR


def test_temperature_first_and_last_differ_as_expected():
    """A low temperature applied first sharpens before top-p, so top-p keeps fewer tokens; applied last, top-p
    cuts the T=1 distribution and the survivors are sharpened."""
    first = ref_distribution(LOGITS, CASES["temperature_first"])
    last = ref_distribution(LOGITS, CASES["temperature_last"])
    assert sum(v > 0 for v in first) < sum(v > 0 for v in last)
    x = torch.tensor([LOGITS])
    got_first = probabilities(x, [RowParams(settings=CASES["temperature_first"], u=0.0)])[0]
    got_last = probabilities(x, [RowParams(settings=CASES["temperature_last"], u=0.0)])[0]
    assert int((got_first > 0).sum()) == sum(v > 0 for v in first)
    assert int((got_last > 0).sum()) == sum(v > 0 for v in last)
    # temperature_last alone, without truncation, is the plain temperature
    t_last = probabilities(x, [RowParams(settings=settings(temperature=0.6, temperature_last=True), u=0.0)])[0]
    t_first = probabilities(x, [RowParams(settings=settings(temperature=0.6), u=0.0)])[0]
    torch.testing.assert_close(t_last, t_first, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ hand-checked


def test_reference_functions_on_hand_checked_examples():
    p = [0.5, 0.3, 0.2]
    assert ref_top_a(p, 1.0) == pytest.approx([0.625, 0.375, 0.0])
    assert ref_typical(p, 0.5) == pytest.approx([0.625, 0.375, 0.0])  # closest to H=1.03 nats: .3, then .5
    assert ref_typical(p, 0.2) == pytest.approx([0.0, 1.0, 0.0])
    assert ref_typical(p, 0.9) == pytest.approx(p)
    assert ref_mirostat_v2(p, 2.0) == pytest.approx([0.625, 0.375, 0.0])  # 2^-2 = .25
    assert ref_xtc(p, 0.25, 0.5) == pytest.approx([0.25, 0.45, 0.30])
    assert ref_xtc(p, 0.35, 1.0) == pytest.approx(p)  # one top choice: nothing excluded
    # d2 of .4 .3 .15 .1 .05 = .05, .10, 0 -> cumulative 1/3, 1, 1: z = .5 first crossed at i = 1, keep 2
    assert ref_tfs([0.4, 0.3, 0.15, 0.1, 0.05], 0.5) == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])
    assert ref_tfs([0.4, 0.3, 0.15, 0.1, 0.05], 0.2) == pytest.approx([1, 0, 0, 0, 0])
    assert ref_pick_probabilities([0.5, 0.5], math.log(2)) == pytest.approx([0.25, 0.75])
    # uniform candidates have normalised entropy 1: the dynamic temperature is max_temp, and p^(1/T) keeps them
    assert ref_distribution([0.0] * 4, settings(min_temp=0.1, max_temp=3.0)) == pytest.approx([0.25] * 4)


def test_stages_on_hand_checked_examples():
    from folio.sampling.truncation import locally_typical, mirostat_v2, tail_free, xtc

    p = torch.tensor([[0.5, 0.3, 0.2]])
    torch.testing.assert_close(locally_typical(p, torch.tensor([[0.5]])), torch.tensor([[0.625, 0.375, 0.0]]))
    torch.testing.assert_close(mirostat_v2(p, torch.tensor([[2.0]], dtype=torch.float64)),
                               torch.tensor([[0.625, 0.375, 0.0]]))
    torch.testing.assert_close(xtc(p, torch.tensor([[0.25]]), torch.tensor([[0.5]])), torch.tensor([[0.25, 0.45, 0.3]]))
    q = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    torch.testing.assert_close(tail_free(q, torch.tensor([[0.5]])), torch.tensor([[4 / 7, 3 / 7, 0, 0, 0]]))


# ------------------------------------------------------------------------------------------ mirostat state


def test_mirostat_mu_update():
    s = settings(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.25)
    seq = SimpleNamespace(job=SimpleNamespace(gen_settings=s), sampler_state=None)
    assert mirostat_mu(s, None) == 6.0
    observe_sampled(seq, 0.25)  # surprise 2 bits: mu = 6 - .25 * (2 - 3) = 6.25
    assert seq.sampler_state.mirostat_mu == pytest.approx(6.25)
    observe_sampled(seq, 1 / 32)  # 5 bits: 6.25 - .25 * 2 = 5.75
    assert seq.sampler_state.mirostat_mu == pytest.approx(5.75)
    observe_sampled(seq, None)  # no probability: unchanged
    assert seq.sampler_state.mirostat_mu == pytest.approx(5.75)
    off = SimpleNamespace(job=SimpleNamespace(gen_settings=PLAIN), sampler_state=None)
    observe_sampled(off, 0.5)
    assert off.sampler_state is None


def _mirostat_jobs(tokenizer, n):
    import folio

    s = SamplerSettings(temperature=1.0, top_k=0, top_p=0.0, token_repetition_penalty=1.0, mirostat=2,
                        mirostat_tau=1.0, mirostat_eta=0.3)
    texts = [f"The lighthouse keeper number {i} walked {'far ' * (i % 5)}along the shore" for i in range(n)]
    return [folio.DynamicJob(input_ids=tokenizer.encode(t), max_new_tokens=40, gen_settings=s, stop_conditions=[],
                             seed=100 + i, return_probs=True) for i, t in enumerate(texts)]


def _run(generator, jobs):
    for job in jobs:
        generator.enqueue(job)
    seqs = [job.sequence for job in jobs]
    probs = {id(j): [] for j in jobs}
    steps = 0
    while generator.num_remaining_jobs():
        for r in generator.step().results:
            if getattr(r, "token_probs", None):
                probs[id(r.job)] += r.token_probs
        steps += 1
        assert steps < 5000
    return seqs, probs


def test_mirostat_mu_survives_preemption(peaked):
    reference_jobs = _mirostat_jobs(peaked.tokenizer, 6)
    _run(peaked.generator(num_tokens=4096), reference_jobs)
    jobs = _mirostat_jobs(peaked.tokenizer, 6)
    small = peaked.generator(num_tokens=12 * 16)
    seqs, probs = _run(small, jobs)
    assert small.scheduler.num_preemptions > 0
    assert [j.generated_ids for j in jobs] == [j.generated_ids for j in reference_jobs]
    for job, seq in zip(jobs, seqs):
        # mu followed every token from 2 tau on, through the preemptions
        s = job.gen_settings
        mu = 2 * s.mirostat_tau
        assert len(probs[id(job)]) == len(job.generated_ids) == 40
        for p in probs[id(job)]:
            mu -= s.mirostat_eta * (-math.log2(p) - s.mirostat_tau)
        assert seq.sampler_state.mirostat_mu == pytest.approx(mu, rel=1e-6, abs=1e-6)


def test_speculator_skips_stateful_jobs():
    from folio.speculative.speculator import Speculator

    def takes(s):
        job = folio.DynamicJob(input_ids=[1, 2], max_new_tokens=4, gen_settings=s)
        return Speculator._job_takes_drafts(SimpleNamespace(job=job, cfg_partner=None))

    assert takes(PLAIN) and takes(settings(tfs=0.9, xtc_probability=0.5))
    assert not takes(settings(mirostat=2))
    assert not takes(settings(dry_multiplier=0.8))
    assert not takes(settings(skew=0.5))


# ------------------------------------------------------------------------------------------ DRY


def brute_dry(history, s, breakers):
    """For every token t: the longest n <= max_ngram such that history[-n:] (no breakers) occurred earlier, ending
    before the last position, followed by t (t no breaker)."""
    h = list(history)[-s.dry_range:] if s.dry_range else list(history)
    best = {}
    for end in range(len(h) - 1):  # an earlier occurrence ending at `end`, followed by h[end + 1]
        t = h[end + 1]
        if t in breakers:
            continue
        n = 0
        while (n < s.dry_max_ngram and end - n >= 0 and h[end - n] == h[len(h) - 1 - n]
               and h[end - n] not in breakers):
            n += 1
        if n:
            best[t] = max(best.get(t, 0), n)
    return {t: s.dry_multiplier * s.dry_base ** (n - s.dry_allowed_length)
            for t, n in best.items() if n >= s.dry_allowed_length}


def test_dry_hand_checked():
    s = settings(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=2)
    ids, pen = dry_penalties([1, 2, 3, 1, 2], s)
    assert dict(zip(ids.tolist(), pen.tolist())) == {3: 0.8}
    ids, pen = dry_penalties([1, 2, 3, 1, 2], dataclasses.replace(s, dry_allowed_length=3))
    assert len(ids) == 0
    ids, pen = dry_penalties([5, 1, 2, 3, 9, 5, 1, 2], s)  # 5 1 2 repeated: n = 3 -> 0.8 * 2
    assert dict(zip(ids.tolist(), pen.tolist())) == {3: pytest.approx(1.6)}
    ids, pen = dry_penalties([5, 1, 2, 3, 9, 5, 1, 2], s, breakers={5})  # the match stops before 5: n = 2
    assert dict(zip(ids.tolist(), pen.tolist())) == {3: pytest.approx(0.8)}
    ids, pen = dry_penalties([5, 1, 2, 3, 9, 5, 1, 2], s, breakers={3})  # a breaker is never penalised
    assert len(ids) == 0


def test_dry_matches_brute_force_over_random_histories():
    rng = random.Random(3)
    for trial in range(300):
        vocab = rng.choice([3, 4, 6])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        breakers = set(rng.sample(range(vocab), rng.choice([0, 0, 1])))
        s = settings(dry_multiplier=rng.choice([0.5, 1.0]), dry_base=rng.choice([1.0, 1.75]),
                     dry_allowed_length=rng.choice([1, 2, 3]), dry_max_ngram=rng.choice([3, 5, 20]),
                     dry_range=rng.choice([0, 0, 10, 25]))
        ids, pen = dry_penalties(history, s, breakers)
        assert dict(zip(ids.tolist(), pen.tolist())) == pytest.approx(brute_dry(history, s, breakers)), (
            trial, history, breakers, s)


def test_dry_through_the_sampler_matches_the_reference():
    rng = random.Random(11)
    history = [rng.randrange(len(LOGITS)) for _ in range(40)]
    history += history[5:12]  # a repeat: its continuation is penalised
    s = settings(dry_multiplier=0.7, dry_base=1.5, dry_allowed_length=2, temperature=0.9)
    breakers = frozenset({3})
    penalised = list(LOGITS)
    for t, pen in brute_dry(history, s, breakers).items():
        penalised[t] -= pen
    assert penalised != LOGITS
    counts = draw_counts(LOGITS, s, seed=5, history=history, breakers=breakers)
    assert chi_square_p(counts, ref_distribution(penalised, s)) > P_FLOOR
    assert chi_square_p(counts, ref_distribution(LOGITS, s)) < P_FLOOR  # mutation: without DRY it fails
    # greedy rows get DRY too (it changes the argmax)
    top = max(range(len(LOGITS)), key=lambda i: penalised[i])
    greedy = dataclasses.replace(s, temperature=0.0)
    out = sample(torch.tensor([LOGITS]), [RowParams(settings=greedy, u=0.5, history_ids=history,
                                                    dry_breakers=breakers)])
    assert out.token_ids.tolist() == [top]


def test_dry_breakers_from_the_tokenizer(demo):
    tok = demo.tokenizer
    ids = breaker_ids(tok, None)
    assert breaker_ids(tok, None) is ids  # cached
    dot = tok.encode(".")
    assert dot and dot[-1] in ids
    assert tok.special_ids <= ids
    custom = breaker_ids(tok, ("zzz_not_in_any_token",))
    assert not custom


def test_dry_job_runs_in_the_generator(peaked):
    import folio

    s = SamplerSettings(temperature=1.0, dry_multiplier=2.0, dry_allowed_length=1)
    job = folio.DynamicJob(input_ids=peaked.tokenizer.encode("one two one two one two"), max_new_tokens=12,
                           gen_settings=s, stop_conditions=[], seed=3)
    _run(peaked.generator(), [job])
    assert len(job.generated_ids) == 12


# ------------------------------------------------------------------------------------------ plumbing


def test_mixed_batch_split_equals_rows_alone():
    """The CUDA routing (extended rows through torch, the others native), run on the CPU: merged outputs equal
    each row sampled alone."""
    plain = SamplerSettings(temperature=0.9, top_k=5)
    rows = [RowParams(settings=s, u=u) for s, u in [(plain, 0.1), (CASES["typical"], 0.7), (plain, 0.95),
                                                    (CASES["xtc"], 0.3), (CASES["mirostat1"], 0.5)]]
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    extended = [r.settings.uses_extended_samplers for r in rows]
    out = _sample_split(x, rows, extended, None, None)
    for b, row in enumerate(rows):
        alone = sample(x[b:b + 1], [row])
        assert out.token_ids[b] == alone.token_ids[0]
        assert out.token_probs[b].item() == pytest.approx(alone.token_probs[0].item(), rel=1e-5)


def test_defaults_are_off_and_unchanged():
    s = SamplerSettings()
    assert not s.uses_extended_samplers and not s.dry_active and s.speculation_safe and s.cfg_scale is None
    assert SamplerSettings.greedy().truncation_only == SamplerSettings.greedy()


@pytest.mark.parametrize(("field", "value"), [
    ("temperature_last", 1), ("min_temp", -0.1), ("max_temp", math.inf), ("temp_exponent", 0.0),
    ("smoothing_factor", -1.0), ("top_a", 1.5), ("tfs", -0.1), ("typical", 2.0), ("skew", math.nan),
    ("mirostat", 3), ("mirostat", True), ("mirostat_eta", -0.1), ("dry_multiplier", -1.0), ("dry_base", 0.5),
    ("dry_allowed_length", 0), ("dry_range", -1), ("dry_max_ngram", 0), ("dry_sequence_breakers", "abc"),
    ("dry_sequence_breakers", ("",)), ("xtc_threshold", 1.1), ("xtc_probability", -0.5), ("cfg_scale", math.inf),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplerSettings.{field}"):
        SamplerSettings(**{field: value})


def test_validation_of_related_fields():
    with pytest.raises(ValueError, match="max_temp"):
        SamplerSettings(min_temp=1.0, max_temp=0.5)
    with pytest.raises(ValueError, match="mirostat_tau"):
        SamplerSettings(mirostat=2, mirostat_tau=0.0)
    with pytest.raises(ValueError, match="dry_max_ngram"):
        SamplerSettings(dry_allowed_length=5, dry_max_ngram=3)
    s = SamplerSettings(dry_sequence_breakers=["\n", ".", "\n"], cfg_scale=1.5)
    assert s.dry_sequence_breakers == ("\n", ".")
    assert hash(s) == hash(SamplerSettings(dry_sequence_breakers=("\n", "."), cfg_scale=1.5))
    assert not s.truncation_only.dry_active
