"""Load a safetensors checkpoint (single file or sharded index) into fused, device-resident weights.

Every expected tensor is checked (present, right shape) before it is loaded; q/k/v are concatenated into one
qkv projection and gate/up into one gate_up projection so each becomes a single GEMM.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from folio.model import architectures as names
from folio.model.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match its config (missing/unexpected key, wrong shape, bad index)."""


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [Hq*D + 2*Hkv*D, H]
    qkv_bias: torch.Tensor | None  # [Hq*D + 2*Hkv*D]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D] (Qwen3)
    o_proj: torch.Tensor  # [H, Hq*D]
    o_proj_bias: torch.Tensor | None  # [H]
    post_attention_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2*I, H], gate rows first
    down: torch.Tensor  # [H, I]


@dataclass(frozen=True)
class ModelWeights:
    embed_tokens: torch.Tensor  # [V, H]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embed_tokens tensor itself when tied


@dataclass(frozen=True)
class CheckpointIndex:
    """Where each tensor of a checkpoint lives."""

    source: Path  # the index file, or the single weights file
    files_by_name: dict[str, Path]

    @classmethod
    def open(cls, model_dir: str | Path) -> CheckpointIndex:
        model_dir = Path(model_dir)
        index_path = model_dir / INDEX_FILE
        if index_path.is_file():
            return cls._from_index(index_path)
        single_path = model_dir / SINGLE_FILE
        if single_path.is_file():
            with safe_open(single_path, framework="pt") as f:
                return cls(single_path, {name: single_path for name in f.keys()})
        raise FileNotFoundError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}")

    @classmethod
    def _from_index(cls, index_path: Path) -> CheckpointIndex:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index with a 'weight_map' ({e!r})") from None
        files_by_name = {name: index_path.parent / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files_by_name.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"shard {shard.name} named in {index_path} does not exist")
        return cls(index_path, files_by_name)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor the model reads."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {names.EMBED_TOKENS: (config.vocab_size, hidden), names.FINAL_NORM: (hidden,)}
    if not config.tie_word_embeddings:
        shapes[names.LM_HEAD] = (config.vocab_size, hidden)
    for layer_idx in range(config.num_layers):
        layer = {
            names.INPUT_NORM: (hidden,),
            names.POST_ATTENTION_NORM: (hidden,),
            names.Q_PROJ + ".weight": (config.q_size, hidden),
            names.K_PROJ + ".weight": (config.kv_size, hidden),
            names.V_PROJ + ".weight": (config.kv_size, hidden),
            names.O_PROJ + ".weight": (hidden, config.q_size),
            names.GATE_PROJ: (inter, hidden),
            names.UP_PROJ: (inter, hidden),
            names.DOWN_PROJ: (hidden, inter),
        }
        if config.attention_bias:
            layer[names.Q_PROJ + ".bias"] = (config.q_size,)
            layer[names.K_PROJ + ".bias"] = (config.kv_size,)
            layer[names.V_PROJ + ".bias"] = (config.kv_size,)
        if config.o_proj_bias:
            layer[names.O_PROJ + ".bias"] = (hidden,)
        if config.qk_norm:
            layer[names.Q_NORM] = (head_dim,)
            layer[names.K_NORM] = (head_dim,)
        prefix = names.layer_prefix(layer_idx)
        shapes.update({prefix + name: shape for name, shape in layer.items()})
    return shapes


def _check_names(index: CheckpointIndex, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    missing = [name for name in shapes if name not in index.files_by_name]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"weight {missing[0]!r}{more} not found in {index.source}")
    tolerated = {names.LM_HEAD} if config.tie_word_embeddings else set()
    unexpected = [
        name
        for name in index.files_by_name
        if name not in shapes and name not in tolerated and not name.endswith(names.IGNORED_SUFFIXES)
    ]
    if unexpected:
        raise CheckpointError(
            f"unexpected weight {unexpected[0]!r} in {index.source}: config.json does not describe it "
            f"({len(unexpected)} unexpected in all)"
        )


