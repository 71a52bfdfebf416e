"""Refusing at enqueue what the sampler or the cache would refuse later: folio.validation.validate_job, and the
bounds SamplerSettings puts on the values that reach fp32 logits.

Oracle for the bounds: a value at a bound is accepted, and a job carrying it samples through folio.sampling.sample
(the torch path on the CPU; the native kernels where built, and on CUDA) without error: a valid id, never -1 while
something is pickable, never a banned or blocked one, with a finite probability.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from folio import ops
from folio.job import DynamicJob, JobState
from folio.sampling import RowParams, SamplerSettings, sample, uniform
from folio.sampling.sampler import _sample_native
from folio.sampling.settings import (
    MAX_INT32,
    MAX_LOGIT_OFFSET,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)
from folio.validation import validate_job

VOCAB = 60  # real vocabulary entries; the logits have 64 columns, the last 4 masked as padding
NUM_COLUMNS = 64
ENGINE = dict(vocab_size=VOCAB, max_seq_len=256, num_pages=16, page_size=16)
INF = math.inf


def make_job(input_ids=(1, 2, 3), max_new_tokens=8, **kw) -> DynamicJob:
    return DynamicJob(input_ids=list(input_ids), max_new_tokens=max_new_tokens, **kw)


# --- validate_job: refused, with the field named ---

@pytest.mark.parametrize("kw, engine, message", [
    (dict(return_top_tokens=61), {}, r"^return_top_tokens=61 exceeds the model's vocabulary of 60$"),
    (dict(return_top_tokens=70000), {}, r"^return_top_tokens=70000 exceeds"),
    (dict(input_ids=[1, 60, 2]), {}, r"^input_ids holds token id 60, outside the model's vocabulary of 60$"),
    (dict(stop_conditions=[5, 60]), {}, r"^stop_conditions: token id 60 is outside the model's vocabulary \[0, 60\)$"),
    (dict(stop_conditions=[60], min_new_tokens=4), {}, r"^stop_conditions: token id 60 is outside"),
    (dict(stop_conditions=["end", -1]), {}, r"^stop_conditions: token id -1 is outside"),
    (dict(stop_conditions=[10**12], min_new_tokens=1), {}, r"^stop_conditions: token id 1000000000000 is outside"),
    (dict(gen_settings=SamplerSettings(token_bias={3: 1.0, 60: 1.0})), {},
     r"^gen_settings\.token_bias: token id 60 is outside the model's vocabulary \[0, 60\)$"),
    (dict(gen_settings=SamplerSettings(token_bias={63: -INF})), {}, r"^gen_settings\.token_bias: token id 63"),
    (dict(max_new_tokens=254), {}, r"max_new_tokens \(254\) = 257 exceeds max_seq_len 256"),
    (dict(max_new_tokens=62), dict(num_pages=4), r"max_new_tokens \(62\) need 5 pages of 16 tokens, but the whole "
                                                 r"cache has 4"),
    (dict(gen_settings=SamplerSettings(token_bias={i: -INF for i in range(VOCAB)})), {},
     r"^gen_settings\.token_bias bans every token of the vocabulary of 60"),
    (dict(gen_settings=SamplerSettings(token_bias={i: -INF for i in range(30)}), stop_conditions=list(range(30, 60)),
          min_new_tokens=1), {}, r"^stop_conditions: .*min_new_tokens=1.*gen_settings\.token_bias bans cover"),
    (dict(stop_conditions=list(range(VOCAB)), min_new_tokens=3), {}, r"^stop_conditions: .*whole vocabulary of 60"),
])
def test_validate_job_refuses(kw, engine, message):
    with pytest.raises(ValueError, match=message):
        validate_job(make_job(**kw), **{**ENGINE, **engine})


def test_validate_job_refuses_a_job_enqueued_before():
    job = make_job()
    validate_job(job, **ENGINE)
    job.state = JobState.PENDING  # what bind() sets at enqueue
    with pytest.raises(ValueError, match="already enqueued"):
        validate_job(job, **ENGINE)


def test_validation_module_loads_no_torch():
    code = "import sys, folio.validation; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- validate_job: accepted at the limits, and the sampler takes what it accepts ---

def row_for(job: DynamicJob, u: float, history_ids=(), sampled: int = 0, **kw) -> RowParams:
    """The job's row as the engine builds it (folio.runner.ModelRunner._row_params) for its `sampled`-th token."""
    return RowParams(job.gen_settings, u, history_ids=list(history_ids),
                     blocked_ids=tuple(job.stop_tokens) if sampled < job.min_new_tokens else (),
                     vocab_size=VOCAB, return_top_tokens=job.return_top_tokens, **kw)


def random_logits(num_rows: int, scale: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, NUM_COLUMNS, generator=torch.Generator().manual_seed(seed)) * scale


