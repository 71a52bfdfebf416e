"""Speculative decoding in the serving layer, without a cluster: the config's drafter options, replica engines of
the demo model drafting with n-grams or a draft model (the demo model itself), the draft counts of a response as
gRPC carries them, and the draft metrics' inputs. tests/test_serving.py serves a drafting application over gRPC."""

from __future__ import annotations

import asyncio
import time

import pytest

from folio.serve.config import ConfigError, ServeConfig
from folio.serve.schema import Chunk, Completion, EngineRequest

# Repeats itself: n-gram drafts of its own tokens are mostly right.
REPETITIVE_PROMPT = "one two three four, one two three four, one two three four, one two three four,"

# --- config -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values, field", [
    ({"draft_model_path": "/models/draft", "ngram": True}, "draft_model_path / ngram"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"num_draft_tokens": "many"}, "num_draft_tokens"),
    ({"ngram": "maybe"}, "ngram"),
])
def test_config_rejects_invalid_drafter_options(values, field):
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_dict({"num_gpus": 0, **values})
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_config_drafter_options_round_trip():
    import argparse

    import yaml

    from folio.serve.app import serve_config

    config = ServeConfig.from_dict({"num_gpus": "0", "ngram": "true", "num_draft_tokens": "3"})
    assert (config.ngram, config.num_draft_tokens, config.draft_model_path, config.speculative) == (True, 3, None, True)
    assert not ServeConfig(num_gpus=0).speculative
    assert ServeConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config
    args = serve_config(config)["applications"][0]["args"]  # what `serve deploy` hands build_app
    assert (args["ngram"], args["num_draft_tokens"]) == (True, 3) and ServeConfig.from_dict(args) == config

    parser = argparse.ArgumentParser()
    ServeConfig.add_arguments(parser)
    flags = parser.parse_args(["--draft-model-path", "/models/draft", "--num-draft-tokens", "2"])
    drafted = ServeConfig.from_args(flags, num_gpus=0.0)
    assert (drafted.draft_model_path, drafted.ngram, drafted.num_draft_tokens) == ("/models/draft", False, 2)
    # unset from strings, as `serve run ... draft_model_path=none` passes it
    assert ServeConfig.from_dict({"num_gpus": 0, "draft_model_path": "none"}).draft_model_path is None
    with pytest.raises(ConfigError, match="^draft_model_path: must name a model directory"):
        ServeConfig(num_gpus=0, draft_model_path="")


def test_serve_command_checks_the_draft_model_directory(demo_dir, tmp_path, capsys):
    from folio.serve.cli import _prepare_model

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, draft_model_path=str(tmp_path / "missing"))
    assert not _prepare_model(config)
    assert "draft_model_path:" in capsys.readouterr().err
    assert _prepare_model(config.replace(draft_model_path=str(demo_dir)))


# --- replica engines ----------------------------------------------------------------------------------------


def _build(demo_dir, **options):
    from folio.serve.engine import Engine

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=2048, page_size=16, max_batch_size=4,
                         max_queue_size=4, warmup=False, **options)
    return Engine.build(config)


def _stream(engine, input_ids, max_new_tokens: int) -> list[Chunk]:
    request = EngineRequest(input_ids=tuple(input_ids), max_new_tokens=max_new_tokens, stop_conditions=(),
                            sampler={"temperature": 0.0, "top_k": 1})

    async def run():
        job = engine.start_job(request)
        return [chunk async for chunk in engine.stream(job, time.monotonic())]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engines(demo_dir):
    built = {"plain": _build(demo_dir), "ngram": _build(demo_dir, ngram=True, num_draft_tokens=3),
             "draft_model": _build(demo_dir, draft_model_path=str(demo_dir))}
    yield built
    for engine in built.values():
        asyncio.run(engine.close(drain_timeout_s=1))


@pytest.fixture(scope="module")
def prompt_ids(engines):
    tokenizer = engines["plain"].tokenizer
    return tokenizer.encode(REPETITIVE_PROMPT, add_bos=tokenizer.add_bos_token)


