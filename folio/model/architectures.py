"""The supported Hugging Face architectures: how they differ, and the checkpoint names of their weights.

All share the Llama decoder layout and tensor names; they differ in attention biases, per-head q/k norms, how a
sliding window is switched on, and (families.py parses these) Gemma's norms, embedding scale and soft-capping,
Phi-3's fused projections and the mixture-of-experts MLPs of Mixtral and Qwen3-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    # None: taken from config.json's attention_bias; a bool: fixed by the architecture
    qkv_bias: bool | None
    o_proj_bias: bool | None
    qk_norm: bool
    # windows.py reads a Mistral/Qwen-style sliding_window; families.py sets the windows of Gemma, Phi-3, Qwen3-MoE
    has_sliding_window_option: bool
    # Qwen2/Qwen3 only window attention when use_sliding_window is set; Mistral whenever sliding_window is set
    sliding_window_needs_opt_in: bool
    # Gemma: RMSNorm scales by (1 + weight); the +1 is folded into the weight at load
    norm_weight_offset: float = 0.0
    # Gemma: RMSNorms on the attention and MLP outputs too, before each is added to the residual
    sandwich_norms: bool = False
    # Phi-3: one qkv_proj and one gate_up_proj tensor in the checkpoint
    fused_projections: bool = False
    # transformers' default when config.json has no tie_word_embeddings
    tie_word_embeddings_default: bool = False
    # "mixtral" or "qwen3_moe": the MLPs are routed experts, under these checkpoint names
    moe_layout: str | None = None


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", None, None, qk_norm=False,
                     has_sliding_window_option=False, sliding_window_needs_opt_in=False),
        Architecture("MistralForCausalLM", False, False, qk_norm=False,
                     has_sliding_window_option=True, sliding_window_needs_opt_in=False),
        Architecture("Qwen2ForCausalLM", True, False, qk_norm=False,
                     has_sliding_window_option=True, sliding_window_needs_opt_in=True),
        Architecture("Qwen3ForCausalLM", None, None, qk_norm=True,
                     has_sliding_window_option=True, sliding_window_needs_opt_in=True),
        Architecture("Gemma2ForCausalLM", None, None, qk_norm=False,
                     has_sliding_window_option=False, sliding_window_needs_opt_in=False,
                     norm_weight_offset=1.0, sandwich_norms=True, tie_word_embeddings_default=True),
        Architecture("Gemma3ForCausalLM", None, None, qk_norm=True,
                     has_sliding_window_option=False, sliding_window_needs_opt_in=False,
                     norm_weight_offset=1.0, sandwich_norms=True, tie_word_embeddings_default=True),
        Architecture("Phi3ForCausalLM", False, False, qk_norm=False,
                     has_sliding_window_option=False, sliding_window_needs_opt_in=False, fused_projections=True),
        Architecture("MixtralForCausalLM", False, False, qk_norm=False,  # windows: Mistral's rule
                     has_sliding_window_option=True, sliding_window_needs_opt_in=False, moe_layout="mixtral"),
        Architecture("Qwen3MoeForCausalLM", None, None, qk_norm=True,
                     has_sliding_window_option=False, sliding_window_needs_opt_in=False, moe_layout="qwen3_moe"),
    )
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

EMBED_TOKENS = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
# checkpoints written by old transformers versions carry this buffer; it is recomputed, never loaded
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def layer_prefix(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}."


# layer-relative names of the per-layer weights
INPUT_NORM = "input_layernorm.weight"
POST_ATTENTION_NORM = "post_attention_layernorm.weight"
Q_PROJ, K_PROJ, V_PROJ, O_PROJ = (f"self_attn.{p}_proj" for p in "qkvo")
Q_NORM = "self_attn.q_norm.weight"
K_NORM = "self_attn.k_norm.weight"
GATE_PROJ = "mlp.gate_proj.weight"
UP_PROJ = "mlp.up_proj.weight"
DOWN_PROJ = "mlp.down_proj.weight"
# Gemma: its post_attention_layernorm normalizes the attention output; this one the MLP's input
PRE_FEEDFORWARD_NORM = "pre_feedforward_layernorm.weight"
POST_FEEDFORWARD_NORM = "post_feedforward_layernorm.weight"
# Phi-3
QKV_PROJ = "self_attn.qkv_proj.weight"
GATE_UP_PROJ = "mlp.gate_up_proj.weight"


@dataclass(frozen=True)
class ExpertNames:
    """Layer-relative names of one layout of a mixture-of-experts MLP's weights."""

    router: str  # [E, H]
    gate: str | None = None  # per expert ({} = expert index): [I, H]
    up: str | None = None  # [I, H]
    down: str | None = None  # [H, I]
    fused_gate_up: str | None = None  # all experts: [E, 2I, H], gate rows first
    fused_down: str | None = None  # [E, H, I]

    @property
    def fused(self) -> bool:
        return self.fused_gate_up is not None


# Per-expert tensors, as checkpoints on the Hub hold them and as transformers 5's save_pretrained writes them
PER_EXPERT_NAMES = {
    "mixtral": ExpertNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.w1.weight",
                           "block_sparse_moe.experts.{}.w3.weight", "block_sparse_moe.experts.{}.w2.weight"),
    "qwen3_moe": ExpertNames("mlp.gate.weight", "mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight",
                             "mlp.experts.{}.down_proj.weight"),
}
# The 3D tensors of a transformers 5 model in memory (its state_dict()), for both architectures
FUSED_EXPERT_NAMES = ExpertNames("mlp.gate.weight", fused_gate_up="mlp.experts.gate_up_proj",
                                 fused_down="mlp.experts.down_proj")
