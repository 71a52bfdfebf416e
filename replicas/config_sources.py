"""Where a ServeConfig's values come from besides a mapping: a YAML file and command-line flags (one per option,
plus --config FILE), layered as callers' defaults, then the file, then the flags given. Imports neither Ray nor
torch."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from folio.serve.config_formats import FLAG_HELP
from folio.serve.config_values import ConfigError


def read_yaml(path: str | Path) -> Mapping[str, Any]:
    """The file's options (an empty file: none); errors name the file."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return values or {}


def add_arguments(config_class: type, parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """One flag per option of config_class (--model-path, ...) plus --config FILE; every flag defaults to None so
    that `layered` can tell the ones given (the help shows `defaults`, else the option's own)."""
    group = parser.add_argument_group("deployment options (also settable in a --config YAML file)")
    group.add_argument("--config", type=Path, default=None, metavar="FILE", help="YAML file of options")
    for field in dataclasses.fields(config_class):
        text = FLAG_HELP.get(field.name, "")
        group.add_argument("--" + field.name.replace("_", "-"), dest=field.name, default=None,
                           metavar=field.name.upper(),
                           help=f"{text + ' ' if text else ''}(default: {defaults.get(field.name, field.default)})")


def layered(config_class: type, args: argparse.Namespace, file_values: Mapping[str, Any],
            defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults, then the --config file's options (file_values), then the flags given. Giving one of the cache sizes
    (cache_tokens, cache_memory_fraction) drops a default for the other."""
    explicit = dict(file_values)
    explicit.update({f.name: getattr(args, f.name) for f in dataclasses.fields(config_class)
                     if getattr(args, f.name, None) is not None})
    values = dict(defaults)
    for one, other in (("cache_tokens", "cache_memory_fraction"), ("cache_memory_fraction", "cache_tokens")):
        if one in explicit:
            values.pop(other, None)
    values.update(explicit)
    return values
