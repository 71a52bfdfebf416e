"""A deterministic tiny Llama model with its own tokenizer, for tests, examples and the README.

`write_demo_model(path)` writes a Hugging Face model directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) that transformers' LlamaForCausalLM also loads.
The weights are random (seeded) and the tokenizer is a byte-level BPE trained on the prose in folio/data/, so the
same version and seed always give byte-identical files. Writing takes well under a second.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Bump when anything below changes the written files (sizes, corpus, tokenizer settings, weight init, chat
# template): a directory written by an older version is then rewritten (is_demo_model_current reads it).
DEMO_VERSION = 2
MARKER_FILE = "folio_demo.json"
CORPUS_FILES = ("stories.txt", "places.txt")
DATA_DIR = Path(__file__).parent / "data"

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
# The demo's chat template (tokenizer_config.json's chat_template, rendered by folio.serve.chat_template and by
# transformers' apply_chat_template). Role markers like "<|user|>" are not special tokens: the byte-level tokenizer
# encodes them as plain text. Each turn ends with the EOS token, so a reply's natural end is EOS. Whitespace is
# written as string literals: renderers strip a template's trailing newline and trim newlines after block tags.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the demo model knows the roles system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class DemoSizes:
    vocab_size: int = 1000  # tokenizer vocabulary, special tokens included; deliberately not a multiple of 32
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02


SIZES = DemoSizes()


def write_demo_model(path: str | Path, seed: int = 0) -> Path:
    """Write the demo model to `path` (created if needed) unless it already holds this version and seed."""
    model_dir = Path(path)
    if is_demo_model_current(model_dir, seed):
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_demo_tokenizer(SIZES.vocab_size)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    special_ids = {t: tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}

    _write_text(model_dir / "tokenizer.json", tokenizer.to_str(pretty=True))
    _write_json(model_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(model_dir / "config.json", _model_config(vocab_size, special_ids))
    _write_json(model_dir / "generation_config.json", _generation_config(special_ids))
    tmp = model_dir / "model.safetensors.tmp"
    save_file(demo_weights(vocab_size, seed), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, model_dir / "model.safetensors")
    # The marker goes last: a directory interrupted mid-write has none, so the next call rewrites everything.
    _write_json(model_dir / MARKER_FILE, _marker(seed))
    return model_dir


def is_demo_model_current(path: str | Path, seed: int = 0) -> bool:
    """True when `path` already holds the demo model of this version and seed."""
    model_dir = Path(path)
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    return marker == _marker(seed) and all((model_dir / f).is_file() for f in files)


def train_demo_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the shipped corpus; the trainer is deterministic for a fixed input order."""
    texts = [(DATA_DIR / name).read_text(encoding="utf-8") for name in CORPUS_FILES]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Same convention as Llama: bos prepended by the post-processor, so transformers' AutoTokenizer agrees with
    # tokenizer_config's add_bos_token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def demo_weights(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights under Hugging Face Llama names: linear layers and embeddings N(0, init_std), norms 1."""
    s = SIZES
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_dim, kv_dim = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * s.init_std

    weights = {"model.embed_tokens.weight": normal(vocab_size, s.hidden_size)}
    for layer in range(s.num_layers):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = torch.ones(s.hidden_size)
        weights[p + "self_attn.q_proj.weight"] = normal(q_dim, s.hidden_size)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_dim, s.hidden_size)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_dim, s.hidden_size)
        weights[p + "self_attn.o_proj.weight"] = normal(s.hidden_size, q_dim)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(s.hidden_size)
        weights[p + "mlp.gate_proj.weight"] = normal(s.intermediate_size, s.hidden_size)
        weights[p + "mlp.up_proj.weight"] = normal(s.intermediate_size, s.hidden_size)
        weights[p + "mlp.down_proj.weight"] = normal(s.hidden_size, s.intermediate_size)
    weights["model.norm.weight"] = torch.ones(s.hidden_size)
    weights["lm_head.weight"] = normal(vocab_size, s.hidden_size)
    return weights


def _model_config(vocab_size: int, special_ids: dict[str, int]) -> dict:
    s = SIZES
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_q_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
    }


def _generation_config(special_ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": [special_ids[EOS_TOKEN]],
        "pad_token_id": special_ids[PAD_TOKEN],
        "do_sample": False,
    }


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": SIZES.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _marker(seed: int) -> dict:
    return {"folio_demo_version": DEMO_VERSION, "seed": seed, "sizes": asdict(SIZES)}


def _write_json(path: Path, value: dict) -> None:
    _write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
