"""Gemma 2 / Gemma 3, Phi-3, Mixtral and Qwen3-MoE against transformers: config parsing, checkpoint layouts, the
forward over paged K/V (whole, chunked, batched decode) and the generator; configs folio cannot serve are refused.

Oracles: transformers' own models (fp32 logits within MAX_REL_ERR relative). Tiny random models from tiny_models.py;
its Gemma defaults keep windows at max_position_embeddings, so the short-window tests at the end (which need the
attention ops to honour ModelConfig.layer_windows) are apart.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tiny_models import LLAMA3_ROPE, build_hf_model, hf_logits, make_hf_model, nan_cache
from tiny_models import run_chunks as run
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import folio
from folio import reference_ops
from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ConfigError, ModelConfig, NotSupportedError
from folio.model.model import Model
from folio.model.rotary import rope_inv_freq
from folio.options import EngineOptions

VARIANTS: dict[str, dict] = {
    "gemma2": dict(arch="gemma2"),
    "gemma3": dict(arch="gemma3"),
    "phi3": dict(arch="phi3"),
    "phi3-tied": dict(arch="phi3", tie=True),
    "mixtral": dict(arch="mixtral"),
    "qwen3_moe": dict(arch="qwen3_moe"),  # norm_topk_prob, a dense layer (mlp_only_layers=[1])
    "qwen3_moe-unnormed": dict(arch="qwen3_moe", norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2),
}
PROMPT_LENS = (53, 41, 60)
PAGE_SIZES = (16, 32)
MAX_REL_ERR = 1e-4


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """transformers' eager attention: the one that soft-caps Gemma 2's attention logits in every version (an
    older transformers picked SDPA for Gemma 2 and left the soft-cap out)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max()).item()


@dataclasses.dataclass
class Case:
    path: Path
    model: Model
    prompts: list[list[int]]
    want: list[torch.Tensor]  # transformers' logits per prompt, [len, vocab]


def make_case(path: Path, name: str, spec: dict) -> Case:
    spec = dict(spec)
    make_hf_model(path, spec.pop("arch"), **spec)
    hf = load_hf_model(path)
    gen = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return Case(path, Model.from_pretrained(path, progress=False), prompts, [hf_logits(hf, p) for p in prompts])


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory) -> Case:
    return make_case(tmp_path_factory.mktemp(request.param), request.param, VARIANTS[request.param])


