"""Constrained generation and the extended samplers at the serving edge (issue 20 item 6).

Without a cluster: every new GenerateRequest field through protobuf -> GenerationRequest -> EngineRequest (the
ingress's validation) -> folio.DynamicJob / folio.SamplerSettings (the replica), field by field; the checks that
name the field; and the replica's mapping of filter failures (a filter that does not compile, one that allows
nothing mid-generation) to INVALID_ARGUMENT without disturbing other requests, with stand-in filters.

Through a real server (marker `ray`: a local Ray cluster, one ingress and one generator replica of the demo model
on the CPU, about 20 s to start): JSON Schema / regex / grammar / choice requests, a schema that does not compile,
banned strings, token healing, classifier-free guidance, and the new samplers.

Tests that need an engine feature not merged yet fail (UNIMPLEMENTED, or an ImportError of the filter class),
never skip: folio.constrain's JsonSchemaFilter / RegexFilter / GrammarFilter / ChoiceFilter, DynamicJob's
banned_strings / token_healing / CFG input, and SamplerSettings' new fields.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest

from folio.constrain.base import Filter, FilterError
from folio.serve.errors import InvalidRequest, Unimplemented
from folio.serve.schema import EngineRequest, GenerationRequest, ModelInfo, ResponseFormat, Sampling
from folio.serve.validation import to_engine_request

INFO = ModelInfo(model_name="demo", architecture="llama", dtype="float32", vocab_size=1000, max_seq_len=2048,
                 page_size=16, num_pages=64, max_batch_size=8, num_replicas=1, eos_token_ids=(1,), bos_token_id=0,
                 add_bos_token=True)

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}

# Every new sampler field with a value that is not its default: (field, value), value as it arrives in
# folio.SamplerSettings (the field names are the engine's).
NEW_SAMPLER_VALUES = [
    ("temperature_last", True), ("min_temp", 0.5), ("max_temp", 1.5), ("temp_exponent", 2.0),
    ("smoothing_factor", 0.3), ("top_a", 0.2), ("tfs", 0.9), ("typical", 0.8), ("skew", 0.5), ("mirostat", 2),
    ("mirostat_tau", 3.0), ("mirostat_eta", 0.2), ("dry_multiplier", 0.8), ("dry_base", 1.75),
    ("dry_allowed_length", 3), ("dry_sequence_breakers", ("\n", ":")), ("dry_range", 256), ("dry_max_ngram", 12),
    ("xtc_threshold", 0.1), ("xtc_probability", 0.5), ("cfg_scale", 1.5),
]


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from folio import Tokenizer

    return Tokenizer.from_pretrained(demo_dir)


def _proto_sampler(message, name, value):
    if name == "dry_sequence_breakers":
        message.sampler.dry_sequence_breakers.values.extend(value)
    else:
        setattr(message.sampler, name, value)


# --- protobuf -> EngineRequest (the ingress) ----------------------------------------------------------------


def test_every_new_request_field_reaches_the_engine_request(tokenizer):
    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.serve import grpc_convert

    message = pb.GenerateRequest(text="Once upon a time", max_new_tokens=8, banned_strings=["dragon", "sword"],
                                 token_healing=True, filter_prefer_eos=True, negative_text="Twice")
    message.response_format.json_schema = json.dumps(SCHEMA)
    for name, value in NEW_SAMPLER_VALUES:
        _proto_sampler(message, name, value)
    request = grpc_convert.request_from_proto(message)
    engine = to_engine_request(request, tokenizer, INFO)
    assert engine.response_format == ("json_schema", json.dumps(SCHEMA))
    assert engine.banned_strings == ("dragon", "sword")
    assert engine.token_healing and engine.filter_prefer_eos
    assert engine.negative_input_ids == tuple(tokenizer.encode("Twice", add_bos=True))
    for name, value in NEW_SAMPLER_VALUES:
        assert engine.sampler[name] == value, name
    # and back: the Python client's requests cross gRPC unchanged
    assert grpc_convert.request_from_proto(grpc_convert.request_to_proto(request)) == request


@pytest.mark.parametrize("fmt, expected", [
    (ResponseFormat(json_schema=SCHEMA), ("json_schema", json.dumps(SCHEMA))),
    (ResponseFormat(regex="[a-c]{3}"), ("regex", "[a-c]{3}")),
    (ResponseFormat(grammar='start: "yes" | "no"'), ("grammar", 'start: "yes" | "no"')),
    (ResponseFormat(choice=["left", "right"]), ("choice", ("left", "right"))),
])
def test_response_formats_cross_grpc(tokenizer, fmt, expected):
    from folio.serve import grpc_convert

    request = GenerationRequest(token_ids=[5, 6], response_format=fmt)
    over_grpc = grpc_convert.request_from_proto(grpc_convert.request_to_proto(request))
    assert to_engine_request(over_grpc, tokenizer, INFO).response_format == expected
    assert to_engine_request(request, tokenizer, INFO).response_format == expected


def test_unset_and_empty_dry_sequence_breakers_differ():
    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.serve import grpc_convert

    assert grpc_convert.request_from_proto(pb.GenerateRequest(text="a")).sampling.dry_sequence_breakers is None
    empty = GenerationRequest(text="a", sampling=Sampling(dry_sequence_breakers=()))
    assert grpc_convert.request_from_proto(grpc_convert.request_to_proto(empty)).sampling.dry_sequence_breakers == ()


def test_responses_carry_end_filter_and_suppressed_text():
    from folio.results import EosReason
    from folio.serve import grpc_convert
    from folio.serve.schema import Chunk, Completion, Finish

    chunks = [Chunk(text="ab", token_ids=[3, 4], suppressed_text="dra"),
              Chunk(text="c", token_ids=[5], suppressed_text="gon", finish=Finish(EosReason.END_FILTER))]
    for chunk in chunks:
        assert grpc_convert.chunk_from_proto(grpc_convert.chunk_to_proto(chunk)) == chunk
    assert grpc_convert.chunk_to_proto(chunks[1]).finish.reason == grpc_convert.pb.FINISH_REASON_END_FILTER
    whole = grpc_convert.completion_to_proto(Completion.from_chunks(chunks))
    assert (whole.text, whole.suppressed_text) == ("abc", "dragon")


@pytest.mark.parametrize("request_, field", [
    (GenerationRequest(text="a", response_format=ResponseFormat()), "response_format"),
    (GenerationRequest(text="a", response_format=ResponseFormat(regex="a", choice=["a"])), "response_format"),
    (GenerationRequest(text="a", response_format=ResponseFormat(json_schema="{not json")),
     "response_format.json_schema"),
    (GenerationRequest(text="a", response_format=ResponseFormat(json_schema="[1, 2]")), "response_format.json_schema"),
    (GenerationRequest(text="a", response_format=ResponseFormat(regex="")), "response_format.regex"),
    (GenerationRequest(text="a", response_format=ResponseFormat(grammar="")), "response_format.grammar"),
    (GenerationRequest(text="a", response_format=ResponseFormat(choice=[])), "response_format.choice"),
    (GenerationRequest(text="a", response_format=ResponseFormat(choice=["x", ""])), "response_format.choice"),
    (GenerationRequest(text="a", response_format=ResponseFormat(choice=["x", "x"])), "response_format.choice"),
    (GenerationRequest(text="a", response_format=ResponseFormat(regex="a" * 70000)), "response_format.regex"),
    (GenerationRequest(text="a", filter_prefer_eos=True), "filter_prefer_eos"),
    (GenerationRequest(text="a", banned_strings=[""]), "banned_strings"),
    (GenerationRequest(text="a", banned_strings="abc"), "banned_strings"),
    (GenerationRequest(text="a", token_healing="yes"), "token_healing"),
    (GenerationRequest(text="a", sampling=Sampling(cfg_scale=1.5)), "cfg_scale"),
    (GenerationRequest(text="a", negative_text="b"), "negative_text"),
    (GenerationRequest(text="a", negative_token_ids=[5], sampling=Sampling(cfg_scale=2.0)), "negative_token_ids"),
    (GenerationRequest(token_ids=[5], negative_text="b", sampling=Sampling(cfg_scale=2.0)), "negative_text"),
    (GenerationRequest(text="a", negative_text="", sampling=Sampling(cfg_scale=2.0)), "negative_text"),
    (GenerationRequest(token_ids=[5], negative_token_ids=[5000], sampling=Sampling(cfg_scale=2.0)),
     "negative_token_ids"),
    (GenerationRequest(token_ids=[5], negative_token_ids=[5] * 1024, sampling=Sampling(cfg_scale=2.0)),
     "negative prompt"),
    (GenerationRequest(text="a", negative_text="b", sampling=Sampling(cfg_scale=-1e9)), "cfg_scale"),
    (GenerationRequest(text="a", negative_text="b", sampling=Sampling(cfg_scale=math.inf)), "cfg_scale"),
    (GenerationRequest(text="a", sampling=Sampling(mirostat=3)), "mirostat"),
    (GenerationRequest(text="a", sampling=Sampling(mirostat=2, mirostat_tau=0.0)), "mirostat_tau"),
    (GenerationRequest(text="a", sampling=Sampling(mirostat_eta=-1.0)), "mirostat_eta"),
    (GenerationRequest(text="a", sampling=Sampling(min_temp=-0.1)), "min_temp"),
    (GenerationRequest(text="a", sampling=Sampling(max_temp=1e5)), "max_temp"),
    (GenerationRequest(text="a", sampling=Sampling(min_temp=2.0, max_temp=1.0)), "max_temp"),
    (GenerationRequest(text="a", sampling=Sampling(temp_exponent=0.0)), "temp_exponent"),
    (GenerationRequest(text="a", sampling=Sampling(smoothing_factor=-1.0)), "smoothing_factor"),
    (GenerationRequest(text="a", sampling=Sampling(top_a=1.5)), "top_a"),
    (GenerationRequest(text="a", sampling=Sampling(tfs=-0.1)), "tfs"),
    (GenerationRequest(text="a", sampling=Sampling(typical=2.0)), "typical"),
    (GenerationRequest(text="a", sampling=Sampling(skew=math.nan)), "skew"),
    (GenerationRequest(text="a", sampling=Sampling(dry_multiplier=-0.5)), "dry_multiplier"),
    (GenerationRequest(text="a", sampling=Sampling(dry_base=0.5)), "dry_base"),
    (GenerationRequest(text="a", sampling=Sampling(dry_allowed_length=0)), "dry_allowed_length"),
    (GenerationRequest(text="a", sampling=Sampling(dry_sequence_breakers=["\n", ""])), "dry_sequence_breakers"),
    (GenerationRequest(text="a", sampling=Sampling(dry_range=-1)), "dry_range"),
    (GenerationRequest(text="a", sampling=Sampling(dry_max_ngram=0)), "dry_max_ngram"),
    (GenerationRequest(text="a", sampling=Sampling(xtc_threshold=1.5)), "xtc_threshold"),
    (GenerationRequest(text="a", sampling=Sampling(xtc_probability=-0.1)), "xtc_probability"),
    (GenerationRequest(text="a", sampling=Sampling(temperature_last=1)), "temperature_last"),
])
def test_invalid_constrained_requests_name_the_field(tokenizer, request_, field):
    with pytest.raises(InvalidRequest) as info:
        to_engine_request(request_, tokenizer, INFO)
    assert info.value.field == field
    assert str(info.value).startswith(field + ": ")


def test_constraint_size_limit_is_the_servers(tokenizer):
    request = GenerationRequest(text="a", response_format=ResponseFormat(choice=["abc", "de"]),
                                banned_strings=["xyz", "uvw"])
    to_engine_request(request, tokenizer, INFO, max_constraint_chars=6)
    with pytest.raises(InvalidRequest, match="^banned_strings: 6 characters in all exceed the server's limit of 5"):
        to_engine_request(request, tokenizer, INFO, max_constraint_chars=5)
    with pytest.raises(InvalidRequest, match="^response_format.choice: 5 characters exceed the server's limit of 4"):
        to_engine_request(request, tokenizer, INFO, max_constraint_chars=4)


def test_config_max_constraint_chars():
    from folio.serve.config import ConfigError, ServeConfig

    assert ServeConfig.from_dict({"num_gpus": 0, "max_constraint_chars": "1024"}).max_constraint_chars == 1024
    with pytest.raises(ConfigError, match="^max_constraint_chars: "):
        ServeConfig.from_dict({"num_gpus": 0, "max_constraint_chars": 0})


# --- EngineRequest -> folio.DynamicJob (the replica) ----------------------------------------------------------


def _engine_request(**fields) -> EngineRequest:
    return EngineRequest(input_ids=(0, 42, 71), max_new_tokens=4, **fields)


@pytest.mark.parametrize("name, value", NEW_SAMPLER_VALUES, ids=[n for n, _ in NEW_SAMPLER_VALUES])
def test_each_new_sampler_field_arrives_in_sampler_settings(tokenizer, name, value):
    """Needs the engine's new SamplerSettings fields: UNIMPLEMENTED naming the field until they are merged."""
    from folio import DynamicJob
    from folio.proto.folio.v1 import generation_pb2 as pb
    from folio.serve import grpc_convert
    from folio.serve.job_request import job_kwargs_of

    message = pb.GenerateRequest(text="Once upon a time")
    _proto_sampler(message, name, value)
    if name == "cfg_scale":
        message.negative_text = "Twice"
    if name == "min_temp":  # dynamic temperature needs max_temp >= min_temp
        _proto_sampler(message, "max_temp", 1.5)
    engine_request = to_engine_request(grpc_convert.request_from_proto(message), tokenizer, INFO)
    job = DynamicJob(**job_kwargs_of(engine_request))
    assert getattr(job.gen_settings, name) == value


