"""Batched sampler: statistical tests of the sampled distribution, exact tests of penalties and masks.

Oracles are computed here, in float64 plain Python, independently of the sampler's tensor code:
`intended()` applies temperature / top-k / top-p (smallest set reaching p) / min-p / bias to one row, and
`penalised()` is the reference's backwards loop over the history (first encounter: repetition + presence, every
encounter: frequency; strengths fade linearly after `range` tokens over `decay` tokens).
Statistical tests draw many rows of the same logits in one call, each with its own counter, and compare the
empirical frequencies with the intended probabilities (5 standard deviations per token; excluded tokens exactly 0).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from folio.sampling import RowParams, SamplerSettings, sample, uniform, uniform_tensor

NO_PENALTY = dict(token_repetition_penalty=1.0)
NUM_DRAWS = 30_000


def settings(**kw) -> SamplerSettings:
    base = dict(temperature=1.0, top_k=0, top_p=0.0, min_p=0.0, **NO_PENALTY)
    base.update(kw)
    return SamplerSettings(**base)


def make_logits(num_columns: int, seed: int = 0, scale: float = 1.5) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(0.0, scale) for _ in range(num_columns)]


def intended(logits: list[float], s: SamplerSettings, blocked=(), vocab_size=None) -> list[float]:
    """The distribution a row should be sampled from."""
    values = list(logits)
    for token_id, bias in s.token_bias:
        values[token_id] += bias
    for token_id in blocked:
        values[token_id] = -math.inf
    for token_id in range(vocab_size or len(values), len(values)):
        values[token_id] = -math.inf
    if s.is_greedy:
        best = max(range(len(values)), key=lambda i: (values[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(values))]
    top = max(values)
    weights = [math.exp((v - top) / s.temperature) for v in values]
    order = sorted(range(len(values)), key=lambda i: -weights[i])
    kept = order[: s.top_k] if s.top_k else order
    if 0 < s.top_p < 1:
        total = sum(weights[i] for i in kept)
        mass, cut = 0.0, []
        for i in kept:
            cut.append(i)
            mass += weights[i] / total
            if mass >= s.top_p - 1e-9:
                break
        kept = cut
    best = max(weights[i] for i in kept)
    kept = [i for i in kept if weights[i] >= s.min_p * best]
    total = sum(weights[i] for i in kept)
    return [weights[i] / total if i in kept else 0.0 for i in range(len(values))]


def draw(logits: list[float], s: SamplerSettings, n: int = NUM_DRAWS, seed: int = 0, **row_kw):
    """n rows of the same logits in one call; returns (frequencies, output)."""
    batch = torch.tensor([logits], dtype=torch.float32).expand(n, -1).contiguous()
    rows = [RowParams(s, u, **row_kw) for u in uniforms(seed, n)]
    out = sample(batch, rows)
    counts = torch.bincount(out.token_ids, minlength=len(logits)).double()
    return (counts / n).tolist(), out


def uniforms(seed: int, n: int) -> list[float]:
    """Draws 0..n-1 of stream `seed` (the vectorized generator; test_sampling_rng checks it equals `uniform`)."""
    return uniform_tensor(torch.tensor(seed), torch.arange(n)).tolist()


def assert_matches(freqs: list[float], probs: list[float], n: int = NUM_DRAWS) -> None:
    for token_id, (f, p) in enumerate(zip(freqs, probs)):
        if p == 0.0:
            assert f == 0.0, f"token {token_id} drawn with frequency {f} but it was excluded"
        else:
            tolerance = 5 * math.sqrt(p * (1 - p) / n) + 1 / n
            assert abs(f - p) <= tolerance, f"token {token_id}: frequency {f:.4f}, intended {p:.4f}"


# --- the sampled distribution ---

@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature(temperature):
    logits = make_logits(12)
    s = settings(temperature=temperature)
    freqs, _ = draw(logits, s)
    assert_matches(freqs, intended(logits, s))


@pytest.mark.parametrize("top_k", [1, 3, 7])
def test_top_k(top_k):
    logits = make_logits(12, seed=1)
    s = settings(top_k=top_k, temperature=0.9)
    freqs, _ = draw(logits, s)
    probs = intended(logits, s)
    assert sum(p > 0 for p in probs) == top_k
    assert_matches(freqs, probs)


def test_top_p():
    logits = make_logits(16, seed=2)
    s = settings(top_p=0.7)
    freqs, _ = draw(logits, s)
    assert_matches(freqs, intended(logits, s))


@pytest.mark.parametrize("probs, top_p, num_kept", [
    ([0.5, 0.3, 0.2], 0.6, 2),  # the exclusive (reference) variant would keep only the first
    ([0.5, 0.3, 0.2], 0.8, 2),  # the first two reach p exactly
    ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.75, 2),
    ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.7501, 3),
    ([0.5, 0.3, 0.2], 0.4, 1),
])
def test_top_p_is_smallest_set_reaching_p(probs, top_p, num_kept):
    logits = [math.log(p) for p in probs]
    s = settings(top_p=top_p)
    freqs, _ = draw(logits, s)
    kept = probs[:num_kept]
    expected = [p / sum(kept) for p in kept] + [0.0] * (len(probs) - num_kept)
    assert_matches(freqs, expected)


def test_min_p():
    logits = make_logits(16, seed=3)
    s = settings(min_p=0.2)
    probs = intended(logits, s)
    assert 1 < sum(p > 0 for p in probs) < 16
    freqs, _ = draw(logits, s)
    assert_matches(freqs, probs)


def test_truncations_combined():
    logits = make_logits(32, seed=4, scale=2.0)
    s = settings(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05)
    freqs, _ = draw(logits, s)
    assert_matches(freqs, intended(logits, s))


def test_token_bias():
    logits = make_logits(10, seed=5)
    s = settings(token_bias={2: 2.5, 7: -1.0, 9: -math.inf})
    probs = intended(logits, s)
    assert probs[9] == 0.0
    freqs, _ = draw(logits, s)
    assert_matches(freqs, probs)


def test_blocked_tokens_never_sampled():
    logits = make_logits(10, seed=6)
    logits[3] = 8.0  # would be picked almost always
    s = settings(top_k=4)
    freqs, out = draw(logits, s, blocked_ids=[3, 7])
    assert freqs[3] == 0.0 and freqs[7] == 0.0
    assert_matches(freqs, intended(logits, s, blocked=[3, 7]))


def test_columns_beyond_vocab_never_sampled():
    logits = make_logits(10, seed=7)
    logits[8] = logits[9] = 9.0
    s = settings()
    freqs, out = draw(logits, s, vocab_size=8, return_logits=True, n=5000)
    assert_matches(freqs, intended(logits, s, vocab_size=8), n=5000)
    assert torch.isinf(out.logits[:, 8:]).all() and torch.isfinite(out.logits[:, :8]).all()


def test_rows_with_different_settings_in_one_batch():
    logits = make_logits(12, seed=8)
    variants = [settings(temperature=0.5), settings(top_k=3), settings(top_p=0.6), SamplerSettings.greedy(),
                settings(min_p=0.3, temperature=1.5), settings(token_bias={0: 3.0})]
    n = 6_000
    rows = [RowParams(variants[i % len(variants)], u) for i, u in enumerate(uniforms(11, n * len(variants)))]
    batch = torch.tensor([logits], dtype=torch.float32).expand(len(rows), -1).contiguous()
    token_ids = sample(batch, rows).token_ids
    for v, s in enumerate(variants):
        counts = torch.bincount(token_ids[v:: len(variants)], minlength=len(logits)).double()
        assert_matches((counts / n).tolist(), intended(logits, s), n=n)


# --- greedy ---

def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen)
    for s in [SamplerSettings.greedy(), settings(temperature=0.005), settings(temperature=1.3, top_k=1)]:
        rows = [RowParams(s, uniform(0, i), return_top_tokens=3) for i in range(64)]
        out = sample(logits, rows)
        assert torch.equal(out.token_ids, logits.argmax(dim=1))
        assert torch.equal(out.token_probs, torch.ones(64))
        assert torch.equal(out.top_k_tokens[:, 0], out.token_ids)
        assert torch.equal(out.top_k_probs, torch.tensor([[1.0, 0.0, 0.0]]).expand(64, 3))


def test_greedy_ties_take_first_index():
    logits = torch.zeros(2, 1000)
    logits[0, 500:] = 2.0
    # The second row makes the call take the top 50 candidates, where partial sorts order ties arbitrarily.
    rows = [RowParams(SamplerSettings.greedy(), 0.99, return_top_tokens=50), RowParams(settings(top_k=50), 0.5)]
    out = sample(logits, rows)
    assert out.token_ids[0].item() == 500
    top = out.top_k_tokens[0].tolist()
    assert top[0] == 500 and len(set(top)) == 50 and all(t >= 500 for t in top)


# --- outputs ---

def test_token_probs_and_top_tokens_are_final_distribution():
    logits = make_logits(20, seed=9)
    s = settings(top_k=6, top_p=0.85, temperature=0.8)
    probs = intended(logits, s)
    _, out = draw(logits, s, n=500, return_top_tokens=8)
    order = sorted(range(20), key=lambda i: -probs[i])
    num_kept = sum(p > 0 for p in probs)
    assert out.top_k_tokens.shape == (500, 8) and out.top_k_probs.shape == (500, 8)
    assert out.top_k_tokens[0, :num_kept].tolist() == order[:num_kept]
    assert out.top_k_probs[0].tolist() == pytest.approx([probs[i] for i in order[:8]], abs=1e-6)
    assert (out.top_k_probs[:, num_kept:] == 0).all()
    for token_id, p in zip(out.token_ids.tolist(), out.token_probs.tolist()):
        assert p == pytest.approx(probs[token_id], abs=1e-6)


def test_logits_output_is_before_temperature():
    logits = make_logits(10, seed=10)
    s = settings(temperature=0.5, token_bias={4: 1.25})
    _, out = draw(logits, s, n=2, return_logits=True, blocked_ids=[1])
    expected = torch.tensor(logits)
    expected[4] += 1.25
    expected[1] = -math.inf
    assert torch.allclose(out.logits[0], expected)
    # The caller's logits are not modified.
    plain = torch.tensor([logits])
    sample(plain, [RowParams(s, 0.5, blocked_ids=[1])])
    assert torch.equal(plain, torch.tensor([logits]))
    assert sample(plain, [RowParams(s, 0.5)]).logits is None and sample(plain, [RowParams(s, 0.5)]).top_k_probs is None


def test_row_with_nothing_allowed_reports_minus_one():
    logits = torch.zeros(2, 4)
    rows = [RowParams(settings(), 0.3, blocked_ids=[0, 1, 2, 3]), RowParams(settings(), 0.3, blocked_ids=[0, 1, 2])]
    out = sample(logits, rows)
    assert out.token_ids.tolist() == [-1, 3]
    assert out.token_probs.tolist() == [0.0, 1.0]


# --- determinism ---

def test_same_token_alone_or_batched():
    gen = torch.Generator().manual_seed(1)
    num_rows = 120
    logits = torch.randn(num_rows, 300, generator=gen) * 2
    rng = random.Random(5)
    variants = [SamplerSettings(), settings(top_k=0, top_p=0.9), settings(top_k=200), SamplerSettings.greedy(),
                settings(min_p=0.1, temperature=1.3)]
    rows = []
    for b in range(num_rows):
        history = [rng.randrange(300) for _ in range(rng.randrange(0, 40))]
        rows.append(RowParams(variants[b % len(variants)], uniform(1000 + b, b), history_ids=history,
                              return_top_tokens=b % 4))
    batched = sample(logits, rows).token_ids.tolist()
    alone = [sample(logits[b: b + 1], [rows[b]]).token_ids.item() for b in range(num_rows)]
    assert batched == alone
    shuffled = list(range(num_rows))
    rng.shuffle(shuffled)
    again = sample(logits[shuffled], [rows[b] for b in shuffled]).token_ids.tolist()
    assert again == [batched[b] for b in shuffled]


# --- penalties, exact ---

def penalised(logits: list[float], history: list[int], s: SamplerSettings) -> list[float]:
    """The reference's loop (sampling.cpp apply_rep_penalty_cpu), in float64."""
    out = list(logits)
    rep, freq, pres = s.token_repetition_penalty, s.token_frequency_penalty, s.token_presence_penalty
    decay = s.token_repetition_decay
    d_rep = (1.0 - rep) / decay if decay else 0.0
    d_freq = -freq / decay if decay else 0.0
    d_pres = -pres / decay if decay else 0.0
    sustain = len(history) if s.token_repetition_range == -1 else s.token_repetition_range
    begin = max(0, len(history) - sustain - decay)
    seen = set()
    for i in range(len(history) - 1, begin - 1, -1):
        t = history[i]
        if 0 <= t < len(out):
            if t not in seen:
                out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
                out[t] -= pres
                seen.add(t)
            out[t] -= freq
        sustain -= 1
        if sustain < 0:
            rep, freq, pres = rep + d_rep, freq + d_freq, pres + d_pres
    return out