def allowed_ids(job: DynamicJob, sampled: int = 0) -> set[int]:
    banned = {t for t, bias in job.gen_settings.token_bias if bias == -INF}
    blocked = set(job.stop_tokens) if sampled < job.min_new_tokens else set()
    return set(range(VOCAB)) - banned - blocked


def native_cpu_available() -> bool:
    return all(ops.DEFAULT.native(name, "cpu") is not None for name in ("sample_rows", "apply_penalties"))


def sampler_paths(device: str) -> list:
    """The ways a row can be sampled on `device`: folio.sampling.sample as called (the torch path on the CPU, the
    native kernels on CUDA unless top tokens are asked for), and on the CPU the native kernels when built."""
    paths = [sample]
    if device == "cpu" and native_cpu_available():
        paths.append(lambda logits, rows: _sample_native(ops.DEFAULT, logits, rows, None))
    return paths


def assert_samples_safely(job: DynamicJob, history_ids=(), sampled: int = 0, device: str = "cpu") -> None:
    allowed = allowed_ids(job, sampled)
    assert allowed, "the oracle needs a pickable token"
    for scale in (3.0, 100.0):
        logits = random_logits(8, scale)
        logits[::2, 4] = 0.0  # a repeated token's logit of exactly 0: 0 * an overflowed repetition penalty is NaN
        logits = logits.to(device)
        rows = [row_for(job, uniform(seed, 0), history_ids, sampled) for seed in range(7)]
        rows.append(row_for(job, 0.999999, history_ids, sampled))
        for path in sampler_paths(device):
            out = path(logits, rows)
            for b, (token_id, prob) in enumerate(zip(out.token_ids.tolist(), out.token_probs.tolist())):
                assert token_id in allowed, (scale, b, token_id)
                assert math.isfinite(prob) and 0.0 < prob <= 1.0, (scale, b, prob)
            if out.top_k_probs is not None:
                assert torch.isfinite(out.top_k_probs).all()


@pytest.mark.parametrize("kw, engine", [
    (dict(return_top_tokens=VOCAB), {}),
    (dict(input_ids=[0, VOCAB - 1]), {}),
    (dict(stop_conditions=[VOCAB - 1, "end"]), {}),
    (dict(stop_conditions=[0, VOCAB - 1], min_new_tokens=2), {}),
    (dict(gen_settings=SamplerSettings(token_bias={0: 2.0, VOCAB - 1: -INF})), {}),
    (dict(max_new_tokens=253), {}),  # prompt + new tokens == max_seq_len == the whole cache
    (dict(max_new_tokens=61), dict(num_pages=4)),  # exactly 4 pages
    # all but one token banned or blocked: the one left is sampled
    (dict(gen_settings=SamplerSettings(token_bias={i: -INF for i in range(VOCAB - 1)})), {}),
    (dict(gen_settings=SamplerSettings(token_bias={i: -INF for i in range(30)}), stop_conditions=list(range(31, 60)),
          min_new_tokens=1), {}),
    # stop tokens covering the vocabulary block nothing without min_new_tokens
    (dict(stop_conditions=list(range(VOCAB))), {}),
])
def test_validate_job_accepts_at_the_limits(kw, engine):
    job = make_job(**kw)
    validate_job(job, **{**ENGINE, **engine})
    assert_samples_safely(job, history_ids=job.input_ids)


# --- SamplerSettings: values that would break the sampler's fp32 logits are refused ---

