"""Rotary inverse frequencies, computed in fp32 exactly as transformers does (default, linear and llama3 scaling)."""

from __future__ import annotations

import math

import torch

from folio.model.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu", local: bool = False) -> torch.Tensor:
    """[head_dim / 2] fp32 angular frequency per rotated pair. local: of Gemma 3's sliding layers (their own base,
    never scaled)."""
    if local and config.local_rope_theta is None:
        raise ValueError(f"{config.architecture} has no local rotary base")
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / ((config.local_rope_theta if local else config.rope_theta) ** exponents)
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None:
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.to(device)


def layer_inv_freqs(config: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Each layer's inv_freq (one tensor shared by the layers of each kind)."""
    global_freq = rope_inv_freq(config, device)
    local_freq = rope_inv_freq(config, device, local=True) if config.local_rope_layers else None
    local_layers = set(config.local_rope_layers)
    return tuple(local_freq if i in local_layers else global_freq for i in range(config.num_layers))


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    band = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