def penalty_logits(rows_spec, tensor_history=False):
    """Run one call with penalties only; return the processed logits per row."""
    logits = torch.tensor([row[0] for row in rows_spec], dtype=torch.float32)
    rows = [RowParams(s, 0.5, history_ids=torch.tensor(h, dtype=torch.int64) if tensor_history else h,
                      return_logits=True) for _, h, s in rows_spec]
    return sample(logits, rows).logits


PENALTY_LOGITS = [2.0, -1.5, 0.0, 0.75, -0.25, 3.0, -2.0, 1.0]


@pytest.mark.parametrize("kw, history", [
    (dict(token_repetition_penalty=1.3), [1, 2, 0, 5, 5, 6, 1]),
    (dict(token_repetition_penalty=0.8), [0, 1, 3]),
    (dict(token_frequency_penalty=0.5), [3, 3, 3, 4, 0, 3]),
    (dict(token_presence_penalty=0.7), [3, 3, 3, 4, 0, 3]),
    (dict(token_repetition_penalty=1.2, token_frequency_penalty=0.3, token_presence_penalty=0.4), [5, 1, 5, 7, 5]),
    (dict(token_repetition_penalty=1.5, token_repetition_range=3), [0, 1, 5, 6, 7, 3]),
    (dict(token_repetition_penalty=1.5, token_frequency_penalty=0.5, token_presence_penalty=0.25,
          token_repetition_range=2, token_repetition_decay=4), [0, 5, 1, 1, 3, 5, 6, 7, 3]),
    (dict(token_frequency_penalty=1.0, token_repetition_range=0, token_repetition_decay=3), [5, 5, 5, 5]),
    (dict(token_repetition_penalty=2.0, token_repetition_decay=5), [0, 1, 2, 3]),  # range -1 ignores decay
    (dict(token_repetition_penalty=2.0, token_repetition_range=0), [0, 1, 2, 3]),  # empty window
    (dict(token_repetition_penalty=1.5, token_frequency_penalty=0.5), [0, 99, -3, 8, 1]),  # out of range ids
])
def test_penalties_exact(kw, history):
    s = settings(**kw)
    got = penalty_logits([(PENALTY_LOGITS, history, s)])[0].tolist()
    assert got == pytest.approx(penalised(PENALTY_LOGITS, history, s), abs=1e-5)


