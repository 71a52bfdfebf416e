"""Model: a Llama-family decoder running over a paged K/V cache through its op set (folio.ops.OpSet).

The other families are variations of its layer (folio.model.families): Gemma's scaled embeddings, norms on each
sublayer's output, gelu-tanh MLP and soft-capped logits; Gemma 3's local rotary base; routed experts
(folio.model.moe) in place of the MLP."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from folio import ops
from folio.model import flash, fp8, fp8_checkpoint, mlp, moe, peer_all_reduce, quant_attention
from folio.model.batch import ForwardBatch
from folio.model.config import ModelConfig, check_dtype
from folio.model.loader import LayerWeights, ModelWeights, fuse_weights, load_weights, tensors_from_state_dict
from folio.model.rotary import layer_inv_freqs
from folio.model.tensor_parallel import TensorParallel, check_shardable, layer_shard, shard
from folio.model.windows import released_window
from folio.options import EngineOptions

if TYPE_CHECKING:
    from folio.kv_cache import Cache
    from folio.lora.apply import LayerLora


# The most logits-sized fp32 buffers sampling holds at once beside the logits: the torch path with a full sort of
# the vocabulary (no top-k; rows that ask for top tokens take it) held 11.3 on an H100 at 256 rows of 32k (its
# working copy, the sort's keys and int64 values with their double buffers, probabilities, sums). The native
# sampler holds one.
SAMPLER_LOGITS_COPIES = 13


def _mm_fp32_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch.mm(out_dtype=float32) exist for 16-bit inputs on this device and agree with the fp32 product?"""
    gen = torch.Generator(device=device).manual_seed(0)  # (the global generator's state stays untouched)
    a = torch.randn(24, 64, device=device, dtype=dtype, generator=gen)
    b = torch.randn(40, 64, device=device, dtype=dtype, generator=gen)
    try:
        got = torch.mm(a, b.t(), out_dtype=torch.float32)
        want = torch.mm(a.float(), b.float().t())
        return got.dtype == torch.float32 and bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class Model:
    """options: the engine's switches (EngineOptions; None: the defaults). The model keeps them (`options`), runs
    its ops through `ops` (an OpSet built from them: backend, PDL, decode attention kernel) and keeps what it probes
    on its device in `flash_state` and here, never in module globals (two models with other options never share
    a decision). On a CUDA device, ops_backend "auto" or "native" needs the native CUDA module: building the model
    raises a RuntimeError saying how to build it (ops_backend "reference" runs the torch reference ops instead).

    tensor_parallel: this process's rank of a tensor-parallel replica (folio.model.tensor_parallel); config and
    weights are then the rank's shard (`shard`, as from_pretrained makes them), and forward sums the attention and
    MLP outputs over the ranks and gathers the logits of the whole vocabulary. None (or one rank): one process."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 options: EngineOptions | None = None, tensor_parallel: TensorParallel | None = None) -> None:
        self.options = options if options is not None else EngineOptions()
        self.ops = _op_set_for(self.options, device)
        self.config = config
        self.weights = weights
        self.device = torch.empty(0, device=device).device  # "cuda" made explicit ("cuda:0"), as a cache's tensors
        # (a collective where it connects the ranks' peer all-reduce: every rank builds its model at once)
        self.tensor_parallel = peer_all_reduce.attach(tensor_parallel, self.device, self.options.tp_all_reduce)
        self.dtype = dtype
        self.layer_inv_freq = layer_inv_freqs(config, device)  # per layer (Gemma 3's sliding layers: their own)
        self.attention_scale = config.attention_scale
        self.act_and_mul = mlp.act_and_mul(self.ops, config.hidden_activation)
        # the embedding scale rounded to the model dtype first, as transformers multiplies by it
        self.embed_scale = float(torch.tensor(config.embed_scale, dtype=dtype))
        self.moe = moe.MoE(config.moe) if config.moe is not None else None
        # Prefill attention on CUDA (see folio.model.flash): options.prefill_attention chooses the path, each
        # probed once per shape family on this device; options.prefill_cudnn lets cuDNN take equal-length prompts.
        self.flash_state = flash.FlashState(self.ops, dense_cudnn=self.options.prefill_cudnn,
                                            windowed=any(config.layer_windows))
        # Every layer windowed: the pages before this window may be released while a sequence runs (never read).
        self.released_window = released_window(config.layer_windows)
        # (device, dtype) -> whether torch.mm(out_dtype=float32) works here (see _logits)
        self._mm_fp32_ok: dict[tuple[torch.device, torch.dtype], bool] = {}
        self.fp8 = fp8.Fp8Linear(self.ops, device, weights)  # the linear layer of FP8 weights, its probes

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        progress: bool = True,
        options: EngineOptions | None = None,
        weight_format: str | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> Model:
        """Load a Hugging Face model directory; dtype None keeps the checkpoint's (config) dtype. weight_format: None
        keeps the checkpoint's (FP8 checkpoints load as FP8), "fp8" quantizes the projections on load, "dense"
        dequantizes an FP8 checkpoint (folio.model.fp8_checkpoint). tensor_parallel: this rank's shard, read a layer
        at a time."""
        config = ModelConfig.from_pretrained(path)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _op_set_for(options or EngineOptions(), device)  # a missing native module fails before the weights load
        dtype = check_dtype(dtype if dtype is not None else config.torch_dtype)
        split = tensor_parallel is not None and tensor_parallel.world_size > 1
        hook = layer_shard(config, tensor_parallel, device) if split else None  # (refuses what cannot split, now)
        convert = fp8_checkpoint.converter_for(path, config, dtype, weight_format)
        weights = load_weights(path, config, torch.device("cpu") if split else device, dtype, progress, convert, hook)
        if split:
            weights, config = shard(weights, config, tensor_parallel, device, layers_sharded=True)
        return cls(config, weights, device, dtype, options, tensor_parallel)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        options: EngineOptions | None = None,
        weight_format: str | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> Model:
        """Build from weights already in memory under their checkpoint names (a transformers model's
        `state_dict()`), e.g. random weights made on the GPU for a benchmark. device None: the tensors' device;
        dtype None: the tensors' dtype. q/k/v and gate/up are fused into new tensors; the others are used as given
        (no copy) when already on `device` in `dtype`. weight_format "fp8": the projections quantized to FP8.
        tensor_parallel: this rank's shard (the whole model is fused where the tensors are; the shard goes to
        `device`)."""
        first = next(iter(state_dict.values()))
        device = torch.device(device if device is not None else first.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _op_set_for(options or EngineOptions(), device)
        dtype = check_dtype(dtype if dtype is not None else first.dtype)
        split = tensor_parallel is not None and tensor_parallel.world_size > 1
        if split:
            check_shardable(config, tensor_parallel.world_size)
        tensors = tensors_from_state_dict(state_dict, config, first.device if split else device, dtype)
        tensors = fp8_checkpoint.quantize_state(tensors, config, weight_format)
        weights = fuse_weights(tensors, config)
        if split:
            weights, config = shard(weights, config, tensor_parallel, device)
        return cls(config, weights, device, dtype, options, tensor_parallel)

    def with_options(self, options: EngineOptions) -> Model:
        """A model over the same weights (shared, not copied) with other options, e.g. another prefill attention
        path for an A/B benchmark. It probes its device afresh."""
        return Model(self.config, self.weights, self.device, self.dtype, options, self.tensor_parallel)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: Cache) -> torch.Tensor:
        """Run the batch's new tokens, writing their K/V into `cache`.

        Returns fp32 logits [len(batch.logits_idx), vocab_size] for the rows selected by batch.logits_idx.
        """
        self._check_cache(cache)
        if cache.mirror is not None:  # tensor parallelism, rank 0: the other ranks run this batch too
            cache.mirror.forward(batch)
        tp = self.tensor_parallel
        if tp is not None and batch.lora is not None:
            raise NotImplementedError("LoRA adapters are not supported under tensor parallelism")
        w = self.weights
        residual = F.embedding(batch.input_ids, w.embed_tokens)  # [T, H], updated in place layer by layer
        if self.embed_scale != 1.0:
            residual.mul_(self.embed_scale)
        if batch.injected_rows is not None:  # embeddings injected at placeholder tokens (folio.embeddings)
            residual.index_copy_(0, batch.injected_rows, batch.injected_values)
        prefill = self._prefill_plan(batch, cache)
        out, out_norm = None, None  # a sublayer's output (none yet), and Gemma's norm of it
        for layer_idx, layer in enumerate(w.layers):
            # Gemma normalizes each sublayer's output before the residual add: no GEMM adds itself into it there;
            # nor under tensor parallelism, where each rank's product is a partial sum, summed first
            into = residual if layer.attn_out_norm is None and tp is None else None
            x = self._add_norm(out, out_norm, residual, layer.input_norm)
            out = self._attention(layer_idx, layer, x, batch, cache, prefill, into)
            x = self._add_norm(out, layer.attn_out_norm, residual, layer.post_attention_norm)
            lora = None if batch.lora is None else batch.lora.at(layer_idx)
            out, out_norm = self._mlp(layer, x, into, lora), layer.mlp_out_norm
        x = self._add_norm(out, out_norm, residual, w.final_norm)
        # only the requested rows go through lm_head: its GEMM is the largest one for short chunks
        logits = self._logits(x[batch.logits_idx], w.lm_head)
        if tp is not None:  # each rank's vocabulary shard -> the whole vocabulary
            logits = tp.gather_vocab(logits, self.config.vocab_size)
        return mlp.softcap_(logits, self.config.final_logit_softcap)

    def step_activation_bytes(self, num_tokens: int, num_logit_rows: int, max_context_tokens: int | None = None,
                              sampling: bool = True) -> int:
        """An upper bound on the device memory that one forward of num_tokens new tokens, num_logit_rows of them
        producing logits, allocates and frees again, sampling included: what a cache sized from free memory
        must leave free (Cache's reserve_bytes). Counted from the tensors `forward` keeps alive at once, layer by
        layer; library workspaces (cuBLAS, cuDNN) are not in it.

        max_context_tokens: the most context tokens (cached prefix and new) that the step's multi-token rows have
        together, which the flash prefill path may gather from the cache; None: as many as it ever gathers.
        sampling: count the sampler's buffers too (False: the forward alone, as a captured decode graph runs it)."""
        if num_tokens < 1 or not 0 <= num_logit_rows <= num_tokens:
            raise ValueError(f"need num_tokens >= 1 and 0 <= num_logit_rows <= num_tokens, "
                             f"got {num_tokens} and {num_logit_rows}")
        cfg = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        gathered = flash.GATHER_MAX_TOKENS if max_context_tokens is None else min(max_context_tokens,
                                                                                   flash.GATHER_MAX_TOKENS)
        # Through every layer: the residual stream, the normalized input, and for a moment the next one beside it.
        stream = 3 * cfg.hidden_size
        # Attention: the fused QKV product; the flash path's q copy, its output and the concatenation with the
        # one-token rows' output; and the context K/V that path may gather from the cache.
        attention = (num_tokens * (stream + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.q_size)
                     + 2 * gathered * cfg.kv_size) * element
        # Gemma: a sublayer's output and its normalized copy beside the stream.
        stream += cfg.hidden_size if self.weights.layers[0].attn_out_norm is not None else 0
        # MLP: the gate/up product and its activation (the largest phase for Llama shapes); routed experts' buffers.
        mlp_bytes = num_tokens * (stream + 3 * cfg.intermediate_size) * element + mlp.act_and_mul_temp_bytes(
            cfg.hidden_activation, num_tokens, cfg.intermediate_size, self.dtype)
        if cfg.moe is not None:
            mlp_bytes = max(mlp_bytes, num_tokens * stream * element
                            + moe.activation_bytes(cfg.moe, cfg.hidden_size, num_tokens, element))
        # Logits: the selected rows' copy and the fp32 logits; then the sampler's buffers.
        logits = num_logit_rows * (cfg.hidden_size * element + cfg.vocab_size * 4)
        if sampling:
            logits += num_logit_rows * cfg.vocab_size * 4 * SAMPLER_LOGITS_COPIES
        return max(attention, mlp_bytes) + logits

    def _add_norm(self, out: torch.Tensor | None, out_norm: torch.Tensor | None, residual: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
        """residual += out (under tensor parallelism summed over the ranks first; then normalized by out_norm where
        there is one), then RMSNorm(residual). out None: a projection already added itself into the residual
        (`_project_into`). Otherwise the normalized residual is written over out (or its out_norm) and returned."""
        eps, tp = self.config.rms_norm_eps, self.tensor_parallel
        if out is None:
            return self.ops.rms_norm(residual, weight, eps)
        if tp is not None:
            if out_norm is None and tp.all_reduce_add_rms_norm(out, residual, weight, eps):
                return out  # the sum, the add and the norm in one kernel (through the peers' memory)
            tp.all_reduce(out)
        out = self._out_norm(out, out_norm)
        self.ops.fused_add_rms_norm(out, residual, weight, eps)
        return out

    def _project_into(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
    ) -> torch.Tensor | None:
        """x @ weight.T (+ bias). With a residual, where the product would be a cuBLAS GEMM: added into the residual
        in place (the GEMM's beta = 1; the sum is rounded once, from fp32) and None returned.

        options.residual_in_gemm: the norm after such a GEMM then reads one [T, H] tensor and writes one instead of
        two each (a 16k-token prompt step on an H100: RMSNorm 10.4 -> 5.5 ms, the GEMMs ~1 ms more). The native
        GEMV (decode batches of a few rows) keeps the separate fused add + norm."""
        if (residual is None or not self.options.residual_in_gemm or bias is not None
                or isinstance(weight, fp8.Fp8Weight) or self.ops.linear_supported(x, weight, bias)):
            return self._linear(x, weight, bias)
        residual.addmm_(x, weight.t())
        return None

    def _prefill_plan(self, batch: ForwardBatch, cache: Cache) -> flash.PrefillPlan | None:
        """Tensor-core prefill (flash.py) on CUDA where probed correct; over a quantized cache see quant_attention."""
        if batch.max_q_len == 1 or self.device.type != "cuda":
            return None
        q_like = torch.empty(0, self.config.num_q_heads, self.config.head_dim, device=self.device, dtype=self.dtype)
        if cache.kv_format is not None:
            return quant_attention.prefill_plan(self, batch, cache, q_like)
        mode = flash.choose_mode(self.flash_state, q_like, cache.k[0], self.attention_scale,
                                 self.options.prefill_attention)
        return flash.plan(self.flash_state, mode, batch, cache.page_size, self.released_window)

    def _attention(
        self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch, cache: Cache,
        prefill: flash.PrefillPlan | None = None, residual: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Attention and o_proj; see `_project_into` for `residual`."""
        cfg = self.config
        window, softcap = cfg.layer_windows[layer_idx], cfg.attn_logit_softcap  # per-layer constants (graphs)
        num_tokens, head_dim = x.shape[0], cfg.head_dim
        qkv = self._linear(x, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2*Hkv) * D]
        if batch.lora is not None:  # LoRA adapters' q/k/v updates, into their slices of qkv (folio.lora)
            batch.lora.apply(layer_idx, "qkv", x, qkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        if cfg.qk_norm:
            q = self.ops.rms_norm(q.reshape(-1, head_dim), layer.q_norm, cfg.rms_norm_eps)
            k = self.ops.rms_norm(k.reshape(-1, head_dim), layer.k_norm, cfg.rms_norm_eps)
        # Views into qkv (rotary_cache_write updates q and k in place, through their row strides): no copies. The
        # FlashAttention prefill takes them as they are too (flash.attention copies only where FA2 needs it).
        q = q.view(num_tokens, cfg.num_q_heads, head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, head_dim)
        inv_freq = self.layer_inv_freq[layer_idx]
        if cache.kv_format is not None:  # codes and scales: written and read through the *_quant ops
            out = quant_attention.attend(self.ops, cache, layer_idx, q, k, v, batch, inv_freq, self.attention_scale,
                                         window, softcap, prefill, self.flash_state)
        else:
            out = self._attend(layer_idx, q, k, v, batch, cache, prefill, inv_freq, window, softcap)
        out = out.view(num_tokens, cfg.q_size)
        projected = self._project_into(out, layer.o_proj, layer.o_proj_bias, residual)
        if batch.lora is not None:  # (into the residual when o_proj added itself there)
            batch.lora.apply(layer_idx, "o_proj", out, residual if projected is None else projected)
        return projected

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                cache: Cache, prefill: flash.PrefillPlan | None, inv_freq: torch.Tensor, window: int,
                softcap: float) -> torch.Tensor:
        """Rotary, the cache write and attention over a cache in the model's dtype."""
        k_cache, v_cache = cache.k[layer_idx], cache.v[layer_idx]
        self.ops.rotary_cache_write(q, k, v, batch.positions, inv_freq, k_cache, v_cache, batch.slot_mapping)
        if prefill is not None:
            return flash.attention(self.flash_state, q, k_cache, v_cache, batch, prefill, self.attention_scale,
                                   k_new=k, v_new=v, window=window, softcap=softcap)
        if batch.max_q_len == 1:
            return self.ops.paged_attention_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                                   self.attention_scale, window, softcap)
        return self.ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q,
                                        batch.context_lens, self.attention_scale, batch.max_q_len, window, softcap)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor, residual: torch.Tensor | None = None,
             lora: LayerLora | None = None) -> torch.Tensor | None:
        """Gated MLP (SiLU, or Gemma's gelu-tanh) or routed experts; see `_project_into` for `residual`. lora: the
        step's LoRA updates at this layer (none in an expert layer: folio.lora is to refuse MoE models' MLP targets)."""
        if layer.experts is not None:
            return self.moe.forward(x, layer.experts, self._linear, self.act_and_mul)
        if (lora is None and x.dtype != torch.float32 and self.config.hidden_activation == "silu"
                and self._gemv_supported(x, layer.gate_up)):
            # decode: the GEMV gates in its epilogue (bit-identical to silu_and_mul after it), one launch fewer
            activation = self._linear(x, layer.gate_up, silu_gate=True)
        else:
            gate_up = self._linear(x, layer.gate_up)
            if lora is not None:
                lora("gate_up", x, gate_up)
            activation = self.act_and_mul(gate_up)
        out = self._project_into(activation, layer.down, None, residual)
        if lora is not None:
            lora("down", activation, residual if out is None else out)
        return out

    def _out_norm(self, out: torch.Tensor | None, weight: torch.Tensor | None) -> torch.Tensor | None:
        """Gemma's norm of a sublayer's output (weight None: out as it is)."""
        return out if weight is None else self.ops.rms_norm(out, weight, self.config.rms_norm_eps)

    def _logits(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """fp32 logits. On CUDA, past the GEMV's few rows, one GEMM that accumulates in fp32 and writes fp32 (not
        rounded to bf16 first): at 256 rows of a 128k vocabulary the separate conversion read 66 MB and wrote
        131 MB per decode step."""
        if x.device.type == "cuda" and x.dtype != torch.float32 and not self.ops.linear_supported(x, lm_head):
            return self._mm_fp32(x, lm_head)
        return self._linear(x, lm_head).float()

    def _mm_fp32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T with fp32 output from 16-bit inputs: torch.mm's out_dtype where this torch has it on this
        device (checked once per model, device and dtype against the fp32 product), else the 16-bit product
        converted."""
        key = (x.device, x.dtype)
        if key not in self._mm_fp32_ok:
            self._mm_fp32_ok[key] = _mm_fp32_works(x.device, x.dtype)
        if self._mm_fp32_ok[key]:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return F.linear(x, weight).float()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor | fp8.Fp8Weight, bias: torch.Tensor | None = None,
                silu_gate: bool = False) -> torch.Tensor:
        """F.linear; decode-sized inputs (at most ops.LINEAR_MAX_ROWS rows on CUDA, see ops.linear_supported) go
        through the native GEMV, which streams the weight once in a single kernel where cuBLAS runs split-K GEMMs.
        Prefill and larger decode batches stay on cuBLAS. FP8 weights: folio.model.fp8. silu_gate: the gated MLP's
        activation of a [gate; up] product (folded into the GEMVs' epilogue)."""
        if isinstance(weight, fp8.Fp8Weight):
            return self.fp8.linear(x, weight, bias, silu_gate)
        if self.ops.linear_supported(x, weight, bias):
            return self.ops.linear(x, weight, bias, silu_gate=silu_gate)
        y = F.linear(x, weight, bias)
        return self.act_and_mul(y) if silu_gate else y

    def _gemv_supported(self, x: torch.Tensor, weight: torch.Tensor | fp8.Fp8Weight) -> bool:
        """Does a native decode GEMV (bf16 or FP8 weights) take x @ weight.T?"""
        if isinstance(weight, fp8.Fp8Weight):
            return self.fp8.gemv_supported(x, weight)
        return self.ops.linear_supported(x, weight)

    def _check_cache(self, cache: Cache) -> None:
        cfg = self.config
        # page_shape, not k's shape: a quantized cache's last dim counts bytes of codes
        num_layers, (_, num_kv_heads, head_dim) = cache.k.shape[0], cache.page_shape
        if (num_layers, num_kv_heads, head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"cache shape {[num_layers, cache.num_pages, *cache.page_shape]} does not fit the model "
                f"(layers={cfg.num_layers}, kv heads={cfg.num_kv_heads}, head_dim={cfg.head_dim})"
            )
        # a quantized cache dequantizes to the queries' dtype: any model dtype reads it
        if (cache.kv_format is None and cache.k.dtype != self.dtype) or cache.k.device != self.device:
            raise ValueError(
                f"cache is {cache.k.dtype} on {cache.k.device}, model is {self.dtype} on {self.device}"
            )


def _op_set_for(options: EngineOptions, device: torch.device) -> ops.OpSet:
    """The op set of a model on `device` with `options`; raises RuntimeError (with how to build it) where the
    options need a native module this installation lacks (folio.ops.missing_native_error)."""
    op_set = ops.OpSet.from_options(options)
    op_set.check_device(device.type)
    return op_set
