"""FP8 weights on the CPU: quantization error bounds, loading each supported FP8 checkpoint layout (written here from a
tiny transformers model's weights, quantized with plain torch in this file), refusals, LoRA on an FP8 base, and the
accuracy of an FP8 model against the fp32 model on the same weights (KL of next-token distributions, greedy
agreement). The CUDA paths (native GEMV, _scaled_mm) are in test_fp8_weights_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import build_hf_model, nan_cache, run_chunks

from folio import reference_ops as ref
from folio.kv_cache import Cache
from folio.lora import LoraRegistry, random_adapter
from folio.model import fp8
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ModelConfig
from folio.model.model import Model
from folio.reference_ops import linear_fp8

E4M3_MAX = 448.0
E4M3_REL_STEP = 2.0**-3  # spacing of e4m3 normals relative to their value (3 mantissa bits)
E4M3_SUBNORMAL_STEP = 2.0**-9
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --- plain-torch oracles (independent of folio.model.fp8) ---

def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale  # [N, K] e4m3, [N, 1]


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax() / E4M3_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale  # [N, K] e4m3, [] scalar


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, scale_inv [ceil(N/b), ceil(K/b)], the scale per element [N, K])."""
    n, k = w.shape
    scale_inv = torch.empty(math.ceil(n / block), math.ceil(k / block))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            scale_inv[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float().abs().amax() / E4M3_MAX
    full = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.float() / full).to(torch.float8_e4m3fn), scale_inv, full


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.split(".")[-2] in PROJECTIONS


def write_checkpoint(path: Path, hf_config: dict, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    path.mkdir(parents=True)
    config = {**hf_config, **({"quantization_config": quantization_config} if quantization_config else {})}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


CT_GROUP = {"targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                         "dynamic": True, "symmetric": True}}


def compressed_tensors(strategy: str, **weights) -> dict:
    group = {**CT_GROUP, "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                                     "dynamic": False, **weights}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


# layout -> (quantization_config, how each projection is stored)
LAYOUTS = {
    "fp8-channel": {"quant_method": "fp8", "activation_scheme": "static"},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [64, 64]},
    "ct-channel": compressed_tensors("channel"),
    "ct-tensor": compressed_tensors("tensor"),
}


def fp8_checkpoint_tensors(state: dict[str, torch.Tensor], layout: str) -> tuple[dict, dict]:
    """(the checkpoint's tensors in `layout`, the dequantized fp32 weights they stand for)."""
    stored, dequantized = {}, {}
    for name, w in state.items():
        if not is_projection(name):
            stored[name] = dequantized[name] = w
            continue
        base = name[: -len(".weight")]
        if layout.endswith("channel"):
            values, scale = quantize_channel(w)
            stored[base + ".input_scale"] = torch.tensor(1.0)  # static activation scales: ignored by folio
        elif layout.endswith("tensor"):
            values, scale = quantize_tensor(w)
            scale = scale.reshape(1) if layout.startswith("ct") else scale
        else:
            values, scale_inv, scale = quantize_blocks(w, 64)
            stored[base + ".weight_scale_inv"] = scale_inv
        stored[name] = values
        if not layout.endswith("block"):
            stored[base + ".weight_scale"] = scale
        dequantized[name] = values.float() * scale
    return stored, dequantized


@pytest.fixture(scope="module")
def hf():
    return build_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def state(hf) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def logits_all(model: Model, ids: list[int]) -> torch.Tensor:
    cache = nan_cache(model, 4, 64)
    return run_chunks(model, cache, [SeqChunk(ids, 0, list(range(math.ceil(len(ids) / 64))), "all")])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# KL bound of one extra e4m3 rounding of every projection of the tiny test models (0.006 measured)
TINY_MODEL_MAX_KL = 0.02
IDS = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1)).tolist()


# --- quantization ---

