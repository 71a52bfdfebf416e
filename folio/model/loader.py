"""Load a safetensors checkpoint (single file or sharded index) into fused, device-resident weights.

Every expected tensor is checked (present, right shape) before it is loaded; q/k/v are concatenated into one
qkv projection and gate/up into one gate_up projection so each becomes a single GEMM (Phi-3 checkpoints hold them
fused already). Experts are stacked into one [E, ...] tensor per projection, from either checkpoint layout (one
tensor per expert, or transformers 5's 3D tensors). Gemma's (1 + weight) norms are folded into fp32 weights.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from folio.model import architectures as names
from folio.model import fp8
from folio.model.architectures import ARCHITECTURES
from folio.model.config import ModelConfig

if TYPE_CHECKING:
    from folio.model.fp8_checkpoint import Converter

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match its config (missing/unexpected key, wrong shape, bad index)."""


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor | fp8.Fp8Weight  # [Hq*D + 2*Hkv*D, H]; the projections may be FP8 (folio.model.fp8)
    qkv_bias: torch.Tensor | None  # [Hq*D + 2*Hkv*D]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D] (Qwen3)
    o_proj: torch.Tensor | fp8.Fp8Weight  # [H, Hq*D]
    o_proj_bias: torch.Tensor | None  # [H]
    post_attention_norm: torch.Tensor  # [H] the MLP input's norm (Gemma's pre_feedforward_layernorm)
    gate_up: torch.Tensor | fp8.Fp8Weight | None  # [2*I, H], gate rows first; None in an MoE layer
    down: torch.Tensor | fp8.Fp8Weight | None  # [H, I]
    attn_out_norm: torch.Tensor | None = None  # [H] Gemma: the attention output's norm (post_attention_layernorm)
    mlp_out_norm: torch.Tensor | None = None  # [H] Gemma: the MLP output's norm (post_feedforward_layernorm)
    experts: ExpertWeights | None = None  # an MoE layer's experts, in place of gate_up and down


@dataclass(frozen=True)
class ExpertWeights:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2*I, H], each expert's gate rows first
    down: torch.Tensor  # [E, H, I]


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


def expected_shapes(config: ModelConfig, present: Collection[str] = ()) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor the model reads. present: the names the checkpoint holds,
    which tell the layout of an MoE layer's experts (3D tensors where it holds them, else one tensor per expert)."""
    arch = ARCHITECTURES[config.architecture]
    hidden, head_dim = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {names.EMBED_TOKENS: (config.vocab_size, hidden), names.FINAL_NORM: (hidden,)}
    if not config.tie_word_embeddings:
        shapes[names.LM_HEAD] = (config.vocab_size, hidden)
    for layer_idx in range(config.num_layers):
        prefix = names.layer_prefix(layer_idx)
        layer = {names.INPUT_NORM: (hidden,), names.POST_ATTENTION_NORM: (hidden,),
                 names.O_PROJ + ".weight": (hidden, config.q_size)}
        if arch.sandwich_norms:
            layer[names.PRE_FEEDFORWARD_NORM] = layer[names.POST_FEEDFORWARD_NORM] = (hidden,)
        if arch.fused_projections:
            layer[names.QKV_PROJ] = (config.q_size + 2 * config.kv_size, hidden)
        else:
            layer[names.Q_PROJ + ".weight"] = (config.q_size, hidden)
            layer[names.K_PROJ + ".weight"] = layer[names.V_PROJ + ".weight"] = (config.kv_size, hidden)
        if config.attention_bias:
            layer[names.Q_PROJ + ".bias"] = (config.q_size,)
            layer[names.K_PROJ + ".bias"] = (config.kv_size,)
            layer[names.V_PROJ + ".bias"] = (config.kv_size,)
        if config.o_proj_bias:
            layer[names.O_PROJ + ".bias"] = (hidden,)
        if config.qk_norm:
            layer[names.Q_NORM] = (head_dim,)
            layer[names.K_NORM] = (head_dim,)
        expert_names = _expert_names(config, layer_idx, prefix, present)
        if expert_names is not None:
            layer.update(_expert_shapes(config, expert_names))
        elif arch.fused_projections:
            layer[names.GATE_UP_PROJ] = (2 * config.intermediate_size, hidden)
            layer[names.DOWN_PROJ] = (hidden, config.intermediate_size)
        else:
            layer[names.GATE_PROJ] = layer[names.UP_PROJ] = (config.intermediate_size, hidden)
            layer[names.DOWN_PROJ] = (hidden, config.intermediate_size)
        shapes.update({prefix + name: shape for name, shape in layer.items()})
    return shapes


