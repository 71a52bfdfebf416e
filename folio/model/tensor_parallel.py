"""Tensor parallelism: one replica's model split over `world_size` processes (one per GPU), each holding a shard of
the weights and of the K/V cache (Megatron's split: a column-split projection, then a row-split one, then one sum).

- Attention is split by kv head: rank r keeps kv heads [r * Hkv/tp, (r+1) * Hkv/tp) and the q heads that read them
  (q head h reads kv head h // (Hq/Hkv), so a GQA group stays whole on one rank and attention needs no
  communication). The fused qkv's q, k and v rows are each sliced (and their biases); o_proj keeps the columns of
  the rank's q heads, so its output is a partial sum over those heads.
- The gated MLP: gate and up rows are sliced alike (row i of the rank's gate still pairs with row i of its up, as
  the fused silu gate and act_and_mul expect); down keeps the matching columns and outputs a partial sum.
- The two partial sums are all-reduced before they join the residual (Model._add_norm). o_proj's bias is kept on
  rank 0 only, so the sum adds it once.
- Embeddings and norms are replicated. lm_head is split by vocabulary rows, ceil(V / tp) per rank (the last shard
  padded with zero rows), and each rank's logits are all-gathered to the full vocabulary on every rank.
- FP8 weights (folio.model.fp8, one scale per row): a row slice takes its rows' scales, a column slice keeps all.

The rank's ModelConfig carries its local head counts and intermediate size, so everything sized from the config
(Cache's kv heads, activation estimates) is the rank's share; page ids and block tables are the same on every rank.
Routed experts (MoE) are not split: such models are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from folio.model import fp8
from folio.model.config import ModelConfig, NotSupportedError
from folio.model.loader import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from folio.model.peer_all_reduce import PeerAllReduce

Weight = torch.Tensor | fp8.Fp8Weight


class TensorParallelError(NotSupportedError):
    """The model cannot be split over this many ranks (head counts or sizes not divisible, routed experts)."""


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """One rank's place in a tensor-parallel replica. rank 0 drives (scheduler, page pool, sampler; see
    folio.tp_worker); group: its torch.distributed process group (None: the default group), over any backend (NCCL
    on GPUs, gloo on the CPU): the tensors of its collectives live on the model's device. peer: the all-reduce through
    the peers' memory (folio.model.peer_all_reduce; a model attaches it as EngineOptions.tp_all_reduce says), which
    sums the messages it takes; None: every sum through the process group. header_group: a CPU (gloo) group over the
    same ranks for rank 0's message headers (folio.tp_worker.Channel), beside an NCCL `group`: a header sent through
    NCCL waits for everything queued before it on the sender's GPU and is read only once the receiver's GPU is
    through its queue too, so a worker could not queue step k+1 while step k ran; None: headers go through `group`."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    peer: PeerAllReduce | None = None
    header_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1 and 0 <= self.rank < self.world_size):
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={self.rank} "
                             f"world_size={self.world_size}")

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None,
                   header_group: dist.ProcessGroup | None = None) -> TensorParallel:
        """This process's rank in `group` (None: the default group, initialised already)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group, header_group=header_group)

    @cached_property
    def driver_rank(self) -> int:
        """The global rank of the group's rank 0 (torch.distributed's broadcast names its source globally)."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.peer is not None and self.peer.takes(x):
            return self.peer.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> bool:
        """Where the peers' memory takes it: x summed over the ranks, residual += x, x = RMSNorm(residual) * weight,
        in one kernel, and True. Otherwise nothing is done, and False (the same answer on every rank)."""
        if self.peer is None or not self.peer.takes_add_rms_norm(x, residual, weight):
            return False
        self.peer.all_reduce_add_rms_norm(x, residual, weight, eps)
        return True

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from rank 0 into x on every rank, in place; returns x. Through the peers' memory where it takes x."""
        if self.peer is None or not self.peer.broadcast(x):
            dist.broadcast(x, src=self.driver_rank, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's [N, ceil(V / tp)] logits of its vocabulary shard -> [N, vocab_size] on every rank."""
        num_rows, shard = logits.shape
        if num_rows == 0:  # (every rank has the same rows: none of them gathers)
            return logits.new_empty(0, vocab_size)
        gathered = logits.new_empty(self.world_size * num_rows, shard)
        # (torch 2.13 renamed all_gather_into_tensor; the older name still works there, with a warning)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(gathered, logits.contiguous(), group=self.group)
        parts = gathered.view(self.world_size, num_rows, shard).unbind(0)
        # one copy into vocabulary order, the last shard's padding left out
        return torch.cat([p[:, : max(0, min(shard, vocab_size - r * shard))] for r, p in enumerate(parts)], dim=1)


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise TensorParallelError, saying why, where `config` cannot be split over world_size ranks."""
    if config.moe is not None:
        raise TensorParallelError("tensor parallelism does not split routed experts (MoE layers) yet")
    for name, value in (("num_key_value_heads", config.num_kv_heads), ("num_attention_heads", config.num_q_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % world_size:
            raise TensorParallelError(
                f"{name}={value} is not divisible by tensor_parallel_size={world_size}: each rank keeps whole kv "
                f"heads with their query groups and an equal share of the MLP; choose a tensor_parallel_size "
                f"that divides it")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's model and cache see: its share of the heads and of the MLP's width."""
    check_shardable(config, world_size)
    return dataclasses.replace(config, num_q_heads=config.num_q_heads // world_size,
                               num_kv_heads=config.num_kv_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    """Rows of lm_head on each rank (the last rank's padded with zero rows)."""
    return -(-vocab_size // world_size)


def shard(weights: ModelWeights, config: ModelConfig, tp: TensorParallel, device: torch.device | None = None,
          layers_sharded: bool = False) -> tuple[ModelWeights, ModelConfig]:
    """Rank tp.rank's shard of a loaded model and its local config, on `device` (None: where the weights are). The
    split tensors are copies (the whole model's can be freed); replicated ones are shared where already on device.
    layers_sharded: the layers are the rank's already (loaded through `layer_shard`): only the rest is split."""
    local = local_config(config, tp.world_size)
    return shard_weights(weights, config, tp.rank, tp.world_size, device, layers_sharded), local


def layer_shard(config: ModelConfig, tp: TensorParallel, device: torch.device | None = None
                ) -> Callable[[LayerWeights], LayerWeights]:
    """Rank tp.rank's shard of one layer of the whole model, on `device`: folio.model.loader.load_weights' layer_hook,
    so that a rank reads the checkpoint a layer at a time and never holds the whole model."""
    check_shardable(config, tp.world_size)
    return _Slicer(config, tp.rank, tp.world_size, device).layer


def shard_weights(weights: ModelWeights, config: ModelConfig, rank: int, world_size: int,
                  device: torch.device | None = None, layers_sharded: bool = False) -> ModelWeights:
    """See `shard`; config is the whole model's."""
    check_shardable(config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    slicer = _Slicer(config, rank, world_size, device)
    layers = weights.layers if layers_sharded else tuple(slicer.layer(layer) for layer in weights.layers)
    lm_head = slicer.vocab_rows(weights.lm_head)
    return ModelWeights(slicer.replicate(weights.embed_tokens), layers, slicer.replicate(weights.final_norm), lm_head)


class _Slicer:
    """The row and column ranges of one rank, applied to a layer's weights."""

    def __init__(self, config: ModelConfig, rank: int, world_size: int, device: torch.device | None) -> None:
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        d = config.head_dim
        q_width = config.num_q_heads // world_size * d
        kv_width = config.num_kv_heads // world_size * d
        # rows of the fused [q; k; v] this rank keeps: its q heads, then its kv heads in k and in v
        q_start, k_start, v_start = rank * q_width, config.q_size + rank * kv_width, config.q_size + config.kv_size
        self.qkv_rows = [(q_start, q_start + q_width), (k_start, k_start + kv_width),
                         (v_start + rank * kv_width, v_start + (rank + 1) * kv_width)]
        self.o_columns = (q_start, q_start + q_width)
        inter = config.intermediate_size // world_size
        start = rank * inter
        self.gate_up_rows = [(start, start + inter), (config.intermediate_size + start,
                                                      config.intermediate_size + start + inter)]
        self.down_columns = (start, start + inter)

    def layer(self, layer: LayerWeights) -> LayerWeights:
        if layer.experts is not None:  # (check_shardable refuses MoE configs; a hand-built layer too)
            raise TensorParallelError("tensor parallelism does not split routed experts (MoE layers) yet")
        rep = self.replicate
        return LayerWeights(
            input_norm=rep(layer.input_norm),
            qkv=self.rows(layer.qkv, self.qkv_rows),
            qkv_bias=None if layer.qkv_bias is None else self.rows(layer.qkv_bias, self.qkv_rows),
            q_norm=rep(layer.q_norm), k_norm=rep(layer.k_norm),
            o_proj=self.columns(layer.o_proj, *self.o_columns),
            # added once: by rank 0, into its partial sum
            o_proj_bias=rep(layer.o_proj_bias) if self.rank == 0 else None,
            post_attention_norm=rep(layer.post_attention_norm),
            gate_up=self.rows(layer.gate_up, self.gate_up_rows),
            down=self.columns(layer.down, *self.down_columns),
            attn_out_norm=rep(layer.attn_out_norm), mlp_out_norm=rep(layer.mlp_out_norm),
        )

    def replicate(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The whole tensor, on the device (shared with the whole model's weights where it is there already)."""
        return None if t is None else self._place(t)

    def rows(self, w: Weight, spans: list[tuple[int, int]]) -> Weight:
        """The rows of each span, concatenated (a copy)."""
        if isinstance(w, fp8.Fp8Weight):
            return fp8.Fp8Weight(self.rows(w.weight, spans), self.rows(w.scale, spans))
        return self._place(torch.cat([w[start:end] for start, end in spans]))

    def columns(self, w: Weight, start: int, end: int) -> Weight:
        """Columns start..end-1 (a contiguous copy); an FP8 weight keeps its per-row scales."""
        if isinstance(w, fp8.Fp8Weight):
            return fp8.Fp8Weight(self.columns(w.weight, start, end), self.replicate(w.scale))
        return self._place(w[:, start:end].clone(memory_format=torch.contiguous_format))

    def vocab_rows(self, w: Weight) -> Weight:
        """This rank's ceil(V / tp) rows of lm_head, zero rows past the vocabulary."""
        vocab = self.config.vocab_size
        size = vocab_shard_size(vocab, self.world_size)
        start, end = min(vocab, self.rank * size), min(vocab, (self.rank + 1) * size)
        if isinstance(w, fp8.Fp8Weight):
            return fp8.Fp8Weight(self._pad(w.weight[start:end], size), self._pad(w.scale[start:end], size))
        return self._pad(w[start:end], size)

    def _pad(self, t: torch.Tensor, num_rows: int) -> torch.Tensor:
        padding = t.new_zeros((num_rows - t.shape[0], *t.shape[1:]))
        return self._place(torch.cat([t, padding]))

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device is None else t.to(self.device)
