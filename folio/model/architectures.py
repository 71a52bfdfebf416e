"""The supported Hugging Face architectures: how they differ, and the checkpoint names of their weights.

All four share the Llama decoder layout and tensor names; they differ in attention biases, Qwen3's per-head
q/k norm, and how a sliding window is switched on.
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
    has_sliding_window_option: bool
    # Qwen2/Qwen3 only window attention when use_sliding_window is set; Mistral whenever sliding_window is set
    sliding_window_needs_opt_in: bool


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
