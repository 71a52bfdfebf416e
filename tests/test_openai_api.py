"""The OpenAI-compatible HTTP API (folio.serve.openai_api) on the ingress.

Without a cluster: chat templates against transformers' apply_chat_template (the oracle), the conversion of
OpenAI bodies to GenerationRequests (and the fields refused), error shaping, and the FastAPI app itself driven as
an ASGI application over a stand-in request path (status codes, error bodies, server-sent events).

Through a real server (marker `ray`): one local cluster with one application, "folio", of one generator replica of
the demo model that runs 1 request (every request alone: no batch shape differs between the paths compared) with
2 queued in its engine and 2 more waiting at the caller -- small enough that a flood of requests is refused (429),
with room for the other tests, which send at most 2 at a time (Serve counts a request being routed as queued at
the caller: 2 that arrive together need room for 2 there). One application rather than two halves the
cluster's start on a loaded 2-core machine. Called with the real `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from fakes import free_port

from folio import EosReason
from folio.serve.errors import InternalError, InvalidRequest, Overloaded, ReplicaUnavailable
from folio.serve.schema import Chunk, Finish, ModelInfo, TopTokens, Usage

INFO = ModelInfo(model_name="demo-model", architecture="LlamaForCausalLM", dtype="float32", vocab_size=1000,
                 max_seq_len=4096, page_size=16, num_pages=64, max_batch_size=1, num_replicas=1,
                 eos_token_ids=(1,), bos_token_id=0, add_bos_token=True)
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is the harbour?"},
            {"role": "assistant", "content": "Past the mill."}, {"role": "user", "content": "And the <|eos|> inn?"}]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
LONG_PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to "
               "the sea below the rocks while the lamp warmed")
HTTP_TIMEOUT_S = 60


# --- chat templates --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer(demo_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(demo_dir)


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    from folio import Tokenizer

    return Tokenizer.from_pretrained(demo_dir)


def _hf_ids(hf_tokenizer, messages) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:2], [{"role": "user", "content": "café 🙂\n\n  spaced"}]])
def test_demo_chat_template_renders_as_transformers_does(demo_dir, hf_tokenizer, tokenizer, messages):
    from folio.serve.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(demo_dir)
    text = template.render(messages)
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text, **template.encode_options()) == _hf_ids(hf_tokenizer, messages)
    assert text.startswith("<|bos|><|") and text.endswith("<|assistant|>\n")


def test_template_features_match_transformers(tmp_path, demo_dir, hf_tokenizer):
    """Whitespace control, loop controls, tojson without HTML escapes, named templates and tools=None."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from folio.serve.chat_template import ChatTemplate

    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\n"
              "  {{ m | tojson }}|{{ m.content | tojson(indent=1) }}\n{% endfor %}"
              "{% if tools is none %}no tools{% endif %}{% generation %}{{ eos_token }}{% endgeneration %}")
    config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": source}]
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(demo_dir / name, tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "it's"},
                {"role": "user", "content": "never shown"}]
    ours = ChatTemplate.from_model_dir(tmp_path).render(messages)
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<a & b>" in ours and "never shown" not in ours


def test_template_refusals_are_invalid_messages_and_missing_templates_none(demo_dir, tmp_path):
    from folio.serve.chat_template import ChatTemplate

    with pytest.raises(InvalidRequest) as info:
        ChatTemplate.from_model_dir(demo_dir).render([{"role": "tool", "content": "x"}])
    assert info.value.field == "messages" and "roles system, user and assistant" in str(info.value)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert ChatTemplate.from_model_dir(tmp_path) is None
    with pytest.raises(InternalError):
        ChatTemplate("{% for %}").render([{"role": "user", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequest):  # the sandbox refuses attribute access to Python internals
        sandboxed.render([{"role": "user", "content": "x"}])


# --- request conversion ----------------------------------------------------------------------------------------

def _completion(**fields):
    from folio.serve import openai_schema as oai

    return oai.parse_body(oai.CompletionBody, json.dumps({"model": "demo-model", "prompt": "hi", **fields}).encode())


def _chat(**fields):
    from folio.serve import openai_schema as oai

    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], **fields}
    return oai.parse_body(oai.ChatCompletionBody, json.dumps(body).encode())


def _requests(body, prompts=("hi",)):
    from folio.serve import openai_schema as oai

    return oai.generation_requests(body, list(prompts), [16] * len(prompts), oai.top_tokens_of(body))


