"""Grammar-constrained generation through the engine (folio.constrain on llguidance): JSON documents under the
20 test schemas validate with jsonschema, regex / choice / Lark outputs match, filtered and unfiltered jobs in one
batch give what each gives alone, a schema that does not compile is refused at enqueue with the compiler's
message, and filtered jobs beside speculative ones are never drafted. The demo model's weights are random: what it
writes is whatever the masks allow."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from json_schemas import SCHEMAS
from test_generator import GREEDY, run_to_end

import folio
from folio.constrain import ChoiceFilter, FilterError, GrammarFilter, JsonSchemaFilter, RegexFilter
from folio.results import EosReason

SAMPLED = folio.SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, token_repetition_penalty=1.0)


def finals(results, jobs):
    return [results[j.serial][-1] for j in jobs]


def test_json_documents_validate_under_twenty_schemas(demo):
    """10 sampled documents per schema (200 in all, in one batch of 64 rows): every one ends with end_filter,
    parses, and validates."""
    assert len(SCHEMAS) == 20
    prompt = demo.tokenizer.encode("Answer in JSON:")
    jobs, schemas = [], []
    for schema in SCHEMAS.values():
        for seed in range(10):
            jobs.append(folio.DynamicJob(input_ids=prompt, max_new_tokens=1024, gen_settings=SAMPLED, seed=seed,
                                         filters=[JsonSchemaFilter(schema)]))
            schemas.append(schema)
    gen = demo.generator(num_tokens=65536, max_batch_size=64)
    results = run_to_end(gen, jobs, check_every_step=False)
    for job, schema, final in zip(jobs, schemas, finals(results, jobs)):
        assert final.eos_reason == EosReason.END_FILTER, (final.eos_reason, final.error, job.full_completion[-80:])
        jsonschema.validate(json.loads(job.full_completion), schema)
    assert len({j.full_completion for j in jobs}) > 150  # sampled: the documents differ
    assert gen.cache_manager.num_in_use == 0


@pytest.mark.parametrize("make, check", [
    (lambda: RegexFilter(r"[A-Z][a-z]{2,6} (north|south) \d{1,3}"),
     lambda text: re.fullmatch(r"[A-Z][a-z]{2,6} (north|south) \d{1,3}", text)),
    (lambda: ChoiceFilter(["lighthouse", "harbour master", "ship"]),
     lambda text: text in ("lighthouse", "harbour master", "ship")),
    (lambda: GrammarFilter('start: item ("," item)*\nitem: "cat" | "dog" | NUMBER\nNUMBER: /[0-9]{1,2}/'),
     lambda text: re.fullmatch(r"(cat|dog|[0-9]{1,2})(,(cat|dog|[0-9]{1,2}))*", text)),
])
def test_regex_choice_and_grammar_outputs_match(demo, make, check):
    prompt = demo.tokenizer.encode("The answer:")
    jobs = [folio.DynamicJob(input_ids=prompt, max_new_tokens=200, gen_settings=SAMPLED, seed=seed,
                             filters=[make()]) for seed in range(12)]
    results = run_to_end(demo.generator(), jobs)
    for job, final in zip(jobs, finals(results, jobs)):
        assert final.eos_reason in (EosReason.END_FILTER, EosReason.STOP_TOKEN), (final.eos_reason, final.error)
        assert check(job.full_completion), job.full_completion


def test_filtered_and_unfiltered_jobs_in_one_batch_equal_each_alone(peaked):
    """Greedy: the batch's shape changes no job's output, filtered (JSON, regex) or not."""
    tok = peaked.tokenizer
    prompts = [tok.encode(f"Record {i} of the harbour log:") for i in range(6)]

    def make(i):
        filters = [[JsonSchemaFilter(SCHEMAS["tool_call"])], [RegexFilter(r"[a-z ]{5,40}\.")], []][i % 3]
        return folio.DynamicJob(input_ids=prompts[i], max_new_tokens=60, gen_settings=GREEDY, stop_conditions=[],
                                filters=filters)

    alone = []
    for i in range(6):
        job = make(i)
        run_to_end(peaked.generator(), [job])
        alone.append(job.generated_ids)
    jobs = [make(i) for i in range(6)]
    run_to_end(peaked.generator(), jobs)
    assert [j.generated_ids for j in jobs] == alone
    json.loads(jobs[0].full_completion)


def test_prefer_eos_ends_at_the_first_accepting_point(demo):
    job = folio.DynamicJob(input_ids=demo.tokenizer.encode("Count:"), max_new_tokens=50, gen_settings=SAMPLED,
                           seed=3, filters=[RegexFilter(r"[0-9]+")], filter_prefer_eos=True)
    results = run_to_end(demo.generator(), [job])
    assert re.fullmatch(r"[0-9]+", job.full_completion)
    assert job.new_tokens == 2  # one token of digits, then the EOS the filter allows
    assert results[job.serial][-1].eos_reason == EosReason.END_FILTER


def test_schema_that_does_not_compile_is_refused_at_enqueue(demo):
    gen = demo.generator()
    bad = folio.DynamicJob(input_ids=[1, 2, 3], max_new_tokens=5,
                           filters=[JsonSchemaFilter({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})])
    with pytest.raises(FilterError, match="JsonSchemaFilter"):
        gen.enqueue(bad)
    with pytest.raises(FilterError, match="RegexFilter"):
        gen.enqueue(folio.DynamicJob(input_ids=[1, 2, 3], max_new_tokens=5, filters=[RegexFilter("(ab")]))
    good = folio.DynamicJob(input_ids=[1, 2, 3], max_new_tokens=5, gen_settings=GREEDY, stop_conditions=[])
    run_to_end(gen, [good])
    assert len(good.generated_ids) == 5


def test_filtered_jobs_beside_speculative_ones_are_not_drafted(demo):
    """n-gram drafting on: the unfiltered repetitive jobs draft, the JSON-filtered ones never do and stay valid."""
    tok = demo.tokenizer
    repeat = tok.encode("the ship the ship the ship the ship the ship")
    gen = demo.generator(use_ngram_draft=True, num_draft_tokens=3)
    plain = [folio.DynamicJob(input_ids=repeat, max_new_tokens=40, gen_settings=GREEDY, stop_conditions=[])
             for _ in range(2)]
    filtered = [folio.DynamicJob(input_ids=repeat, max_new_tokens=400, gen_settings=SAMPLED, seed=s,
                                 filters=[JsonSchemaFilter(SCHEMAS["tool_call"])]) for s in range(3)]
    results = run_to_end(gen, plain + filtered)
    for job, final in zip(filtered, finals(results, filtered)):
        assert final.eos_reason == EosReason.END_FILTER
        jsonschema.validate(json.loads(job.full_completion), SCHEMAS["tool_call"])
        assert final.accepted_draft_tokens == final.rejected_draft_tokens == 0
    assert sum(r.accepted_draft_tokens + r.rejected_draft_tokens for r in finals(results, plain)) > 0


def test_everything_at_once_with_launch_ahead(demo_dir):
    """JSON and regex filters, banned strings, CFG, token healing, the extended samplers and plain jobs in one
    batch with decode-ahead and overlapped emission on (tests/test_constrained_gpu.py runs the same on CUDA with
    graphs)."""
    from test_constrained_gpu import run_everything_at_once

    run_everything_at_once(demo_dir, "cpu")


def test_generate_takes_filters_banned_strings_and_healing(demo):
    gen = demo.generator()
    text = gen.generate("The answer:", max_new_tokens=60, filters=[ChoiceFilter(["north", "south"])],
                        completion_only=True, seed=1)
    assert text in ("north", "south")
    texts = gen.generate(["A", "B"], max_new_tokens=400, completion_only=True, seed=2,
                         filters=[[RegexFilter(r"[0-9]{3}")], [JsonSchemaFilter(SCHEMAS["tool_call"])]])
    assert re.fullmatch(r"[0-9]{3}", texts[0])
    jsonschema.validate(json.loads(texts[1]), SCHEMAS["tool_call"])
    with pytest.raises(ValueError, match="one list of filters per prompt"):
        gen.generate(["A", "B"], max_new_tokens=4, filters=[RegexFilter("a")])
    free = gen.generate("Once upon a time", max_new_tokens=24, completion_only=True, seed=3,
                        gen_settings=SAMPLED)
    banned = free.strip().split()[0][:3] if free.strip() else "the"
    text = gen.generate("Once upon a time", max_new_tokens=24, completion_only=True, seed=3, gen_settings=SAMPLED,
                        banned_strings=[banned])
    assert banned.lower() not in text.lower()
    assert gen.generate("Once upon a ti", max_new_tokens=4, token_healing=True, completion_only=True, seed=4)


def test_stop_strings_found_while_masks_are_made_release_nothing_twice(demo):
    """With launch-ahead and overlapped emission, a step whose grammar masks are being made hands the previous
    step's tokens to their jobs first: a job a stop string ends there is not planned into the step launched next
    (its pages are gone). JSON-filtered jobs beside plain ones with stop strings; the pool's invariants hold after
    every step and no page is held at the end."""
    tok = demo.tokenizer
    prompt = tok.encode("Once upon a time, in a harbour town,")
    free = [folio.DynamicJob(input_ids=prompt, max_new_tokens=40, gen_settings=SAMPLED, seed=s, stop_conditions=[])
            for s in range(6)]
    run_to_end(demo.generator(), free)
    stops = [[f.full_completion[10:13]] if len(f.full_completion) > 13 else ["e"] for f in free]
    gen = demo.generator(max_batch_size=16, decode_ahead=True, overlap_emit=True)
    plain = [folio.DynamicJob(input_ids=prompt, max_new_tokens=40, gen_settings=SAMPLED, seed=s,
                              stop_conditions=stops[s]) for s in range(6)]
    filtered = [folio.DynamicJob(input_ids=prompt, max_new_tokens=300, gen_settings=SAMPLED, seed=s,
                                 filters=[JsonSchemaFilter(SCHEMAS["tool_call"])]) for s in range(6)]
    steps = []
    results = run_to_end(gen, plain + filtered, stats=steps)
    assert sum(s.launched_ahead for s in steps) > 0
    assert sum(r[-1].eos_reason == EosReason.STOP_STRING for r in results.values()) >= 3
    for job in filtered:
        jsonschema.validate(json.loads(job.full_completion), SCHEMAS["tool_call"])
    assert gen.cache_manager.num_in_use == 0
