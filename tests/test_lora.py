"""LoRA adapters (folio.lora) against PEFT: random adapters made with PEFT on tiny random models, saved with
save_pretrained; the oracle for each is PEFT's merged model (merge_and_unload) run by transformers. folio never
merges: it applies each row's adapter as a batched low-rank update, several adapters and base rows in one batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_hf_model, hf_logits

import folio
from folio.kv_cache import Cache
from folio.lora import AdapterError, LoraRegistry, random_adapter
from folio.lora import apply as lora_apply
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.model import Model
from folio.tokenizer import Tokenizer

peft = pytest.importorskip("peft")

MAX_REL_ERR = 1e-4
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rslora, targets) of the adapters each test uses
ADAPTERS = {
    "all": (4, 8, False, ALL_TARGETS),
    "attn": (8, 16, True, ["q_proj", "v_proj", "o_proj"]),
    "mlp": (2, 3, False, ["up_proj", "down_proj"]),
}
GREEDY = folio.SamplerSettings.greedy()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def make_adapter(arch: str, path: Path, spec: str, seed: int) -> torch.nn.Module:
    """Save a random PEFT adapter for the tiny `arch` model to path; returns PEFT's merged model (the oracle)."""
    rank, alpha, rslora, targets = ADAPTERS[spec]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(build_hf_model(arch), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: random non-zero factors
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


class Setup:
    """A tiny model saved for folio, and adapters saved by PEFT with their merged oracles."""

    def __init__(self, arch: str, root: Path):
        self.arch = arch
        self.path = root / "model"
        self.base = build_hf_model(arch)
        self.base.save_pretrained(self.path, safe_serialization=True)
        self.model = Model.from_pretrained(self.path, progress=False)
        self.adapter_dirs: dict[str, Path] = {}
        self.merged: dict[str | None, torch.nn.Module] = {None: self.base}
        for seed, spec in enumerate(ADAPTERS):
            self.adapter_dirs[spec] = root / spec
            self.merged[spec] = make_adapter(arch, root / spec, spec, seed + 1)

    def registry(self) -> LoraRegistry:
        registry = LoraRegistry(self.model)
        for name, path in self.adapter_dirs.items():
            registry.load(name, path)
        return registry


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory) -> Setup:
    return Setup(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Setup:
    return Setup("llama", tmp_path_factory.mktemp("lora-gen"))


def forward(model: Model, cache: Cache, registry: LoraRegistry, chunks: list[SeqChunk],
            adapters: list[str | None]) -> torch.Tensor:
    batch = ForwardBatch.build(chunks, cache.page_size, model.device)
    lora = registry.batch([(registry.resolve(a), len(c.token_ids)) for c, a in zip(chunks, adapters)], model.device)
    return model.forward(dataclasses.replace(batch, lora=lora), cache)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]


# --- the forward against merged models ---

def test_one_adapter_equals_merged_model(setup):
    registry = setup.registry()
    (ids,) = prompts([45])
    cache = Cache(setup.model, num_tokens=4 * 16, page_size=16)
    for spec in ADAPTERS:
        want = hf_logits(setup.merged[spec], ids)
        assert rel_err(want, hf_logits(setup.base, ids)) > 1e-2  # the adapter matters
        got = forward(setup.model, cache, registry, [SeqChunk(ids, 0, [0, 1, 2], logits="all")], [spec])
        assert rel_err(got, want) <= MAX_REL_ERR, spec