@pytest.mark.parametrize("fmt, cls", [
    (("json_schema", json.dumps(SCHEMA)), "JsonSchemaFilter"), (("regex", "[a-c]{3}"), "RegexFilter"),
    (("grammar", 'start: "yes" | "no"'), "GrammarFilter"), (("choice", ("left", "right")), "ChoiceFilter"),
])
def test_response_format_becomes_the_jobs_filter(fmt, cls):
    """Needs folio.constrain's filter classes: UNIMPLEMENTED naming response_format.<kind> until merged."""
    import folio.constrain
    from folio import DynamicJob
    from folio.serve.job_request import job_kwargs_of

    kwargs = job_kwargs_of(_engine_request(response_format=fmt, filter_prefer_eos=True))
    job = DynamicJob(**kwargs)
    assert len(job.filters) == 1 and isinstance(job.filters[0], getattr(folio.constrain, cls))
    assert job.filter_prefer_eos


def test_banned_strings_and_token_healing_reach_the_job():
    """Needs DynamicJob(banned_strings=, token_healing=): UNIMPLEMENTED until merged."""
    from folio import DynamicJob
    from folio.serve.job_request import job_kwargs_of

    kwargs = job_kwargs_of(_engine_request(banned_strings=("dragon",), token_healing=True))
    assert kwargs["banned_strings"] == ["dragon"] and kwargs["token_healing"] is True
    DynamicJob(**kwargs)