def new_cache(model: Model, page_size: int, seed: int = 0) -> tuple[Cache, list[list[int]]]:
    """A cache (NaN-filled: unwritten slots must never be read) and each prompt's shuffled pages."""
    pages_per_seq = [-(-n // page_size) for n in PROMPT_LENS]
    num_pages = sum(pages_per_seq) + 2
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[sum(pages_per_seq[:i]):sum(pages_per_seq[:i + 1])] for i in range(len(PROMPT_LENS))]
    return nan_cache(model, num_pages, page_size), tables


def check_whole_chunked_and_decode(case: Case, page_size: int) -> None:
    """Prompt 0 whole; prompt 1 in chunks starting mid-page; then prompts 1 and 2 continue together: the rest of
    prompt 2 as a chunk beside prompt 1's decode rows, then both decode token by token."""
    model = case.model
    cache, tables = new_cache(model, page_size)
    assert rel_err(run(model, cache, [SeqChunk(case.prompts[0], 0, tables[0], "all")]), case.want[0]) <= MAX_REL_ERR
    p1, p2 = case.prompts[1], case.prompts[2]
    got1, start = [], 0
    for size in (7, 13, 1):
        got1.append(run(model, cache, [SeqChunk(p1[start:start + size], start, tables[1], "all")]))
        start += size
    got2 = [run(model, cache, [SeqChunk(p2[:30], 0, tables[2], "all")])]
    mixed = run(model, cache, [SeqChunk(p1[start:start + 1], start, tables[1], "last"),
                               SeqChunk(p2[30:50], 30, tables[2], "all")])
    got1.append(mixed[:1])
    got2.append(mixed[1:])
    for step in range(max(len(p1) - start - 1, len(p2) - 50)):  # batched decode; the shorter drops out
        rows = [(i, pos, prompt, got) for i, pos, prompt, got in ((1, start + 1 + step, p1, got1),
                                                                  (2, 50 + step, p2, got2)) if pos < len(prompt)]
        logits = run(model, cache, [SeqChunk([prompt[pos]], pos, tables[i], "last") for i, pos, prompt, _ in rows])
        for row, (_, _, _, got) in enumerate(rows):
            got.append(logits[row:row + 1])
    assert rel_err(torch.cat(got1), case.want[1]) <= MAX_REL_ERR
    assert rel_err(torch.cat(got2), case.want[2]) <= MAX_REL_ERR


# ---------------------------------------------------------------- the forward against transformers


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_whole_chunked_and_batched_decode(case: Case, page_size: int) -> None:
    check_whole_chunked_and_decode(case, page_size)


def test_reference_ops_backend(case: Case) -> None:
    model = case.model.with_options(EngineOptions(ops_backend="reference"))
    cache, tables = new_cache(model, 16)
    assert rel_err(run(model, cache, [SeqChunk(case.prompts[0], 0, tables[0], "all")]), case.want[0]) <= MAX_REL_ERR


# Each knob of a family changes the logits well beyond MAX_REL_ERR: the tests above would notice it ignored.
KNOBS = {
    "gemma2": [dict(attn_logit_softcap=0.0), dict(final_logit_softcap=0.0), dict(query_pre_attn_scalar=None),
               dict(embed_scale=1.0), dict(hidden_activation="silu")],
    "gemma3": [dict(local_rope_layers=()), dict(rope_scaling=None), dict(final_logit_softcap=0.0)],
}


@pytest.mark.parametrize("arch", sorted(KNOBS))
def test_each_family_knob_matters(tmp_path, arch) -> None:
    case = make_case(tmp_path, arch, VARIANTS[arch])
    for change in KNOBS[arch]:
        model = Model(dataclasses.replace(case.model.config, **change), case.model.weights, torch.device("cpu"),
                      torch.float32)
        cache, tables = new_cache(model, 16)
        got = run(model, cache, [SeqChunk(case.prompts[0], 0, tables[0], "all")])
        assert rel_err(got, case.want[0]) > 1e-3, change


# ---------------------------------------------------------------- config


def config_of(arch: str, **overrides) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(build_hf_model(arch, **overrides).config.to_json_string()))


def test_gemma_config_fields() -> None:
    g2 = config_of("gemma2", sliding_window=32)
    assert (g2.hidden_activation, g2.embed_scale, g2.attention_scale) == ("gelu_tanh", 96**0.5, 24**-0.5)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (8.0, 5.0)
    raw = json.loads(build_hf_model("gemma2").config.to_json_string())
    del raw["tie_word_embeddings"]
    assert ModelConfig.from_dict(raw).tie_word_embeddings  # Gemma's default, unlike Llama's
    assert g2.layer_windows == (32, 0, 32)  # transformers' default layer_types: sliding, global, sliding
    g3 = config_of("gemma3", sliding_window=32)
    assert g3.layer_windows == (32, 0, 32) and g3.local_rope_layers == (0, 2)
    assert (g3.rope_theta, g3.rope_scaling.rope_type, g3.rope_scaling.factor, g3.local_rope_theta) == (
        10000.0, "linear", 4.0, 100.0)
    assert g3.attn_logit_softcap == 0.0
    # a window no shorter than max_position_embeddings masks nothing: full attention
    assert config_of("gemma2", sliding_window=512).layer_windows == (0, 0, 0)


def test_gemma3_transformers4_spelling() -> None:
    """transformers 4's Gemma 3 config (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern)
    parses as transformers 5's (per-layer-type rope_parameters, layer_types)."""
    new = json.loads(build_hf_model("gemma3", sliding_window=32).config.to_json_string())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"type": "linear", "factor": 4.0},
               sliding_window_pattern=2)
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(new)