def test_completion_body_becomes_one_request_per_choice():
    from folio.serve.schema import ResponseFormat

    body = _completion(n=2, seed=-1, stop="\n", temperature=0.5, logit_bias={"7": -100}, logprobs=3,
                       presence_penalty=0.5, frequency_penalty=0.25, top_k=5, user="ignored", best_of=2,
                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    requests = _requests(body, ["a", [5, 6]])
    assert [(r.text, r.token_ids, r.seed) for r in requests] == [
        ("a", None, 2**64 - 1), ("a", None, 0), (None, [5, 6], 2**64 - 1), (None, [5, 6], 0)]
    r = requests[0]
    assert r.stop_strings == ["\n"] and r.return_probs and r.return_top_tokens == 3
    assert r.sampling.temperature == 0.5 and r.sampling.top_p == 1.0 and r.sampling.top_k == 5
    assert r.sampling.repetition_penalty == 1.0 and r.sampling.token_bias == {7: -100.0}
    assert (r.sampling.presence_penalty, r.sampling.frequency_penalty) == (0.5, 0.25)
    assert r.response_format == ResponseFormat(json_schema=SCHEMA)
    assert _requests(_completion(response_format={"type": "json_object"}))[0].response_format == \
        ResponseFormat(json_schema={"type": "object"})
    plain = _requests(_completion())[0]
    assert not plain.return_probs and plain.seed is None and plain.sampling.temperature == 1.0


def test_completion_prompts_and_chat_fields():
    from folio.serve import openai_schema as oai

    assert oai.completion_prompts("x") == ["x"]
    assert oai.completion_prompts([1, 2]) == [[1, 2]]
    assert oai.completion_prompts([[1], [2]]) == [[1], [2]]
    assert oai.completion_prompts(["a", "b"]) == ["a", "b"]
    assert oai.chat_max_tokens(_chat(max_completion_tokens=5)) == 5
    assert oai.chat_max_tokens(_chat(max_tokens=5, max_completion_tokens=5)) == 5
    assert oai.top_tokens_of(_chat(logprobs=True, top_logprobs=4)) == 4
    assert oai.top_tokens_of(_chat(logprobs=True)) == 0
    assert oai.top_tokens_of(_chat()) is None
    parts = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                     "text": "b"}]}])
    assert oai.chat_messages(parts.messages) == [{"role": "user", "content": "a\nb"}]