def test_cfg_builds_a_two_prompt_job():
    """Needs SamplerSettings.cfg_scale and DynamicJob's [positive, negative] input: fails until merged."""
    from folio import DynamicJob
    from folio.serve.job_request import job_kwargs_of

    kwargs = job_kwargs_of(_engine_request(negative_input_ids=(0, 9), sampler={"cfg_scale": 2.0}))
    assert kwargs["input_ids"] == [[0, 42, 71], [0, 9]]
    assert kwargs["gen_settings"].cfg_scale == 2.0
    DynamicJob(**kwargs)


def test_plain_requests_pass_no_new_job_options():
    """A request that uses none of the new features builds the same job as before (and works on any engine)."""
    from folio.serve.job_request import job_kwargs_of

    kwargs = job_kwargs_of(_engine_request(sampler={"temperature": 0.5}))
    assert not {"filters", "filter_prefer_eos", "banned_strings", "token_healing"} & set(kwargs)
    assert kwargs["input_ids"] == [0, 42, 71]


def test_missing_engine_features_are_unimplemented_not_dropped(monkeypatch):
    """Simulates an engine without the features: the request fails naming the field."""
    import folio.constrain
    import folio.serve.job_request as engine_module

    monkeypatch.delattr(folio.constrain, "RegexFilter", raising=False)
    with pytest.raises(Unimplemented, match="^response_format.regex: "):
        engine_module.job_kwargs_of(_engine_request(response_format=("regex", "a+")))
    monkeypatch.setattr(engine_module, "DynamicJob", lambda input_ids, max_new_tokens: None)
    with pytest.raises(Unimplemented, match="^banned_strings: "):
        engine_module.job_kwargs_of(_engine_request(banned_strings=("x",)))
    with pytest.raises(Unimplemented, match="^token_healing: "):
        engine_module.job_kwargs_of(_engine_request(token_healing=True))
    monkeypatch.setattr(engine_module, "SamplerSettings", _OldSamplerSettings)
    with pytest.raises(Unimplemented, match="^mirostat: "):
        engine_module.job_kwargs_of(_engine_request(sampler={"mirostat": 2}))
    with pytest.raises(Unimplemented, match="^repetition_penalty: "):  # the API's name, not the engine's
        engine_module.job_kwargs_of(_engine_request(sampler={"token_repetition_penalty": 1.1}))