def test_gemma3_inv_freq_matches_transformers() -> None:
    hf = build_hf_model("gemma3")
    cfg = ModelConfig.from_dict(json.loads(hf.config.to_json_string()))
    for layer_type, local in (("full_attention", False), ("sliding_attention", True)):
        rope_type = hf.config.rope_parameters[layer_type]["rope_type"]
        init = ROPE_INIT_FUNCTIONS.get(rope_type, hf.model.rotary_emb.compute_default_rope_parameters)
        want, _ = init(hf.config, layer_type=layer_type)
        torch.testing.assert_close(rope_inv_freq(cfg, local=local), want, rtol=0, atol=0)


def test_windows_of_phi3_mixtral_and_qwen3_moe() -> None:
    assert config_of("phi3", sliding_window=16).layer_windows == (16, 16, 16)
    assert config_of("phi3").layer_windows == (0, 0, 0)
    assert config_of("mixtral", sliding_window=16).layer_windows == (16, 16, 16)
    assert config_of("qwen3_moe", sliding_window=16, use_sliding_window=True).layer_windows == (16, 16, 16)
    assert config_of("qwen3_moe", sliding_window=16, use_sliding_window=False).layer_windows == (0, 0, 0)


def test_moe_config_fields() -> None:
    mixtral = config_of("mixtral").moe
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.expert_intermediate_size) == (4, 2, 160)
    assert mixtral.norm_topk_prob and mixtral.layers == (True, True, True)
    qwen = config_of("qwen3_moe", norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=2).moe
    assert (qwen.num_experts, qwen.expert_intermediate_size, qwen.norm_topk_prob) == (4, 64, False)
    assert qwen.layers == (False, True, False)  # layer 1: (1 + 1) % 2 == 0; layer 2 listed as dense
    assert config_of("qwen3_moe", mlp_only_layers=[0, 1, 2]).moe is None


