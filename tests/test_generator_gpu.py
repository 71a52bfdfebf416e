"""The generator on CUDA, end to end with the native kernels: greedy generation equals CPU fp32 (or diverges only
at a near-tie), CUDA-graph decode equals eager decode (and steps launched ahead equal plain ones), verify rows in
graphs equal eager ones, and a step makes no host synchronisation before the sampled tokens are read."""

from __future__ import annotations

import pytest
import torch
from tiny_models import LLAMA3_ROPE, make_hf_model

import folio
from folio.options import EngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = folio.SamplerSettings.greedy()
NEW_TOKENS = 64
PROMPTS = [list(range(5, 40)), list(range(60, 61)), [7, 3, 9] * 20, list(range(100, 180))]


# On CUDA the native kernels, never the torch reference (backend "native" raises instead of falling back).
NATIVE = EngineOptions(ops_backend="native")


def greedy_run(path, device, dtype, page_size=16, cuda_graphs=None, prompts=PROMPTS, **gen_kwargs):
    options = NATIVE if device == "cuda" else None
    model = folio.Model.from_pretrained(path, device=device, dtype=dtype, progress=False, options=options)
    tokenizer = folio.Tokenizer.from_pretrained(path)
    cache = folio.Cache(model, num_tokens=4096, page_size=page_size)
    kwargs = {} if device == "cpu" else {"cuda_graphs": cuda_graphs}
    gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=8,
                                 max_seq_len=512, **kwargs, **gen_kwargs)
    jobs = [folio.DynamicJob(input_ids=p, max_new_tokens=NEW_TOKENS, gen_settings=GREEDY, stop_conditions=[],
                             return_logits=True) for p in prompts]
    for job in jobs:
        gen.enqueue(job)
    logits = {j: [] for j in jobs}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.stage == folio.Stage.STREAMING and r.logits is not None:
                logits[r.job].append(r.logits)
        gen.cache_manager.check()
    return [(j.generated_ids, torch.cat(logits[j])) for j in jobs], gen


def assert_same_or_near_tie(want, got, relative_gap):
    """Token lists equal, or equal up to a step where the reference's top two logits were within
    `relative_gap` of the logits' scale (a rounding-level tie), after which they may differ."""
    (want_ids, want_logits), (got_ids, _) = want, got
    for i, (a, b) in enumerate(zip(want_ids, got_ids)):
        if a != b:
            row = want_logits[i]
            gap = (row[a] - row[b]).abs().item()
            assert gap <= relative_gap * row.abs().max().item(), (
                f"diverged at token {i}: {a} vs {b}, logit gap {gap:.4g} is not a near-tie")
            return
    assert len(want_ids) == len(got_ids) == NEW_TOKENS


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, demo_dir):
    import shutil

    paths = {}
    for arch, overrides in [("llama", {"rope_parameters": LLAMA3_ROPE}), ("mistral", {}), ("qwen2", {}),
                            ("qwen3", {"tie": True})]:
        path = tmp_path_factory.mktemp(arch)
        make_hf_model(path, arch, vocab_size=1000, max_position_embeddings=512, **overrides)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_dir / name, path / name)
        paths[arch] = path
    return paths


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype, relative_gap", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_greedy_matches_cpu_fp32(tiny_models, arch, dtype, relative_gap):
    cuda, _ = greedy_run(tiny_models[arch], "cuda", dtype)
    cpu, _ = greedy_run(tiny_models[arch], "cpu", torch.float32)
    for want, got in zip(cpu, cuda):
        assert_same_or_near_tie(want, got, relative_gap)


@pytest.mark.parametrize("page_size", [16, 256])
def test_graph_decode_equals_eager(tiny_models, page_size):
    graphs, gen = greedy_run(tiny_models["llama"], "cuda", torch.bfloat16, page_size, cuda_graphs=True)
    assert gen.runner.graphs is not None
    eager, gen_eager = greedy_run(tiny_models["llama"], "cuda", torch.bfloat16, page_size, cuda_graphs=False)
    assert gen_eager.runner.graphs is None
    for want, got in zip(eager, graphs):
        assert_same_or_near_tie(want, got, 2e-2)


def test_decode_ahead_equals_plain_graph_decode(tiny_models):
    """Steps launched ahead from the device-side sampled ids run the same graphs on the same inputs."""
    ahead, gen = greedy_run(tiny_models["llama"], "cuda", torch.bfloat16, cuda_graphs=True)
    assert gen.decode_ahead and gen.pipeline.num_steps_ahead > NEW_TOKENS // 2
    plain, gen = greedy_run(tiny_models["llama"], "cuda", torch.bfloat16, cuda_graphs=True, decode_ahead=False)
    assert gen.pipeline.num_steps_ahead == 0
    for want, got in zip(plain, ahead):
        assert want[0] == got[0]
        assert torch.equal(want[1], got[1])


def test_decode_step_makes_no_host_sync(tiny_models):
    path = tiny_models["llama"]
    model = folio.Model.from_pretrained(path, device="cuda", dtype=torch.bfloat16, progress=False)
    tokenizer = folio.Tokenizer.from_pretrained(path)
    gen = folio.DynamicGenerator(model=model, cache=folio.Cache(model, num_tokens=4096, page_size=16),
                                 tokenizer=tokenizer, max_batch_size=8, max_seq_len=512, decode_ahead=False)
    for p in PROMPTS:
        gen.enqueue(folio.DynamicJob(input_ids=p, max_new_tokens=NEW_TOKENS,
                                     gen_settings=folio.SamplerSettings(temperature=0.9, top_p=0.9,
                                                                        token_repetition_penalty=1.1),
                                     stop_conditions=[]))
    for _ in range(4):  # through prefill, into steady decode
        gen.iterate()
    torch.cuda.synchronize()
    plan = gen.scheduler.plan()  # the step by hand, as DynamicGenerator.step runs it
    assert plan.chunks and all(c.num_tokens == 1 for c in plan.chunks)
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits, used_graph = gen.runner.forward(plan)
        sampled = gen.runner.sample(plan.chunks, logits)  # penalty windows and history on the device
        gen.scheduler.commit(plan)
        # the next step, launched ahead from the sampled ids on the device: no sync either
        gen.pipeline.launch(plan.chunks, sampled.token_ids, gen.scheduler, gen.runner, gen.max_batch_size)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert used_graph and sampled.token_ids.shape == (len(plan.chunks),)
    ahead = gen.pipeline.step
    assert ahead is not None and ahead.error is None and ahead.logits.shape[0] == len(plan.chunks)


def test_verify_rows_in_graphs_equal_eager_and_one_token_steps(tiny_models):
    """Rows of several tokens whose every logit is wanted (speculative decoding's verify rows) replay in the
    decode graphs as one-token rows over the same pages: the same logits as the eager forward, and as feeding
    the tokens one step at a time."""
    from runner_helpers import verify_rows_logits

    results = {graphs: verify_rows_logits(tiny_models["llama"], "cuda", torch.bfloat16, graphs, options=NATIVE)
               for graphs in (True, False)}
    (graph_rows, _, used), (eager_rows, eager_steps, _) = results[True], results[False]
    assert used  # the verify step replayed a graph
    for got, want, steps in zip(graph_rows, eager_rows, eager_steps):
        # bf16 through other kernels (decode attention vs the prefill paths): rounding-level differences, measured
        # against the logits' scale; a wrong context or page would differ at the scale itself
        for other in (want, steps):
            scale = other.abs().amax(dim=1, keepdim=True)
            assert ((got - other).abs() <= 3e-2 * scale).all(), ((got - other).abs() / scale).max()