@dataclass(frozen=True)
class _OldSamplerSettings:
    temperature: float = 0.8


# --- filter failures on a replica's engine (stand-in filters; no cluster) ------------------------------------


class _StubFilter(Filter):
    """Allows every token for `steps` tokens, then none; or fails to compile."""

    def __init__(self, spec, steps=3, compiles=True):
        super().__init__()
        self.spec, self.steps, self.compiles = spec, steps, compiles

    def bind(self, tokenizer, vocab_size):
        if not self.compiles:
            raise FilterError(f"cannot compile {self.spec!r}: unexpected end of pattern at position 1")
        super().bind(tokenizer, vocab_size)

    def fill_bitmask(self, row: np.ndarray) -> None:
        row[:] = -1 if len(self._fed) < self.steps else 0


@pytest.fixture(scope="module")
def engine(demo_dir):
    from folio.serve.config import ServeConfig
    from folio.serve.engine import Engine

    config = ServeConfig(model_path=str(demo_dir), num_gpus=0, cache_tokens=1024, page_size=16, max_batch_size=4,
                         max_queue_size=4, warmup=False)
    engine = Engine.build(config)
    yield engine
    asyncio.run(engine.close(drain_timeout_s=1))


async def _run(engine, request: EngineRequest):
    job = engine.start_job(request)
    return [chunk async for chunk in engine.stream(job, 0.0)]