@pytest.mark.parametrize("kw, message", [
    # Each of these broke the torch path (an index error, or no token at all) before the bounds.
    (dict(token_presence_penalty=-1e308), r"token_presence_penalty must be in \[-10000.0, 10000.0\], got -1e\+308"),
    (dict(token_presence_penalty=1e308), "token_presence_penalty"),
    (dict(token_frequency_penalty=-1e300), "token_frequency_penalty"),
    (dict(token_frequency_penalty=1e300), "token_frequency_penalty"),
    (dict(token_repetition_penalty=1e-300), "token_repetition_penalty"),
    (dict(token_repetition_penalty=1e-38), "token_repetition_penalty"),
    (dict(token_repetition_penalty=1e300), "token_repetition_penalty"),
    (dict(token_bias={3: 1e308}), r"token_bias\[3\]: bias must be in \[-10000.0, 10000.0\], or -inf"),
    (dict(token_bias={3: -1e308}), r"token_bias\[3\]"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=1e30), "temperature"),
    # Just past each bound.
    (dict(token_presence_penalty=math.nextafter(-MAX_LOGIT_OFFSET, -INF)), "token_presence_penalty"),
    (dict(token_frequency_penalty=math.nextafter(MAX_LOGIT_OFFSET, INF)), "token_frequency_penalty"),
    (dict(token_repetition_penalty=math.nextafter(MIN_REPETITION_PENALTY, 0.0)), "token_repetition_penalty"),
    (dict(token_repetition_penalty=math.nextafter(MAX_REPETITION_PENALTY, INF)), "token_repetition_penalty"),
    (dict(token_repetition_penalty=0.0), "token_repetition_penalty"),
    (dict(token_bias={7: math.nextafter(MAX_LOGIT_OFFSET, INF)}), r"token_bias\[7\]"),
    (dict(token_bias={7: math.nextafter(-MAX_LOGIT_OFFSET, -INF)}), r"token_bias\[7\]"),
    (dict(temperature=math.nextafter(MAX_TEMPERATURE, INF)), "temperature"),
    # int32 in the native kernels: 2**31 wrapped, and the native CPU kernel dropped the penalty
    (dict(top_k=MAX_INT32 + 1), "top_k"),
    (dict(token_repetition_range=MAX_INT32 + 1), "token_repetition_range"),
    (dict(token_repetition_decay=MAX_INT32 + 1), "token_repetition_decay"),
    (dict(token_repetition_decay=2**63), "token_repetition_decay"),
])
def test_settings_refuse_values_that_break_the_sampler(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplerSettings(**kw)


# Settings at the bounds, alone and in the combinations that push a logit furthest (a repeated token's logit
# multiplied by 1e4 and raised by every offset, over the smallest sampled temperature), each with a history where
# some tokens occur many times (the frequency penalty counts each occurrence).
BOUNDARY_SETTINGS = [
    dict(token_presence_penalty=-MAX_LOGIT_OFFSET),
    dict(token_presence_penalty=MAX_LOGIT_OFFSET),
    dict(token_frequency_penalty=-MAX_LOGIT_OFFSET),
    dict(token_frequency_penalty=MAX_LOGIT_OFFSET),
    dict(token_repetition_penalty=MIN_REPETITION_PENALTY),
    dict(token_repetition_penalty=MAX_REPETITION_PENALTY),
    dict(token_bias={5: MAX_LOGIT_OFFSET, 6: -MAX_LOGIT_OFFSET, 7: -INF}),
    dict(temperature=MAX_TEMPERATURE),
    dict(temperature=0.01),  # the smallest temperature that is sampled (below it is greedy)
    dict(temperature=0.0099),
    dict(top_k=MAX_INT32),
    dict(top_k=MAX_INT32, temperature=MAX_TEMPERATURE, top_p=1.0, min_p=0.0),
    dict(token_repetition_penalty=1.5, token_repetition_range=MAX_INT32, token_repetition_decay=MAX_INT32),
    dict(token_repetition_penalty=1.5, token_repetition_range=0, token_repetition_decay=MAX_INT32),
    dict(top_p=1e-300),
    dict(top_p=1.0 - 1e-9),
    dict(min_p=1.0),
    dict(min_p=1e-300, top_p=0.0, top_k=0),
    dict(top_p=1e-300, min_p=1.0, top_k=2),
    dict(token_repetition_penalty=MIN_REPETITION_PENALTY, token_presence_penalty=-MAX_LOGIT_OFFSET,
         token_frequency_penalty=-MAX_LOGIT_OFFSET, token_bias={3: MAX_LOGIT_OFFSET, 4: MAX_LOGIT_OFFSET},
         temperature=0.01, top_k=0, top_p=0.0),
    dict(token_repetition_penalty=MAX_REPETITION_PENALTY, token_presence_penalty=MAX_LOGIT_OFFSET,
         token_frequency_penalty=MAX_LOGIT_OFFSET, token_bias={3: -MAX_LOGIT_OFFSET}, temperature=MAX_TEMPERATURE,
         top_k=0, top_p=0.0),
    dict(token_repetition_penalty=MIN_REPETITION_PENALTY, token_presence_penalty=MAX_LOGIT_OFFSET,
         token_frequency_penalty=-MAX_LOGIT_OFFSET, temperature=0.01, top_k=0, top_p=0.5, min_p=0.5),
]
HISTORY = [3, 4] * 200 + list(range(VOCAB)) + [8] * 100  # ids 3, 4, 8 repeated; every id present once at least


@pytest.mark.parametrize("kw", BOUNDARY_SETTINGS)
def test_settings_at_the_bounds_sample_safely(kw):
    job = make_job(gen_settings=SamplerSettings(**kw), stop_conditions=[9, 10], min_new_tokens=1,
                   return_top_tokens=5)
    validate_job(job, **ENGINE)
    assert_samples_safely(job, history_ids=HISTORY)  # stop tokens blocked, top tokens asked: the torch path
    assert_samples_safely(make_job(gen_settings=job.gen_settings), history_ids=HISTORY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kw", BOUNDARY_SETTINGS)
def test_settings_at_the_bounds_sample_safely_on_cuda(kw):
    # No top tokens asked: sample() takes the native CUDA kernels where built.
    job = make_job(gen_settings=SamplerSettings(**kw), stop_conditions=[9, 10], min_new_tokens=1)
    assert_samples_safely(job, history_ids=HISTORY, device="cuda")
    assert_samples_safely(make_job(gen_settings=job.gen_settings), history_ids=HISTORY, device="cuda")
