"""The sampler and the random draws on CUDA: same results as on the CPU, and no host synchronization."""

from __future__ import annotations

import math
import random

import pytest
import torch

from folio.sampling import RowParams, SamplerSettings, sample, uniform_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def mixed_rows(num_rows: int, num_columns: int, seed: int) -> list[RowParams]:
    rng = random.Random(seed)
    variants = [SamplerSettings(), SamplerSettings.greedy(), SamplerSettings(top_k=0, top_p=0.9, min_p=0.02),
                SamplerSettings(temperature=1.3, top_k=200, token_frequency_penalty=0.2, token_presence_penalty=0.1,
                                token_repetition_range=16, token_repetition_decay=8),
                SamplerSettings(token_bias={3: 2.0, 7: -math.inf}, top_p=0.0)]
    u = uniform_tensor(torch.tensor(seed), torch.arange(num_rows)).tolist()
    return [RowParams(variants[b % len(variants)], u[b],
                      history_ids=[rng.randrange(num_columns) for _ in range(rng.randrange(0, 300))],
                      blocked_ids=[rng.randrange(num_columns)] if b % 3 == 0 else (),
                      vocab_size=num_columns - 24 if b % 4 == 0 else None,
                      return_top_tokens=b % 6, return_logits=True) for b in range(num_rows)]


def test_uniform_tensor_cuda_matches_cpu():
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63)])[:, None]
    counters = torch.arange(0, 2**40, 2**40 // 997)[None, :]
    assert torch.equal(uniform_tensor(seeds.cuda(), counters.cuda()).cpu(), uniform_tensor(seeds, counters))


def test_sample_cuda_matches_cpu():
    num_rows, num_columns = 256, 4096
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(0)) * 3
    rows = mixed_rows(num_rows, num_columns, seed=1)
    cpu = sample(logits, rows)
    gpu = sample(logits.cuda(), rows)
    assert gpu.token_ids.is_cuda
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)
    assert torch.allclose(gpu.token_probs.cpu(), cpu.token_probs, atol=1e-5)
    assert torch.allclose(gpu.top_k_probs.cpu(), cpu.top_k_probs, atol=1e-5)
    assert torch.allclose(gpu.logits.cpu(), cpu.logits, atol=1e-5, equal_nan=False)


def test_sample_does_not_synchronize():
    num_rows, num_columns = 64, 32000
    logits = torch.randn(num_rows, num_columns, device="cuda")
    rows = mixed_rows(num_rows, num_columns, seed=2)
    sample(logits, rows)  # warm-up: first pinned allocations, kernel loading
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (num_rows,)


def test_native_sampler_agrees_with_the_torch_sampler():
    """Without candidate reports, CUDA samples with the native kernels (penalties; radix-select truncation and
    draw). They implement the same definition: processed logits agree, and so does every token whose draw is not
    within rounding of a cut-off (margins from the row-by-row reference in tests/native_reference.py)."""
    from native_reference import sample_rows_reference

    from folio import ops
    from folio.sampling.device_history import DeviceHistories

    assert ops.OpSet().native("sample_rows", "cuda") is not None
    num_rows, num_columns = 192, 8192
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(5)) * 3
    rows = [RowParams(r.settings, r.u, r.history_ids, r.blocked_ids, r.vocab_size, 0, True)
            for r in mixed_rows(num_rows, num_columns, seed=6)]
    torch_path = sample(logits, rows)  # CPU: the torch code
    native = sample(logits.cuda(), rows)
    histories = DeviceHistories("cuda")
    for b, row in enumerate(rows):
        histories.add(b, list(row.history_ids), len(row.history_ids) + 1)
    sizes = [min(len(r.history_ids), r.settings.penalty_window if r.settings.penalty_window is not None
                 else len(r.history_ids)) for r in rows]
    windows = histories.windows(range(num_rows), [len(r.history_ids) for r in rows], sizes, num_columns)
    from_device = sample(logits.cuda(), [RowParams(r.settings, r.u, (), r.blocked_ids, r.vocab_size, 0, True)
                                         for r in rows], windows)
    assert torch.equal(from_device.token_ids, native.token_ids)
    torch.testing.assert_close(native.logits.cpu(), torch_path.logits, rtol=1e-5, atol=1e-5)

    def column(fn, dtype=torch.float32):
        return torch.tensor([fn(r.settings) for r in rows], dtype=dtype)

    draws = sample_rows_reference(
        torch_path.logits, column(lambda s: 0.0 if s.is_greedy else s.temperature),
        column(lambda s: 1 if s.is_greedy else s.top_k, torch.int32),
        column(lambda s: s.top_p if s.top_p_active else 2.0), column(lambda s: s.min_p),
        torch.tensor([r.u for r in rows]))
    compared = 0
    for b, draw in enumerate(draws):
        if draw.margin < 1e-5:
            continue
        compared += 1
        assert int(native.token_ids[b]) == int(torch_path.token_ids[b]), f"row {b}: {rows[b].settings}"
        assert float(native.token_probs[b]) == pytest.approx(float(torch_path.token_probs[b]), abs=1e-4)
    assert compared >= 0.9 * num_rows