def test_filter_that_does_not_compile_is_invalid_argument(engine, monkeypatch):
    import folio.constrain

    monkeypatch.setattr(folio.constrain, "RegexFilter", lambda spec: _StubFilter(spec, compiles=False),
                        raising=False)

    async def main():
        with pytest.raises(InvalidRequest) as info:
            await _run(engine, _engine_request(response_format=("regex", "("), sampler={"top_k": 1}))
        return info.value

    error = asyncio.run(main())
    assert error.status == "INVALID_ARGUMENT" and error.field == "response_format.regex"
    assert str(error) == "response_format.regex: cannot compile '(': unexpected end of pattern at position 1"


def test_filter_that_allows_nothing_fails_only_its_request(engine, monkeypatch):
    import folio.constrain

    monkeypatch.setattr(folio.constrain, "GrammarFilter", lambda spec: _StubFilter(spec, steps=3),
                        raising=False)
    plain = EngineRequest(input_ids=(0, 42, 71), max_new_tokens=12, stop_conditions=(),
                          sampler={"temperature": 0.0, "top_k": 1})

    async def main():
        stuck = asyncio.ensure_future(_run(engine, EngineRequest(
            input_ids=(0, 42, 71), max_new_tokens=12, stop_conditions=(), response_format=("grammar", "start: x"),
            sampler={"temperature": 0.0, "top_k": 1})))
        other = asyncio.ensure_future(_run(engine, plain))
        results = await asyncio.gather(stuck, other, return_exceptions=True)
        return results

    stuck, other = asyncio.run(main())
    assert isinstance(stuck, InvalidRequest) and stuck.field == "response_format.grammar", stuck
    assert "after 3 generated tokens" in str(stuck)
    assert sum(len(c.token_ids) for c in other) == 12 and other[-1].finish is not None


