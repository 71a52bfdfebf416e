"""DynamicJob's arguments, checked and normalised: prompts as token-id lists, filters, stop conditions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from folio.constrain.base import Filter
from folio.sampling import SamplerSettings


def as_token_list(input_ids: Any) -> list[int]:
    if hasattr(input_ids, "tolist"):  # torch tensor or numpy array, shape (n,) or (1, n)
        if getattr(input_ids, "ndim", 1) == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids must have shape (n,) or (1, n), got {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Iterable):
        raise TypeError("input_ids must be a sequence of token ids (list of int or a (1, n) tensor)")
    ids = list(input_ids)
    if not ids:
        raise ValueError("input_ids is empty: a job needs at least one prompt token")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"input_ids must hold non-negative integer token ids, found {t!r}")
    return ids


def as_filters(filters: Any) -> tuple[Filter, ...]:
    if isinstance(filters, Filter):
        filters = (filters,)
    if filters is None or isinstance(filters, (str, bytes)) or not isinstance(filters, Iterable):
        raise TypeError("filters must be a list of folio.constrain.Filter objects")
    filters = tuple(filters)
    for f in filters:
        if not isinstance(f, Filter):
            raise TypeError(f"filters must hold folio.constrain.Filter objects, got {type(f).__name__}")
    if len({id(f) for f in filters}) < len(filters):
        raise ValueError("filters: the same Filter object appears twice (a filter keeps one job's state)")
    return filters


def split_stop_conditions(conditions: Sequence[int | str] | None) -> tuple[frozenset[int], tuple[str, ...]]:
    if conditions is None:
        return frozenset(), ()
    if isinstance(conditions, (str, int)) or not isinstance(conditions, Iterable):
        raise ValueError("stop_conditions must be a list of token ids (int) and/or stop strings (str)")
    tokens: set[int] = set()
    strings: list[str] = []
    for c in conditions:
        if isinstance(c, bool):
            raise ValueError(f"stop condition {c!r} is neither a token id (int) nor a string")
        if isinstance(c, int):
            tokens.add(c)
        elif isinstance(c, str):
            if not c:
                raise ValueError("stop strings must not be empty")
            strings.append(c)
        else:
            raise ValueError(f"stop condition {c!r} is neither a token id (int) nor a string")
    return frozenset(tokens), tuple(strings)


def check_counts(max_new_tokens: Any, min_new_tokens: Any, return_top_tokens: Any, max_skips: Any,
                 gen_settings: Any) -> None:
    """DynamicJob's counts and settings, checked: ValueError / TypeError naming the argument."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")
    if not isinstance(return_top_tokens, int) or return_top_tokens < 0:
        raise ValueError(f"return_top_tokens must be an integer >= 0, got {return_top_tokens!r}")
    if max_skips is not None and (not isinstance(max_skips, int) or max_skips < 0):
        raise ValueError(f"max_skips must be None or an integer >= 0, got {max_skips!r}")
    if gen_settings is not None and not isinstance(gen_settings, SamplerSettings):
        raise TypeError("gen_settings must be a folio.SamplerSettings")
