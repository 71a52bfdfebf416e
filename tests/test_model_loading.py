"""Config parsing, checkpoint loading (single, sharded, dtypes) and the errors for bad model directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import LLAMA3_ROPE, build_hf_model, hf_logits, load_hf_model, make_hf_model, make_sharded_hf_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ConfigError, ModelConfig, NotSupportedError
from folio.model.loader import CheckpointError
from folio.model.model import Model
from folio.model.rotary import rope_inv_freq

PROMPT = list(range(3, 48))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def prefill_logits(model: Model, page_size: int = 16) -> torch.Tensor:
    cache = Cache(model, num_tokens=4 * page_size, page_size=page_size)
    batch = ForwardBatch.build([SeqChunk(PROMPT, 0, [3, 1, 0, 2], "all")], page_size, model.device)
    return model.forward(batch, cache)


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> Path:
    """A private, editable copy of the tiny llama."""
    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


# ---------------------------------------------------------------- config


def test_config_fields(llama_dir) -> None:
    cfg = ModelConfig.from_pretrained(llama_dir)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM", 250, 96, 160)
    assert (cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 6, 2, 16)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) == (10000.0, None, 512)
    assert (cfg.tie_word_embeddings, cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (False, False, False, False)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype, cfg.rms_norm_eps) == (1, (2,), torch.float32, 1e-6)


@pytest.mark.parametrize("arch, qkv_bias, qk_norm", [("mistral", False, False), ("qwen2", True, False),
                                                     ("qwen3", False, True)])
def test_config_architecture_options(tmp_path, arch, qkv_bias, qk_norm) -> None:
    build_hf_model(arch).config.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (qkv_bias, False, qk_norm)


def transformers4_llama3_config() -> dict:
    """How transformers 4 spelled a Llama 3.1 config: rope_theta on top, rope_scaling with 'rope_type' or 'type'."""
    return {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 250, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        "bos_token_id": 128000, "eos_token_id": [128001, 128009],
    }


def test_rope_spellings_agree() -> None:
    old = transformers4_llama3_config()
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["rope_parameters"] = {**old["rope_scaling"], "rope_theta": 500000.0}
    new["dtype"] = "bfloat16"
    legacy_type = {**old, "rope_scaling": {**{k: v for k, v in old["rope_scaling"].items() if k != "rope_type"},
                                            "type": "llama3"}}
    parsed = [ModelConfig.from_dict(c) for c in (old, new, legacy_type)]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0].rope_theta == 500000.0 and parsed[0].rope_scaling.factor == 8.0
    assert parsed[0].head_dim == 16  # derived: no head_dim in the config
    assert parsed[0].torch_dtype == torch.bfloat16


def test_eos_ids_from_config_and_generation_config() -> None:
    raw = transformers4_llama3_config()
    assert ModelConfig.from_dict(raw).eos_token_ids == (128001, 128009)
    merged = ModelConfig.from_dict({**raw, "eos_token_id": 128001}, {"eos_token_id": [128009, 128001, 128008]})
    assert merged.eos_token_ids == (128009, 128001, 128008)
    assert ModelConfig.from_dict({**raw, "eos_token_id": None}).eos_token_ids == ()
    assert ModelConfig.from_dict({**raw, "bos_token_id": None}, {"bos_token_id": 7}).bos_token_id == 7


def test_llama3_inv_freq_matches_transformers() -> None:
    hf = build_hf_model("llama", rope_parameters=LLAMA3_ROPE)
    want, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf.config)
    assert scaling == 1.0
    got = rope_inv_freq(ModelConfig.from_dict(json.loads(hf.config.to_json_string())))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the tiny head_dim spans all three bands, so the scaling really changes something
    assert not torch.equal(got, rope_inv_freq(ModelConfig.from_dict(json.loads(build_hf_model("llama").config
                                                                                .to_json_string()))))


@pytest.mark.parametrize("change, error, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, NotSupportedError,
     r"architecture 'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, MistralForCausalLM, "
     r"Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"architectures": None}, ConfigError, "missing 'architectures'"),
    ({"hidden_size": None}, ConfigError, "missing required field 'hidden_size'"),
    ({"num_hidden_layers": 0}, ConfigError, "field 'num_hidden_layers' = 0 must be positive"),
    ({"vocab_size": "250"}, ConfigError, "field 'vocab_size' = '250' has the wrong type"),
    ({"num_key_value_heads": 4}, ConfigError, "num_attention_heads=6 is not a multiple of num_key_value_heads=4"),
    ({"hidden_act": "gelu"}, NotSupportedError, "hidden_act='gelu'"),
    ({"mlp_bias": True}, NotSupportedError, "mlp_bias"),
    ({"dtype": "float64"}, NotSupportedError, "dtype 'float64' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, NotSupportedError,
     "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, ConfigError,
     "llama3 rope scaling is missing field 'low_freq_factor'"),
    ({"partial_rotary_factor": 0.5}, NotSupportedError, "partial_rotary_factor=0.5"),
])
def test_config_errors_name_the_field(llama_copy, change, error, message) -> None:
    edit_json(llama_copy / "config.json", **change)
    with pytest.raises(error, match=message) as info:
        Model.from_pretrained(llama_copy, progress=False)
    assert "config.json" in str(info.value)


def test_mistral_sliding_window_becomes_layer_windows(tmp_path) -> None:
    """Every Mistral layer attends to sliding_window tokens (tests/test_sliding_window.py checks the logits); a
    window at least max_position_embeddings never masks anything."""
    build_hf_model("mistral", sliding_window=32).config.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).layer_windows == (32, 32, 32)
    build_hf_model("mistral", sliding_window=512).config.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).layer_windows == (0, 0, 0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sliding_window_only_when_enabled(tmp_path, arch) -> None:
    build_hf_model(arch, sliding_window=32, use_sliding_window=False).config.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).layer_windows == (0, 0, 0)
    build_hf_model(arch, sliding_window=32, use_sliding_window=True, max_window_layers=1).config.save_pretrained(
        tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).layer_windows == (0, 32, 32)


# ---------------------------------------------------------------- checkpoint errors


def test_missing_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=f"no config.json in model directory {tmp_path}"):
        Model.from_pretrained(tmp_path, progress=False)


def test_missing_weights_file(llama_copy) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        Model.from_pretrained(llama_copy, progress=False)


def rewrite_weights(model_dir: Path, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_missing_weight_key(llama_copy) -> None:
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"weight 'model.layers.2.mlp.up_proj.weight' not found in .*"
                                              r"model.safetensors"):
        Model.from_pretrained(llama_copy, progress=False)


def test_wrong_shape(llama_copy) -> None:
    def shrink(tensors):
        tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 96)
    rewrite_weights(llama_copy, shrink)
    with pytest.raises(CheckpointError, match=r"weight 'model.layers.1.self_attn.k_proj.weight' in "
                                              r"model.safetensors: expected shape \[32, 96\], got \[16, 96\]"):
        Model.from_pretrained(llama_copy, progress=False)


def test_unexpected_weight(llama_copy) -> None:
    def add_bias(tensors):
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(96)
    rewrite_weights(llama_copy, add_bias)
    with pytest.raises(CheckpointError, match="unexpected weight 'model.layers.0.self_attn.q_proj.bias'"):
        Model.from_pretrained(llama_copy, progress=False)


def test_missing_shard(tmp_path) -> None:
    path = make_sharded_hf_model(tmp_path, "llama")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard.name} named in .*model.safetensors.index.json"):
        Model.from_pretrained(path, progress=False)


def test_missing_key_in_index(tmp_path) -> None:
    path = make_sharded_hf_model(tmp_path, "qwen3")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.self_attn.k_norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.k_norm.weight' not found in .*index.json"):
        Model.from_pretrained(path, progress=False)


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen2", True)])
def test_sharded_checkpoint_matches(tmp_path, arch, tie) -> None:
    path = make_sharded_hf_model(tmp_path, arch, tie=tie)
    assert len(list(path.glob("model-*.safetensors"))) > 2
    want = hf_logits(load_hf_model(path), PROMPT)
    assert rel_err(prefill_logits(Model.from_pretrained(path, progress=False)), want) <= 1e-4


def test_weights_are_fused(llama_dir) -> None:
    model = Model.from_pretrained(llama_dir, progress=False)
    raw = load_file(llama_dir / "model.safetensors")
    layer = model.weights.layers[1]
    want_qkv = torch.cat([raw[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    want_gate_up = torch.cat([raw["model.layers.1.mlp.gate_proj.weight"], raw["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(layer.qkv, want_qkv) and torch.equal(layer.gate_up, want_gate_up)
    assert layer.qkv_bias is None and layer.q_norm is None


def test_tied_head_is_the_embedding(tmp_path) -> None:
    model = Model.from_pretrained(make_hf_model(tmp_path, "qwen3", tie=True), progress=False)
    assert model.weights.lm_head is model.weights.embed_tokens


def test_progress_bar(llama_dir, capsys) -> None:
    Model.from_pretrained(llama_dir, progress=True)
    assert "30/30" in capsys.readouterr().err  # 3 layers x 9 tensors + embedding, final norm, lm_head
    Model.from_pretrained(llama_dir, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_load(llama_dir, dtype) -> None:
    model = Model.from_pretrained(llama_dir, dtype=dtype, progress=False)
    assert model.dtype == dtype
    assert all(t.dtype == dtype for t in (model.weights.embed_tokens, model.weights.layers[0].qkv,
                                          model.weights.layers[2].down, model.weights.final_norm))
    assert Cache(model, num_tokens=64, page_size=16).k.dtype == dtype
    got = prefill_logits(model)
    assert got.dtype == torch.float32
    assert rel_err(got, hf_logits(load_hf_model(llama_dir), PROMPT)) <= 5e-2


def test_checkpoint_dtype_is_the_default(tmp_path) -> None:
    path = make_hf_model(tmp_path, "mistral", dtype=torch.bfloat16)
    model = Model.from_pretrained(path, progress=False)
    assert model.config.torch_dtype == torch.bfloat16 and model.dtype == torch.bfloat16
    assert model.weights.layers[0].o_proj.dtype == torch.bfloat16
    want = hf_logits(load_hf_model(path, dtype=torch.bfloat16), PROMPT)
    assert rel_err(prefill_logits(model), want) <= 5e-2
    as_fp32 = Model.from_pretrained(path, dtype=torch.float32, progress=False)
    assert as_fp32.weights.layers[0].o_proj.dtype == torch.float32


def test_unsupported_requested_dtype(llama_dir) -> None:
    with pytest.raises(NotSupportedError, match="dtype torch.float64 is not supported"):
        Model.from_pretrained(llama_dir, dtype=torch.float64, progress=False)


# ---------------------------------------------------------------- weights in memory


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen3", True), ("qwen2", False)])
def test_from_state_dict_matches_transformers(arch, tie) -> None:
    hf = build_hf_model(arch, tie=tie)
    config = ModelConfig.from_dict(hf.config.to_dict())
    state = hf.state_dict()
    model = Model.from_state_dict(config, state)
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    # unfused weights are the transformers model's own tensors, not copies
    assert model.weights.layers[0].o_proj.data_ptr() == state["model.layers.0.self_attn.o_proj.weight"].data_ptr()
    assert (model.weights.lm_head is model.weights.embed_tokens) == tie
    assert rel_err(prefill_logits(model), hf_logits(hf, PROMPT)) <= 1e-4
    assert len(state) == len(hf.state_dict())  # the caller's dict is left whole


def test_from_state_dict_casts_and_checks() -> None:
    hf = build_hf_model("llama")
    config = ModelConfig.from_dict(hf.config.to_dict())
    model = Model.from_state_dict(config, hf.state_dict(), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.weights.layers[1].down.dtype == torch.bfloat16
    state = hf.state_dict()
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][:, :-1]
    with pytest.raises(CheckpointError, match="down_proj.weight.*expected shape"):
        Model.from_state_dict(config, state)
    state = hf.state_dict()
    del state["model.norm.weight"]
    with pytest.raises(CheckpointError, match="model.norm.weight.*not found"):
        Model.from_state_dict(config, state)
    state = hf.state_dict()
    state["model.extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match="unexpected weight 'model.extra.weight'"):
        Model.from_state_dict(config, state)