# --- through a real server (gRPC) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("ray.serve")
    grpc = pytest.importorskip("grpc")
    from fakes import free_port

    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    model_dir = write_demo_model(tmp_path_factory.mktemp("constrained") / "demo-model")
    config = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.5, ingress_num_cpus=0.2, num_replicas=1,
                         cache_tokens=2048, page_size=16, max_batch_size=8, max_queue_size=8,
                         grpc_port=free_port(), http_port=free_port(), app_name="constrained")
    local.start_cluster(config)
    try:
        local.deploy(config)
        channel = grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}")
        yield {"config": config, "channel": channel, "model_dir": model_dir}
        channel.close()
    finally:
        local.shutdown()


def _call(served, message, unary=True):
    from folio.proto.folio.v1 import generation_pb2_grpc as pb_grpc

    stub = pb_grpc.GenerationStub(served["channel"])
    md = (("application", "constrained"),)
    if unary:
        return stub.GenerateUnary(message, metadata=md, timeout=60)
    return list(stub.Generate(message, metadata=md, timeout=60))


def _greedy_message(text="Once upon a time", **fields):
    from folio.proto.folio.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(text=text, stop_on_eos=False, **fields)
    message.sampler.temperature, message.sampler.top_k = 0.0, 1
    return message


def _status(served, message):
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        _call(served, message)
    return info.value.code(), info.value.details()


@pytest.mark.ray
def test_server_json_schema(served):
    import jsonschema

    from folio.proto.folio.v1 import generation_pb2 as pb

    message = _greedy_message(max_new_tokens=64, filter_prefer_eos=True)
    message.stop_on_eos = True
    message.response_format.json_schema = json.dumps(SCHEMA)  # (fixed whitespace: a model cannot pad forever)
    result = _call(served, message)
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.finish.reason in (pb.FINISH_REASON_END_FILTER, pb.FINISH_REASON_STOP_TOKEN)


@pytest.mark.ray
def test_server_regex_choice_and_grammar(served):
    import re

    from folio.proto.folio.v1 import generation_pb2 as pb

    message = _greedy_message(max_new_tokens=16)
    message.response_format.regex = "[a-c]{3}-[0-9]{2}"
    messages = _call(served, message, unary=False)
    text = "".join(m.text for m in messages)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", text), text
    assert messages[-1].finish.reason == pb.FINISH_REASON_END_FILTER

    message = _greedy_message(max_new_tokens=16)
    message.response_format.choice.options.extend(["north", "south", "east", "west"])
    result = _call(served, message)
    assert result.text in ("north", "south", "east", "west")
    assert result.finish.reason == pb.FINISH_REASON_END_FILTER

    message = _greedy_message(max_new_tokens=16)
    message.response_format.grammar = 'start: answer "!"\nanswer: "yes" | "no"'
    result = _call(served, message)
    assert result.text in ("yes!", "no!") and result.finish.reason == pb.FINISH_REASON_END_FILTER


@pytest.mark.ray
@pytest.mark.parametrize("kind, spec, cls", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
     "JsonSchemaFilter"),
    ("regex", "(ab", "RegexFilter"),
    ("grammar", "start: undefined_rule", "GrammarFilter"),
])
def test_server_constraint_that_does_not_compile_is_invalid_argument(served, kind, spec, cls):
    """The details carry the engine compiler's own message (what FilterError says here, in the test process)."""
    import grpc

    import folio.constrain
    from folio import Tokenizer

    compiler_message = None
    try:
        getattr(folio.constrain, cls)(spec).bind(Tokenizer.from_pretrained(served["model_dir"]), 1000)
    except FilterError as e:
        compiler_message = str(e)
    assert compiler_message, f"{cls} compiled {spec!r}"
    message = _greedy_message(max_new_tokens=8)
    setattr(message.response_format, kind, spec)
    code, details = _status(served, message)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"response_format.{kind}: {compiler_message}"