@pytest.mark.parametrize("arch, change, error, message", [
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [1.0] * 8}}, NotSupportedError, "rope type 'longrope'"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     NotSupportedError, "partial_rotary_factor=0.75"),
    ("gemma2", {"hidden_activation": "gelu"}, NotSupportedError, "hidden_activation='gelu'"),
    ("gemma2", {"use_bidirectional_attention": True}, NotSupportedError, "use_bidirectional_attention"),
    ("gemma2", {"query_pre_attn_scalar": 0}, ConfigError, "query_pre_attn_scalar"),
    ("gemma2", {"layer_types": ["sliding_attention"]}, ConfigError, "layer_types"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, NotSupportedError, "attn_logit_softcapping=50.0"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     NotSupportedError, "rope type 'yarn' is not supported"),
    ("gemma3", {"rope_parameters": {"full_attention": {**LLAMA3_ROPE, "rope_theta": 1e4},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     NotSupportedError, "Gemma 3 rope scaling 'llama3'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     NotSupportedError, "sliding_attention"),
    ("mixtral", {"num_experts_per_tok": 5}, ConfigError, "num_experts_per_tok=5"),
    ("mixtral", {"hidden_act": "gelu"}, NotSupportedError, "hidden_act='gelu'"),
    ("qwen3_moe", {"mlp_only_layers": [7]}, ConfigError, "mlp_only_layers"),
    ("qwen3_moe", {"moe_intermediate_size": "64"}, ConfigError, "moe_intermediate_size"),
    ("qwen3_moe", {"num_experts": None}, ConfigError, "num_experts"),
])
def test_unservable_configs_are_refused(tmp_path, arch, change, error, message) -> None:
    build_hf_model(arch).config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(change)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(error, match=message) as info:
        ModelConfig.from_pretrained(tmp_path)
    assert "config.json" in str(info.value)


# ---------------------------------------------------------------- checkpoint layouts and weights


def test_gemma_norms_fold_the_offset_in_fp32(tmp_path) -> None:
    hf = build_hf_model("gemma3", dtype=torch.bfloat16, tie=True)
    cfg = ModelConfig.from_dict(json.loads(hf.config.to_json_string()))
    model = Model.from_state_dict(cfg, hf.state_dict())
    layer, state = model.weights.layers[1], hf.state_dict()
    for got, name in ((layer.input_norm, "input_layernorm"), (layer.attn_out_norm, "post_attention_layernorm"),
                      (layer.post_attention_norm, "pre_feedforward_layernorm"),
                      (layer.mlp_out_norm, "post_feedforward_layernorm"), (layer.q_norm, "self_attn.q_norm")):
        assert got.dtype == torch.float32
        assert torch.equal(got, 1.0 + state[f"model.layers.1.{name}.weight"].float())
    assert model.weights.lm_head is model.weights.embed_tokens


def test_phi3_fused_projections_are_used_as_they_are(tmp_path) -> None:
    hf = build_hf_model("phi3")
    cfg = ModelConfig.from_dict(json.loads(hf.config.to_json_string()))
    state = hf.state_dict()
    model = Model.from_state_dict(cfg, state)
    assert model.weights.layers[2].qkv.data_ptr() == state["model.layers.2.self_attn.qkv_proj.weight"].data_ptr()
    assert model.weights.layers[2].gate_up.data_ptr() == state["model.layers.2.mlp.gate_up_proj.weight"].data_ptr()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_layouts_load_alike(tmp_path, arch) -> None:
    """save_pretrained's per-expert tensors (a Hub checkpoint's layout), transformers 5's 3D tensors in a
    checkpoint file, and a model's state_dict() in memory all give the same experts and transformers' logits."""
    per_expert = make_hf_model(tmp_path / "per_expert", arch)
    hf = load_hf_model(per_expert)
    state = hf.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)  # transformers 5 fuses them
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(per_expert / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, fused / "model.safetensors")
    cfg = ModelConfig.from_pretrained(per_expert)
    models = [Model.from_pretrained(per_expert, progress=False), Model.from_pretrained(fused, progress=False),
              Model.from_state_dict(cfg, state)]
    want = hf_logits(hf, list(range(3, 40)))
    for model in models:
        experts = model.weights.layers[0].experts
        assert experts.gate_up.shape == (4, 2 * cfg.moe.expert_intermediate_size, 96)
        assert torch.equal(experts.gate_up, state["model.layers.0.mlp.experts.gate_up_proj"])
        assert torch.equal(experts.down, state["model.layers.0.mlp.experts.down_proj"])
        cache = Cache(model, num_tokens=64, page_size=16)
        assert rel_err(run(model, cache, [SeqChunk(list(range(3, 40)), 0, [2, 0, 1], "all")]), want) <= MAX_REL_ERR


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_paths_agree(arch) -> None:
    """The grouped GEMM (where torch._grouped_mm runs on this CPU), the per-expert loop and the dense fallback."""
    hf = build_hf_model(arch)
    model = Model.from_state_dict(ModelConfig.from_dict(json.loads(hf.config.to_json_string())), hf.state_dict())
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(0))
    experts = model.weights.layers[0].experts
    outs = {path: model.moe.forward(x, experts, model._linear, model.act_and_mul, path=path)
            for path in ("loop", "dense", "grouped" if model.moe.grouped_supported(x, experts) else "loop")}
    want = hf.model.layers[0].mlp(x[None])[0]
    for path, got in outs.items():
        assert rel_err(got, want) <= 1e-5, path


