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