@pytest.mark.parametrize("prompt_update", ["masked", "in-place"])
def test_mixed_adapters_in_one_batch_prefill_and_decode(setup, prompt_update, monkeypatch):
    """Rows of three adapters, the base model, and one adapter twice (not adjacent), prefilled in two chunks (short
    ones: the masked update; then long ones: masked over every row, or runs updated in place and the short adapter
    rows gathered), then decoded one token per step."""
    if prompt_update == "in-place":
        monkeypatch.setattr(lora_apply, "MASKED_MAX_COLUMNS", 0)
    registry = setup.registry()
    adapters = ["all", None, "attn", "mlp", "all"]
    lengths = [50, 41, 63, 37, 44]
    token_lists = prompts(lengths, seed=1)
    pages = 5
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(len(adapters))]
    cache = Cache(setup.model, num_tokens=len(adapters) * pages * 16, page_size=16)
    split = 12
    got: list[list[torch.Tensor]] = [[] for _ in adapters]
    first = forward(setup.model, cache, registry, [SeqChunk(ids[:split], 0, t, logits="all")
                                                   for ids, t in zip(token_lists, tables)], adapters)
    rest = forward(setup.model, cache, registry, [SeqChunk(ids[split:-3], split, t, logits="all")
                                                  for ids, t in zip(token_lists, tables)], adapters)
    rest_batch = registry.batch([(registry.resolve(a), len(ids) - 3 - split) for ids, a in zip(token_lists, adapters)],
                                setup.model.device)
    if prompt_update == "masked":
        assert rest_batch.rows is None and not rest_batch.runs
    else:  # the chunks of 35 ("all") and 48 ("attn") rows in place, the others' adapter rows gathered
        assert len(rest_batch.runs) == 2 and rest_batch.rows is not None
    offsets = [0, 0]
    for i, ids in enumerate(token_lists):
        got[i].append(first[offsets[0]:offsets[0] + split])
        offsets[0] += split
        n = len(ids) - 3 - split
        got[i].append(rest[offsets[1]:offsets[1] + n])
        offsets[1] += n
    for k in range(3, 0, -1):  # the last three tokens of every prompt, one decode step each
        step = forward(setup.model, cache, registry, [SeqChunk([ids[-k]], len(ids) - k, t)
                                                      for ids, t in zip(token_lists, tables)], adapters)
        for i in range(len(adapters)):
            got[i].append(step[i:i + 1])
    for i, (spec, ids) in enumerate(zip(adapters, token_lists)):
        assert rel_err(torch.cat(got[i]), hf_logits(setup.merged[spec], ids)) <= MAX_REL_ERR, (i, spec)


# --- the generator ---

def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    return Tokenizer.synthetic(vocab_size, bos_token_id=1, eos_token_ids=[2])


def make_generator(setup: Setup, **kwargs) -> folio.DynamicGenerator:
    cache = Cache(setup.model, num_tokens=kwargs.pop("num_tokens", 64 * 16), page_size=16)
    gen = folio.DynamicGenerator(setup.model, cache, synthetic_tokenizer(250), max_seq_len=256, **kwargs)
    for name, path in setup.adapter_dirs.items():
        gen.load_lora(name, path)
    return gen


def job(ids: list[int], lora: str | None, max_new_tokens: int = 10, **kwargs) -> folio.DynamicJob:
    return folio.DynamicJob(input_ids=ids, max_new_tokens=max_new_tokens, gen_settings=GREEDY, stop_conditions=[],
                            lora=lora, **kwargs)


def run(gen: folio.DynamicGenerator, jobs: list[folio.DynamicJob], between_steps=None) -> dict:
    finals = {}
    for j in jobs:
        gen.enqueue(j)
    steps = 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            assert getattr(r, "error", None) is None, r.error
            if getattr(r, "eos", False):
                finals[r.serial] = r
        gen.cache_manager.check()
        if between_steps is not None:
            between_steps(steps)
        steps += 1
        assert steps < 1000
    return finals


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_generator_greedy_equals_merged_models(llama):
    gen = make_generator(llama, max_chunk_size=32)
    specs = ["all", None, "attn", "mlp", "all", "attn"]
    token_lists = prompts([40, 23, 57, 30, 33, 19], seed=2)
    jobs = [job(ids, spec) for ids, spec in zip(token_lists, specs)]
    run(gen, jobs)
    for j, spec, ids in zip(jobs, specs, token_lists):
        assert j.generated_ids == hf_greedy(llama.merged[spec], ids, 10), spec


def test_generator_with_ngram_drafts_equals_without(llama):
    ids = prompts([30], seed=3)[0]
    repetitive = ids[:6] * 6  # n-gram drafts get accepted
    plain = [job(p, "attn", 16) for p in (ids, repetitive)]
    run(make_generator(llama), plain)
    drafted = [job(p, "attn", 16) for p in (ids, repetitive)]
    run(make_generator(llama, use_ngram_draft=True), drafted)
    assert [j.generated_ids for j in drafted] == [j.generated_ids for j in plain]


def test_pages_shared_within_an_adapter_only(llama, tmp_path):
    gen = make_generator(llama)
    ids = prompts([70], seed=4)[0]

    def cached_tokens(spec) -> int:
        j = job(ids, spec, 2)
        return run(gen, [j])[j.serial].cached_tokens

    assert cached_tokens("all") == 0
    assert cached_tokens("attn") == 0  # same prompt, another adapter: nothing shared
    assert cached_tokens(None) == 0  # nor with the base model
    assert cached_tokens("all") >= 64  # the same adapter: its pages (and the partial page's slots)
    assert cached_tokens(None) >= 64
    # reloaded under the same name: other weights match nothing, the same weights match again
    gen.unload_lora("all")
    gen.load_lora("all", llama.adapter_dirs["mlp"])
    assert cached_tokens("all") == 0
    gen.unload_lora("all")
    gen.load_lora("all", llama.adapter_dirs["all"])
    assert cached_tokens("all") >= 64
    infos = {i.name: i for i in gen.list_loras()}
    assert set(infos) == set(ADAPTERS) and infos["attn"].rank == 8 and infos["attn"].scale == 16 / 8**0.5


