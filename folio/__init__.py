"""folio: a paged dynamic generator for serving language models.

The public names are imported lazily so that torch-free parts (`folio.hashing`, `folio.cache`) stay importable
without loading torch — the router imports `folio.hashing` in processes that never run a model.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Model": "folio.model.model",
    "ModelConfig": "folio.model.config",
    "Cache": "folio.kv_cache",
    "Tokenizer": "folio.tokenizer",
    "DynamicGenerator": "folio.generator",
    "QueueFull": "folio.generator",
    "StepOutput": "folio.generator",
    "activation_reserve_bytes": "folio.sizing",
    "EngineOptions": "folio.options",
    "StepStats": "folio.stats",
    "CacheSnapshot": "folio.cache.manager",
    "PrefixCacheStats": "folio.cache.manager",
    "DynamicJob": "folio.job",
    "InjectedEmbeddings": "folio.embeddings",
    "JobState": "folio.job",
    "SamplerSettings": "folio.sampling",
    "SAMPLER_LIMITS": "folio.limits",
    "DynamicGeneratorAsync": "folio.aio",
    "DynamicJobAsync": "folio.aio",
    "GeneratorClosed": "folio.aio",
    "Stage": "folio.results",
    "EosReason": "folio.results",
    "Result": "folio.results",
    "StreamingResult": "folio.results",
    "write_demo_model": "folio.demo",
    "is_demo_model_current": "folio.demo",
    "engine_cli_main": "folio.cli",
}

__all__ = sorted(_PUBLIC)


_RENAMED = {"engine_cli_main": "main"}  # public name -> its name in its module


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'folio' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
