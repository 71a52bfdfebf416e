"""OpenAI request bodies (/v1/completions, /v1/chat/completions) and their conversion to GenerationRequests.

Every field of a body is one of four kinds, so that no setting is ever accepted and silently dropped:

supported      model, n, stream, stream_options.include_usage, stop, max_tokens (chat: also
               max_completion_tokens), temperature, top_p, seed, presence_penalty, frequency_penalty, logit_bias,
               response_format ({"type": "text" | "json_object" | "json_schema"}: accepted by completions too),
               completions: prompt, logprobs (int); chat: messages, logprobs (bool), top_logprobs.
               folio's own, outside OpenAI's API (the openai client's extra_body): top_k, min_p,
               repetition_penalty.
ignored        (harmless: they change nothing about the output) user, metadata, store, service_tier,
               safety_identifier, prompt_cache_key, parallel_tool_calls (meaningless without tools).
off only       accepted only at the value that means "off", else a 400 naming the field, because folio cannot
               honour them: tools / functions (null or []), tool_choice / function_call (null or "none"),
               modalities (null or ["text"]), audio, prediction, reasoning_effort, verbosity, web_search_options
               (null), echo (false: no prompt log-probabilities), suffix (null or ""), best_of (null or n).
unknown        anything else: a 400 naming it.

Semantics follow OpenAI where folio's engine defaults differ: temperature and top_p default to 1 and top-k and the
repetition penalty are off unless given. Choice i of a request with a seed samples with seed + i (a negative
int64 seed is taken modulo 2**64), so n > 1 gives n different samples that are each reproducible. Log-probabilities
are those of the distribution the token was drawn from (after temperature and truncation): a greedy pick has 0.
A chat prompt is the model's chat template rendered with add_generation_prompt and tokenized with its special
tokens; completions' max_tokens defaults to 16 (as OpenAI's), chat's to what the context leaves after the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from folio.serve.errors import InvalidRequest
from folio.serve.schema import GenerationRequest, ResponseFormat, Sampling

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 64  # n times the number of prompts: one request's share of a server
SEED_MODULUS = 1 << 64

IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "parallel_tool_calls"})


def _off(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


# field -> (what folio lacks, whether a value means "off")
OFF_ONLY_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "tools": ("tool calling is not supported", _off([])),
    "functions": ("function calling is not supported", _off([])),
    "tool_choice": ("tool calling is not supported", _off("none")),
    "function_call": ("function calling is not supported", _off("none")),
    "modalities": ("only text output is supported", _off(["text"])),
    "audio": ("audio output is not supported", _off()),
    "prediction": ("predicted outputs are not supported", _off()),
    "reasoning_effort": ("the served model has no reasoning settings", _off()),
    "verbosity": ("the served model has no verbosity setting", _off()),
    "web_search_options": ("web search is not supported", _off()),
    "echo": ("echo is not supported (the engine returns no prompt log-probabilities)", _off(False)),
    "suffix": ("suffix (insertion) is not supported", _off("")),
}


class OpenAIError(Exception):
    """An error as OpenAI's API reports it: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


# --- bodies ---

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # folio's constraint is always exact: true and false both get it


