"""Speculative decoding on CUDA with the native kernels and CUDA graphs: greedy output equals decoding without
drafts (or diverges only at a near-tie of the reference's logits: verify rows run in larger graph buckets), the
verify rows and the draft model's forwards replay captured graphs, and sampled jobs with drafts run."""

from __future__ import annotations

import pytest
import torch
from test_generator_gpu import NATIVE, NEW_TOKENS, PROMPTS, assert_same_or_near_tie
from tiny_models import make_hf_model

import folio

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = folio.SamplerSettings.greedy()


@pytest.fixture(scope="module")
def models(tmp_path_factory, demo_dir):
    import shutil

    loaded = {}
    for name, seed in (("target", 0), ("draft", 1)):
        path = tmp_path_factory.mktemp(name)
        make_hf_model(path, "llama", vocab_size=1000, max_position_embeddings=512, seed=seed)
        for item in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_dir / item, path / item)
        loaded[name] = folio.Model.from_pretrained(path, device="cuda", dtype=torch.bfloat16, progress=False,
                                                   options=NATIVE)
    loaded["tokenizer"] = folio.Tokenizer.from_pretrained(path)
    return loaded


def run(models, return_logits=False, settings=GREEDY, **spec):
    model = models["target"]
    gen = folio.DynamicGenerator(model=model, cache=folio.Cache(model, num_tokens=4096, page_size=16),
                                 tokenizer=models["tokenizer"], max_batch_size=8, max_seq_len=512, **spec)
    jobs = [folio.DynamicJob(input_ids=p, max_new_tokens=NEW_TOKENS, gen_settings=settings, stop_conditions=[],
                             return_logits=return_logits, seed=i) for i, p in enumerate(PROMPTS)]
    logits = {j: [] for j in jobs}
    for job in jobs:
        gen.enqueue(job)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.stage == folio.Stage.STREAMING and r.logits is not None:
                logits[r.job].append(r.logits)
        gen.cache_manager.check()
    assert gen.cache_manager.num_in_use == 0
    return [(j.generated_ids, torch.cat(logits[j]) if logits[j] else None) for j in jobs], gen


@pytest.mark.parametrize("drafter", ["ngram", "draft", "self"])
def test_greedy_with_drafts_equals_plain_on_cuda(models, drafter):
    want, _ = run(models, return_logits=True)
    spec = {"ngram": dict(use_ngram_draft=True), "draft": dict(draft_model=models["draft"]),
            "self": dict(draft_model=models["target"])}[drafter]
    got, gen = run(models, adaptive_draft=False, **spec)
    assert gen.runner.graphs is not None
    assert gen.speculator.num_drafted > 0
    if drafter == "self":
        assert gen.speculator.num_accepted >= 0.9 * gen.speculator.num_drafted
        assert gen.speculator.draft_runner.graphs is not None
    for w, g in zip(want, got):
        assert_same_or_near_tie(w, g, 2e-2)


def test_sampled_jobs_with_drafts_run_to_their_lengths(models):
    settings = folio.SamplerSettings(temperature=1.0, top_k=20, token_repetition_penalty=1.1)
    got, gen = run(models, settings=settings, draft_model=models["target"], adaptive_draft=False)
    assert all(len(ids) == NEW_TOKENS for ids, _ in got)
    assert 0 < gen.speculator.num_accepted <= gen.speculator.num_drafted