def test_load_and_unload_while_jobs_run(llama):
    gen = make_generator(llama)
    gen.unload_lora("mlp")
    token_lists = prompts([35, 28], seed=5)
    first = job(token_lists[0], "all", 12)
    late = job(token_lists[1], "mlp", 6)
    events = []

    def between_steps(step: int) -> None:
        if step == 2:
            with pytest.raises(RuntimeError, match="used by 1 queued or running job"):
                gen.unload_lora("all")
            gen.load_lora("mlp", llama.adapter_dirs["mlp"])
            gen.enqueue(late)
            events.append("loaded")
        if step > 2 and not gen.num_remaining_jobs():
            gen.unload_lora("all")
            gen.unload_lora("mlp")
            events.append("unloaded")

    run(gen, [first], between_steps)
    assert events == ["loaded", "unloaded"]
    assert first.generated_ids == hf_greedy(llama.merged["all"], token_lists[0], 12)
    assert late.generated_ids == hf_greedy(llama.merged["mlp"], token_lists[1], 6)
    with pytest.raises(ValueError, match="lora='all'"):
        gen.enqueue(job(token_lists[0], "all"))


def test_unknown_adapter_refused_at_enqueue(llama):
    gen = make_generator(llama)
    with pytest.raises(ValueError, match="lora='nope'.*loaded: \\['all', 'attn', 'mlp'\\]"):
        gen.enqueue(job([5, 6, 7], "nope"))
    with pytest.raises(ValueError, match="lora must be an adapter name"):
        job([5, 6, 7], 3)
    with pytest.raises(ValueError, match="loaded already"):
        gen.load_lora("all", llama.adapter_dirs["all"])


# --- bad adapters ---

def edited_copy(src: Path, dst: Path, config_edit=None, tensors_edit=None) -> Path:
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    if config_edit:
        config.update(config_edit)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(src / "adapter_model.safetensors")
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def _add_magnitude(tensors: dict) -> None:
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(96)


def _wrong_shape(tensors: dict) -> None:
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(4, 64)


def _drop_b(tensors: dict) -> None:
    del tensors[next(k for k in tensors if k.endswith("v_proj.lora_B.weight"))]


@pytest.mark.parametrize("config_edit, tensors_edit, message", [
    ({"use_dora": True}, None, "use_dora"),
    ({"bias": "lora_only"}, None, "bias='lora_only'"),
    ({"target_modules": ["q_proj", "lm_head"]}, None, r"target_modules \['lm_head'\]"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, None, r"target_modules \['embed_tokens'\]"),
    ({"target_modules": ".*proj"}, None, "patterns are not supported"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, None, "rank_pattern"),
    ({"peft_type": "IA3"}, None, "peft_type"),
    ({"r": 0}, None, "r must be a positive integer"),
    ({"target_modules": ["q_proj", "v_proj"]}, None, r"_proj is not in target_modules \[.q_proj., .v_proj.\]"),
    (None, _add_magnitude, "DoRA magnitudes"),
    (None, _wrong_shape, "lora_A \\[4, 64\\]"),
    (None, _drop_b, "lora_B is missing"),
])
def test_bad_adapters_refused(llama, tmp_path, config_edit, tensors_edit, message):
    path = edited_copy(llama.adapter_dirs["all"], tmp_path / "bad", config_edit, tensors_edit)
    registry = LoraRegistry(llama.model)
    with pytest.raises(AdapterError, match=message):
        registry.load("bad", path)
    assert registry.infos() == []


def test_missing_files_refused(llama, tmp_path):
    registry = LoraRegistry(llama.model)
    with pytest.raises(AdapterError, match="not a directory"):
        registry.load("x", tmp_path / "nowhere")
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        registry.load("x", tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        registry.load("x", tmp_path)


def test_random_adapter_registers(llama):
    """The benchmark's in-memory adapters: registered without files, applied like loaded ones."""
    gen = make_generator(llama)
    cfg = llama.model.config
    gen.loras.add(random_adapter("rnd", cfg, 16, tuple(ALL_TARGETS), "cpu", torch.float32, seed=1))
    ids = prompts([20], seed=6)[0]
    with_adapter, without = job(ids, "rnd", 4), job(ids, None, 4)
    run(gen, [with_adapter, without])
    assert len(with_adapter.generated_ids) == 4
    assert "rnd" in {i.name for i in gen.list_loras()}