class ResponseFormatSpec(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls and the like: refused by chat_messages()

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # sorted by check_fields(): ignored, off only, unknown

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormatSpec | None = None
    best_of: int | None = None
    # folio's, outside OpenAI's API
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


class ChatCompletionBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """The body as `model`, its fields sorted (see the module's docstring); a 400 naming the field otherwise."""
    import json

    try:
        data = json.loads(raw)
    except ValueError as error:
        raise bad_request(None, f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise bad_request(None, "the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = _param_path(first["loc"])
        raise bad_request(param or None, f"{param or 'body'}: {first['msg']}") from None
    check_fields(body)
    return body


# Parts of a pydantic error location that name a union's member type, not a field ("prompt", "list[int]", 0).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "ChatMessage", "StreamOptions",
                        "ResponseFormatSpec", "JsonSchemaSpec"})


def _param_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as the param OpenAI names: messages[0].role, stream_options.include_usage."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _TYPE_TAGS and "[" not in part and "-" not in part:
            param += f".{part}" if param else part
    return param


def check_fields(body: _Body) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name in OFF_ONLY_FIELDS:
            reason, is_off = OFF_ONLY_FIELDS[name]
            if not is_off(value):
                raise bad_request(name, f"{name}: {reason}")
            continue
        raise bad_request(name, f"{name}: unknown field")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of", "best_of: only best_of = n is supported (no server-side ranking)")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options: only allowed with stream: true")
    if not 1 <= body.n <= MAX_CHOICES:
        raise bad_request("n", f"n: must be in [1, {MAX_CHOICES}], got {body.n}")


# --- conversion ---

def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completions body: a string, token ids, or a list of either (one choice set each)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt", "prompt: is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: text content as a string; tool calls, images and audio refused."""
    if not messages:
        raise bad_request("messages", "messages: at least one message is needed")
    out = []
    for i, message in enumerate(messages):
        for name, value in (message.model_extra or {}).items():
            if value is not None:
                raise bad_request(f"messages[{i}].{name}", f"messages[{i}].{name}: not supported "
                                                           "(tool calling and audio are not)")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}]: only text parts "
                                                                     "are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


def generation_requests(body: _Body, prompts: Sequence[str | list[int]], max_new_tokens: Sequence[int],
                        return_top_tokens: int | None, prompt_options: Mapping[str, Any] | None = None
                        ) -> list[GenerationRequest]:
    """One GenerationRequest per choice: prompt p's sample i is choice p * n + i. `return_top_tokens`: None for no
    log-probabilities, else how many alternatives each token reports."""
    options: dict[str, Any] = dict(
        sampling=sampling(body), stop_strings=stop_strings(body.stop), response_format=response_format(body),
        return_probs=return_top_tokens is not None, return_top_tokens=return_top_tokens or 0,
        **(prompt_options or {}))
    requests = []
    for prompt, max_new in zip(prompts, max_new_tokens):
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % SEED_MODULUS
            prompt_field = {"text": prompt} if isinstance(prompt, str) else {"token_ids": list(prompt)}
            requests.append(GenerationRequest(**prompt_field, max_new_tokens=max_new, seed=seed, **options))
    if len(requests) > MAX_CHOICES:
        raise bad_request("n", f"n times the number of prompts is {len(requests)}; at most {MAX_CHOICES}")
    return requests


def sampling(body: _Body) -> Sampling:
    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    token_bias = {}
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_bias[int(key)] = bias
        except ValueError:
            raise bad_request("logit_bias", f"logit_bias: keys are token ids, got {key!r}") from None
    return Sampling(temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0), top_k=given(body.top_k, 0),
                    min_p=body.min_p, repetition_penalty=given(body.repetition_penalty, 1.0),
                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                    token_bias=token_bias)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def response_format(body: _Body) -> ResponseFormat | None:
    spec = body.response_format
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return ResponseFormat(json_schema={"type": "object"})
    if spec.json_schema is None or spec.json_schema.schema_ is None:
        raise bad_request("response_format", "response_format: type json_schema needs json_schema.schema")
    return ResponseFormat(json_schema=spec.json_schema.schema_)


def chat_max_tokens(body: ChatCompletionBody) -> int | None:
    given = {name: value for name in ("max_completion_tokens", "max_tokens")
             if (value := getattr(body, name)) is not None}
    if len(set(given.values())) > 1:
        raise bad_request("max_tokens", "max_tokens: differs from max_completion_tokens; give one of them")
    return next(iter(given.values()), None)


def top_tokens_of(body: _Body) -> int | None:
    """How many alternatives each token's log-probabilities list (None: no log-probabilities)."""
    if isinstance(body, ChatCompletionBody):
        if not body.logprobs:
            if body.top_logprobs is not None:
                raise bad_request("top_logprobs", "top_logprobs: needs logprobs: true")
            return None
        return body.top_logprobs or 0
    return body.logprobs


# folio's field (InvalidRequest.field) -> the OpenAI parameter a client set
_COMMON_PARAMS = {"stop_strings": "stop", "token_bias": "logit_bias", "response_format.json_schema": "response_format",
                  "sampler": None}
COMPLETION_PARAMS = {**_COMMON_PARAMS, "max_new_tokens": "max_tokens", "text": "prompt", "token_ids": "prompt",
                     "return_top_tokens": "logprobs"}
CHAT_PARAMS = {**_COMMON_PARAMS, "max_new_tokens": "max_tokens", "text": "messages", "token_ids": "messages",
               "prompt": "messages", "return_top_tokens": "top_logprobs"}


def param_of(error: InvalidRequest, params: Mapping[str, str | None]) -> str | None:
    return params.get(error.field, error.field)