@pytest.mark.ray
def test_server_rejects_bad_constraint_fields_naming_them(served):
    import grpc

    message = _greedy_message(max_new_tokens=8)
    message.response_format.json_schema = "{not json"
    code, details = _status(served, message)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("response_format.json_schema: ")
    message = _greedy_message(max_new_tokens=8)
    message.sampler.cfg_scale = 2.0
    code, details = _status(served, message)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("cfg_scale: ")
    for name, value in (("mirostat", 3), ("dry_base", 0.5), ("xtc_probability", 2.0), ("top_a", -1.0)):
        message = _greedy_message(max_new_tokens=8)
        setattr(message.sampler, name, value)
        code, details = _status(served, message)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(name + ": "), (name, details)


@pytest.mark.ray
def test_server_filter_dead_end_fails_only_its_request(served):
    """A choice whose every first token is banned by the request's own bias: nothing to pick at the first step."""
    import grpc

    from folio import Tokenizer

    tokenizer = Tokenizer.from_pretrained(served["model_dir"])
    stuck = _greedy_message(max_new_tokens=8)
    stuck.response_format.choice.options.append("abc")
    for token_id in range(tokenizer.vocab_size):
        if tokenizer.decode([token_id]).startswith("a"):
            stuck.sampler.token_bias[token_id] = -math.inf
    code, details = _status(served, stuck)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("response_format.choice: "), details
    assert len(_call(served, _greedy_message(max_new_tokens=8)).token_ids) == 8  # the replica serves on


@pytest.mark.ray
def test_server_banned_strings(served):
    plain = _call(served, _greedy_message(max_new_tokens=24))
    banned = plain.text[4:7]  # greedy: the unbanned completion would contain it at the same place
    assert len(banned) == 3
    message = _greedy_message(max_new_tokens=24, banned_strings=[banned])
    messages = _call(served, message, unary=False)
    text = "".join(m.text for m in messages)
    assert banned not in text
    assert "".join(m.suppressed_text for m in messages), "the suppressed text is reported"
    unary = _call(served, message)
    assert unary.text == text and unary.suppressed_text == "".join(m.suppressed_text for m in messages)


@pytest.mark.ray
def test_server_token_healing(served):
    from folio.proto.folio.v1 import generation_pb2 as pb

    result = _call(served, _greedy_message("Once upon a ti", max_new_tokens=8, token_healing=True))
    assert result.finish.reason == pb.FINISH_REASON_MAX_NEW_TOKENS and result.token_ids


@pytest.mark.ray
def test_server_cfg(served):
    plain = _call(served, _greedy_message(max_new_tokens=12))
    same = _greedy_message(max_new_tokens=12, negative_text="It was a dark and stormy night")
    same.sampler.cfg_scale = 1.0  # the positive logits alone
    assert list(_call(served, same).token_ids) == list(plain.token_ids)
    guided = _greedy_message(max_new_tokens=12, negative_text="It was a dark and stormy night")
    guided.sampler.cfg_scale = 3.0
    result = _call(served, guided)
    assert len(result.token_ids) == 12


@pytest.mark.ray
@pytest.mark.parametrize("settings", [
    {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_range": 64},
    {"xtc_threshold": 0.1, "xtc_probability": 0.5, "min_temp": 0.5, "max_temp": 1.5, "temperature_last": True,
     "top_a": 0.1, "tfs": 0.95, "typical": 0.9, "smoothing_factor": 0.2, "skew": 0.1, "temp_exponent": 1.5},
])
def test_server_new_samplers_produce_results(served, settings):
    from folio.proto.folio.v1 import generation_pb2 as pb

    message = pb.GenerateRequest(text="Once upon a time", max_new_tokens=10, stop_on_eos=False, seed=7)
    message.sampler.temperature = 1.0
    for name, value in settings.items():
        setattr(message.sampler, name, value)
    if "dry_multiplier" in settings:
        message.sampler.dry_sequence_breakers.values.extend(["\n", "."])
    first, second = _call(served, message), _call(served, message)
    assert len(first.token_ids) == 10 and list(first.token_ids) == list(second.token_ids)  # seeded
