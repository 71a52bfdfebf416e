"""Constrained and controlled generation on CUDA with graphs and launch-ahead on: JSON filters (masks applied on
the device), banned strings (rollback between steps), CFG pairs, token healing and the extended samplers, all in
one batch, each job valid and no page held at the end; extended samplers pick on CUDA what they pick on the CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch

import folio
from folio.options import EngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "tags", "n"], "additionalProperties": False}


def test_everything_at_once_with_graphs_and_launch_ahead(demo_dir):
    run_everything_at_once(demo_dir, "cuda")


def run_to_end(gen: folio.DynamicGenerator, jobs: list[folio.DynamicJob], max_steps: int) -> dict:
    """Enqueue jobs and step until every one ended; each job's final result. No page is held at the end."""
    gen.enqueue(jobs)
    finals, steps = {}, 0
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.eos:
                finals[r.job] = r
        steps += 1
        assert steps < max_steps
    gen.cache_manager.check()
    assert gen.cache_manager.num_in_use == 0
    return finals


def run_everything_at_once(demo_dir, device: str) -> None:
    """(tests/test_constrained_engine.py runs it on the CPU, launch-ahead on.)"""
    import jsonschema

    from folio.constrain import JsonSchemaFilter, RegexFilter

    on_cuda = device == "cuda"
    options = EngineOptions(ops_backend="native") if on_cuda else None
    model = folio.Model.from_pretrained(demo_dir, device=device, dtype=torch.bfloat16 if on_cuda else torch.float32,
                                        progress=False, options=options)
    tok = folio.Tokenizer.from_pretrained(demo_dir)
    cache = folio.Cache(model, num_tokens=16384, page_size=16)
    gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tok, max_batch_size=32, cuda_graphs=on_cuda,
                                 decode_ahead=True, overlap_emit=True)
    sampled = folio.SamplerSettings(temperature=1.0, top_k=0, top_p=1.0)
    prompt = tok.encode("Once upon a time, in a harbour town,")
    jobs = {
        "json": [folio.DynamicJob(input_ids=prompt, max_new_tokens=300, gen_settings=sampled, seed=s,
                                  filters=[JsonSchemaFilter(SCHEMA)]) for s in range(8)],
        "regex": [folio.DynamicJob(input_ids=prompt, max_new_tokens=60, gen_settings=sampled, seed=s,
                                   filters=[RegexFilter(r"[a-z]{3,8}( [a-z]{3,8}){2}")]) for s in range(4)],
        "banned": [folio.DynamicJob(input_ids=prompt, max_new_tokens=48, gen_settings=sampled, seed=s,
                                    banned_strings=["e", " a"], stop_conditions=[]) for s in range(4)],
        "cfg": [folio.DynamicJob(input_ids=[prompt, tok.encode("A storm")], max_new_tokens=32, seed=s,
                                 gen_settings=folio.SamplerSettings(cfg_scale=1.5), stop_conditions=[])
                for s in range(2)],
        "heal": [folio.DynamicJob(input_ids=tok.encode("Once upon a ti"), max_new_tokens=16, token_healing=True,
                                  gen_settings=sampled, seed=1)],
        "samplers": [folio.DynamicJob(input_ids=prompt, max_new_tokens=40, seed=s, stop_conditions=[],
                                      gen_settings=folio.SamplerSettings(
                                          mirostat=2, dry_multiplier=0.8, xtc_probability=0.5, typical=0.9,
                                          tfs=0.95, temperature_last=True))
                     for s in range(4)],
        "plain": [folio.DynamicJob(input_ids=prompt, max_new_tokens=64, stop_conditions=[], seed=s)
                  for s in range(4)],
    }
    everything = [j for group in jobs.values() for j in group]
    finals = run_to_end(gen, everything, max_steps=5000)
    for job in everything:
        assert finals[job].eos_reason != folio.EosReason.ERROR, finals[job].error
    for job in jobs["json"]:
        assert finals[job].eos_reason == folio.EosReason.END_FILTER
        jsonschema.validate(json.loads(job.full_completion), SCHEMA)
    for job in jobs["banned"]:
        assert "e" not in job.full_completion.lower() and " a" not in job.full_completion.lower()
    for job in jobs["samplers"] + jobs["plain"] + jobs["cfg"]:
        assert job.new_tokens == job.max_new_tokens
    healed = jobs["heal"][0]
    first = healed.sequence.token_ids[len(healed.input_ids)]  # the first sampled token: the healed one
    assert tok.token_bytes(first).startswith(tok.token_bytes(healed.healing_token_id))


@pytest.mark.parametrize("extra", [dict(typical=0.9), dict(tfs=0.9), dict(top_a=0.2), dict(skew=0.7),
                                   dict(xtc_probability=0.5, xtc_threshold=0.05), dict(min_temp=0.5, max_temp=1.5),
                                   dict(smoothing_factor=0.3), dict(temperature_last=True, min_p=0.05),
                                   dict(mirostat=2, mirostat_tau=3.0)])
def test_extended_samplers_pick_on_cuda_what_they_pick_on_the_cpu(extra):
    from folio.sampling import RowParams, SamplerSettings, sample, uniform_tensor

    num_rows, num_columns = 256, 4096
    logits = torch.randn(num_rows, num_columns, generator=torch.Generator().manual_seed(7)) * 3
    settings = SamplerSettings(top_k=0, top_p=1.0, **extra)
    u = uniform_tensor(torch.tensor(5), torch.arange(num_rows)).tolist()
    rng = random.Random(0)
    rows = [RowParams(settings, u[b], history_ids=[rng.randrange(num_columns) for _ in range(50)])
            for b in range(num_rows)]
    cpu = sample(logits, rows).token_ids
    cuda = sample(logits.cuda(), rows).token_ids.cpu()
    # the same draw over the same distribution: equal but where fp32 sums differ at a CDF boundary
    assert (cpu == cuda).float().mean().item() >= 0.98