# ---------------------------------------------------------------- through the generator


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"])
def test_generator_matches_transformers(tmp_path, demo_dir, arch) -> None:
    """Three jobs batched, prompts ingested in chunks of 16: the logits of every generated token are
    transformers' over the prompt and the tokens before it."""
    vocab = json.loads((demo_dir / "config.json").read_text())["vocab_size"]
    path = make_hf_model(tmp_path, arch, vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (demo_dir / name).exists():
            shutil.copy(demo_dir / name, path / name)
    model = Model.from_pretrained(path, progress=False)
    cache = Cache(model, num_tokens=1024, page_size=16)
    generator = folio.DynamicGenerator(model=model, cache=cache, tokenizer=folio.Tokenizer.from_pretrained(path),
                                       max_chunk_size=16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (37, 21, 50)]
    jobs = [folio.DynamicJob(input_ids=p, max_new_tokens=6, gen_settings=folio.SamplerSettings.greedy(),
                             stop_conditions=[], return_logits=True) for p in prompts]
    results: dict[int, list] = {}
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        for r in generator.step().results:
            results.setdefault(r.serial, []).append(r)
    hf = load_hf_model(path)
    for job, prompt in zip(jobs, prompts):
        ours = torch.cat([r.logits for r in results[job.serial] if getattr(r, "logits", None) is not None])
        assert ours.shape[0] == 6
        want = hf_logits(hf, prompt + job.generated_ids)[len(prompt) - 1:len(prompt) + 5]
        assert rel_err(ours[:, :vocab], want[:, :vocab]) <= MAX_REL_ERR


# ---------------------------------------------------------------- windows shorter than the prompt

WINDOWS_HONOURED = "window" in inspect.signature(reference_ops.paged_attention).parameters
SHORT_WINDOWS = {
    "gemma2-window": dict(arch="gemma2", sliding_window=20),
    "gemma3-window": dict(arch="gemma3", sliding_window=20),
    "phi3-window": dict(arch="phi3", sliding_window=20),
    "mixtral-window": dict(arch="mixtral", sliding_window=20),
    "qwen3_moe-window": dict(arch="qwen3_moe", sliding_window=20, use_sliding_window=True),
}


@pytest.mark.skipif(not WINDOWS_HONOURED, reason="the attention ops do not take ModelConfig.layer_windows yet")
@pytest.mark.parametrize("name", sorted(SHORT_WINDOWS))
def test_short_windows(tmp_path, name) -> None:
    case = make_case(tmp_path, name, SHORT_WINDOWS[name])
    assert any(case.model.config.layer_windows)
    check_whole_chunked_and_decode(case, 16)


# ---------------------------------------------------------------- on a GPU (run by hand on an H100)

def _random_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype):
    from folio.model.loader import ExpertWeights

    gen = torch.Generator(device="cuda").manual_seed(0)
    return ExpertWeights(torch.randn(num_experts, hidden, device="cuda", dtype=dtype, generator=gen),
                         torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=gen) / 16,
                         torch.randn(num_experts, hidden, inter, device="cuda", dtype=dtype, generator=gen) / 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 3000])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_grouped_path_matches_the_loop_on_cuda(num_tokens, norm_topk_prob) -> None:
    """bf16 on the GPU: torch._grouped_mm is taken (probed as working), agrees with one GEMM pair per expert, and
    replays the same from a CUDA graph (no host sync inside); the dense fallback captures too."""
    from folio.model.config import MoeConfig
    from folio.model.moe import MoE

    experts = _random_experts(8, 512, 1024, torch.bfloat16)
    moe = MoE(MoeConfig(8, 2, 1024, norm_topk_prob, (True,)))
    x = torch.randn(num_tokens, 512, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(
        device="cuda").manual_seed(1))
    linear, act = torch.nn.functional.linear, reference_ops.silu_and_mul
    assert moe.grouped_supported(x, experts), "torch._grouped_mm does not run here"
    loop = moe.forward(x, experts, linear, act, path="loop")
    grouped = moe.forward(x, experts, linear, act)
    assert rel_err(grouped.float(), loop.float()) <= 1e-2
    for path in (None, "dense"):
        static_x = x.clone()
        moe.forward(static_x, experts, linear, act, path=path)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.forward(static_x, experts, linear, act, path=path)
        static_x.copy_(x.flip(0))
        graph.replay()
        want = moe.forward(x.flip(0), experts, linear, act, path="loop")
        assert rel_err(out.float(), want.float()) <= 1e-2, path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_families_on_cuda_match_transformers(tmp_path, arch, dtype, tolerance) -> None:
    """Each family on the GPU with the default (native) ops: a prompt in two chunks, then decode steps, against
    transformers' fp32 logits on the CPU."""
    path = make_hf_model(tmp_path, arch, sliding_window=20) if arch != "qwen3_moe" else make_hf_model(
        tmp_path, arch, sliding_window=20, use_sliding_window=True)
    want = hf_logits(load_hf_model(path), list(range(3, 64)))
    model = Model.from_pretrained(path, device="cuda", dtype=dtype, progress=False)
    cache = Cache(model, num_tokens=128, page_size=16)
    table = [5, 2, 7, 0, 1]
    got = [run(model, cache, [SeqChunk(list(range(3, 40)), 0, table, "all")]),
           run(model, cache, [SeqChunk(list(range(40, 60)), 37, table, "all")])]
    got += [run(model, cache, [SeqChunk([t], t - 3, table, "last")]) for t in range(60, 64)]
    row_errs = (torch.cat(got).cpu() - want).abs().amax(dim=-1) / want.abs().max()
    if dtype == torch.bfloat16 and arch in ("mixtral", "qwen3_moe"):
        # bf16 rounding can flip a near-tied top-k choice of the fp32 oracle, and a flipped expert changes the
        # rows after it: most rows must still agree (a systematic error would fail them all)
        assert (row_errs <= tolerance).float().mean() >= 0.8, row_errs
    else:
        assert row_errs.max() <= tolerance, row_errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["gemma2", "mixtral"])
