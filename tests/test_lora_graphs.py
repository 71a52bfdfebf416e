"""LoRA decode rows in the form captured CUDA graphs run (folio.lora.slots): the masked update over fixed-capacity
slot buffers, against each adapter's own factors and PEFT's merged models (the oracles of tests/test_lora.py).

On the CPU, DecodeGraphs(capture=False) runs each replay as an eager forward over the static buffers the graphs are
captured from: the generator then takes exactly the captured path (buffer filling, padding rows, row slots, the
graphs' batch) for its decode and verify steps. The CUDA test at the end captures for real."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_lora import ADAPTERS, ALL_TARGETS, MAX_REL_ERR, Setup, hf_greedy, job, prompts, rel_err, synthetic_tokenizer
from tiny_models import build_hf_model, hf_logits, make_hf_model

import folio
from folio.kv_cache import Cache
from folio.lora import AdapterError, LoraBatch, LoraRegistry, LoraSlots, lora_slot_bytes, random_adapter
from folio.lora import apply as lora_apply
from folio.lora.adapter import part_sizes
from folio.model.batch import ForwardBatch, SeqChunk
from folio.model.config import ModelConfig
from folio.model.decode_graphs import DecodeGraphs
from folio.options import EngineOptions
from folio.sizing import activation_reserve_bytes


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Setup:
    return Setup("llama", tmp_path_factory.mktemp("lora-graphs"))


def registry_of(setup: Setup, names=tuple(ADAPTERS), **capacity) -> LoraRegistry:
    registry = LoraRegistry(setup.model, **capacity)
    for name in names:
        registry.load(name, setup.adapter_dirs[name])
    return registry


# --- the masked update ---

def test_masked_update_equals_each_adapters_factors(llama):
    """Every layer and projection, rows of three adapters (one twice, apart), base rows and two empty slots: the
    masked update over all rows, and over gathered rows, equal each row's own (x A^T) B^T."""
    registry = registry_of(llama, max_loras=5, max_lora_rank=8)
    slots = registry.slots
    row_adapters = [registry.resolve(n) for n in ["all", None, "attn", "mlp", "all", None, "attn"]]
    row_slots = torch.tensor([slots.slot_of(a) for a in row_adapters])
    assert sorted(set(row_slots.tolist())) == [-1, 0, 1, 2]  # slots 3 and 4 stay empty
    gathered = torch.tensor([i for i, a in enumerate(row_adapters) if a is not None])
    gen = torch.Generator().manual_seed(0)
    sizes = part_sizes(llama.model.config)
    for layer_idx in range(llama.model.config.num_layers):
        for projection, (out_sizes, in_features) in sizes.items():
            x = torch.randn(len(row_adapters), in_features, generator=gen)
            y = torch.randn(len(row_adapters), sum(out_sizes), generator=gen)
            want = y.clone()
            for i, adapter in enumerate(row_adapters):
                delta = adapter and adapter.layers[layer_idx].get(projection)
                if delta is not None:
                    want[i] += (x[i] @ delta.a.t()) @ delta.b.t()
            every_row = y.clone()
            slots.apply(layer_idx, projection, x, every_row, slots.mask(row_slots))
            some_rows = y.clone()
            slots.apply(layer_idx, projection, x, some_rows, slots.mask(row_slots[gathered]), gathered)
            assert torch.allclose(every_row, want, atol=1e-5), (layer_idx, projection)
            assert torch.allclose(some_rows, want, atol=1e-5), (layer_idx, projection)


def test_eager_batch_takes_the_graph_form_in_steps_of_short_chunks(llama, monkeypatch):
    registry = registry_of(llama)  # 8 slots of rank 16: narrow
    all_, attn = registry.get("all"), registry.get("attn")
    cpu = torch.device("cpu")
    decode = LoraBatch.build([(all_, 1), (None, 1), (attn, 3)], registry.slots, cpu)
    assert decode.rows is None and not decode.runs and decode.mask.shape == (5, registry.max_loras)
    # a long chunk, most rows with adapters, narrow slots: the masked update over every row, base rows on slot -1
    mixed = LoraBatch.build([(all_, 40), (None, 1), (attn, 3)], registry.slots, cpu)
    assert mixed.rows is None and not mixed.runs and mixed.mask.shape == (44, registry.max_loras)
    assert mixed.mask[40].sum() == 0 and mixed.mask[:40].sum(dim=0).max() == 40
    half = LoraBatch.build([(None, 40), (attn, 40)], registry.slots, cpu)
    assert half.rows is None and not half.runs
    long_base = LoraBatch.build([(None, 40), (attn, 2)], registry.slots, cpu)
    assert long_base.rows.tolist() == [40, 41] and not long_base.runs  # the base chunk's rows are not updated
    assert LoraBatch.build([(None, 4)], registry.slots, cpu) is None
    # wide slots: the long run updates in place, the short adapter rows gathered
    monkeypatch.setattr(lora_apply, "MASKED_MAX_COLUMNS", registry.max_loras * registry.slots.max_lora_rank - 1)
    mixed = LoraBatch.build([(all_, 40), (None, 1), (attn, 3)], registry.slots, cpu)
    assert mixed.rows.tolist() == [41, 42, 43] and len(mixed.runs) == 1


