"""How ServeConfig's option values are read and checked: strings (flags, `serve run key=value`) converted to each
option's type, types checked, and the error every bad value raises. Imports neither Ray nor torch."""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the option."""


def optional_inner(kind: Any) -> tuple[Any, bool]:
    """(T, True) for `T | None`, (kind, False) otherwise."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        return inner[0], True
    return kind, False


def convert(name: str, value: Any, kind: Any) -> Any:
    if not isinstance(value, str):
        if isinstance(value, int) and not isinstance(value, bool) and optional_inner(kind)[0] is float:
            return float(value)
        return value
    inner, optional = optional_inner(kind)
    text = value.strip()
    if optional and text.lower() in ("none", "null", ""):
        return None
    try:
        if inner is dict:
            parsed = json.loads(text)
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
        if inner is bool:
            lowered = text.lower()
            if lowered in ("true", "yes", "1", "on"):
                return True
            if lowered in ("false", "no", "0", "off"):
                return False
            raise ValueError
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
    except ValueError:  # json.JSONDecodeError is one
        raise ConfigError(f"{name}: expected {type_name(kind)}, got {value!r}") from None
    return text


def check_type(name: str, value: Any, kind: Any) -> None:
    inner, optional = optional_inner(kind)
    if value is None:
        if not optional:
            raise ConfigError(f"{name}: must be set (expected {type_name(kind)})")
        return
    if inner is bool:
        ok = isinstance(value, bool)
    elif inner is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif inner is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, inner)
    if not ok:
        raise ConfigError(f"{name}: expected {type_name(kind)}, got {value!r}")


def type_name(kind: Any) -> str:
    inner, optional = optional_inner(kind)
    name = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping (JSON object)"}.get(inner, str(inner))
    return f"{name} or none" if optional else name


def positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")