def _expert_names(config: ModelConfig, layer_idx: int, prefix: str,
                  present: Collection[str]) -> names.ExpertNames | None:
    """The names of layer layer_idx's experts in this checkpoint; None where the layer is a dense MLP."""
    if config.moe is None or not config.moe.layers[layer_idx]:
        return None
    if prefix + names.FUSED_EXPERT_NAMES.fused_gate_up in present:
        return names.FUSED_EXPERT_NAMES
    return names.PER_EXPERT_NAMES[ARCHITECTURES[config.architecture].moe_layout]


def _expert_shapes(config: ModelConfig, expert_names: names.ExpertNames) -> dict[str, tuple[int, ...]]:
    moe, hidden = config.moe, config.hidden_size
    inter = moe.expert_intermediate_size
    shapes = {expert_names.router: (moe.num_experts, hidden)}
    if expert_names.fused:
        shapes[expert_names.fused_gate_up] = (moe.num_experts, 2 * inter, hidden)
        shapes[expert_names.fused_down] = (moe.num_experts, hidden, inter)
        return shapes
    for e in range(moe.num_experts):
        shapes[expert_names.gate.format(e)] = shapes[expert_names.up.format(e)] = (inter, hidden)
        shapes[expert_names.down.format(e)] = (hidden, inter)
    return shapes


def _check_names(index: CheckpointIndex, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                 ignored_suffixes: tuple[str, ...] = ()) -> None:
    missing = [name for name in shapes if name not in index.files_by_name]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"weight {missing[0]!r}{more} not found in {index.source}")
    tolerated = {names.LM_HEAD} if config.tie_word_embeddings else set()
    unexpected = [
        name
        for name in index.files_by_name
        if name not in shapes and name not in tolerated
        and not name.endswith(names.IGNORED_SUFFIXES + ignored_suffixes)
    ]
    if unexpected:
        raise CheckpointError(
            f"unexpected weight {unexpected[0]!r} in {index.source}: config.json does not describe it "
            f"({len(unexpected)} unexpected in all)"
        )


class LazyTensors(dict):
    """Tensor names -> loaders: a tensor is read when it is popped (fuse_weights pops each once), so a model is
    never whole in memory when its layers are transformed as they are built (fuse_weights' layer_hook)."""

    on_read: Callable[[], None] | None = None  # called after each read (a progress bar's update)

    def pop(self, name: str, *default):
        value = super().pop(name, *default)
        if not callable(value):
            return value
        tensor = value()
        if self.on_read is not None:
            self.on_read()
        return tensor


def load_tensors(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, progress: bool,
    convert: Converter | None = None, lazy: bool = False,
) -> dict[str, torch.Tensor | fp8.Fp8Weight]:
    """Every expected tensor, checked and loaded straight onto `device`, cast to `dtype`. convert: turns each
    tensor as it is loaded into what the model keeps instead (FP8 weights, folio.model.fp8_checkpoint); the
    checkpoint's scale tensors beside the weights are then expected and read through it. lazy: every shape is
    checked now, and a LazyTensors returned whose tensors are read as they are popped."""
    index = CheckpointIndex.open(model_dir)
    shapes = expected_shapes(config, index.files_by_name.keys())
    _check_names(index, config, shapes, convert.ignored_suffixes if convert is not None else ())

    def read(name: str) -> torch.Tensor | None:
        path = index.files_by_name.get(name)
        if path is None:
            return None
        with safe_open(path, framework="pt", device=str(device)) as f:
            return f.get_tensor(name)

    names_by_file: dict[Path, list[str]] = defaultdict(list)
    for name in shapes:
        names_by_file[index.files_by_name[name]].append(name)

    def finish(name: str, tensor: torch.Tensor) -> torch.Tensor | fp8.Fp8Weight:
        return tensor.to(dtype) if convert is None else convert(name, tensor, read)

    tensors: dict[str, torch.Tensor] = LazyTensors() if lazy else {}
    with tqdm(total=len(shapes), desc=f"Loading {Path(model_dir).name}", unit="tensor",
              disable=not progress or lazy) as bar:
        for path, file_names in names_by_file.items():
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in file_names:
                    got = tuple(f.get_slice(name).get_shape())
                    if got != shapes[name]:
                        raise CheckpointError(
                            f"weight {name!r} in {path.name}: expected shape {list(shapes[name])}, got {list(got)}"
                        )
                    if lazy:
                        tensors[name] = functools.partial(_read_lazily, path, name, device, finish)
                    else:
                        tensors[name] = finish(name, f.get_tensor(name))
                        bar.update(1)
    return tensors


def _read_lazily(path: Path, name: str, device: torch.device, finish) -> torch.Tensor | fp8.Fp8Weight:
    with safe_open(path, framework="pt", device=str(device)) as f:
        return finish(name, f.get_tensor(name))