@pytest.mark.parametrize("make, fields, param", [
    (_completion, {"tools": [{"type": "function"}]}, "tools"),
    (_chat, {"tool_choice": "auto"}, "tool_choice"),
    (_chat, {"modalities": ["text", "audio"]}, "modalities"),
    (_completion, {"echo": True}, "echo"),
    (_completion, {"suffix": "end"}, "suffix"),
    (_completion, {"best_of": 3}, "best_of"),
    (_completion, {"frobnicate": 1}, "frobnicate"),
    (_completion, {"temperature": "hot"}, "temperature"),
    (_completion, {"prompt": []}, "prompt"),
    (_completion, {"n": 0}, "n"),
    (_completion, {"stream_options": {"include_usage": True}}, "stream_options"),
    (_completion, {"stream": True, "stream_options": {"include_usage": True, "other": 1}}, "stream_options.other"),
    (_completion, {"logit_bias": {"seven": 1}}, "logit_bias"),
    (_chat, {"top_logprobs": 2}, "top_logprobs"),
    (_chat, {"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
    (_chat, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls"),
    (_chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    (_chat, {"messages": []}, "messages"),
])
def test_fields_folio_cannot_honour_are_refused_by_name(make, fields, param):
    from folio.serve import openai_schema as oai

    with pytest.raises(oai.OpenAIError) as info:
        body = make(**fields)
        if isinstance(body, oai.CompletionBody):
            _requests(body, oai.completion_prompts(body.prompt))
        else:
            oai.top_tokens_of(body)
            oai.chat_max_tokens(body)
            oai.chat_messages(body.messages)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body()
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_harmless_and_off_fields_are_accepted():
    _chat(tools=[], tool_choice="none", parallel_tool_calls=True, store=False, metadata={"a": "b"},
          service_tier="auto", modalities=["text"], user="u")
    _completion(echo=False, suffix=None, best_of=1)


# --- error shaping ---------------------------------------------------------------------------------------------

def test_request_errors_become_openai_errors():
    from ray.serve.exceptions import BackPressureError

    from folio.serve.openai_api import as_openai_error
    from folio.serve.openai_schema import COMPLETION_PARAMS

    error = as_openai_error(InvalidRequest("max_new_tokens", "too many"), COMPLETION_PARAMS)
    assert (error.status_code, error.param, error.message) == (400, "max_tokens", "max_tokens: too many")
    assert as_openai_error(InvalidRequest("temperature", "bad")).param == "temperature"
    slow = as_openai_error(Overloaded("full", retry_after_s=2.5))
    assert (slow.status_code, slow.headers["Retry-After"]) == (429, "3")
    assert as_openai_error(Overloaded("full")).headers["Retry-After"] == "1"
    assert as_openai_error(BackPressureError(num_queued_requests=2, max_queued_requests=1)).status_code == 429
    assert as_openai_error(ReplicaUnavailable("gone")).status_code == 503
    bug = as_openai_error(InternalError("boom"))
    assert (bug.status_code, bug.type) == (500, "server_error")
    assert set(bug.body()["error"]) == {"message", "type", "param", "code"}


# --- the app over a stand-in request path ----------------------------------------------------------------------

def _chunks(*texts: str, reason=EosReason.MAX_NEW_TOKENS):
    chunks = [Chunk(text=t, token_ids=[100 + i], token_probs=[0.5], top_tokens=[TopTokens([100 + i, 7], [0.5, 0.25])])
              for i, t in enumerate(texts)]
    chunks[-1].finish = Finish(reason=reason, usage=Usage(prompt_tokens=3, cached_tokens=1,
                                                          completion_tokens=len(texts)))
    return chunks


class FakePath:
    """The ingress's request path: each request's script, a list of Chunks and exceptions, played in order."""

    def __init__(self, script):
        self.script = script
        self.requests = []
        self.closed = 0

    async def stream(self, request, method):
        self.requests.append(request)
        try:
            for item in self.script(request):
                await asyncio.sleep(0)
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed += 1


def _app(tokenizer, script, template=True, demo_dir=None):
    from folio.serve.chat_template import ChatTemplate
    from folio.serve.openai_api import Backend, build_app

    async def model_info():
        return INFO

    async def tokenize(text, add_bos, encode_special_tokens):
        return tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=encode_special_tokens)

    path = FakePath(script)
    chat_template = ChatTemplate.from_model_dir(demo_dir) if template else None
    return build_app(Backend(path.stream, model_info, tokenizer, tokenize, chat_template)), path


def _call(app, method: str, path: str, body=None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP exchange with an ASGI app, in memory."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""

    async def run():
        sent, out = [], []

        async def receive():
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.sleep(3600)  # the client stays until the response ends

        async def send(message):
            out.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
                 "raw_path": path.encode(), "root_path": "", "query_string": b"", "scheme": "http",
                 "headers": [(b"content-type", b"application/json")], "server": ("test", 80), "client": ("t", 1)}
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
        start = next(m for m in out if m["type"] == "http.response.start")
        headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
        return start["status"], headers, b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")

    return asyncio.run(run())


def _events(raw: bytes) -> list:
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_app_completions_and_streaming(tokenizer, demo_dir):
    app, path = _app(tokenizer, lambda r: _chunks("Once", " more"), demo_dir=demo_dir)
    status, _, raw = _call(app, "POST", "/v1/completions", {"model": "demo-model", "prompt": "x", "n": 2,
                                                            "logprobs": 1})
    body = json.loads(raw)
    assert status == 200 and [c["text"] for c in body["choices"]] == ["Once more"] * 2
    assert body["choices"][0]["finish_reason"] == "length" and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [pytest.approx(math.log(0.5))] * 2 and logprobs["text_offset"][0] == 0

    status, headers, raw = _call(app, "POST", "/v1/chat/completions", {
        "model": "demo-model", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(raw)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Once"}
    assert events[1]["choices"][0]["delta"] == {"content": " more"}
    assert events[1]["choices"][0]["finish_reason"] == "length" and events[0]["usage"] is None
    assert path.requests[-1].token_ids[0] == 0 and path.requests[-1].max_new_tokens == INFO.max_request_tokens - \
        len(path.requests[-1].token_ids)  # chat: the template's own BOS; max_tokens: what the context leaves


def test_app_errors_are_openai_shaped(tokenizer, demo_dir):
    def script(request):
        if request.text == "full":
            return [Overloaded("full", retry_after_s=2.0)]
        if request.text == "bad":
            return [InvalidRequest("max_new_tokens", "too many")]
        return [Chunk(text="a", token_ids=[5]), InternalError("lost it; request id 7")]

    app, path = _app(tokenizer, script, template=False)
    for method, url, body, status, param in [
        ("POST", "/v1/completions", b"{not json", 400, None),
        ("POST", "/v1/completions", {"model": "demo-model"}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": "demo-model", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("POST", "/v1/completions", {"model": "demo-model", "prompt": "bad", "stream": True}, 400, "max_tokens"),
        ("POST", "/v1/chat/completions", {"model": "demo-model", "messages": MESSAGES}, 400, "messages"),
        ("GET", "/v1/nothing", None, 404, None),
        ("GET", "/v1/models/gpt-4", None, 404, "model"),
    ]:
        got, _, raw = _call(app, method, url, body)
        error = json.loads(raw)["error"]
        assert (got, error["param"]) == (status, param), (url, body, raw)
        assert set(error) == {"message", "type", "param", "code"}
    got, headers, raw = _call(app, "POST", "/v1/completions", {"model": "demo-model", "prompt": "full"})
    assert got == 429 and headers["retry-after"] == "2" and json.loads(raw)["error"]["code"] == "overloaded"
    # after the first chunk the status is sent: the error is the stream's last event
    got, _, raw = _call(app, "POST", "/v1/completions", {"model": "demo-model", "prompt": "late", "stream": True})
    events = _events(raw)
    assert got == 200 and events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["type"] == "server_error" and "[DONE]" not in events
    assert path.closed == len(path.requests)
    got, _, raw = _call(app, "GET", "/v1/models", None)
    assert got == 200 and json.loads(raw)["data"][0]["id"] == "demo-model"
    got, _, raw = _call(app, "GET", "/health", None)
    assert got == 200 and json.loads(raw)["status"] == "SERVING"


def test_closing_a_merged_stream_closes_every_request_stream(tokenizer):
    from folio.serve.openai_api import _merged
    from folio.serve.schema import GenerationRequest

    path = FakePath(lambda r: _chunks(*["x"] * 1000))

    async def run():
        for n in (1, 3):
            events = _merged(SimpleNamespace(stream=path.stream), [GenerationRequest(text="a")] * n, "m")
            assert (await anext(events))[1].text == "x"
            await events.aclose()
            for _ in range(10):
                await asyncio.sleep(0)

    path.closed = 0
    asyncio.run(run())
    assert path.closed == 4  # the client left: every choice's stream (and so its job) is closed at once


# --- through a real server -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("ray.serve")
    openai = pytest.importorskip("openai")
    from folio.demo import write_demo_model
    from folio.serve import local
    from folio.serve.config import ServeConfig

    model_dir = write_demo_model(tmp_path_factory.mktemp("openai") / "demo-model")
    config = ServeConfig(model_path=str(model_dir), num_gpus=0, num_cpus=0.5, ingress_num_cpus=0.2, num_replicas=1,
                         cache_tokens=1024, page_size=16, max_batch_size=1, max_queue_size=2, max_queued_requests=2,
                         grpc_port=free_port(), http_port=free_port(), app_name="folio")
    local.start_cluster(config)
    try:
        local.deploy(config)
        base = f"http://127.0.0.1:{config.http_port}/folio"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
        yield {"config": config, "base": base, "client": client, "model_dir": model_dir}
        client.close()
    finally:
        local.shutdown()


def _handle(prompt, **options):
    """The same request through the Python handle path (gRPC's request path), with OpenAI's sampling defaults."""
    from folio.serve.client import Client

    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    return Client("folio").complete_sync(prompt, **{**defaults, **options})


@pytest.mark.ray
def test_server_health_models_and_raw_errors(served):
    for path in ("", "/", "/health"):
        with urllib.request.urlopen(served["base"] + path, timeout=HTTP_TIMEOUT_S) as response:
            assert response.status == 200 and json.loads(response.read())["model"] == "demo-model"
    assert [m.id for m in served["client"].models.list()] == ["demo-model"]
    request = urllib.request.Request(served["base"] + "/v1/completions", data=b'{"model": ', method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["type"] == "invalid_request_error"


@pytest.mark.ray
def test_server_greedy_completion_equals_the_handle_path(served):
    client = served["client"]
    expected = _handle("Once upon a time", max_new_tokens=12, temperature=0.0)
    got = client.completions.create(model="demo-model", prompt="Once upon a time", max_tokens=12, temperature=0)
    choice = got.choices[0]
    assert choice.text == expected.text and choice.index == 0
    assert choice.finish_reason == ("length" if expected.finish.reason == EosReason.MAX_NEW_TOKENS else "stop")
    assert got.usage.completion_tokens == expected.finish.usage.completion_tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    streamed = list(client.completions.create(model="demo-model", prompt="Once upon a time", max_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    assert streamed[-1].usage.completion_tokens == got.usage.completion_tokens
    by_ids = client.completions.create(model="demo-model", prompt=expected_prompt_ids(served), max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == expected.text


def expected_prompt_ids(served):
    from folio import Tokenizer

    tokenizer = Tokenizer.from_pretrained(served["model_dir"])
    return tokenizer.encode("Once upon a time", add_bos=tokenizer.add_bos_token)


@pytest.mark.ray
def test_server_chat_equals_the_handle_path_on_the_transformers_prompt(served):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(served["model_dir"])
    expected = _handle(_hf_ids(hf, MESSAGES), max_new_tokens=10, temperature=0.0)
    client = served["client"]
    got = client.chat.completions.create(model="demo-model", messages=MESSAGES, max_completion_tokens=10,
                                         temperature=0)
    assert got.choices[0].message.content == expected.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(_hf_ids(hf, MESSAGES))
    chunks = list(client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.ray
def test_server_n_seeds_and_logprobs(served):
    client = served["client"]
    got = client.completions.create(model="demo-model", prompt="The harbour", max_tokens=6, temperature=1.0,
                                    seed=11, n=2, logprobs=2)
    assert [c.index for c in got.choices] == [0, 1]
    for i, choice in enumerate(got.choices):
        expected = _handle("The harbour", max_new_tokens=6, seed=11 + i, return_probs=True, return_top_tokens=2)
        assert choice.text == expected.text
        assert len(choice.logprobs.token_logprobs) == len(expected.token_ids)
        for lp, p in zip(choice.logprobs.token_logprobs, expected.token_probs):
            assert lp <= 0 and math.isclose(lp, math.log(p), abs_tol=1e-4)
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model="demo-model", messages=MESSAGES[1:2], max_tokens=4, seed=5,
                                          logprobs=True, top_logprobs=3, n=2, stream=True)
    by_choice: dict[int, list] = {0: [], 1: []}
    for chunk in chat:
        for c in chunk.choices:
            by_choice[c.index] += c.logprobs.content if c.logprobs else []
    for entries in by_choice.values():
        assert 1 <= len(entries) <= 4
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 and e.bytes is not None for e in entries)


@pytest.mark.ray
def test_server_stop_max_tokens_and_cached_usage(served):
    client = served["client"]
    full = client.completions.create(model="demo-model", prompt="Once upon a time", max_tokens=16, temperature=0)
    text = full.choices[0].text
    start = next(i for i in range(2, len(text) - 3) if text[i:i + 3].isascii() and text[i:i + 3].strip())
    stop = text[start:start + 3]
    stopped = client.completions.create(model="demo-model", prompt="Once upon a time", max_tokens=16,
                                        temperature=0, stop=[stop, "unlikely stop"])
    assert stopped.choices[0].text == text[:text.find(stop)] and stopped.choices[0].finish_reason == "stop"
    short = client.completions.create(model="demo-model", prompt="Once upon a time", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    cached = []
    for _ in range(2):
        usage = client.completions.create(model="demo-model", prompt=LONG_PROMPT, max_tokens=2).usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
        assert usage.prompt_tokens > 32 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert cached[1] >= 16, cached  # whole pages of the prompt came from the prefix cache


@pytest.mark.ray
def test_server_json_schema_response_format(served):
    jsonschema = pytest.importorskip("jsonschema")
    got = served["client"].chat.completions.create(
        model="demo-model", messages=MESSAGES[1:2], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.ray
def test_server_errors(served):
    openai = pytest.importorskip("openai")
    client = served["client"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="demo-model", prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=5000)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-model", messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert info.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="x")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.ray
def test_server_client_leaving_a_stream_cancels_its_job(served):
    """A client that closes its stream cancels the job: the replica is idle long before the job could have run to
    its end at the rate the stream came."""
    from folio.serve.client import replica_stats

    def idle():
        stats = replica_stats("folio")
        return bool(stats) and all(s["num_running"] == 0 and s["num_queued"] == 0 for s in stats.values())

    max_tokens = 900
    start_s = time.monotonic()
    stream = served["client"].completions.create(model="demo-model", prompt=LONG_PROMPT, max_tokens=max_tokens,
                                                 temperature=0, stream=True)
    received = 0
    for _ in stream:
        received += 1  # one event per engine step: at least one token each
        if received == 20:
            break
    tokens_per_s = received / (time.monotonic() - start_s)
    stream.close()
    closed_s = time.monotonic()
    while not idle() and time.monotonic() - closed_s < 30:
        time.sleep(0.05)
    freed_after_s = time.monotonic() - closed_s
    assert idle(), replica_stats("folio")
    assert freed_after_s < 0.5 * (max_tokens - received) / tokens_per_s, (freed_after_s, tokens_per_s)


@pytest.mark.ray
def test_server_flood_is_429_with_retry_after(served):
    """Last: the queues are left full for a moment. The application admits 5 requests at once (1 running + 2
    queued in the replica + 2 waiting); the rest are refused with OpenAI's 429 and a Retry-After. Requests are sent
    20 ms apart, so that they pass Serve's HTTP proxy and reach the ingress's admission: the proxy counts requests
    it is still routing as queued, and refuses a burst beyond the ingress's queue itself (Serve's own 503, or 429
    where the ingress deployment has a backpressure_config), not in OpenAI's shape."""
    openai = pytest.importorskip("openai")
    client = served["client"]
    outcomes, lock = [], threading.Lock()

    def one(i: int) -> None:
        try:
            client.completions.create(model="demo-model", prompt=f"flood {i}", max_tokens=128, temperature=0)
            outcome = "ok"
        except openai.APIStatusError as error:
            if not isinstance(error.body, dict):  # refused by Serve's proxy before reaching the application
                assert error.status_code in (429, 503) and "backpressure" in error.response.text, error.response.text
                outcome = "proxy"
            else:
                retry_after = error.response.headers.get("retry-after")
                assert error.status_code == 429 and retry_after is not None and int(retry_after) >= 1, error.body
                assert error.body["type"] == "rate_limit_error" and "Traceback" not in error.body["message"]
                outcome = "429"
        with lock:
            outcomes.append(outcome)

    with ThreadPoolExecutor(12) as pool:
        futures = []
        for i in range(12):
            futures.append(pool.submit(one, i))
            time.sleep(0.02)
        for future in futures:
            future.result(timeout=2 * HTTP_TIMEOUT_S)
    assert outcomes.count("429") >= 1 and outcomes.count("ok") >= 2, outcomes


def test_app_model_names_a_lora_adapter(tokenizer):
    """`model` may name a loaded adapter: listed under /v1/models with the model as its parent, applied to every
    choice's request, echoed in the response; other names are 404 listing what is served."""
    from folio.serve.adapters import AdapterInfo
    from folio.serve.openai_api import Backend, build_app

    path = FakePath(lambda r: _chunks("Once", " more"))
    tone = AdapterInfo(name="tone", path="/adapters/tone", rank=8, scale=2.0, target_modules=("q_proj",),
                       adapter_id="ab")

    async def adapters():
        return [tone]

    async def model_info():
        return INFO

    async def tokenize(text, add_bos, encode_special_tokens):
        return tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=encode_special_tokens)

    app = build_app(Backend(path.stream, model_info, tokenizer, tokenize, None, adapters=adapters))
    status, _, raw = _call(app, "GET", "/v1/models")
    cards = json.loads(raw)["data"]
    assert status == 200 and [c["id"] for c in cards] == [INFO.model_name, "tone"]
    assert cards[1]["parent"] == INFO.model_name and cards[1]["root"] == "/adapters/tone"
    status, _, raw = _call(app, "POST", "/v1/completions", {"model": "tone", "prompt": "x", "n": 2})
    assert status == 200 and json.loads(raw)["model"] == "tone"
    assert [r.lora for r in path.requests] == ["tone", "tone"]
    _call(app, "POST", "/v1/completions", {"model": INFO.model_name, "prompt": "x"})
    assert path.requests[-1].lora is None
    status, _, raw = _call(app, "POST", "/v1/completions", {"model": "other", "prompt": "x"})
    error = json.loads(raw)["error"]
    assert status == 404 and error["code"] == "model_not_found" and "'tone'" in error["message"]