def test_quantize_error_is_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-4, 2, 64)[:, None]  # rows of very different scales
    w[5] = 0.0
    q = fp8.quantize(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.scale.shape == (64,) and q.scale.dtype == torch.float32
    assert q.weight[5].float().abs().max() == 0 and q.scale[5] > 0  # a zero row: zeros, a finite scale
    nonzero = torch.arange(64) != 5
    # every other row uses e4m3's whole range: its largest value maps to 448 exactly
    assert torch.equal(q.weight.float().abs().amax(dim=1)[nonzero], torch.full((63,), E4M3_MAX))
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(w.abs() * E4M3_REL_STEP / 2, q.scale[:, None] * E4M3_SUBNORMAL_STEP / 2)
    assert (err <= bound * 1.0001).all()
    assert err[nonzero].max() > 0  # (not trivially exact)


def test_quantize_rows_error_bound_and_blocks():
    x = torch.randn(4100, 64, generator=torch.Generator().manual_seed(1))  # more rows than one fp32 block
    values, scale = ref.quantize_rows_fp8(x)
    assert scale.shape == (4100, 1) and values.dtype == torch.float8_e4m3fn
    err = (values.float() * scale - x).abs()
    assert (err <= torch.maximum(x.abs() * E4M3_REL_STEP / 2, scale * E4M3_SUBNORMAL_STEP / 2) * 1.0001).all()


def test_fused_weights_concatenate_rows_and_scales():
    gen = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, 32, generator=gen) for n in (48, 16, 16)]
    fused = fp8.cat([fp8.quantize(p) for p in parts])
    whole = fp8.quantize(torch.cat(parts))  # per-row scales: quantizing the concatenation is the same
    assert torch.equal(fused.weight.view(torch.uint8), whole.weight.view(torch.uint8))
    assert torch.equal(fused.scale, whole.scale)
    mixed = fp8.cat([fp8.quantize(parts[0]), parts[1], parts[2]])  # dense parts are quantized to join
    assert torch.equal(mixed.scale, whole.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_is_the_dequantized_product(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    w = fp8.quantize(torch.randn(40, 64, generator=gen))
    bias = torch.randn(40, generator=gen).to(dtype)
    want = x.float() @ (w.weight.float() * w.scale[:, None]).t() + bias.float()
    got = linear_fp8(x, w.weight, w.scale, bias)
    assert got.dtype == dtype
    assert rel_err(got.float(), want) <= (1e-6 if dtype == torch.float32 else 1e-2)
    gated = linear_fp8(x, w.weight, w.scale, bias, silu_gate=True)
    g, u = got.float().chunk(2, dim=-1)
    assert torch.equal(gated, (torch.nn.functional.silu(g) * u).to(dtype))


# --- loading ---

def test_dense_checkpoint_quantized_on_load(hf, state, tmp_path):
    path = tmp_path / "bf16"
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    write_checkpoint(path, hf.config.to_dict(), bf16, None)
    model = Model.from_pretrained(path, dtype=torch.float32, progress=False, weight_format="fp8")
    layer = model.weights.layers[1]
    assert all(isinstance(w, fp8.Fp8Weight) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert model.weights.lm_head.dtype == torch.float32 and model.weights.embed_tokens.dtype == torch.float32
    p = "model.layers.1."
    want_values, want_scale = quantize_channel(torch.cat([bf16[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(layer.qkv.weight.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(layer.qkv.scale, want_scale[:, 0])
    # the FP8 model is the dense model over the dequantized weights
    dequantized = {k: (quantize_channel(v)[0].float() * quantize_channel(v)[1]) if is_projection(k) else v.float()
                   for k, v in bf16.items()}
    oracle = Model.from_state_dict(ModelConfig.from_pretrained(path), dequantized)
    assert rel_err(logits_all(model, IDS), logits_all(oracle, IDS)) <= 1e-4
    dense = Model.from_pretrained(path, dtype=torch.float32, progress=False)
    assert isinstance(dense.weights.layers[0].qkv, torch.Tensor)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_checkpoint_layouts_load(hf, state, tmp_path, layout):
    stored, dequantized = fp8_checkpoint_tensors(state, layout)
    path = write_checkpoint(tmp_path / layout, hf.config.to_dict(), stored, LAYOUTS[layout])
    model = Model.from_pretrained(path, progress=False)
    qkv = model.weights.layers[2].qkv
    assert isinstance(qkv, fp8.Fp8Weight)
    want = torch.cat([dequantized[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv"])
    oracle = Model.from_state_dict(ModelConfig.from_pretrained(path), dequantized)
    if layout.endswith("block"):
        # requantized per channel: one more e4m3 rounding of each dequantized weight
        amax = want.abs().amax(dim=1, keepdim=True)
        assert ((qkv.dequantize() - want).abs() <= torch.maximum(want.abs() * E4M3_REL_STEP / 2,
                                                                  amax / E4M3_MAX * 2**-10) * 1.0001).all()
        # (this tiny model's wide weight spread amplifies errors: the accuracy test below uses realistic scales)
        assert mean_kl(logits_all(oracle, IDS), logits_all(model, IDS)) <= TINY_MODEL_MAX_KL
    else:  # stored values and scales kept as they are
        stored_qkv = torch.cat([stored[f"model.layers.2.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(qkv.weight.view(torch.uint8), stored_qkv.view(torch.uint8))
        assert torch.allclose(qkv.dequantize(), want, rtol=1e-6, atol=0)
        assert rel_err(logits_all(model, IDS), logits_all(oracle, IDS)) <= 1e-4
    dense = Model.from_pretrained(path, progress=False, weight_format="dense")
    assert isinstance(dense.weights.layers[2].qkv, torch.Tensor)
    if not layout.endswith("block"):
        assert torch.allclose(dense.weights.layers[2].qkv, want, rtol=1e-6, atol=0)


def test_mixture_of_experts_keeps_experts_dense(tmp_path):
    hf = build_hf_model("qwen3_moe", seed=1)
    path = tmp_path / "moe"
    hf.save_pretrained(path, safe_serialization=True)
    model = Model.from_pretrained(path, progress=False, weight_format="fp8")
    routed, dense_mlp = model.weights.layers[0], model.weights.layers[1]  # mlp_only_layers=[1]
    assert isinstance(routed.qkv, fp8.Fp8Weight) and routed.experts.gate_up.dtype == torch.float32
    assert isinstance(dense_mlp.gate_up, fp8.Fp8Weight)
    oracle = Model.from_pretrained(path, progress=False)
    assert mean_kl(logits_all(oracle, IDS), logits_all(model, IDS)) <= TINY_MODEL_MAX_KL


def write_layout(tmp_path: Path, hf, state, layout: str, quantization_config: dict) -> Path:
    stored, _ = fp8_checkpoint_tensors(state, layout)
    return write_checkpoint(tmp_path / "refused", hf.config.to_dict(), stored, quantization_config)


@pytest.mark.parametrize(("quantization_config", "field"), [
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    ({**compressed_tensors("channel"), "format": "pack-quantized"}, "quantization_config.format"),
    (compressed_tensors("group", group_size=128), "quantization_config.config_groups.group_0.weights.strategy"),
    (compressed_tensors("channel", num_bits=4), "quantization_config.config_groups.group_0.weights.num_bits"),
    ({**compressed_tensors("channel"), "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                                                                          "strategy": "channel"}}}},
     "quantization_config.config_groups.g.weights.type"),
])
def test_unsupported_quantization_configs_are_refused(hf, state, tmp_path, quantization_config, field):
    path = write_layout(tmp_path, hf, state, "fp8-channel", quantization_config)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Model.from_pretrained(path, progress=False)


def test_fp8_tensors_without_scales_or_config_are_refused(hf, state, tmp_path):
    stored, _ = fp8_checkpoint_tensors(state, "fp8-channel")
    stored.pop("model.layers.0.self_attn.k_proj.weight_scale")
    path = write_checkpoint(tmp_path / "no-scale", hf.config.to_dict(), stored, LAYOUTS["fp8-channel"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight_scale"):
        Model.from_pretrained(path, progress=False)
    stored, _ = fp8_checkpoint_tensors(state, "fp8-channel")
    unscaled = {k: v for k, v in stored.items() if not k.endswith("_scale")}
    path = write_checkpoint(tmp_path / "no-config", hf.config.to_dict(), unscaled, None)
    with pytest.raises(ValueError, match="is torch.float8_e4m3fn but config.json has no quantization_config"):
        Model.from_pretrained(path, progress=False, weight_format="fp8")
    stored["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(7)
    path = write_checkpoint(tmp_path / "bad-scale", hf.config.to_dict(), stored, LAYOUTS["fp8-channel"])
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale has shape \[7\]"):
        Model.from_pretrained(path, progress=False)
    with pytest.raises(ValueError, match="weight_format='int4'"):
        Model.from_pretrained(path, progress=False, weight_format="int4")


# --- LoRA on an FP8 base ---

def test_lora_on_an_fp8_base_is_the_lora_on_the_dequantized_base(hf, state):
    config = ModelConfig.from_dict(hf.config.to_dict())
    model = Model.from_state_dict(config, state, weight_format="fp8")
    dequantized = {k: (quantize_channel(v)[0].float() * quantize_channel(v)[1]) if is_projection(k) else v
                   for k, v in state.items()}
    oracle = Model.from_state_dict(config, dequantized)
    results = []
    for m in (model, oracle):
        registry = LoraRegistry(m)
        adapter = random_adapter("a", config, 4, PROJECTIONS, "cpu", torch.float32, seed=5, std=0.2)
        registry.add(adapter)
        cache = Cache(m, num_tokens=4 * 16, page_size=16)
        batch = ForwardBatch.build([SeqChunk(IDS, 0, [0, 1, 2], "all")], cache.page_size, m.device)
        lora = registry.batch([(registry.resolve("a"), len(IDS))], m.device)
        results.append(m.forward(dataclasses.replace(batch, lora=lora), cache))
    assert rel_err(results[0], results[1]) <= 1e-4
    assert rel_err(results[0], logits_all(model, IDS)) > 1e-2  # the adapter matters


# --- accuracy against the fp32 model on the same weights ---

def mean_kl(ref_logits: torch.Tensor, got_logits: torch.Tensor) -> float:
    """Mean over rows of KL(ref || got) of the next-token distributions."""
    ref, got = ref_logits.log_softmax(-1), got_logits.log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1).mean().item()


def greedy(model: Model, prompt: list[int], num_new: int, page_size: int = 64) -> list[int]:
    cache = Cache(model, num_tokens=math.ceil((len(prompt) + num_new) / page_size) * page_size, page_size=page_size)
    table = list(range(cache.k.shape[1]))
    ids = list(prompt)
    logits = run_chunks(model, cache, [SeqChunk(ids, 0, table, "last")])
    while len(ids) < len(prompt) + num_new:
        ids.append(int(logits[-1].argmax()))
        logits = run_chunks(model, cache, [SeqChunk(ids[-1:], len(ids) - 1, table, "last")])
    return ids


ACCURACY_SIZES = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, num_hidden_layers=4, vocab_size=1000)
LOGIT_SCALE = 3.0  # lm_head scaled up: next-token distributions of a few nats' entropy, not flat
ACCURACY_TOKENS = 256
MAX_MEAN_KL = 0.01  # the bound (FP8 weights vs bf16)
MIN_AGREEMENT = 0.9  # random models have many near-ties (0.9375 measured)


def test_fp8_model_accuracy_against_fp32(capsys):
    hf = build_hf_model("llama", seed=7, **ACCURACY_SIZES)
    with torch.no_grad():
        for module in hf.modules():  # transformers-like init spread for these widths (std 0.02 * sqrt(1024 / H))
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(0.04 / 0.12)
        hf.lm_head.weight.mul_(LOGIT_SCALE * 0.12 / 0.04)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    config = ModelConfig.from_dict(hf.config.to_dict())
    ref = Model.from_state_dict(config, state)
    model = Model.from_state_dict(config, state, weight_format="fp8")
    prompt = torch.randint(3, 1000, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    ref_ids = greedy(ref, prompt, ACCURACY_TOKENS - len(prompt))
    got_ids = greedy(model, prompt, ACCURACY_TOKENS - len(prompt))
    # teacher-forced over the reference's greedy sequence: each position's next-token distribution
    ref_logits, got_logits = logits_all(ref, ref_ids), logits_all(model, ref_ids)
    kl = mean_kl(ref_logits, got_logits)
    agreement = (ref_logits.argmax(-1) == got_logits.argmax(-1)).float().mean().item()
    entropy = -(ref_logits.softmax(-1) * ref_logits.log_softmax(-1)).sum(-1).mean().item()
    # context: the same model's weights rounded to bf16 (computed in fp32)
    bf16_state = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    bf16_kl = mean_kl(ref_logits, logits_all(Model.from_state_dict(config, bf16_state), ref_ids))
    same_prefix = next((i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b), len(ref_ids)) - len(prompt)
    with capsys.disabled():
        print(f"\nfp8 vs fp32 over {ACCURACY_TOKENS} tokens: mean KL {kl:.2e}, greedy agreement {agreement:.4f}, "
              f"identical free-running greedy tokens {same_prefix}/{ACCURACY_TOKENS - len(prompt)}, "
              f"reference entropy {entropy:.2f} nats; bf16-rounded weights: mean KL {bf16_kl:.2e}")
    assert 0.3 <= entropy <= 5.0  # neither flat (log 1000 = 6.9) nor one-hot
    assert kl <= MAX_MEAN_KL
    assert agreement >= MIN_AGREEMENT