def tensors_from_state_dict(
    state_dict: dict[str, torch.Tensor], config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The expected tensors of an in-memory state dict (e.g. a transformers model's), checked like a checkpoint's
    and moved to `device` / cast to `dtype` (no copy when they already are). The dict itself is left unchanged."""
    shapes = expected_shapes(config, state_dict.keys())
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


def fuse_weights(tensors: dict[str, torch.Tensor], config: ModelConfig,
                 layer_hook: Callable[[LayerWeights], LayerWeights] | None = None) -> ModelWeights:
    """Group loaded tensors per layer, concatenating q/k/v and gate/up and stacking experts. Consumes `tensors`.
    layer_hook: what each layer becomes as soon as it is built (a tensor-parallel rank's shard of it)."""
    arch = ARCHITECTURES[config.architecture]
    present = set(tensors)

    def norm(name: str) -> torch.Tensor:
        # Gemma scales by (1 + weight), computed in fp32 as transformers does; the norm ops take fp32 weights
        weight = tensors.pop(name)
        return weight.float() + arch.norm_weight_offset if arch.norm_weight_offset else weight

    layers = []
    for layer_idx in range(config.num_layers):
        prefix = names.layer_prefix(layer_idx)

        def take(name: str, prefix: str = prefix) -> torch.Tensor:
            return tensors.pop(prefix + name)

        if arch.fused_projections:
            qkv = take(names.QKV_PROJ)
        else:
            qkv = fp8.cat([take(p + ".weight") for p in (names.Q_PROJ, names.K_PROJ, names.V_PROJ)])
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([take(p + ".bias") for p in (names.Q_PROJ, names.K_PROJ, names.V_PROJ)])
        gate_up = down = experts = None
        expert_names = _expert_names(config, layer_idx, prefix, present)
        if expert_names is not None:
            experts = _stack_experts(tensors, prefix, expert_names, config.moe.num_experts)
        elif arch.fused_projections:
            gate_up, down = take(names.GATE_UP_PROJ), take(names.DOWN_PROJ)
        else:
            gate_up, down = fp8.cat([take(names.GATE_PROJ), take(names.UP_PROJ)]), take(names.DOWN_PROJ)
        sandwich = arch.sandwich_norms
        layer = LayerWeights(
                input_norm=norm(prefix + names.INPUT_NORM),
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=norm(prefix + names.Q_NORM) if config.qk_norm else None,
                k_norm=norm(prefix + names.K_NORM) if config.qk_norm else None,
                o_proj=take(names.O_PROJ + ".weight"),
                o_proj_bias=take(names.O_PROJ + ".bias") if config.o_proj_bias else None,
                post_attention_norm=norm(prefix + (names.PRE_FEEDFORWARD_NORM if sandwich
                                                   else names.POST_ATTENTION_NORM)),
                gate_up=gate_up,
                down=down,
                attn_out_norm=norm(prefix + names.POST_ATTENTION_NORM) if sandwich else None,
                mlp_out_norm=norm(prefix + names.POST_FEEDFORWARD_NORM) if sandwich else None,
                experts=experts,
            )
        layers.append(layer if layer_hook is None else layer_hook(layer))
    embed_tokens = tensors.pop(names.EMBED_TOKENS)
    lm_head = embed_tokens if config.tie_word_embeddings else tensors.pop(names.LM_HEAD)
    return ModelWeights(embed_tokens, tuple(layers), norm(names.FINAL_NORM), lm_head)


def _stack_experts(tensors: dict[str, torch.Tensor], prefix: str, expert_names: names.ExpertNames,
                   num_experts: int) -> ExpertWeights:
    router = tensors.pop(prefix + expert_names.router)
    if expert_names.fused:
        return ExpertWeights(router, tensors.pop(prefix + expert_names.fused_gate_up),
                             tensors.pop(prefix + expert_names.fused_down))
    gate_up, down = [], []
    for e in range(num_experts):
        gate = tensors.pop(prefix + expert_names.gate.format(e))
        gate_up.append(torch.cat([gate, tensors.pop(prefix + expert_names.up.format(e))]))
        down.append(tensors.pop(prefix + expert_names.down.format(e)))
    return ExpertWeights(router, torch.stack(gate_up), torch.stack(down))


def load_weights(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, progress: bool = True,
    convert: Converter | None = None, layer_hook: Callable[[LayerWeights], LayerWeights] | None = None,
) -> ModelWeights:
    """layer_hook (fuse_weights'): the layers are then read one at a time, each transformed before the next is read
    (a tensor-parallel rank holds its shards and one whole layer at most, not the whole model)."""
    if layer_hook is None:
        return fuse_weights(load_tensors(model_dir, config, device, dtype, progress, convert), config)
    tensors = load_tensors(model_dir, config, device, dtype, progress, convert, lazy=True)
    with tqdm(total=len(tensors), desc=f"Loading {Path(model_dir).name}", unit="tensor", disable=not progress) as bar:
        tensors.on_read = bar.update
        return fuse_weights(tensors, config, layer_hook)