def test_generator_with_decode_graphs_on_cuda(tmp_path, demo_dir, arch) -> None:
    """bf16 on the GPU with CUDA graphs (MoE: the grouped path captured): batched greedy jobs give the tokens
    the same generator gives without graphs."""
    vocab = json.loads((demo_dir / "config.json").read_text())["vocab_size"]
    path = make_hf_model(tmp_path, arch, dtype=torch.bfloat16, vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    shutil.copy(demo_dir / "tokenizer.json", path / "tokenizer.json")
    model = Model.from_pretrained(path, device="cuda", progress=False)
    tokenizer = folio.Tokenizer.from_pretrained(path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (37, 21, 50, 9)]
    outs = []
    for graphs in (True, False):
        generator = folio.DynamicGenerator(model=model, cache=Cache(model, num_tokens=2048, page_size=16),
                                           tokenizer=tokenizer, cuda_graphs=graphs)
        jobs = [folio.DynamicJob(input_ids=p, max_new_tokens=12, gen_settings=folio.SamplerSettings.greedy(),
                                 stop_conditions=[]) for p in prompts]
        for job in jobs:
            generator.enqueue(job)
        while generator.num_remaining_jobs():
            generator.step()
        assert (generator.runner.graphs is not None) == graphs
        outs.append([job.generated_ids for job in jobs])
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["mixtral", "gemma2"])
@pytest.mark.parametrize("num_tokens, num_logit_rows", [(2048, 1), (256, 256)])
def test_step_activation_bytes_bounds_the_peak(arch, num_tokens, num_logit_rows) -> None:
    """Model.step_activation_bytes (the forward alone) against the caching allocator's peak, for a routed-experts
    and a Gemma model of real-ish widths: a prompt chunk, and a decode batch."""
    overrides = dict(num_hidden_layers=2, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=128, intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096)
    if arch == "mixtral":
        overrides.update(num_local_experts=8, num_experts_per_tok=2)
    hf = build_hf_model(arch, dtype=torch.bfloat16, **overrides)
    model = Model.from_state_dict(ModelConfig.from_dict(json.loads(hf.config.to_json_string())), hf.state_dict(),
                                  device="cuda")
    page_size = 256
    pages = -(-num_tokens // page_size) if num_logit_rows == 1 else num_logit_rows * 2
    cache = Cache(model, num_tokens=pages * page_size, page_size=page_size)
    if num_logit_rows == 1:
        chunks = [SeqChunk([7] * num_tokens, 0, list(range(pages)), "last")]
    else:
        chunks = [SeqChunk([7], 300, [2 * i, 2 * i + 1], "last") for i in range(num_logit_rows)]
    batch = ForwardBatch.build(chunks, page_size, model.device)
    model.forward(batch, cache)  # probes and workspaces once
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.forward(batch, cache)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    bound = model.step_activation_bytes(batch.num_tokens, num_logit_rows, max_context_tokens=num_tokens,
                                        sampling=False)
    print(f"{arch} {num_tokens} tokens: peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB")
    assert peak <= bound