def test_penalties_random_rows_in_one_batch():
    rng = random.Random(3)
    spec = []
    for _ in range(40):
        s = settings(token_repetition_penalty=rng.choice([1.0, 1.1, 1.5, 0.9]),
                     token_frequency_penalty=rng.choice([0.0, 0.2, -0.3]),
                     token_presence_penalty=rng.choice([0.0, 0.5]),
                     token_repetition_range=rng.choice([-1, 0, 1, 4, 10]),
                     token_repetition_decay=rng.choice([0, 1, 3, 8]))
        history = [rng.randrange(-2, 34) for _ in range(rng.randrange(0, 30))]
        spec.append(([rng.gauss(0, 2) for _ in range(32)], history, s))
    got = penalty_logits(spec)
    for b, (logits, history, s) in enumerate(spec):
        assert got[b].tolist() == pytest.approx(penalised(logits, history, s), abs=1e-5), b
    # A history given as a CPU int64 tensor is the same history.
    assert torch.equal(penalty_logits(spec, tensor_history=True), got)


def test_penalties_then_bias_then_block_order():
    s = settings(token_repetition_penalty=2.0, token_bias={0: 1.0, 1: 1.0})
    logits = torch.tensor([[4.0, 4.0, 4.0]])
    out = sample(logits, [RowParams(s, 0.5, history_ids=[0], blocked_ids=[2], return_logits=True)])
    # 4 / 2 + 1 = 3 (penalty before bias), 4 + 1 = 5, blocked last.
    assert out.logits.tolist() == [[3.0, 5.0, -math.inf]]


