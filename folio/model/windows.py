"""Sliding-window attention: which layers of a config.json attend to a window, and how wide it is.

A window of W tokens (transformers' sliding-window mask): the query at position i sees the keys at positions j with
i - W < j <= i. 0 means the whole context. The attention ops take the window per call (`window`), one value per
layer (ModelConfig.layer_windows), so that a decode graph captures each layer's window as a constant.

How the supported architectures switch windows on (read off transformers' configuration and modeling code):
- Mistral: `sliding_window` (null: none) applies to every layer; MistralForCausalLM ignores `layer_types`.
- Qwen2 / Qwen3: only with `use_sliding_window`; then the layers marked "sliding_attention" in `layer_types`, or,
  without `layer_types`, layers i >= `max_window_layers` (transformers' default 28) use `sliding_window`.
"""

from __future__ import annotations

from typing import Any

from folio.model.architectures import ARCHITECTURES

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
# transformers' Qwen2Config / Qwen3Config default when config.json names no max_window_layers
DEFAULT_MAX_WINDOW_LAYERS = 28


class WindowConfigError(ValueError):
    """A window field of config.json makes no sense (config.py re-raises it as its ConfigError)."""


def layer_windows(raw: dict[str, Any], architecture: str, num_layers: int,
                  max_position_embeddings: int) -> tuple[int, ...]:
    """One window per layer in tokens (0 = full attention) for a config.json of `architecture`.

    A window at least max_position_embeddings never masks a key within the supported context, so it is 0 here:
    the full-attention paths (and no page release) apply."""
    arch = ARCHITECTURES[architecture]
    full = (0,) * num_layers
    if not arch.has_sliding_window_option:
        return full
    if arch.sliding_window_needs_opt_in:
        if not _flag(raw, "use_sliding_window"):
            return full
        window = _window(raw)
        if window == 0:
            return full
        types = raw.get("layer_types")
        if types is None:
            first = raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise WindowConfigError(f"field 'max_window_layers' = {first!r} must be an int >= 0")
            windowed = [i >= first for i in range(num_layers)]
        else:
            windowed = [t == SLIDING for t in check_layer_types(types, num_layers)]
    else:
        window = _window(raw)
        windowed = [True] * num_layers
    if window >= max_position_embeddings:
        return full
    return tuple(window if w else 0 for w in windowed)


def first_visible_key(first_query_pos: int, window: int) -> int:
    """The first key position that a query at first_query_pos (or later) sees: 0 without a window."""
    return max(0, first_query_pos - window + 1) if window > 0 else 0


def released_window(*layer_windows: tuple[int, ...]) -> int:
    """The widest window when every layer of every given model (the layer_windows of each model that reads the same
    block tables: a target and its draft) has one: K/V before it is never read again, so its pages may go back to
    the pool while the sequence runs. Else 0 (some layer reads the whole context)."""
    windows = [w for model in layer_windows for w in model]
    return max(windows) if windows and all(w > 0 for w in windows) else 0


def check_layer_types(types: Any, num_layers: int) -> list[str]:
    """config.json's `layer_types`: a list of num_layers entries, each "sliding_attention" or "full_attention"."""
    if not isinstance(types, list) or len(types) != num_layers:
        raise WindowConfigError(f"field 'layer_types' must be a list of num_hidden_layers={num_layers} entries, "
                                f"got {types!r}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise WindowConfigError(f"field 'layer_types' has unknown entries {unknown}; expected {LAYER_TYPES}")
    return types


def check_windows(windows: Any, num_layers: int) -> tuple[int, ...]:
    """ModelConfig.layer_windows: one int >= 0 per layer."""
    windows = tuple(windows)
    if len(windows) != num_layers or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in windows):
        raise WindowConfigError(f"layer_windows must hold one int >= 0 per layer ({num_layers}), got {windows}")
    return windows


def _flag(raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise WindowConfigError(f"field {key!r} = {value!r} must be true or false")
    return value


def _window(raw: dict[str, Any]) -> int:
    """`sliding_window` in tokens; null or absent: 0 (none)."""
    value = raw.get("sliding_window")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise WindowConfigError(f"field 'sliding_window' = {value!r} must be a positive int (or null for none)")
    return value
