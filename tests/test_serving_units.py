"""The serving layer without a cluster: config validation, request validation, protobuf conversion, and the
replica's engine side (streaming, cancellation, queue full, draining) over the demo model."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from folio.serve.config import ConfigError, ServeConfig
from folio.serve.errors import InvalidRequest, Overloaded
from folio.serve.schema import Chunk, Completion, EngineRequest, Finish, GenerationRequest, ModelInfo, Sampling, Usage
from folio.serve.validation import to_engine_request

# --- config -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values, field", [
    ({"page_size": 24}, "page_size"),
    ({"page_size": 8}, "page_size"),
    ({"cache_tokens": 1000, "page_size": 16}, "cache_tokens"),
    ({"cache_tokens": 4096, "cache_memory_fraction": 0.5}, "cache_tokens / cache_memory_fraction"),
    ({"cache_memory_fraction": 1.5}, "cache_memory_fraction"),
    ({"cache_memory_fraction": 0.5, "num_gpus": 0}, "cache_memory_fraction"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"max_chunk_size": 100, "page_size": 16}, "max_chunk_size"),
    ({"max_queue_size": 0}, "max_queue_size"),
    ({"max_queued_requests": -1}, "max_queued_requests"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"num_gpus": -1}, "num_gpus"),
    ({"num_gpus": 1.5}, "num_gpus"),
    ({"grpc_port": 70000}, "grpc_port"),
    ({"grpc_port": 9000, "http_port": 9000}, "grpc_port / http_port"),
    ({"device": "tpu"}, "device"),
    ({"device": "cpu", "num_gpus": 1}, "device"),
    ({"device": "cuda", "num_gpus": 0}, "device"),
    ({"dtype": "int8"}, "dtype"),
    ({"router": "round_robin"}, "router"),
    ({"router_options": "[1, 2]"}, "router_options"),
    ({"routing_stats_period_s": 0}, "routing_stats_period_s"),
    ({"model_path": ""}, "model_path"),
    ({"app_name": "a/b"}, "app_name"),
    ({"stall_timeout_s": 0}, "stall_timeout_s"),
    ({"max_batch_size": "many"}, "max_batch_size"),
    ({"warmup": "maybe"}, "warmup"),
    ({"max_batch_size": 2.5}, "max_batch_size"),
    ({"num_gpus": float("nan")}, "num_gpus"),
    ({"weight_format": "int8"}, "weight_format"),
    ({"weight_format": "FP8"}, "weight_format"),
    ({"kv_format": "q3"}, "kv_format"),
    ({"kv_format": "bfloat16"}, "kv_format"),  # the dtype's ServeConfig name, not the format's
    ({"kv_format": "fp16", "dtype": "bfloat16"}, "kv_format"),  # an unquantized cache is in the model's dtype
    ({"kv_format": "q4h", "num_gpus": 1}, "kv_format"),  # no CUDA kernel
    ({"host_cache_bytes": -1}, "host_cache_bytes"),
    ({"host_cache_bytes": "64GiB"}, "host_cache_bytes"),
])
def test_config_rejects_invalid_values_naming_the_option(values, field):
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_dict(values)
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_config_format_refusals_list_the_valid_names():
    from folio.serve.config import KV_FORMATS, WEIGHT_FORMATS

    with pytest.raises(ConfigError) as kv:
        ServeConfig.from_dict({"kv_format": "int4"})
    assert all(name in str(kv.value) for name in KV_FORMATS) and "'int4'" in str(kv.value)
    with pytest.raises(ConfigError) as weights:
        ServeConfig.from_dict({"weight_format": "int8"})
    assert all(name in str(weights.value) for name in WEIGHT_FORMATS) and "'int8'" in str(weights.value)


def test_config_format_names_are_the_engines():
    """ServeConfig repeats the engine's format names (it imports no torch): they must stay equal."""
    import torch

    from folio import kv_formats
    from folio.model import fp8_checkpoint
    from folio.serve.config import KV_FORMAT_OF_DTYPE, KV_FORMATS, WEIGHT_FORMATS

    assert set(WEIGHT_FORMATS) == set(fp8_checkpoint.WEIGHT_FORMATS) - {None}
    assert set(KV_FORMATS) == set(kv_formats.UNQUANTIZED_DTYPES) | set(kv_formats.QUANTIZED_FORMATS)
    for dtype, short in KV_FORMAT_OF_DTYPE.items():
        assert kv_formats.UNQUANTIZED_DTYPES[short] == getattr(torch, dtype)


def test_config_accepts_formats_as_serve_run_passes_them():
    config = ServeConfig.from_dict({"num_gpus": "0", "kv_format": "q4h", "weight_format": "fp8",
                                    "host_cache_bytes": "1048576"})
    assert (config.kv_format, config.weight_format, config.host_cache_bytes) == ("q4h", "fp8", 1 << 20)
    unset = ServeConfig.from_dict({"kv_format": "none", "weight_format": "", "host_cache_bytes": "none"})
    assert (unset.kv_format, unset.weight_format, unset.host_cache_bytes) == (None, None, None)
    assert ServeConfig(kv_format="bf16", dtype="bfloat16").kv_format == "bf16"  # the model's dtype by name
    assert ServeConfig(host_cache_bytes=0).host_cache_bytes == 0  # off


def test_config_rejects_unknown_options():
    with pytest.raises(ConfigError, match="unknown option.*'page_sise'"):
        ServeConfig.from_dict({"page_sise": 16})


def test_config_converts_strings_as_serve_run_passes_them():
    config = ServeConfig.from_dict({"num_gpus": "0", "cache_tokens": "4096", "page_size": "16", "warmup": "false",
                                    "dtype": "none", "request_timeout_s": "30", "num_replicas": 3})
    assert config.num_gpus == 0.0 and config.cache_tokens == 4096 and config.page_size == 16
    assert config.warmup is False and config.dtype is None and config.request_timeout_s == 30.0
    assert config.resolved_device == "cpu"
    assert config.cache_size() == {"num_tokens": 4096}
    assert config.max_ongoing_requests == config.max_batch_size + config.max_queue_size


def test_config_cache_defaults_per_device():
    assert ServeConfig(num_gpus=0, page_size=16).cache_size() == {"num_tokens": 16384}
    assert ServeConfig(num_gpus=1).cache_size() == {"max_memory_fraction": 0.85}


def test_config_from_yaml_and_flags(tmp_path):
    import argparse

    path = tmp_path / "serve.yaml"
    path.write_text("model_path: /models/x\nnum_replicas: 4\npage_size: 64\n")
    parser = argparse.ArgumentParser()
    ServeConfig.add_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--num-replicas", "2", "--cache-tokens", "8192"])
    config = ServeConfig.from_args(args, num_gpus=0.0, num_replicas=9)
    assert (config.model_path, config.num_replicas, config.page_size, config.cache_tokens) == ("/models/x", 2, 64, 8192)
    assert config.num_gpus == 0.0
    gpu = ServeConfig.from_args(parser.parse_args(["--num-gpus", "1", "--cache-memory-fraction", "0.9"]),
                                num_gpus=0.0, cache_tokens=8192)
    assert (gpu.cache_tokens, gpu.cache_memory_fraction, gpu.resolved_device) == (None, 0.9, "cuda")
    path.write_text("page_size: 10\n")
    with pytest.raises(ConfigError, match=r"serve.yaml: page_size:"):
        ServeConfig.from_yaml(path)