# --- validation ---

@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(min_p=2.0), "min_p"),
    (dict(token_repetition_penalty=0.0), "token_repetition_penalty"),
    (dict(token_repetition_range=-2), "token_repetition_range"),
    (dict(token_repetition_decay=-1), "token_repetition_decay"),
    (dict(token_frequency_penalty=math.inf), "token_frequency_penalty"),
    (dict(token_bias={-1: 1.0}), "token_bias"),
    (dict(token_bias={1: math.inf}), "token_bias"),
    (dict(token_bias={1: math.nan}), "token_bias"),
])
def test_settings_validation(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplerSettings(**kw)


def test_settings_defaults_and_greedy():
    s = SamplerSettings()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.token_repetition_penalty) == (0.8, 50, 0.8, 0.0, 1.025)
    assert (s.token_repetition_range, s.token_repetition_decay) == (-1, 0)
    g = SamplerSettings.greedy()
    assert g.is_greedy and g.penalty_window == 0 and g.token_bias == ()
    assert SamplerSettings(token_bias={5: 1.0, 2: -1.0}).token_bias == ((2, -1.0), (5, 1.0))
    hash(SamplerSettings(token_bias={5: 1.0}))  # frozen and hashable


def test_call_validation():
    logits = torch.zeros(1, 8)
    s = settings()
    with pytest.raises(ValueError, match="u must be"):
        RowParams(s, 1.0)
    with pytest.raises(ValueError, match="history_ids"):
        RowParams(s, 0.5, history_ids=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="blocked token id 8"):
        sample(logits, [RowParams(s, 0.5, blocked_ids=[8])])
    with pytest.raises(ValueError, match="token_bias id 9"):
        sample(logits, [RowParams(settings(token_bias={9: 1.0}), 0.5)])
    with pytest.raises(ValueError, match="vocab_size 9"):
        sample(logits, [RowParams(s, 0.5, vocab_size=9)])
    with pytest.raises(ValueError, match="float32"):
        sample(logits.double(), [RowParams(s, 0.5)])
    with pytest.raises(ValueError, match="2 RowParams"):
        sample(logits, [RowParams(s, 0.5)] * 2)