# --- the graphs' batch against merged models ---

def graph_decode(setup: Setup, registry: LoraRegistry, specs: list[str | None], bucket_rows: int) -> None:
    """Prefill each prompt but its last 3 tokens eagerly, decode those through DecodeGraphs (eager replays, padding
    rows in the bucket): every row's logits equal its merged model's."""
    token_lists = prompts([30, 21, 44, 17, 35][:len(specs)], seed=7)
    pages = 4
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(len(specs))]
    cache = Cache(setup.model, num_tokens=len(specs) * pages * 16, page_size=16)
    adapters = [registry.resolve(s) for s in specs]
    batch = ForwardBatch.build([SeqChunk(ids[:-3], 0, t, logits="all") for ids, t in zip(token_lists, tables)],
                               16, setup.model.device)
    lora = registry.batch([(a, len(ids) - 3) for a, ids in zip(adapters, token_lists)], setup.model.device)
    first = setup.model.forward(dataclasses.replace(batch, lora=lora), cache)
    graphs = DecodeGraphs(setup.model, cache, bucket_rows, 64, capture=False)
    graphs.enable_lora(registry.slots)
    got = [[] for _ in specs]
    offset = 0
    for i, ids in enumerate(token_lists):
        got[i].append(first[offset:offset + len(ids) - 3])
        offset += len(ids) - 3
    for k in range(3, 0, -1):
        logits = graphs.run([ids[-k] for ids in token_lists], [len(ids) - k for ids in token_lists], tables,
                            [registry.slot_of(a) for a in adapters])
        assert logits.shape[0] == len(specs)
        for i in range(len(specs)):
            got[i].append(logits[i:i + 1])
    for i, (spec, ids) in enumerate(zip(specs, token_lists)):
        assert rel_err(torch.cat(got[i]), hf_logits(setup.merged[spec], ids)) <= MAX_REL_ERR, (i, spec)


def test_graph_batch_equals_merged_models(llama):
    graph_decode(llama, registry_of(llama, max_loras=4), ["all", None, "attn", "mlp", "all"], 8)


def test_slot_reused_after_unload(llama):
    """A freed slot takes the next adapter, with nothing left of the one before (the rank-4 all-targets adapter's
    slot goes to the rank-2 MLP-only one); a full registry refuses another adapter, naming max_loras."""
    registry = registry_of(llama, ["all", "attn"], max_loras=2)
    assert registry.slot_of(registry.get("all")) == 0
    with pytest.raises(AdapterError, match="max_loras=2 adapters are loaded already"):
        registry.load("mlp", llama.adapter_dirs["mlp"])
    assert [i.name for i in registry.infos()] == ["all", "attn"]
    registry.unload("all", [])
    registry.load("mlp", llama.adapter_dirs["mlp"])
    assert registry.slot_of(registry.get("mlp")) == 0
    graph_decode(llama, registry, ["mlp", "attn", None], 4)