def test_replica_engines_build_the_configured_drafter(engines, demo_dir):
    assert engines["plain"].generator.speculator is None and engines["plain"].draft_model is None
    ngram = engines["ngram"]
    assert ngram.generator.speculator is not None and ngram.draft_model is None
    assert ngram.generator.max_q_size == 1 + 3  # a verify row: the last token and every draft
    drafted = engines["draft_model"]
    target, draft = drafted.model, drafted.draft_model
    assert drafted.generator.draft_model is draft and draft is not target  # loaded once, beside the target
    assert (draft.device, draft.dtype, draft.options) == (target.device, target.dtype, target.options)
    assert drafted.generator.draft_cache.num_pages == drafted.cache.num_pages


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_drafting_engine_completes_as_the_plain_one_and_counts_drafts(engines, prompt_ids, drafter):
    from folio.serve import grpc_convert

    max_new_tokens = 48
    plain = Completion.from_chunks(_stream(engines["plain"], prompt_ids, max_new_tokens))
    engine = engines[drafter]
    totals_before = (engine.totals.num_drafted, engine.totals.num_accepted_drafts)
    chunks = _stream(engine, prompt_ids, max_new_tokens)
    drafted = Completion.from_chunks(chunks)

    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text  # greedy: the target's own tokens
    usage = drafted.finish.usage
    assert usage.accepted_draft_tokens + usage.rejected_draft_tokens > 0
    assert 0 < usage.accepted_draft_tokens <= usage.completion_tokens == max_new_tokens
    assert (plain.finish.usage.accepted_draft_tokens, plain.finish.usage.rejected_draft_tokens) == (0, 0)
    # the step totals the replica exports as metrics count the same drafts
    assert engine.totals.num_drafted - totals_before[0] == usage.accepted_draft_tokens + usage.rejected_draft_tokens
    assert engine.totals.num_accepted_drafts - totals_before[1] == usage.accepted_draft_tokens
    assert engine.generator.cache_manager.num_in_use == 0

    # as gRPC carries them: the last message of a stream, and the unary response
    last = grpc_convert.chunk_to_proto(chunks[-1]).finish.usage
    unary = grpc_convert.completion_to_proto(drafted).finish.usage
    for message in (last, unary):
        assert message.accepted_draft_tokens == usage.accepted_draft_tokens
        assert message.rejected_draft_tokens == usage.rejected_draft_tokens
    assert grpc_convert.chunk_from_proto(grpc_convert.chunk_to_proto(chunks[-1])).finish.usage == usage


# --- GPU memory (arithmetic only: these sizes go to folio.Cache on a GPU) ----------------------------------------


def test_gpu_cache_size_leaves_room_for_the_draft_model(demo):
    from folio import Cache, activation_reserve_bytes
    from folio.serve import speculation

    model = demo.model
    page_bytes = Cache(model, num_tokens=16, page_size=16).bytes_per_page
    config = ServeConfig(num_gpus=1, page_size=16, max_batch_size=64, num_draft_tokens=4)
    plain = speculation.gpu_cache_size(config, model, None)
    assert plain == {"max_memory_fraction": 0.85, "reserve_bytes": activation_reserve_bytes(model, 64, None, 16)}

    # verify rows feed every draft: decode graphs (and steps) of up to 64 * (1 + 4) rows
    ngram = config.replace(ngram=True)
    assert speculation.target_rows_per_step(ngram) == 320
    assert speculation.target_rows_per_step(ngram.replace(max_batch_size=200)) == 512
    assert speculation.target_rows_per_step(ngram.replace(max_batch_size=600)) == 600
    assert speculation.gpu_cache_size(ngram, model, None)["reserve_bytes"] == activation_reserve_bytes(
        model, 320, None, 16)

    # a draft model as large as the target: each cache gets half the fraction, or its pages are set aside
    drafted = config.replace(draft_model_path="/models/draft")
    target_reserve = activation_reserve_bytes(model, 320, None, 16)
    draft_reserve = speculation.draft_reserve_bytes(drafted, model)
    split = speculation.gpu_cache_size(drafted, model, model)
    assert split == {"max_memory_fraction": pytest.approx(0.85 / 2), "reserve_bytes": target_reserve + draft_reserve}
    fixed = speculation.gpu_cache_size(drafted.replace(cache_tokens=4096), model, model)
    assert fixed == {"num_tokens": 4096, "reserve_bytes": target_reserve + draft_reserve + 256 * page_bytes}
