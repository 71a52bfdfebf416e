"""Model loading and the forward pass over a paged K/V cache."""

from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ConfigError, ModelConfig, NotSupportedError, RopeScaling
from folio.model.loader import CheckpointError
from folio.model.model import Model

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ForwardBatch",
    "Model",
    "ModelConfig",
    "NotSupportedError",
    "RopeScaling",
    "SeqChunk",
]