def test_native_sampler_with_device_windows_does_not_synchronize():
    from folio.sampling.device_history import DeviceHistories

    num_rows, num_columns = 64, 32000
    logits = torch.randn(num_rows, num_columns, device="cuda")
    rows = [RowParams(SamplerSettings(), 0.25) for _ in range(num_rows)]
    histories = DeviceHistories("cuda")
    for b in range(num_rows):
        histories.add(b, list(range(b, b + 100)), 200)
    args = (range(num_rows), [100] * num_rows, [100] * num_rows, num_columns)
    sample(logits, rows, histories.windows(*args))  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, rows, histories.windows(*args))
        histories.append(range(num_rows), [100] * num_rows, out.token_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (num_rows,)


@pytest.mark.parametrize("return_logits", [False, True])
def test_sample_in_place_matches_a_copy_and_keeps_returned_logits_apart(return_logits):
    """in_place lets the native kernels penalise and mask the caller's logits where they are: the same draws as
    sampling a copy; a row that returns its processed logits keeps the caller's tensor unchanged."""
    num_rows, num_columns = 64, 32000
    logits = torch.randn(num_rows, num_columns, device="cuda", generator=torch.Generator("cuda").manual_seed(4)) * 3
    rows = [RowParams(r.settings, r.u, history_ids=r.history_ids, blocked_ids=r.blocked_ids,
                      vocab_size=r.vocab_size, return_logits=return_logits and b == 5)
            for b, r in enumerate(mixed_rows(num_rows, num_columns, seed=3))]
    want = sample(logits, rows)
    mine = logits.clone()
    got = sample(mine, rows, in_place=True)
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.token_probs, want.token_probs)
    if return_logits:
        assert torch.equal(mine, logits), "the caller's logits changed although a row returns its logits"
        assert torch.equal(got.logits, want.logits)
    else:
        assert not torch.equal(mine, logits), "in_place sampled a copy (penalties and masks left the input as is)"


def test_reference_op_set_samples_with_the_torch_code_on_cuda(monkeypatch):
    """sample(..., ops=OpSet("reference")) (a model built with ops_backend="reference") never loads a native kernel:
    on CUDA it runs the torch code, which draws what the CPU draws."""
    from folio import ops

    num_rows, num_columns = 64, 4096
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(8)) * 3
    rows = [RowParams(r.settings, r.u, history_ids=r.history_ids, blocked_ids=r.blocked_ids, vocab_size=r.vocab_size)
            for r in mixed_rows(num_rows, num_columns, seed=9)]
    cpu = sample(logits, rows)

    def no_native(device_type):
        raise AssertionError(f"a native module was loaded for {device_type}")

    monkeypatch.setattr(ops, "load_native", no_native)
    gpu = sample(logits.cuda(), rows, ops=ops.OpSet("reference"))
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)
    assert torch.allclose(gpu.token_probs.cpu(), cpu.token_probs, atol=1e-5)


@pytest.mark.parametrize("variant", ["greedy", "native", "torch"])
def test_bitmask_is_honoured_on_cuda(variant):
    """Filtered rows (a token bitmask) pick only allowed tokens on every CUDA path: the plain-greedy argmax, the
    native kernels and the torch code (rows asking for top tokens)."""
    from folio.constrain.base import bitmask_words, set_bits

    num_rows, num_columns = 64, 128256
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(3)).cuda() * 4
    rng = random.Random(5)
    masks = torch.zeros(num_rows, bitmask_words(num_columns), dtype=torch.int32)
    allowed = []
    for b in range(num_rows):
        ids = rng.sample(range(num_columns), rng.choice([1, 2, 50, 3000]))
        allowed.append(set(ids))
        row = masks[b].numpy()
        set_bits(row, ids)
    settings = SamplerSettings.greedy() if variant == "greedy" else SamplerSettings(temperature=1.5, top_k=0,
                                                                                      top_p=1.0)
    u = uniform_tensor(torch.tensor(11), torch.arange(num_rows)).tolist()
    rows = [RowParams(settings, u[b], return_top_tokens=2 if variant == "torch" else 0) for b in range(num_rows)]
    out = sample(logits, rows, allowed=masks.cuda()).token_ids.tolist()
    assert all(t in allowed[b] for b, t in enumerate(out))
    if variant == "greedy":  # the argmax over the allowed tokens
        expected = [max(allowed[b], key=lambda t: logits[b, t].item()) for b in range(num_rows)]
        assert out == expected