def test_serve_flags_set_the_memory_formats(capsys):
    """`folio serve --weight-format/--kv-format/--host-cache-bytes/--host-write-through` reach ServeConfig over the
    demo defaults; a bad one is refused naming the option before anything starts (exit 2)."""
    from folio.serve import cli

    parser = cli._parser()
    args = parser.parse_args(["serve", "--weight-format", "fp8", "--kv-format", "q8", "--host-cache-bytes", "4096",
                              "--host-write-through", "true"])
    config = ServeConfig.from_args(args, **cli.DEMO_DEFAULTS)
    assert (config.weight_format, config.kv_format, config.host_cache_bytes) == ("fp8", "q8", 4096)
    assert config.host_write_through is True
    assert config.page_size == cli.DEMO_DEFAULTS["page_size"]  # the other defaults stay
    plain = ServeConfig.from_args(parser.parse_args(["serve"]), **cli.DEMO_DEFAULTS)
    assert (plain.weight_format, plain.kv_format, plain.host_cache_bytes) == (None, None, None)
    assert plain.host_write_through is False
    assert cli.main(["serve", "--kv-format", "q3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("folio serve: kv_format: must be one of bf16, fp16, fp32, fp8, q8, q4, q4h"), err
    assert cli.main(["serve", "--host-cache-bytes", "-5"]) == 2
    assert "folio serve: host_cache_bytes: must be >= 0" in capsys.readouterr().err


def test_the_tensor_parallel_all_reduce_reaches_every_rank_s_model_options(capsys):
    """`--tensor-parallel-all-reduce` is checked (a mode, and only with tensor parallelism) and reaches the
    EngineOptions every rank builds its model with."""
    from folio.serve import build, cli

    parser = cli._parser()
    args = parser.parse_args(["serve", "--tensor-parallel-size", "2", "--num-gpus", "0",
                              "--tensor-parallel-all-reduce", "nccl"])
    config = ServeConfig.from_args(args, **cli.DEMO_DEFAULTS)
    assert config.tensor_parallel_all_reduce == "nccl"
    assert build._model_kwargs(config)["options"].tp_all_reduce == "nccl"
    assert ServeConfig.from_args(parser.parse_args(["serve"]), **cli.DEMO_DEFAULTS).tensor_parallel_all_reduce == "auto"
    assert cli.main(["serve", "--tensor-parallel-all-reduce", "nvls"]) == 2
    assert "tensor_parallel_all_reduce: must be one of auto, peer, nccl" in capsys.readouterr().err
    assert cli.main(["serve", "--tensor-parallel-all-reduce", "peer"]) == 2  # one process: nothing to sum
    assert "applies to tensor_parallel_size > 1 only" in capsys.readouterr().err


def test_app_builder_and_serve_config():
    from ray.serve.schema import ServeDeploySchema

    from folio.serve.app import build_app, serve_config

    app = build_app({"num_gpus": "0", "cache_tokens": "4096", "page_size": "16", "num_replicas": "2"})
    assert app is not None
    schema = ServeDeploySchema.model_validate(serve_config(ServeConfig(num_gpus=0, cache_tokens=4096, page_size=16)))
    assert schema.grpc_options.grpc_servicer_functions == [
        "folio.serve.grpc_servicer.add_GenerationServicer_to_server"]


def test_app_builder_attaches_the_configured_router():
    from folio.router.policy import PolicyConfig
    from folio.router.ray_router import PrefixAwareRequestRouter
    from folio.serve.app import request_router_config

    config = ServeConfig(num_gpus=0, cache_tokens=4096, page_size=16, routing_stats_period_s=0.5,
                         router_options={"shortlist_size": 4})
    ours = request_router_config(config)
    assert ours.get_request_router_class() is PrefixAwareRequestRouter
    assert ours.request_router_kwargs == {"default_page_size": 16, "shortlist_size": 4}
    assert ours.request_routing_stats_period_s == 0.5
    PolicyConfig(**ours.request_router_kwargs)  # what initialize_state makes of them
    ray_prefix = request_router_config(config.replace(router="ray_prefix", router_options=None))
    assert ray_prefix.get_request_router_class().__name__ == "PrefixCacheAffinityRouter"
    assert ray_prefix.request_router_kwargs == {"imbalanced_threshold": 10}
    pow2 = request_router_config(config.replace(router="pow2", router_options=None))
    assert pow2.get_request_router_class().__name__ == "PowerOfTwoChoicesRequestRouter"
    from_strings = ServeConfig.from_dict({"num_gpus": "0", "router": "pow2", "router_options": '{"a": 1}'})
    assert (from_strings.router, from_strings.router_options) == ("pow2", {"a": 1})


# --- request validation -------------------------------------------------------------------------------------

INFO = ModelInfo(model_name="demo", architecture="LlamaForCausalLM", dtype="float32", vocab_size=1000,
                 max_seq_len=4096, page_size=16, num_pages=64, max_batch_size=8, num_replicas=1,
                 eos_token_ids=(1,), bos_token_id=0, add_bos_token=True)


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from folio.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(demo_dir)


@pytest.mark.parametrize("request_, field", [
    (GenerationRequest(), "prompt"),
    (GenerationRequest(text="a", token_ids=[5]), "prompt"),
    (GenerationRequest(text=""), "text"),
    (GenerationRequest(token_ids=[]), "token_ids"),
    (GenerationRequest(token_ids=[5, 1000]), "token_ids"),
    (GenerationRequest(token_ids=[5, -1]), "token_ids"),
    (GenerationRequest(text="a", max_new_tokens=0), "max_new_tokens"),
    (GenerationRequest(text="a", max_new_tokens=-3), "max_new_tokens"),
    (GenerationRequest(text="a", min_new_tokens=-1), "min_new_tokens"),
    (GenerationRequest(text="a", max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
    (GenerationRequest(token_ids=[5] * 1024), "prompt"),  # the cache holds 64 pages of 16 = 1024 tokens
    (GenerationRequest(token_ids=[5] * 1000, max_new_tokens=100), "max_new_tokens"),
    (GenerationRequest(text="a", sampling=Sampling(temperature=-0.1)), "temperature"),
    (GenerationRequest(text="a", sampling=Sampling(temperature=math.inf)), "temperature"),
    (GenerationRequest(text="a", sampling=Sampling(top_k=-1)), "top_k"),
    (GenerationRequest(text="a", sampling=Sampling(top_p=1.5)), "top_p"),
    (GenerationRequest(text="a", sampling=Sampling(min_p=-0.5)), "min_p"),
    (GenerationRequest(text="a", sampling=Sampling(repetition_penalty=0.0)), "repetition_penalty"),
    # past the engine's bounds (folio.SAMPLER_LIMITS): refused at the ingress, not inside the replica
    (GenerationRequest(text="a", sampling=Sampling(temperature=1e5)), "temperature"),
    (GenerationRequest(text="a", sampling=Sampling(repetition_penalty=1e5)), "repetition_penalty"),
    (GenerationRequest(text="a", sampling=Sampling(presence_penalty=-1e308)), "presence_penalty"),
    (GenerationRequest(text="a", sampling=Sampling(frequency_penalty=1e5)), "frequency_penalty"),
    (GenerationRequest(text="a", sampling=Sampling(top_k=2**31)), "top_k"),
    (GenerationRequest(text="a", sampling=Sampling(token_bias={5: 1e308})), "token_bias"),
    (GenerationRequest(text="a", sampling=Sampling(repetition_range=-2)), "repetition_range"),
    (GenerationRequest(text="a", sampling=Sampling(repetition_decay=-1)), "repetition_decay"),
    (GenerationRequest(text="a", sampling=Sampling(token_bias={5000: 1.0})), "token_bias"),
    (GenerationRequest(text="a", sampling=Sampling(token_bias={5: math.nan})), "token_bias"),
    # no token left to sample: every one banned, or all but the stop tokens while min_new_tokens blocks them
    (GenerationRequest(text="a", sampling=Sampling(token_bias=dict.fromkeys(range(1000), -math.inf))), "token_bias"),
    (GenerationRequest(text="a", min_new_tokens=2,
                       sampling=Sampling(token_bias=dict.fromkeys(range(2, 1000), -math.inf) | {0: -math.inf})),
     "token_bias"),
    (GenerationRequest(text="a", min_new_tokens=1, stop_on_eos=False, stop_token_ids=[7],
                       sampling=Sampling(token_bias={t: -math.inf for t in range(1000) if t != 7})), "token_bias"),
    (GenerationRequest(text="a", stop_strings=[""]), "stop_strings"),
    (GenerationRequest(text="a", stop_token_ids=[1000]), "stop_token_ids"),
    (GenerationRequest(text="a", seed=-1), "seed"),
    (GenerationRequest(text="a", return_top_tokens=65), "return_top_tokens"),
    (GenerationRequest(token_ids=[5], add_bos=True), "add_bos"),
])
def test_invalid_requests_name_the_field(tokenizer, request_, field):
    with pytest.raises(InvalidRequest) as info:
        to_engine_request(request_, tokenizer, INFO)
    assert info.value.field == field
    assert str(info.value).startswith(field + ": ")


def test_requests_at_the_engine_bounds_build_sampler_settings(tokenizer):
    """What the ingress lets through, the engine's SamplerSettings accepts: the two check the same bounds."""
    import folio

    limits = folio.SAMPLER_LIMITS
    sampling = Sampling(temperature=limits.max_temperature, top_k=limits.max_int32,
                        repetition_penalty=limits.min_repetition_penalty, presence_penalty=-limits.max_logit_offset,
                        frequency_penalty=limits.max_logit_offset, repetition_range=limits.max_int32,
                        token_bias={3: -limits.max_logit_offset, 4: -math.inf})
    engine = to_engine_request(GenerationRequest(text="a", sampling=sampling), tokenizer, INFO)
    folio.SamplerSettings(**engine.sampler)


def test_valid_request_becomes_an_engine_request(tokenizer):
    request = GenerationRequest(text="Once upon a time", max_new_tokens=5, stop_strings=["\n"],
                                stop_token_ids=[7], sampling=Sampling(temperature=0.5, top_p=0.9, token_bias={3: -1}))
    engine = to_engine_request(request, tokenizer, INFO, "r1")
    assert engine.input_ids == tuple(tokenizer.encode("Once upon a time", add_bos=True))
    assert engine.stop_conditions == (1, 7, "\n")  # EOS first, then the request's own stops
    assert engine.sampler == {"temperature": 0.5, "top_p": 0.9, "token_bias": {3: -1}}
    assert engine.request_id == "r1"
    plain = to_engine_request(GenerationRequest(token_ids=[5, 6]), tokenizer, INFO)
    assert plain.stop_conditions is None and plain.input_ids == (5, 6)
    no_eos = to_engine_request(GenerationRequest(token_ids=[5], stop_on_eos=False), tokenizer, INFO)
    assert no_eos.stop_conditions == ()


def test_proto_round_trip():
    from folio.serve import grpc_convert

    request = GenerationRequest(text="hi", max_new_tokens=7, min_new_tokens=2, stop_strings=("x",),
                                stop_token_ids=(3,), stop_on_eos=False, seed=2**63 + 5, add_bos=False,
                                return_probs=True, return_top_tokens=2,
                                sampling=Sampling(temperature=0.0, top_k=1, token_bias={4: -2.5}))
    assert grpc_convert.request_from_proto(grpc_convert.request_to_proto(request)) == request
    ids_request = GenerationRequest(token_ids=[1, 2, 3])
    assert grpc_convert.request_from_proto(grpc_convert.request_to_proto(ids_request)) == ids_request
    from folio.results import EosReason

    chunk = Chunk(text="ab", token_ids=[1, 2], token_probs=[0.5, 0.25],
                  finish=Finish(EosReason.STOP_STRING, stop_string="x", usage=Usage(3, 1, 2, 1, 4)))
    assert grpc_convert.chunk_from_proto(grpc_convert.chunk_to_proto(chunk)) == chunk


def test_failures_below_the_ingress_map_to_statuses():
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import BackPressureError

    from folio.serve.errors import InternalError, ReplicaUnavailable
    from folio.serve.failures import as_request_error

    wrapped = RayTaskError("generate", "Traceback (most recent call last): ...", Overloaded("queue is full"))
    assert isinstance(as_request_error(wrapped, "r"), Overloaded)
    invalid = as_request_error(RayTaskError("generate", "Traceback", InvalidRequest("top_p", "bad")), "r")
    assert (invalid.status, invalid.field, str(invalid)) == ("INVALID_ARGUMENT", "top_p", "top_p: bad")
    assert as_request_error(BackPressureError(3, 2), "r").status == "RESOURCE_EXHAUSTED"
    assert isinstance(as_request_error(ActorDiedError(), "r"), ReplicaUnavailable)
    internal = as_request_error(RayTaskError("generate", "Traceback (most recent call last): ...",
                                             ZeroDivisionError("x")), "req-7")
    assert isinstance(internal, InternalError) and "Traceback" not in str(internal) and "req-7" in str(internal)


def test_internal_errors_always_name_a_request_id(caplog):
    """Where Serve has no request id (outside a request context, a handle call that set none), the ingress makes
    one: the INTERNAL message and the log line that holds the real exception name the same one."""
    import re

    from ray.exceptions import RayTaskError

    from folio.serve.failures import as_request_error, current_request_id

    assert current_request_id() and current_request_id() != current_request_id()
    with caplog.at_level("ERROR", logger="folio.serve.failures"):
        internal = as_request_error(RayTaskError("generate", "Traceback", ZeroDivisionError("x")), "")
    match = re.search(r"request id (\S+)$", str(internal))
    assert match and match.group(1) not in ("''", ""), str(internal)
    assert any(match.group(1) in record.getMessage() and record.exc_info for record in caplog.records)


def test_proto_without_prompt_is_invalid():
    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.serve import grpc_convert

    with pytest.raises(InvalidRequest, match="^prompt: "):
        grpc_convert.request_from_proto(pb.GenerateRequest(max_new_tokens=3))


# --- the replica's engine side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(demo_dir):
    from folio.serve.engine import Engine

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=1024, page_size=16, max_batch_size=2,
                         max_queue_size=1, warmup=False)
    engine = Engine.build(config)
    yield engine
    asyncio.run(engine.close(drain_timeout_s=1))


def _request(n: int, prompt=(0, 42, 71, 277, 81), **kw) -> EngineRequest:
    return EngineRequest(input_ids=tuple(prompt), max_new_tokens=n, stop_conditions=(),
                         sampler={"temperature": 0.0, "top_k": 1}, **kw)


def test_engine_streams_exact_lengths(engine):
    async def run():
        job = engine.start_job(_request(12))
        return [c async for c in engine.stream(job, time.monotonic())]

    chunks = asyncio.run(run())
    completion = Completion.from_chunks(chunks)
    assert len(completion.token_ids) == 12
    assert completion.finish.usage.completion_tokens == 12
    assert completion.finish.usage.prompt_tokens == 5
    assert engine.generator.cache_manager.num_in_use == 0
    # the step totals the replica publishes as metrics saw every token of it
    assert engine.totals.num_sampled >= 12 and engine.totals.num_steps >= 12


def test_engine_stream_paced_sends_fewer_messages_with_the_same_tokens(engine, monkeypatch):
    """A replica bounding its streamed messages per second (folio.serve.pacing): the first tokens go at once, later
    messages carry what came while the stream waited its turn; the tokens and the finish are those of an unpaced
    stream (greedy)."""
    from folio.serve.pacing import StreamPacer

    async def run():
        job = engine.start_job(_request(40))
        start = time.monotonic()
        chunks = [(time.monotonic(), c) async for c in engine.stream(job, time.monotonic())]
        return chunks, time.monotonic() - start

    unpaced, _ = asyncio.run(run())
    monkeypatch.setattr(engine, "pacer", StreamPacer(max_messages_per_s=20.0))  # one stream: 50 ms apart
    paced, elapsed_s = asyncio.run(run())
    assert engine.pacer.num_streams == 0  # (the stream left the count when it ended)
    tokens = [Completion.from_chunks([c for _, c in chunks]).token_ids for chunks in (unpaced, paced)]
    assert len(tokens[0]) == 40 and tokens[1] == tokens[0]
    assert len(paced[0][1].token_ids) >= 1  # the first message: not held
    gaps = [b - a for (a, _), (b, chunk) in zip(paced[1:], paced[2:]) if not chunk.finish]
    assert all(gap >= 0.045 for gap in gaps), gaps  # (the finish is never held: it may come sooner)
    assert len(paced) <= 2 + elapsed_s / 0.05 and len(paced) < len(unpaced)


def test_stream_pacer_interval_grows_with_the_streams_open():
    from folio.serve.pacing import StreamPacer

    pacer = StreamPacer(max_messages_per_s=1000.0)
    assert pacer.interval_s() == 0.0 and pacer.hold_s(None) == 0.0
    with pacer.stream(), pacer.stream():
        assert pacer.interval_s() == pytest.approx(0.002)
        assert 0.0 < pacer.hold_s(time.monotonic()) <= 0.002
        assert pacer.hold_s(time.monotonic() - 1.0) == 0.0 and pacer.hold_s(None) == 0.0
    assert pacer.num_streams == 0
    assert StreamPacer(0.0).hold_s(time.monotonic()) == 0.0  # no bound


def test_engine_routing_digest_lists_the_prompt_pages(engine):
    """The engine's report carries its pool's routing keys (folio.router.keys: at 16-token pages, the page ending at
    token 64 carries one): a router that applies it holds the prompt's keys, and a second report carries the next
    batch."""
    from folio.hashing import page_hashes
    from folio.router.digest import page_keys, parse_digest
    from folio.router.index import PrefixIndex
    from folio.router.keys import KeyGeometry

    prompt = tuple(range(3, 3 + 72))  # 4 full pages of 16 and 8 tokens
    received_before = engine.num_received  # (the engine is shared by this module's tests)

    async def run():
        job = engine.start_job(_request(4, prompt=prompt))
        [c async for c in engine.stream(job, time.monotonic())]
        return [await engine.routing_digest(epoch=epoch, instance_id="x") for epoch in (7, 8)]

    first, second = (parse_digest(stats) for stats in asyncio.run(run()))
    assert (first.epoch, first.instance_id, first.page_size, first.max_running) == (7, "x", 16, 2)
    assert first.block_tokens == engine.config.routing_block_tokens
    geometry = KeyGeometry(16, first.block_tokens, first.dense_tokens, first.dense_key_tokens)
    all_keys = page_keys(page_hashes(list(prompt), 16))
    keys = {all_keys[depth] for depth in geometry.depths(len(all_keys))}
    assert len(keys) == 1  # page 3's
    assert first.snapshot is not None and keys <= set(first.snapshot.keys)
    assert first.num_running == first.num_queued == first.num_prefill_tokens == 0
    assert first.num_received == received_before + 1  # the job above: routers tell their share of traffic from it
    assert first.num_pages == 64 and first.num_allocatable_pages == 64
    assert first.prefill_tokens_per_s > 0 and first.decode_step_s > 0  # measured on the job's steps
    assert second.epoch == 8 and second.seq == first.seq + 1 and second.batches[-1].seq == second.seq
    index = PrefixIndex(clock=time.monotonic)
    for digest in (first, second):
        assert index.report("replica", digest)
    assert keys <= index.held_keys("replica") and index.is_synced("replica")


def test_engine_stream_closed_early_cancels_the_job(engine):
    async def run():
        job = engine.start_job(_request(500))
        stream = engine.stream(job, time.monotonic())
        seen = 0
        async for chunk in stream:
            seen += len(chunk.token_ids)
            if seen >= 3:
                break
        in_use_while_running = engine.generator.cache_manager.num_in_use
        await stream.aclose()
        return in_use_while_running

    assert asyncio.run(run()) > 0
    assert engine.generator.cache_manager.num_in_use == 0
    assert engine.num_remaining == 0


def test_engine_refuses_a_job_with_nothing_to_sample_naming_the_field(engine):
    """Past the ingress (an older one, or the engine's API): the engine's enqueue-time check refuses a token_bias
    that bans every token, as INVALID_ARGUMENT under the API's field name."""
    request = EngineRequest(input_ids=(0, 42, 71), max_new_tokens=4, stop_conditions=(),
                            sampler={"token_bias": dict.fromkeys(range(1000), -math.inf)})

    async def start():
        engine.start_job(request)

    with pytest.raises(InvalidRequest) as info:
        asyncio.run(start())
    assert info.value.field == "token_bias" and "nothing is left to sample" in str(info.value)
    assert engine.num_remaining == 0


def test_engine_queue_full_is_overloaded(engine):
    async def run():
        jobs = []
        with pytest.raises(Overloaded, match="queue is full"):
            for _ in range(10):  # batch of 2 + a queue of 1: the fourth at the latest is refused
                jobs.append(engine.start_job(_request(200)))
        assert 1 <= len(jobs) <= 3
        for job in jobs:
            await job.cancel()

    asyncio.run(run())
    assert engine.num_remaining == 0


def _page_bytes(model, page_size: int, bytes_per_head_token: int) -> int:
    """K and V of every layer and kv head, by hand."""
    cfg = model.config
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * bytes_per_head_token


def test_model_info_reports_the_unquantized_cache(engine):
    info, cfg = engine.info, engine.model.config
    assert (info.weight_format, info.kv_format) == ("dense", "fp32")  # the demo model's float32
    assert info.bytes_per_page == _page_bytes(engine.model, 16, cfg.head_dim * 4)
    assert (info.num_host_pages, info.host_cache_bytes) == (0, 0)  # no host tier on a CPU unless asked


def test_engine_builds_the_memory_formats_it_is_configured_with(demo_dir):
    """weight_format, kv_format and host_cache_bytes reach the model, the cache and the generator: ModelInfo (and
    its proto) report them, and a prompt evicted from the small GPU cache comes back from the host tier, generating
    what it generated the first time; without the tier it is computed again."""
    import dataclasses

    from folio.serve import grpc_convert
    from folio.serve.engine import Engine

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=128, page_size=16, max_batch_size=2,
                         warmup=False, weight_format="fp8", kv_format="q8", host_cache_bytes=1 << 20,
                         host_write_through=True)
    engine = Engine.build(config)
    info, cfg = engine.info, engine.model.config
    # q8: a byte per element plus a float16 scale per 32 elements
    page_bytes = _page_bytes(engine.model, 16, cfg.head_dim + 2 * (cfg.head_dim // 32))
    assert (info.weight_format, info.kv_format, info.bytes_per_page, info.num_pages) == ("fp8", "q8", page_bytes, 8)
    assert info.num_host_pages == (1 << 20) // page_bytes > 0
    assert info.host_cache_bytes == info.num_host_pages * page_bytes
    assert info.host_write_through and engine.generator.host_write_through
    message = grpc_convert.model_info_to_proto(info)
    assert (message.weight_format, message.kv_format, message.bytes_per_page) == ("fp8", "q8", page_bytes)
    assert grpc_convert.model_info_from_proto(message) == dataclasses.replace(info, max_seq_len=info.max_request_tokens)

    prompt_a, prompt_b = tuple(range(2, 102)), tuple(range(300, 400))  # 6 full pages each: B evicts A's

    async def run(engine):
        completions = []
        for prompt in (prompt_a, prompt_b, prompt_a):
            job = engine.start_job(_request(4, prompt=prompt))
            completions.append(Completion.from_chunks([c async for c in engine.stream(job, time.monotonic())]))
        await engine.routing_digest(1, "test")  # takes the cache's stats on the engine thread
        await engine.close(drain_timeout_s=1)
        return completions

    first_a, _, again_a = asyncio.run(run(engine))
    assert again_a.finish.usage.cached_tokens == 96 and again_a.token_ids == first_a.token_ids
    stats = engine.cache_stats
    assert 1 <= stats.num_host_hit_pages <= stats.num_pages_from_host <= stats.num_pages_to_host
    without = Engine.build(config.replace(host_cache_bytes=0))
    assert without.info.num_host_pages == 0
    _, _, recomputed_a = asyncio.run(run(without))
    assert recomputed_a.token_ids == first_a.token_ids and without.cache_stats.num_pages_to_host == 0
    # the pages that the GPU cache lost are the ones that came back from the host
    num_lost_pages = (96 - recomputed_a.finish.usage.cached_tokens) // 16
    assert num_lost_pages >= 1 and stats.num_host_hit_pages == num_lost_pages


def test_gpu_cache_sizing_splits_memory_by_the_kv_formats_page_bytes(engine):
    """With a draft model, a cache_memory_fraction is split in proportion to the two caches' page bytes: the
    target's in its kv_format, the draft's (unquantized) in its dtype."""
    from folio.serve import speculation

    model = engine.model
    config = ServeConfig(model_path="unused", num_gpus=1, cache_memory_fraction=0.5, page_size=16, kv_format="q8")
    target = _page_bytes(model, 16, model.config.head_dim + 2 * (model.config.head_dim // 32))
    draft = _page_bytes(model, 16, model.config.head_dim * 4)
    size = speculation.gpu_cache_size(config, model, draft_model=model)
    assert size["max_memory_fraction"] == pytest.approx(0.5 * target / (target + draft))
    plain = speculation.gpu_cache_size(config.replace(kv_format=None), model, draft_model=model)
    assert plain["max_memory_fraction"] == pytest.approx(0.25)


def test_engine_close_lets_running_jobs_finish(demo_dir):
    from folio.serve.engine import Engine

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=512, page_size=16, warmup=False)
    engine = Engine.build(config)

    async def run():
        job = engine.start_job(_request(40))
        consumer = asyncio.ensure_future(_collect(engine.stream(job, time.monotonic())))
        await asyncio.sleep(0.01)
        await engine.close(drain_timeout_s=30)
        return await consumer

    completion = Completion.from_chunks(asyncio.run(run()))
    assert completion.finish.usage.completion_tokens == 40


async def _collect(stream):
    return [chunk async for chunk in stream]


@pytest.mark.parametrize("max_chunk_size", [2048, 640])
def test_engine_timings_count_prefill_from_the_first_prompt_chunk(demo_dir, max_chunk_size):
    """A lone job on an idle engine waits for nothing: its queued_s is small next to its prefill_s, whether the
    prompt goes in one step or in several (1251 tokens in chunks of 640: two steps), and queued_s + prefill_s +
    generate_s make up about the whole time."""
    from folio.serve.engine import Engine

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=2048, page_size=16, warmup=False,
                         max_chunk_size=max_chunk_size)
    engine = Engine.build(config)

    async def run():
        await engine.routing_digest(0, "x")  # the engine thread is up and idle
        arrival_s = time.monotonic()
        job = engine.start_job(_request(8, prompt=[(7 * i) % 997 + 2 for i in range(1251)]))
        return Completion.from_chunks([chunk async for chunk in engine.stream(job, arrival_s)])

    try:
        completion = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        asyncio.run(engine.close(drain_timeout_s=1))
    timings = completion.finish.timings
    assert completion.finish.usage.prompt_tokens == 1251 and completion.finish.usage.completion_tokens == 8
    assert timings.prefill_s > 0 and timings.queued_s < 0.2 * timings.prefill_s, timings
    parts = timings.queued_s + timings.prefill_s + timings.generate_s
    assert 0.5 * timings.total_s <= parts <= timings.total_s * 1.01 + 0.01, timings


def test_check_health_detects_a_stalled_engine():
    from folio.serve.generator import Generator

    cls = Generator.func_or_class
    replica = cls.__new__(cls)
    replica.config = ServeConfig(num_gpus=0, stall_timeout_s=5)
    replica.engine = SimpleNamespace(is_alive=True, num_remaining=2, last_progress_time=time.monotonic() - 60)
    replica._last_enqueue_s = time.monotonic() - 60
    with pytest.raises(RuntimeError, match="no progress"):
        replica.check_health()
    replica.engine.num_remaining = 0  # idle is healthy however long ago the last step was
    replica.check_health()
    replica.engine.num_remaining = 2
    replica._last_enqueue_s = time.monotonic()  # work just arrived
    replica.check_health()
    replica.engine.is_alive = False
    with pytest.raises(RuntimeError, match="dead"):
        replica.check_health()


def test_check_health_counts_jobs_not_engine_calls(demo_dir):
    """Routing-stats calls (run_in_engine) waiting behind a busy engine thread are not jobs: an idle replica whose
    last step is long past stays healthy while they wait. A job enqueued while the engine thread is blocked is a
    stall."""
    import threading

    from folio.serve.engine import Engine
    from folio.serve.generator import Generator

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=512, page_size=16, warmup=False,
                         stall_timeout_s=0.5)
    engine = Engine.build(config)
    cls = Generator.func_or_class
    replica = cls.__new__(cls)
    replica.config, replica.engine, replica._last_enqueue_s = config, engine, time.monotonic()
    entered, release = threading.Event(), threading.Event()

    def block(generator):
        entered.set()
        release.wait(60)

    async def run():
        blocked = asyncio.ensure_future(engine.runner.run_in_engine(block))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        digests = [asyncio.ensure_future(engine.routing_digest(epoch, "x")) for epoch in range(3)]
        await asyncio.sleep(1.0)  # past stall_timeout_s, with the engine thread inside a call and 3 more waiting
        assert engine.num_remaining == 0
        replica.check_health()
        job = engine.start_job(_request(4))
        replica._last_enqueue_s = time.monotonic()
        await asyncio.sleep(1.0)
        assert engine.num_remaining == 1
        with pytest.raises(RuntimeError, match="no progress for .* with 1 jobs"):
            replica.check_health()
        release.set()
        await blocked
        assert len(await asyncio.gather(*digests)) == 3
        completion = Completion.from_chunks([chunk async for chunk in engine.stream(job, time.monotonic())])
        replica.check_health()
        return completion

    try:
        completion = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        release.set()
        asyncio.run(engine.close(drain_timeout_s=1))
    assert completion.finish.usage.completion_tokens == 4


# --- the proxy-side servicer wrapper ------------------------------------------------------------------------


class _FakeGrpcContext:
    def __init__(self):
        self.done_callbacks = []

    def peer(self):
        return "ipv4:127.0.0.1:5"

    def peer_identities(self):
        return None

    def peer_identity_key(self):
        return None

    def auth_context(self):
        return {}

    def invocation_metadata(self):
        return (("application", "folio"),)

    def add_done_callback(self, callback):
        self.done_callbacks.append(callback)


def _slow_handler(events):
    async def handler(request, context):
        assert context.peer() == "ipv4:127.0.0.1:5" and context.invocation_metadata()[0][0] == "application"
        try:
            for i in range(1000):
                await asyncio.sleep(0.005)  # the proxy waiting for the replica's next result
                yield i
        except asyncio.CancelledError:
            events.append("cancelled in an await")  # where Ray's proxy cancels the request it sent
            raise
        except GeneratorExit:
            events.append("closed at a yield")  # where Ray's proxy loses the cancellation
            raise

    return handler


@pytest.mark.parametrize("how", ["aclose", "rpc_done"])
def test_decoupled_proxy_handler_is_always_cancelled_inside_an_await(how):
    from folio.serve.grpc_servicer import decoupled

    events: list[str] = []

    async def run():
        context = _FakeGrpcContext()
        stream = decoupled(_slow_handler(events))("request", context)
        received = [await stream.__anext__() for _ in range(3)]
        if how == "aclose":
            await stream.aclose()  # grpc closes the handler at its yield when a write was cancelled
        else:
            for callback in context.done_callbacks:
                callback(context)  # the RPC ended while nobody iterated the stream
        await asyncio.sleep(0.05)
        return received

    assert asyncio.run(run()) == [0, 1, 2]
    assert events == ["cancelled in an await"]


def test_snapshot_context_never_reads_the_call_after_the_rpc():
    from folio.serve.grpc_servicer import SnapshotContext

    context = _FakeGrpcContext()
    snapshot = SnapshotContext(context)
    context.peer = None  # a released call: reading it would crash
    assert snapshot.peer() == "ipv4:127.0.0.1:5" and snapshot.auth_context() == {}
    assert snapshot.invocation_metadata() == (("application", "folio"),)


def test_malformed_request_bytes_are_invalid_argument():
    """Bytes that do not parse as the method's message, sent to Serve's gRPC server (the proxy's: gRPCGenericServer
    with a handler factory, here one that echoes), end with INVALID_ARGUMENT "malformed request: ...", not grpc's
    UNKNOWN naming a Python class; the handler never sees them. Well-formed requests go through as before."""
    from unittest.mock import Mock

    import grpc
    from fakes import free_port
    from ray.serve._private.grpc_util import gRPCGenericServer
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.serve.grpc_servicer import add_GenerationServicer_to_server

    seen = []

    def factory(service_method, streaming_type):
        if streaming_type == gRPCStreamingType.UNARY_STREAM:
            async def stream(request, context):
                seen.append(request)
                yield request.SerializeToString()
            return stream

        async def unary(request, context):
            seen.append(request)
            return request.SerializeToString()
        return unary

    async def run():
        server = gRPCGenericServer(factory)
        add_GenerationServicer_to_server(Mock(), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        results = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                unary = channel.unary_unary("/folio.v1.Generation/GenerateUnary")
                stream = channel.unary_stream("/folio.v1.Generation/Generate")
                for name, call in (("unary", lambda b: unary(b, timeout=10)),
                                   ("stream", lambda b: _drain(stream(b, timeout=10)))):
                    try:
                        await call(b"\xff\xff\xff\xff")
                        results[name] = ("OK", "")
                    except grpc.aio.AioRpcError as error:
                        results[name] = (error.code(), error.details())
                good = pb.GenerateRequest(text="hi", max_new_tokens=3).SerializeToString()
                results["good"] = (await unary(good, timeout=10), await _drain(stream(good, timeout=10)))
        finally:
            await server.stop(None)
        return results

    results = asyncio.run(asyncio.wait_for(run(), 60))
    for name in ("unary", "stream"):
        code, details = results[name]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, results[name]
        assert details.startswith("malformed request: ") and "<class" not in details, details
    good = pb.GenerateRequest(text="hi", max_new_tokens=3).SerializeToString()
    assert results["good"] == (good, [good])
    assert [type(r) for r in seen] == [pb.GenerateRequest, pb.GenerateRequest]


async def _drain(call):
    return [message async for message in call]


# --- metrics -----------------------------------------------------------------------------------------------


class _FakeMetric:
    def __init__(self, name, description="", tag_keys=(), boundaries=None):
        self.name, self.values, self.tag_keys = name, [], tuple(tag_keys)

    def set_default_tags(self, tags):
        return self

    def set(self, value, tags=None):
        self.values.append(value)

    def inc(self, value=1.0, tags=None):
        self.values.append((value, dict(tags or {})))

    observe = set


@pytest.fixture
def fake_ray_metrics(monkeypatch):
    from folio.serve import metrics

    made = {}

    def make(name, **kwargs):
        made[name] = _FakeMetric(name, **kwargs)
        return made[name]

    monkeypatch.setattr(metrics, "metrics", SimpleNamespace(Counter=make, Gauge=make, Histogram=make))
    return made


def test_every_routing_stats_poll_sets_every_gauge_again(fake_ray_metrics):
    """Ray's metrics agent drops a gauge not reported for two export intervals: each poll (every second) sets every
    gauge again, the hit rate (set when a request ends) included, so an idle replica's gauges never vanish."""
    from folio.serve.engine import StepTotals
    from folio.serve.generator import Generator
    from folio.serve.metrics import GeneratorMetrics

    cls = Generator.func_or_class
    replica = cls.__new__(cls)
    replica.config, replica.epoch, replica.instance_id = ServeConfig(num_gpus=0), 0, "x"
    replica.metrics = GeneratorMetrics("app", "r1")
    digest = {"num_pages": 64, "num_allocatable_pages": 60, "num_free_pages": 50}

    async def routing_digest(epoch, instance_id):
        return digest

    replica.engine = SimpleNamespace(routing_digest=routing_digest, totals=StepTotals(num_running=1), cache_stats=None)
    replica.adapters = SimpleNamespace(sync=lambda: asyncio.sleep(0))  # no LoRA registry to follow here
    replica.metrics.record_job(prompt_tokens=100, cached_tokens=40, generated_tokens=5)
    gauges = {name: m for name, m in fake_ray_metrics.items() if name in (
        "folio_prefix_cache_hit_rate", "folio_pages_in_use", "folio_pages_cached", "folio_pages_total",
        "folio_engine_running_jobs", "folio_engine_waiting_jobs")}
    for _ in range(3):  # idle polls: no request ends between them
        for gauge in gauges.values():
            gauge.values.clear()
        asyncio.run(replica.record_routing_stats())
        assert {name: g.values[-1:] for name, g in gauges.items()} == {
            "folio_prefix_cache_hit_rate": [0.4], "folio_pages_in_use": [4], "folio_pages_cached": [10],
            "folio_pages_total": [64], "folio_engine_running_jobs": [1], "folio_engine_waiting_jobs": [0]}
    assert not fake_ray_metrics["folio_engine_draft_acceptance_rate"].values  # never drafted: never exported


def test_host_tier_metrics(fake_ray_metrics):
    """The replica's formats and host tier size are gauges set at start (and on every poll); the host tier's
    counters grow by what the prefix cache's running totals grew since the last poll."""
    from folio.cache.reports import PrefixCacheStats
    from folio.serve.engine import StepTotals
    from folio.serve.generator import Generator
    from folio.serve.metrics import GeneratorMetrics

    cls = Generator.func_or_class
    replica = cls.__new__(cls)
    replica.config, replica.epoch, replica.instance_id = ServeConfig(num_gpus=0), 0, "x"
    replica.metrics = GeneratorMetrics("app", "r1")
    info = SimpleNamespace(weight_format="fp8", kv_format="q8", bytes_per_page=8704, num_host_pages=120,
                           host_cache_bytes=120 * 8704)
    replica.metrics.record_formats(info)
    gauges = {name: fake_ray_metrics[name] for name in (
        "folio_replica_format_info", "folio_kv_page_bytes", "folio_host_tier_pages", "folio_host_tier_bytes")}
    assert {name: g.values for name, g in gauges.items()} == {
        "folio_replica_format_info": [1], "folio_kv_page_bytes": [8704], "folio_host_tier_pages": [120],
        "folio_host_tier_bytes": [120 * 8704]}
    assert fake_ray_metrics["folio_replica_format_info"].tag_keys == ("app", "replica", "weight_format", "kv_format")

    async def routing_digest(epoch, instance_id):
        return {"num_pages": 8, "num_allocatable_pages": 8, "num_free_pages": 8}

    replica.engine = SimpleNamespace(routing_digest=routing_digest, totals=StepTotals(), cache_stats=None)
    replica.adapters = SimpleNamespace(sync=lambda: asyncio.sleep(0))
    polls = [PrefixCacheStats(0, 0, 0, 0, 0, num_host_hit_pages=5, num_pages_to_host=10, num_pages_from_host=6,
                              num_copies_to_host=20),
             PrefixCacheStats(0, 0, 0, 0, 0, num_host_hit_pages=5, num_pages_to_host=10, num_pages_from_host=6,
                              num_copies_to_host=20),
             PrefixCacheStats(0, 0, 0, 0, 0, num_host_hit_pages=7, num_pages_to_host=13, num_pages_from_host=9,
                              num_copies_to_host=24)]
    for stats in [None, *polls]:
        replica.engine.cache_stats = stats
        asyncio.run(replica.record_routing_stats())
    counted = {name: [value for value, _ in fake_ray_metrics[name].values] for name in (
        "folio_host_tier_pages_to_host_total", "folio_host_tier_pages_from_host_total",
        "folio_prefix_cache_host_hit_pages_total", "folio_host_tier_copies_to_host_total")}
    assert counted == {"folio_host_tier_pages_to_host_total": [10.0, 3.0],
                       "folio_host_tier_copies_to_host_total": [20.0, 4.0],
                       "folio_host_tier_pages_from_host_total": [6.0, 3.0],
                       "folio_prefix_cache_host_hit_pages_total": [5.0, 2.0]}
    assert gauges["folio_host_tier_pages"].values[-1] == 120  # refreshed on every poll


def test_requests_refused_at_the_ingress_are_counted(fake_ray_metrics):
    """Refusals that reach folio's code are counted in folio_requests_total with their status: the ingress's
    admission bound and Serve's bound on the generator replicas (RESOURCE_EXHAUSTED), a message that does not
    convert (INVALID_ARGUMENT)."""
    from ray.serve.exceptions import BackPressureError

    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.serve.admission import Admission
    from folio.serve.failures import as_request_error
    from folio.serve.ingress import Ingress
    from folio.serve.metrics import IngressMetrics

    cls = Ingress.func_or_class
    ingress = cls.__new__(cls)
    ingress._metrics = IngressMetrics("app")
    ingress._admission = Admission(1)
    ingress._admission.in_flight = 1  # at its bound

    async def refused_below(request, start_s, stream=True):
        raise as_request_error(BackPressureError(3, 2), "r")
        yield  # (an async generator, like the real one)

    async def run():
        with pytest.raises(Overloaded):
            await ingress.generate(GenerationRequest(text="a"))
        ingress._admission.in_flight = 0
        ingress._stream = refused_below
        with pytest.raises(Overloaded):
            [chunk async for chunk in ingress.generate_stream(GenerationRequest(text="a"))]
        with pytest.raises(InvalidRequest):
            await ingress.GenerateUnary(pb.GenerateRequest(max_new_tokens=3))

    asyncio.run(run())
    counted = [(tags["method"], tags["status"]) for _, tags in fake_ray_metrics["folio_requests_total"].values]
    assert counted == [("generate", "RESOURCE_EXHAUSTED"), ("generate_stream", "RESOURCE_EXHAUSTED"),
                       ("GenerateUnary", "INVALID_ARGUMENT")]


class _FakeCall:
    """A generator replica's call as the ingress sees it: its chunks, then `error` (if any)."""

    def __init__(self, chunks: list, error: BaseException | None) -> None:
        self.chunks, self.error, self.cancelled = chunks, error, False

    async def _items(self):
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    def __aiter__(self):
        return self._items()

    def cancel(self) -> None:
        self.cancelled = True


class _FakeGeneratorHandle:
    """`handle.options(stream=True).generate.remote(request)`, answering each call with the next planned call."""

    def __init__(self, planned: list[_FakeCall]) -> None:
        self.planned, self.request_ids = list(planned), []
        self.generate = self

    def options(self, **_kwargs):
        return self

    def remote(self, engine_request: EngineRequest) -> _FakeCall:
        self.request_ids.append(engine_request.request_id)
        return self.planned.pop(0)


def _ingress_over(handle: _FakeGeneratorHandle):
    """An Ingress (not deployed) whose generator handle is `handle`, for a token-id prompt that needs no tokenizer."""
    from concurrent.futures import ThreadPoolExecutor

    from folio.serve.admission import Admission
    from folio.serve.ingress import Ingress
    from folio.serve.metrics import IngressMetrics
    from folio.serve.validation import RequestLimits

    cls = Ingress.func_or_class
    ingress = cls.__new__(cls)
    ingress._metrics = IngressMetrics("app")
    ingress._admission = Admission(8)
    ingress._generator = handle
    ingress._config = ServeConfig(num_gpus=0, token_channel=False)
    ingress._validation_pool = ThreadPoolExecutor(max_workers=1)

    async def model_info():
        return INFO

    async def limits():
        return RequestLimits()

    async def no_adapter(request, engine_request):
        return engine_request

    ingress.model_info, ingress._request_limits, ingress._with_adapter = model_info, limits, no_adapter
    ingress._engine_request = lambda request, info, request_id: EngineRequest(
        input_ids=tuple(request.token_ids), max_new_tokens=request.max_new_tokens, request_id=request_id)
    return ingress


def _finished(text: str) -> Chunk:
    from folio.results import EosReason

    return Chunk(text=text, token_ids=[7], finish=Finish(reason=EosReason.MAX_NEW_TOKENS, usage=Usage(2, 0, 1)))


def test_a_request_whose_replica_was_lost_before_answering_is_sent_again(fake_ray_metrics):
    """A replica that fails as if gone (ActorUnavailableError: a call over gRPC to a replica being killed) before
    any chunk: the request goes again, under a fresh id, up to RETRIES_BEFORE_FIRST_CHUNK times; after the first
    chunk, or for any other error, the failure is the client's (UNAVAILABLE, or the replica's own status)."""
    from ray.exceptions import ActorUnavailableError

    from folio.serve.errors import ReplicaUnavailable
    from folio.serve.ingress import RETRIES_BEFORE_FIRST_CHUNK

    def lost() -> ActorUnavailableError:
        return ActorUnavailableError("Actor is unavailable.", b"\x00" * 16)

    request = GenerationRequest(token_ids=[5, 6], max_new_tokens=1)

    async def stream(ingress) -> list:
        return [chunk async for chunk in ingress.generate_stream(request)]

    handle = _FakeGeneratorHandle([_FakeCall([], lost()), _FakeCall([], lost()), _FakeCall([_finished("ok")], None)])
    chunks = asyncio.run(stream(_ingress_over(handle)))
    assert [c.text for c in chunks] == ["ok"] and RETRIES_BEFORE_FIRST_CHUNK == 2
    first = handle.request_ids[0]
    assert handle.request_ids == [first, f"{first}.retry1", f"{first}.retry2"]

    # one loss more than the retries: the client gets UNAVAILABLE
    handle = _FakeGeneratorHandle([_FakeCall([], lost()) for _ in range(RETRIES_BEFORE_FIRST_CHUNK + 1)])
    with pytest.raises(ReplicaUnavailable):
        asyncio.run(stream(_ingress_over(handle)))
    assert not handle.planned

    # lost after a chunk reached the client: not sent again
    handle = _FakeGeneratorHandle([_FakeCall([Chunk(text="a", token_ids=[3])], lost()),
                                   _FakeCall([_finished("x")], None)])
    with pytest.raises(ReplicaUnavailable):
        asyncio.run(stream(_ingress_over(handle)))
    assert len(handle.planned) == 1

    # the replica's own refusal: the client's, at once
    handle = _FakeGeneratorHandle([_FakeCall([], Overloaded("full", retry_after_s=1.0)),
                                   _FakeCall([_finished("x")], None)])
    with pytest.raises(Overloaded):
        asyncio.run(stream(_ingress_over(handle)))
    assert len(handle.planned) == 1


def test_a_streamed_request_sent_again_takes_a_fresh_token_channel_entry(fake_ray_metrics):
    """With the token channel, each attempt listens under its own request id, and none is left behind."""
    from ray.exceptions import ActorUnavailableError

    from folio.serve.token_channel import ChannelServer

    async def run() -> tuple[list, dict, list]:
        handle = _FakeGeneratorHandle([_FakeCall([], ActorUnavailableError("gone", b"\x00" * 16)),
                                       _FakeCall([_finished("ok")], None)])
        ingress = _ingress_over(handle)
        ingress._config = ServeConfig(num_gpus=0, token_channel=True)
        ingress._channel, ingress._channel_lock = ChannelServer(), asyncio.Lock()
        await ingress._channel.start("127.0.0.1")
        try:
            chunks = [c async for c in ingress.generate_stream(GenerationRequest(token_ids=[5], max_new_tokens=1))]
            return [c.text for c in chunks], dict(ingress._channel._queues), handle.request_ids
        finally:
            await ingress._channel.stop()

    texts, open_entries, request_ids = asyncio.run(run())
    assert texts == ["ok"] and open_entries == {} and request_ids[1] == f"{request_ids[0]}.retry1"


def test_merged_chunk_equals_the_results_chunks_one_after_another():
    """A stream's batch of results becomes one Chunk, the one their Chunks extended one by one make (the oracle):
    plain text and ids joined at once, results with probabilities or dropped text through Chunk.extend."""
    from folio.results import EosReason, StartedResult, StreamingResult
    from folio.serve.engine import chunk_of, merged_chunk

    job = SimpleNamespace(time_first_token=None)

    def result(text, ids, **fields):
        r = StreamingResult(job=job, serial=0, identifier=None, text=text, token_ids=list(ids))
        for name, value in fields.items():
            setattr(r, name, value)
        return r

    last = dict(eos=True, eos_reason=EosReason.MAX_NEW_TOKENS, new_tokens=4, prompt_tokens=3)
    batches = [
        [StartedResult(job=job, serial=0, identifier=None), result("ab", [1]), result("", []), result("c", [2, 3])],
        [result("x", [5], token_probs=[0.5]), result("y", [6], token_probs=[0.25]), result("z", [7], **last)],
        [result("p", [8]), result("", [], suppressed_text="q"), result("r", [9], **last)],
    ]
    for results in batches:
        want = None
        for r in results:
            if r.stage.value != "streaming":
                continue
            if want is None:
                want = chunk_of(r, 0.0)
            else:
                want.extend(chunk_of(r, 0.0))
        got = merged_chunk(results, 0.0)
        assert (got.text, got.token_ids, got.token_probs, got.suppressed_text) == (
            want.text, want.token_ids, want.token_probs, want.suppressed_text)
        assert (got.finish is None) == (want.finish is None)
        if got.finish is not None:
            assert (got.finish.reason, got.finish.usage) == (want.finish.reason, want.finish.usage)
    assert merged_chunk([StartedResult(job=job, serial=0, identifier=None)], 0.0) is None
    assert merged_chunk([result("", [])], 0.0) is None  # text held back: nothing to send