def load_tensors(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, progress: bool
) -> dict[str, torch.Tensor]:
    """Every expected tensor, checked and loaded straight onto `device`, cast to `dtype`."""
    index = CheckpointIndex.open(model_dir)
    shapes = expected_shapes(config)
    _check_names(index, config, shapes)
    names_by_file: dict[Path, list[str]] = defaultdict(list)
    for name in shapes:
        names_by_file[index.files_by_name[name]].append(name)

    tensors: dict[str, torch.Tensor] = {}
    with tqdm(total=len(shapes), desc=f"Loading {Path(model_dir).name}", unit="tensor", disable=not progress) as bar:
        for path, file_names in names_by_file.items():
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in file_names:
                    got = tuple(f.get_slice(name).get_shape())
                    if got != shapes[name]:
                        raise CheckpointError(
                            f"weight {name!r} in {path.name}: expected shape {list(shapes[name])}, got {list(got)}"
                        )
                    tensors[name] = f.get_tensor(name).to(dtype)
                    bar.update(1)
    return tensors


def tensors_from_state_dict(
    state_dict: dict[str, torch.Tensor], config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The expected tensors of an in-memory state dict (e.g. a transformers model's), checked like a checkpoint's
    and moved to `device` / cast to `dtype` (no copy when they already are). The dict itself is left unchanged."""
    shapes = expected_shapes(config)
    tolerated = {names.LM_HEAD} if config.tie_word_embeddings else set()
    missing = [name for name in shapes if name not in state_dict]
    if missing:
        raise CheckpointError(f"weight {missing[0]!r} not found in the state dict ({len(missing)} missing)")
    unexpected = [name for name in state_dict
                  if name not in shapes and name not in tolerated and not name.endswith(names.IGNORED_SUFFIXES)]
    if unexpected:
        raise CheckpointError(f"unexpected weight {unexpected[0]!r} in the state dict: the config does not describe it")
    tensors = {}
    for name, shape in shapes.items():
        tensor = state_dict[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"weight {name!r}: expected shape {list(shape)}, got {list(tensor.shape)}")
        tensors[name] = tensor.detach().to(device=device, dtype=dtype)
    return tensors


def fuse_weights(tensors: dict[str, torch.Tensor], config: ModelConfig) -> ModelWeights:
    """Group loaded tensors per layer, concatenating q/k/v and gate/up. Consumes `tensors`."""
    layers = []
    for layer_idx in range(config.num_layers):
        prefix = names.layer_prefix(layer_idx)

        def take(name: str, prefix: str = prefix) -> torch.Tensor:
            return tensors.pop(prefix + name)

        qkv = torch.cat([take(p + ".weight") for p in (names.Q_PROJ, names.K_PROJ, names.V_PROJ)])
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([take(p + ".bias") for p in (names.Q_PROJ, names.K_PROJ, names.V_PROJ)])
        layers.append(
            LayerWeights(
                input_norm=take(names.INPUT_NORM),
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=take(names.Q_NORM) if config.qk_norm else None,
                k_norm=take(names.K_NORM) if config.qk_norm else None,
                o_proj=take(names.O_PROJ + ".weight"),
                o_proj_bias=take(names.O_PROJ + ".bias") if config.o_proj_bias else None,
                post_attention_norm=take(names.POST_ATTENTION_NORM),
                gate_up=torch.cat([take(names.GATE_PROJ), take(names.UP_PROJ)]),
                down=take(names.DOWN_PROJ),
            )
        )
    embed_tokens = tensors.pop(names.EMBED_TOKENS)
    lm_head = embed_tokens if config.tie_word_embeddings else tensors.pop(names.LM_HEAD)
    return ModelWeights(embed_tokens, tuple(layers), tensors.pop(names.FINAL_NORM), lm_head)


def load_weights(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, progress: bool = True
) -> ModelWeights:
    return fuse_weights(load_tensors(model_dir, config, device, dtype, progress), config)
