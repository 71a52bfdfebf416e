"""Constrained generation: filters that say which tokens may come next."""

from folio.constrain.base import Filter, FilterError, bitmask_words
from folio.constrain.grammar import (
    ChoiceFilter,
    GrammarFilter,
    GrammarFilterBase,
    JsonSchemaFilter,
    RegexFilter,
    fill_bitmasks,
)

__all__ = [
    "ChoiceFilter",
    "Filter",
    "FilterError",
    "GrammarFilter",
    "GrammarFilterBase",
    "JsonSchemaFilter",
    "RegexFilter",
    "bitmask_words",
    "fill_bitmasks",
]