def test_plain_greedy_fast_path_equals_the_full_path() -> None:
    """All-greedy batches skip the sort; asking for one top token forces the full path on the same rows."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=gen).round(decimals=1)  # rounding makes ties
    logits[1] = -math.inf
    logits[2, 37:] = 50.0  # beyond vocab_size: must be masked
    logits[3, [5, 9]] = 9.0  # a tie: the first index wins
    greedy = SamplerSettings.greedy()
    fast = sample(logits, [RowParams(greedy, 0.3, vocab_size=37) for _ in range(6)])
    full = sample(logits, [RowParams(greedy, 0.3, vocab_size=37, return_top_tokens=1) for _ in range(6)])
    assert fast.token_ids.tolist() == full.token_ids.tolist()
    assert fast.token_probs.tolist() == full.token_probs.tolist()
    assert fast.token_ids[1] == -1 and fast.token_ids[3] == 5
    assert fast.top_k_tokens is None and fast.logits is None


def test_first_max_matches_max_with_ties_nan_and_inf():
    """The greedy fast path's two-stage max: the same values and first indices as torch's max, ties across and
    within chunks, NaN and all -inf rows included; narrow or indivisible widths go straight to torch."""
    from folio.sampling.sampler import _first_max

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 128 * 70, generator=g)
    x[1, 3000] = x[1, 8000] = 50.0  # tie across chunks: the first wins
    x[2, 10] = x[2, 11] = 40.0  # tie within a chunk
    x[3] = -math.inf
    x[4, 500] = math.nan
    x[5, :] = 7.0  # all equal
    values, ids = _first_max(x)
    want_values, want_ids = x.max(dim=1)
    assert torch.equal(ids, want_ids) and torch.allclose(values, want_values, equal_nan=True)
    assert ids[1] == 3000 and ids[2] == 10 and ids[5] == 0
    narrow = torch.randn(3, 100, generator=g)
    assert torch.equal(_first_max(narrow)[1], narrow.max(dim=1)[1])


def test_per_row_settings_share_one_entry_per_value_and_keep_each_row_s():
    """The per-row table holds one entry per distinct value (a server's jobs each bring their own settings object),
    each row gathers its own settings' numbers, `adjust` applies to the table, and the draws stay per row."""
    from folio.sampling.sampler import _per_row_settings, native_entry, with_window

    made = [SamplerSettings(temperature=0.7, top_k=40), SamplerSettings(temperature=0.7, top_k=40),
            SamplerSettings(temperature=1.1, top_p=0.9, token_repetition_penalty=1.2),
            SamplerSettings.greedy(), SamplerSettings(temperature=0.7, top_k=40)]
    assert made[0] is not made[1] and made[0] == made[1]
    rows = [RowParams(settings=s, u=0.1 * k) for k, s in enumerate(made)]
    width = 77  # the call's penalty window: where a row's range is -1 (the whole history)
    per_row, u, table = _per_row_settings(rows, native_entry, torch.device("cpu"),
                                          adjust=lambda t: with_window(t, width))
    assert len(table) == 3
    want = [native_entry(s) for s in made]
    want = [t if t[7] >= 0 else (*t[:7], width, *t[8:]) for t in want]
    assert per_row.tolist() == [[float(v) for v in t] for t in want]
    assert u.tolist() == pytest.approx([0.1 * k for k in range(5)])
    # asked again (the next step), the same numbers: kept on each settings object
    again, _, _ = _per_row_settings(rows, native_entry, torch.device("cpu"),
                                    adjust=lambda t: with_window(t, width))
    assert torch.equal(again, per_row)
    # each column, as the native kernels take it (one argument each), is contiguous: no copy per argument
    for table in (per_row, per_row.float(), per_row.int()):
        assert all(table[:, k].is_contiguous() for k in range(table.shape[1]))
        assert table[:, 4].contiguous().data_ptr() == table[:, 4].data_ptr()
