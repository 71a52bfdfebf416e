"""The sampler's plain path (folio.sampling.plain) against the general path's native sampling of the same rows, built
as the runner builds them (a RowParams each, windows from the device histories), on the CPU module's kernels: the
same kernels over the same inputs, so the same tokens and probabilities, bit for bit. And which rows it refuses."""

from __future__ import annotations

import random

import pytest
import torch

from folio.job import DynamicJob
from folio.ops import DEFAULT
from folio.sampling import RowParams, SamplerSettings
from folio.sampling.device_history import DeviceHistories
from folio.sampling.penalties import window_size
from folio.sampling.plain import plain_rows, sample_plain
from folio.sampling.rng import uniforms
from folio.sampling.sampler import _sample_native
from folio.sequence import Sequence

pytestmark = pytest.mark.skipif(DEFAULT.native("sample_rows", "cpu") is None, reason="the CPU module is not built")

VOCAB, COLUMNS = 900, 1024  # logits wider than the vocabulary: the columns past it are masked

MIXED = [SamplerSettings(),  # temperature, top-k, top-p, a repetition penalty over the whole history
         SamplerSettings(temperature=1.3, top_k=0, top_p=0.95, token_repetition_penalty=1.0),  # no penalty
         SamplerSettings(top_k=5, min_p=0.1, token_repetition_range=16, token_repetition_decay=8,
                         token_frequency_penalty=0.3, token_presence_penalty=0.2),
         SamplerSettings.greedy(),
         SamplerSettings(temperature=0.0, token_repetition_penalty=1.3)]  # greedy with a penalty


def make_seqs(settings: list[SamplerSettings], num_rows: int, histories: DeviceHistories, seed: int,
              **job_args) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for b in range(num_rows):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        job = DynamicJob(input_ids=prompt, max_new_tokens=64, stop_conditions=[],
                         gen_settings=settings[b % len(settings)], seed=rng.randrange(1 << 40), **job_args)
        seq = Sequence(job, list(prompt))
        seq.num_sampled = rng.randrange(0, 20)
        sampled = [rng.randrange(VOCAB) for _ in range(seq.num_sampled)]
        seq.token_ids += sampled
        if job.gen_settings.penalty_window != 0:
            histories.add(seq, seq.token_ids, len(prompt) + 64)
        seqs.append(seq)
    return seqs


def general(logits: torch.Tensor, seqs: list[Sequence], histories: DeviceHistories):
    """The general path's native sampling, with its inputs built the way folio.runner.ModelRunner.sample does."""
    draws = uniforms([s.job.seed for s in seqs], [s.num_sampled for s in seqs])
    rows = [RowParams(settings=s.job.gen_settings, u=u, vocab_size=VOCAB) for s, u in zip(seqs, draws)]
    keys = [s if s in histories else None for s in seqs]
    lengths = [s.prompt_len + s.num_sampled for s in seqs]
    sizes = [0 if k is None else window_size(s.job.gen_settings, n) for k, s, n in zip(keys, seqs, lengths)]
    windows = histories.windows(keys, lengths, sizes, COLUMNS) if any(sizes) else None
    return _sample_native(DEFAULT, logits, rows, windows, in_place=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_path_equals_the_general_path(seed):
    histories = DeviceHistories("cpu")
    seqs = make_seqs(MIXED, 37, histories, seed)
    logits = torch.randn(len(seqs), COLUMNS, generator=torch.Generator().manual_seed(seed)) * 3
    plain = plain_rows(seqs, histories)
    assert plain is not None and len(plain.table) == len(MIXED)  # one entry per distinct settings
    got = sample_plain(logits.clone(), plain, histories, VOCAB, DEFAULT)
    want = general(logits.clone(), seqs, histories)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.token_probs, want.token_probs)
    assert (got.token_ids < VOCAB).all()
    # the penalties changed something: without them the draws differ somewhere
    unpenalized = [Sequence(DynamicJob(input_ids=s.job.input_ids, max_new_tokens=64, stop_conditions=[],
                                       gen_settings=SamplerSettings(temperature=s.job.gen_settings.temperature,
                                                                    top_k=s.job.gen_settings.top_k,
                                                                    top_p=s.job.gen_settings.top_p,
                                                                    min_p=s.job.gen_settings.min_p,
                                                                    token_repetition_penalty=1.0),
                                       seed=s.job.seed), list(s.token_ids)) for s in seqs]
    for u, s in zip(unpenalized, seqs):
        u.num_sampled = s.num_sampled
    other = plain_rows(unpenalized, DeviceHistories("cpu"))
    assert other is not None and not any(other.sizes)
    differs = sample_plain(logits.clone(), other, histories, VOCAB, DEFAULT)
    assert not torch.equal(differs.token_probs, got.token_probs)


