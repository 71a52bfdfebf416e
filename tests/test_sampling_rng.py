"""Counter-based uniform draws: scalar == vectorized, in [0, 1), uniform-looking, independent of batching."""

from __future__ import annotations

import math

import pytest
import torch

from folio.sampling.rng import uniform, uniform_tensor

SEEDS = [0, 1, 7, -1, -(2**63), 2**63 - 1, 2**64 - 1, 2**64 + 5, 123456789123456789]
COUNTERS = [0, 1, 2, 3, 1000, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**63 - 1]


def as_int64(seed: int) -> int:
    """The int64 with the same low 64 bits as `seed`."""
    seed &= 2**64 - 1
    return seed - 2**64 if seed >= 2**63 else seed


def test_scalar_matches_vectorized():
    seeds = torch.tensor([as_int64(s) for s in SEEDS])[:, None]
    counters = torch.tensor(COUNTERS)[None, :]
    table = uniform_tensor(seeds, counters)
    assert table.dtype == torch.float64 and table.shape == (len(SEEDS), len(COUNTERS))
    for i, seed in enumerate(SEEDS):
        for j, counter in enumerate(COUNTERS):
            assert uniform(seed, counter) == table[i, j].item(), (seed, counter)


def test_seeds_equal_modulo_2_64():
    assert uniform(-1, 5) == uniform(2**64 - 1, 5)
    assert uniform(3, 9) == uniform(3 + 2**64, 9)


def test_values_in_unit_interval_and_stable():
    u = uniform_tensor(torch.tensor(42), torch.arange(50_000))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # A pure function: recomputing any slice gives the same values.
    assert torch.equal(uniform_tensor(torch.tensor(42), torch.arange(1000, 2000)), u[1000:2000])


def ks_statistic(values: torch.Tensor) -> float:
    x = values.sort().values
    n = x.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return max(float((ranks / n - x).max()), float((x - (ranks - 1) / n).max()))


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 3])
def test_uniform_over_counters(seed):
    n = 50_000
    u = uniform_tensor(torch.tensor(seed), torch.arange(n))
    # Kolmogorov-Smirnov at alpha = 0.001: critical value 1.95 / sqrt(n).
    assert ks_statistic(u) < 1.95 / math.sqrt(n)
    # Consecutive draws are uncorrelated, and the mean / variance are those of U(0, 1).
    centred = u - 0.5
    assert abs(float((centred[1:] * centred[:-1]).mean())) < 5 * (1 / 12) / math.sqrt(n)
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 0.002


def test_uniform_over_seeds_and_low_bits():
    n = 50_000
    u = uniform_tensor(torch.arange(n), torch.tensor(0))
    assert ks_statistic(u) < 1.95 / math.sqrt(n)
    # The low bits of the 53-bit mantissa vary too (not just the top few).
    low_bits = (u * 2.0**53).to(torch.int64) & 0xFF
    counts = torch.bincount(low_bits, minlength=256).double()
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)


def test_counter_validation():
    with pytest.raises(ValueError, match="counter"):
        uniform(0, -1)
    with pytest.raises(ValueError, match="counter"):
        uniform(0, 2**63)
    with pytest.raises(TypeError, match="int64"):
        uniform_tensor(torch.tensor([1], dtype=torch.int32), torch.tensor([0]))


def test_batched_host_uniforms_equal_the_scalar_version() -> None:
    import random

    from folio.sampling.rng import uniforms

    gen = random.Random(7)
    seeds = [gen.getrandbits(64) for _ in range(300)] + [-1, -(1 << 63), (1 << 64) - 1, 0, 1 << 70]
    counters = [gen.randrange(1 << 63) for _ in range(len(seeds))]
    counters[:50] = range(50)
    assert uniforms(seeds, counters) == [uniform(s, c) for s, c in zip(seeds, counters)]
    assert uniforms([], []) == []
    with pytest.raises(ValueError, match="counters"):
        uniforms([1], [-1])