@pytest.mark.parametrize("top_k", [0, 50])
def test_masked_rows_pick_on_cuda_what_they_pick_on_the_cpu(top_k):
    """Rows a bitmask leaves fewer tokens than their top-k (or with top-k off) take the native kernel's short list
    with top-k = the allowed count: the same candidates, so the same picks as the CPU's torch code (up to fp32
    sums at a CDF boundary)."""
    from folio.constrain.base import bitmask_words, set_bits

    num_rows, num_columns = 256, 32000
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(9)) * 3
    rng = random.Random(2)
    masks = torch.zeros(num_rows, bitmask_words(num_columns), dtype=torch.int32)
    for b in range(num_rows):
        set_bits(masks[b].numpy(), rng.sample(range(num_columns), rng.choice([1, 2, 7, 40, 49, 300, 2000])))
    settings = SamplerSettings(temperature=0.9, top_k=top_k, top_p=0.95)
    u = uniform_tensor(torch.tensor(4), torch.arange(num_rows)).tolist()
    rows = [RowParams(settings, u[b]) for b in range(num_rows)]
    cpu = sample(logits, rows, allowed=masks).token_ids
    cuda = sample(logits.cuda(), rows, allowed=masks.cuda()).token_ids.cpu()
    assert (cpu == cuda).float().mean().item() >= 0.98


def test_generator_plain_path_equals_the_general_path(demo_dir, monkeypatch):
    """A batch on the sampler's plain path (folio.sampling.plain: settings, draws and penalty windows only) gives
    the tokens and probabilities the general path gives the same jobs; the plain path did run."""
    import folio
    from folio.runner import ModelRunner

    settings = [SamplerSettings(), SamplerSettings(temperature=1.2, top_k=0, top_p=0.9, token_repetition_range=8,
                                                    token_repetition_decay=4, token_frequency_penalty=0.2),
                SamplerSettings(token_repetition_penalty=1.0, min_p=0.05), SamplerSettings.greedy()]

    def run(plain: bool):
        calls = []
        original = ModelRunner._plain_rows

        def counted(self, *args):
            rows = original(self, *args) if plain else None
            calls.append(rows is not None)
            return rows

        monkeypatch.setattr(ModelRunner, "_plain_rows", counted)
        model = folio.Model.from_pretrained(demo_dir, device="cuda", dtype=torch.bfloat16, progress=False)
        cache = folio.Cache(model, num_tokens=8192, page_size=16)
        gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=folio.Tokenizer.from_pretrained(demo_dir),
                                     max_batch_size=16)
        rng = random.Random(0)
        jobs = [folio.DynamicJob(input_ids=[rng.randrange(5, 1000) for _ in range(rng.randrange(4, 60))],
                                 max_new_tokens=40, stop_conditions=[], gen_settings=settings[i % len(settings)],
                                 seed=i, return_probs=True) for i in range(12)]
        # rows the plain path leaves to the general one for some of their tokens: the healed token (its filter's
        # mask), stop tokens blocked below min_new_tokens
        jobs += [folio.DynamicJob(input_ids=[rng.randrange(5, 1000) for _ in range(20)], max_new_tokens=40,
                                  stop_conditions=[], token_healing=True, seed=100, return_probs=True),
                 folio.DynamicJob(input_ids=[rng.randrange(5, 1000) for _ in range(20)], max_new_tokens=40,
                                  stop_conditions=list(range(5, 405)), min_new_tokens=6, seed=101,
                                  return_probs=True)]
        gen.enqueue(jobs)
        probs = {job: [] for job in jobs}
        while gen.num_remaining_jobs():
            for result in gen.iterate():
                probs[result.job] += getattr(result, "token_probs", None) or []
        monkeypatch.undo()
        return [(j.generated_ids, probs[j]) for j in jobs], calls

    plain, plain_calls = run(True)
    general, general_calls = run(False)
    assert sum(plain_calls) >= 30 and not any(general_calls)
    for (ids, probs), (want_ids, want_probs) in zip(plain, general):
        assert ids == want_ids and probs == want_probs and probs
    assert all(len(ids) == 40 for ids, _ in plain[:12])
    assert len(plain[-1][0]) >= 6  # (the job whose stops were blocked for 6 tokens)