def test_every_row_penalized_equals_the_general_path():
    """Every row keeps a penalty history (a server's default settings): the same draws as the general path."""
    histories = DeviceHistories("cpu")
    penalized = [s for s in MIXED if s.penalty_window != 0]
    seqs = make_seqs(penalized, 29, histories, 7)
    assert all(s in histories for s in seqs)
    logits = torch.randn(len(seqs), COLUMNS, generator=torch.Generator().manual_seed(7)) * 3
    plain = plain_rows(seqs, histories)
    assert plain.history_rows == list(range(len(seqs)))
    got = sample_plain(logits.clone(), plain, histories, VOCAB, DEFAULT)
    want = general(logits.clone(), seqs, histories)
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.token_probs, want.token_probs)


def test_plain_path_reports_which_rows_keep_histories_and_probabilities():
    histories = DeviceHistories("cpu")
    seqs = make_seqs(MIXED, 10, histories, 5, return_probs=True)
    plain = plain_rows(seqs, histories)
    assert plain.history_rows == [b for b, s in enumerate(seqs) if s in histories]
    assert plain.return_probs
    assert plain.counters == [s.num_sampled for s in seqs]


@pytest.mark.parametrize("job_args", [
    dict(gen_settings=SamplerSettings(token_bias={3: 1.0})),
    dict(gen_settings=SamplerSettings(dry_multiplier=0.8)),
    dict(gen_settings=SamplerSettings(top_a=0.2)),  # an extended sampler
    dict(gen_settings=SamplerSettings(mirostat=2)),
    dict(return_top_tokens=3),
    dict(return_logits=True),
    dict(banned_strings=["abc"]),
])
def test_rows_that_need_the_general_path_are_refused(job_args):
    histories = DeviceHistories("cpu")
    seqs = make_seqs([SamplerSettings()], 4, histories, 0)
    settings = job_args.pop("gen_settings", SamplerSettings())
    odd = DynamicJob(input_ids=[1, 2, 3], max_new_tokens=8, stop_conditions=[], gen_settings=settings, seed=1,
                     **job_args)
    assert plain_rows(seqs, histories) is not None
    assert plain_rows(seqs + [Sequence(odd, [1, 2, 3])], histories) is None


def test_blocked_stop_tokens_all_greedy_and_wide_windows_are_refused():
    histories = DeviceHistories("cpu")
    seqs = make_seqs([SamplerSettings()], 3, histories, 0)
    blocked = DynamicJob(input_ids=[1, 2], max_new_tokens=8, stop_conditions=[7], min_new_tokens=2, seed=1)
    seq = Sequence(blocked, [1, 2])
    histories.add(seq, seq.token_ids, 16)
    assert plain_rows(seqs + [seq], histories) is None  # stop token 7 is blocked for its first 2 tokens
    seq.num_sampled = 2
    assert plain_rows(seqs + [seq], histories) is not None
    greedy = make_seqs([SamplerSettings.greedy()], 3, DeviceHistories("cpu"), 1)
    assert plain_rows(greedy, DeviceHistories("cpu")) is None  # the general path's argmax
    long = DeviceHistories("cpu")
    wide = make_seqs([SamplerSettings()], 2, long, 2)
    wide[0].num_sampled = 20_000  # a whole-history window wider than the native kernel reads
    assert plain_rows(wide, long) is None


def test_the_healed_token_takes_the_general_path():
    """Token healing constrains a job's first sampled token (folio.constrain.healing's mask): that row goes to the
    general path, which applies the mask; the tokens after it may take the plain path."""
    histories = DeviceHistories("cpu")
    seqs = make_seqs([SamplerSettings()], 3, histories, 0)
    healing = DynamicJob(input_ids=[1, 2, 3, 4], max_new_tokens=8, stop_conditions=[], token_healing=True, seed=1)
    seq = Sequence(healing, [1, 2, 3])
    histories.add(seq, seq.token_ids, 16)
    assert plain_rows(seqs + [seq], histories) is None
    seq.num_sampled = 1
    assert plain_rows(seqs + [seq], histories) is not None
