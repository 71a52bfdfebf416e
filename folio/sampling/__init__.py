"""Sampling: per-job settings, counter-based random draws, and the batched sampler."""

from folio.sampling.rng import uniform, uniform_tensor
from folio.sampling.rows import RowParams, SampleOutput
from folio.sampling.sampler import sample
from folio.sampling.settings import SamplerSettings

__all__ = ["RowParams", "SampleOutput", "SamplerSettings", "sample", "uniform", "uniform_tensor"]