def test_capacity_checked(llama):
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1, got 0"):
        LoraRegistry(llama.model, max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        LoraRegistry(llama.model, max_lora_rank=2.5)
    registry = LoraRegistry(llama.model, max_lora_rank=4)
    with pytest.raises(AdapterError, match="rank 8, more than max_lora_rank=4"):
        registry.load("attn", llama.adapter_dirs["attn"])
    assert registry.slots is None and not registry.infos()  # refused before anything was allocated
    registry.load("all", llama.adapter_dirs["all"])  # rank 4 fits
    with pytest.raises(AdapterError, match="max_lora_rank=4"):
        registry.load("attn", llama.adapter_dirs["attn"])
    with pytest.raises(ValueError, match="max_loras must be"):
        folio.DynamicGenerator(llama.model, Cache(llama.model, num_tokens=256, page_size=16),
                               synthetic_tokenizer(250), max_seq_len=64, max_loras=-1)


def test_slot_memory_counted():
    """lora_slot_bytes is what LoraSlots allocates (none for expert MLPs), and the reserve counts it twice (the
    slots and the adapters' own factors)."""
    for arch in ("llama", "mixtral"):
        config = ModelConfig.from_dict(build_hf_model(arch).config.to_dict())
        slots = LoraSlots(config, 3, 8, torch.device("cpu"), torch.bfloat16)
        allocated = sum(t.nbytes for layer in slots.layers for f in layer.values() for t in (f.a, f.b))
        assert lora_slot_bytes(config, torch.bfloat16, 3, 8) == allocated, arch
        if arch == "mixtral":
            assert all(set(layer) == {"qkv", "o_proj"} for layer in slots.layers)


def test_reserve_counts_lora_slots(llama):
    model = llama.model
    extra = activation_reserve_bytes(model, 8, max_loras=3, max_lora_rank=8) - activation_reserve_bytes(model, 8)
    assert extra == 2 * lora_slot_bytes(model.config, model.dtype, 3, 8)


# --- the generator through the graphs' path ---

def graph_generator(setup: Setup, names=tuple(ADAPTERS), max_graph_rows: int = 64, **kwargs) -> folio.DynamicGenerator:
    """A CPU generator whose runner replays DecodeGraphs(capture=False); adapters loaded after (the first load
    enables LoRA in the graphs, as on CUDA)."""
    capacity = {k: kwargs.pop(k) for k in ("max_loras", "max_lora_rank") if k in kwargs}
    cache = Cache(setup.model, num_tokens=64 * 16, page_size=16)
    gen = folio.DynamicGenerator(setup.model, cache, synthetic_tokenizer(250), max_seq_len=256, **capacity, **kwargs)
    gen.runner.graphs = DecodeGraphs(setup.model, cache, max_graph_rows, 256, capture=False)
    for name in names:
        gen.load_lora(name, setup.adapter_dirs[name])
    assert gen.runner.graphs.lora_slots is gen.loras.slots
    return gen


def run_steps(gen: folio.DynamicGenerator, jobs: list[folio.DynamicJob], between_steps=None) -> list:
    """Run the jobs; returns each step's stats."""
    for j in jobs:
        gen.enqueue(j)
    all_stats = []
    while gen.num_remaining_jobs():
        results, stats = gen.step()
        for r in results:
            assert getattr(r, "error", None) is None, r.error
        gen.cache_manager.check()
        if between_steps is not None:
            between_steps(len(all_stats))
        all_stats.append(stats)
        assert len(all_stats) < 1000
    return all_stats


@pytest.mark.parametrize("decode_ahead", [False, True])
def test_generator_graph_steps_equal_merged_models(llama, decode_ahead):
    gen = graph_generator(llama, max_chunk_size=32, decode_ahead=decode_ahead)
    specs = ["all", None, "attn", "mlp", "all", "attn"]
    token_lists = prompts([40, 23, 57, 30, 33, 19], seed=2)
    jobs = [job(ids, spec) for ids, spec in zip(token_lists, specs)]
    stats = run_steps(gen, jobs)
    decode_steps = [s for s in stats if s.num_rows and not s.num_prompt_tokens]
    assert len(decode_steps) >= 5 and all(s.used_graph for s in decode_steps)
    assert not decode_ahead or any(s.launched_ahead and s.used_graph for s in stats)
    for j, spec, ids in zip(jobs, specs, token_lists):
        assert j.generated_ids == hf_greedy(llama.merged[spec], ids, 10), spec


def test_generator_verify_rows_in_graphs_equal_merged_model(llama):
    """n-gram drafts: verify rows of several tokens replay as one-token rows, each on its job's slot."""
    gen = graph_generator(llama, use_ngram_draft=True)
    ids = prompts([30], seed=3)[0]
    specs, token_lists = ["attn", None, "all"], [ids[:6] * 6, ids, ids[:5] * 7]  # repetitive: drafts accepted
    jobs = [job(p, spec, 16) for p, spec in zip(token_lists, specs)]
    stats = run_steps(gen, jobs)
    assert any(s.num_verify_rows and s.used_graph for s in stats)
    for j, spec, p in zip(jobs, specs, token_lists):
        assert j.generated_ids == hf_greedy(llama.merged[spec], p, 16), spec


def test_generator_loads_into_a_freed_slot_while_jobs_run(llama):
    gen = graph_generator(llama, ["all", "attn"], max_loras=2)
    token_lists = prompts([35, 28], seed=5)
    first = job(token_lists[0], "all", 12)
    late = job(token_lists[1], "mlp", 6)

    def between_steps(step: int) -> None:
        if step == 2:
            with pytest.raises(AdapterError, match="max_loras=2"):
                gen.load_lora("mlp", llama.adapter_dirs["mlp"])
            gen.unload_lora("attn")
            gen.load_lora("mlp", llama.adapter_dirs["mlp"])  # attn's slot
            gen.enqueue(late)

    stats = run_steps(gen, [first], between_steps)
    assert sum(s.used_graph for s in stats) >= 8
    assert first.generated_ids == hf_greedy(llama.merged["all"], token_lists[0], 12)
    assert late.generated_ids == hf_greedy(llama.merged["mlp"], token_lists[1], 6)


# --- CUDA: captured graphs against eager steps ---

@pytest.mark.gpu
def test_captured_lora_graphs_equal_eager_steps(tmp_path):
    """bf16 on CUDA, graphs captured with the LoRA update: several adapters (ranks 16, 8, 4; other targets) and
    base rows give the greedy tokens of the same generator without graphs (or part at a near-tie), and every decode
    step with adapter rows replayed a graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = make_hf_model(tmp_path / "model", "llama", vocab_size=1000)
    specs = ["a0", None, "a1", "a2", "a0", None, "a1"]
    token_lists = prompts([35, 20, 47, 28, 33, 12, 40], seed=8)
    new_tokens = 48

    def generate(cuda_graphs: bool, with_adapters: bool = True):
        model = folio.Model.from_pretrained(path, device="cuda", dtype=torch.bfloat16, progress=False,
                                            options=EngineOptions(ops_backend="native"))
        cache = Cache(model, num_tokens=4096, page_size=16)
        gen = folio.DynamicGenerator(model, cache, synthetic_tokenizer(1000), max_batch_size=8, max_seq_len=256,
                                     cuda_graphs=cuda_graphs)
        for k, (rank, targets) in enumerate([(16, ALL_TARGETS), (8, ["q_proj", "v_proj", "down_proj"]),
                                             (4, ["gate_proj", "up_proj", "o_proj"])]):
            gen.loras.add(random_adapter(f"a{k}", model.config, rank, tuple(targets), model.device, model.dtype,
                                         seed=k, std=0.1))
        assert (gen.runner.graphs is not None) == cuda_graphs
        assert not cuda_graphs or gen.runner.graphs.lora_slots is gen.loras.slots
        jobs = [folio.DynamicJob(input_ids=ids, max_new_tokens=new_tokens, gen_settings=folio.SamplerSettings.greedy(),
                                 stop_conditions=[], return_logits=True, lora=spec if with_adapters else None)
                for ids, spec in zip(token_lists, specs)]
        for j in jobs:
            gen.enqueue(j)
        logits = {j: [] for j in jobs}
        decode_steps = []
        while gen.num_remaining_jobs():
            results, stats = gen.step()
            for r in results:
                assert getattr(r, "error", None) is None, r.error
                if r.stage == folio.Stage.STREAMING and r.logits is not None:
                    logits[r.job].append(r.logits)
            if stats.num_rows and not stats.num_prompt_tokens:
                decode_steps.append(stats.used_graph)
        return [(j.generated_ids, torch.cat(logits[j])) for j in jobs], decode_steps

    eager, eager_steps = generate(False)
    graphed, graph_steps = generate(True)
    assert not any(eager_steps) and len(graph_steps) >= new_tokens - 2 and all(graph_steps)
    for (want_ids, want_logits), (got_ids, got_logits) in zip(eager, graphed):
        assert len(want_ids) == len(got_ids) == new_tokens
        same = next((i for i, (a, b) in enumerate(zip(want_ids, got_ids)) if a != b), new_tokens)
        scale = want_logits[:same + 1].abs().max().item()
        # the same inputs up to the first difference: logits within bf16 rounding of each other
        assert (want_logits[:same + 1] - got_logits[:same + 1]).abs().max().item() <= 2e-2 * scale
        if same < new_tokens:  # where they part, the eager step's top two logits were a near-tie
            row = want_logits[same]
            assert (row[want_ids[same]] - row[got_ids[same]]).abs().item() <= 2e-2 * row.abs().max().item()
    base, _ = generate(True, with_adapters=False)
    assert all(b[0] != g[0] for b, g, s in zip(base, graphed, specs) if s is not None)  # the adapters matter
