"""An OpenAI-compatible HTTP API on the ingress deployment, beside its gRPC methods (one ingress, one request path).

Under the application's route prefix (/folio: the base URL is http://HOST:PORT/folio/v1):

    GET  /v1/models, /v1/models/{model}    the served model (its id: the model directory's name) and each loaded
                                           LoRA adapter (its id: the adapter's name; `parent`: the model)
    POST /v1/completions                   prompt: text, token ids, or a list of either
    POST /v1/chat/completions              messages, rendered with the model's chat template
                                           (both: `model` names the model, or an adapter to apply)
    GET  /, /health                        a small JSON answer

Bodies are checked and converted by folio.serve.openai_schema (its docstring lists the fields, and those refused)
and each choice becomes a GenerationRequest streamed through the ingress's own request path, so validation,
tokenization, routing and metrics are the gRPC API's. Errors are OpenAI's shape, {"error": {message, type, param,
code}}: InvalidRequest 400 (param: the field), an unknown model or route 404, Overloaded 429 with Retry-After,
ReplicaUnavailable 503, InternalError 500. A streamed response whose headers are sent ends with a last event
`data: {"error": ...}` instead. A client that leaves (or cancels) ends the stream, which cancels its jobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from folio import Tokenizer
from folio.serve import openai_schema as oai
from folio.serve.chat_template import ChatTemplate
from folio.serve.errors import (
    SERVE_REFUSAL_RETRY_AFTER_S,
    Cancelled,
    FieldError,
    Overloaded,
    ReplicaUnavailable,
    RequestError,
    http_retry_after,
)
from folio.serve.openai_response import Shaper
from folio.serve.openai_schema import OpenAIError
from folio.serve.schema import Chunk, GenerationRequest, ModelInfo


@dataclass(frozen=True)
class Backend:
    """What the routes need from the ingress: its request path (a GenerationRequest and a method name for the
    metrics -> Chunks), the model's info, its tokenizer and chat template, and its tokenize method (text, add_bos,
    encode_special_tokens -> ids: the prompt size limit, off the event loop)."""

    stream: Callable[[GenerationRequest, str], AsyncIterator[Chunk]]
    model_info: Callable[[], Awaitable[ModelInfo]]
    tokenizer: Tokenizer
    tokenize: Callable[[str, bool | None, bool], Awaitable[list[int]]]
    chat_template: ChatTemplate | None
    request_id: Callable[[], str] = lambda: ""
    health: Callable[[], Awaitable[tuple[str, str]]] | None = None  # ("SERVING" | "NOT_SERVING", why)
    # the LoRA adapters (folio.serve.adapters.AdapterInfo) a request's `model` may name instead of the base model
    adapters: Callable[[], Awaitable[list[Any]]] | None = None


def build_app(backend: Backend) -> FastAPI:
    app = FastAPI(title="folio", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
        code = "unknown_url" if error.status_code == 404 else None
        return error_response(OpenAIError(error.status_code, str(error.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(oai.bad_request(None, str(error)))

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, error: RequestError) -> JSONResponse:
        return error_response(as_openai_error(error))

    @app.exception_handler(Exception)
    async def _bug(_: Request, error: Exception) -> JSONResponse:
        return error_response(as_openai_error(error))  # logged with its traceback by as_request_error

    @app.get("/")
    @app.get("/health")
    async def health() -> JSONResponse:
        info = await _model_info(backend)
        status, why = ("SERVING", "") if backend.health is None else await backend.health()
        body = {"status": status, "model": info.model_name, "openai_base_url": "v1"}
        if why:
            body["detail"] = why
        return JSONResponse(body, status_code=200 if status == "SERVING" else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = await _model_info(backend)
        return {"object": "list", "data": [_model_card(info), *(_adapter_card(a, info)
                                                                for a in await _adapters(backend))]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        info = await _model_info(backend)
        adapter = await _resolve_model(backend, model, info)
        return _model_card(info) if adapter is None else _adapter_card(adapter, info)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = oai.parse_body(oai.CompletionBody, await request.body())
        info = await _model_info(backend)
        adapter = await _resolve_model(backend, body.model, info)
        prompts = oai.completion_prompts(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else oai.COMPLETIONS_DEFAULT_MAX_TOKENS
        requests = _with_adapter(oai.generation_requests(body, prompts, [max_tokens] * len(prompts),
                                                         oai.top_tokens_of(body)), adapter)
        shaper = Shaper(False, f"cmpl-{_response_id(backend)}", int(time.time()), body.model, backend.tokenizer)
        return await _respond(backend, body, requests, shaper, "OpenAICompletions", oai.COMPLETION_PARAMS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = oai.parse_body(oai.ChatCompletionBody, await request.body())
        info = await _model_info(backend)
        adapter = await _resolve_model(backend, body.model, info)
        messages = oai.chat_messages(body.messages)
        if backend.chat_template is None:
            raise oai.bad_request("messages", "messages: the served model has no chat template (use "
                                              "/v1/completions)")
        text = await _render(backend.chat_template, messages)
        # Tokenized here, not on the request path, because max_tokens' default depends on the prompt's length.
        options = ChatTemplate.encode_options()
        try:
            ids = await backend.tokenize(text, options["add_bos"], options["encode_special_tokens"])
        except RequestError as error:
            raise as_openai_error(error, oai.CHAT_PARAMS) from None
        max_tokens = oai.chat_max_tokens(body)
        if max_tokens is None:  # OpenAI's default: whatever the context leaves
            max_tokens = max(1, info.max_request_tokens - len(ids))
        requests = _with_adapter(oai.generation_requests(body, [ids], [max_tokens], oai.top_tokens_of(body)), adapter)
        params = dict(oai.CHAT_PARAMS)
        if body.max_completion_tokens is not None:
            params["max_new_tokens"] = "max_completion_tokens"
        shaper = Shaper(True, f"chatcmpl-{_response_id(backend)}", int(time.time()), body.model, backend.tokenizer)
        return await _respond(backend, body, requests, shaper, "OpenAIChatCompletions", params)

    return app


# --- responses ---

async def _respond(backend: Backend, body: Any, requests: list[GenerationRequest], shaper: Shaper, method: str,
                   params: Mapping[str, str | None]) -> Response:
    if not body.stream:
        try:
            wholes = await _collect_all(backend, requests, method)
        except Exception as error:  # noqa: BLE001 — every failure becomes an OpenAI error
            raise as_openai_error(error, params) from None
        return JSONResponse(shaper.response(wholes, body.n))
    events = _merged(backend, requests, method)
    try:
        # The first chunk before the headers: a request refused (400, 429, ...) gets its HTTP status.
        first = await anext(events)
    except Exception as error:  # noqa: BLE001
        await events.aclose()
        raise as_openai_error(error, params) from None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    sse = _sse(events, first, shaper, len(requests), body.n, include_usage, params)
    return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _sse(events: AsyncIterator[tuple[int, Chunk]], first: tuple[int, Chunk], shaper: Shaper,
               num_choices: int, n: int, include_usage: bool, params: Mapping[str, str | None]
               ) -> AsyncIterator[str]:
    started = [False] * num_choices
    offsets = [0] * num_choices
    finishes: list[Any] = [None] * num_choices
    try:
        index, chunk = first
        while True:
            if chunk.finish is not None:
                finishes[index] = chunk.finish
            if chunk.text or chunk.token_ids or chunk.finish is not None or not started[index]:
                yield _event(shaper.chunk(index, chunk, not started[index], offsets[index], include_usage))
                started[index] = True
                offsets[index] += len(chunk.text)
            try:
                index, chunk = await anext(events)
            except StopAsyncIteration:
                break
        if include_usage:
            yield _event(shaper.usage_chunk(finishes, n))
        yield "data: [DONE]\n\n"
    except Exception as error:  # noqa: BLE001 — the headers are sent: the error is the stream's last event
        if not isinstance(error, Cancelled):  # cancelled: the client left, or the server stops; nothing to say
            yield _event(as_openai_error(error, params).body())
    finally:
        await events.aclose()


def _event(body: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _collect_all(backend: Backend, requests: Sequence[GenerationRequest], method: str) -> list[Chunk]:
    """Each request's chunks merged, run concurrently; the first failure cancels the others."""

    async def collect(index: int, request: GenerationRequest) -> Chunk:
        if len(requests) > 1:
            own_serve_identity(index)
        whole = Chunk()
        async for chunk in backend.stream(request, method):  # a cancellation lands in the stream, which cancels
            whole.extend(chunk)
        if whole.finish is None:
            raise RuntimeError("the stream ended without its final chunk")
        return whole

    if len(requests) == 1:
        return [await collect(0, requests[0])]
    tasks = [asyncio.ensure_future(collect(i, r)) for i, r in enumerate(requests)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a no-op on those done; a failure or the caller's cancellation stops the rest


async def _merged(backend: Backend, requests: Sequence[GenerationRequest], method: str
                  ) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) from all requests' streams as they come. Closing this cancels the streams left
    (which cancels their jobs on the replicas)."""
    if len(requests) == 1:
        stream = backend.stream(requests[0], method)
        try:
            async for chunk in stream:
                yield 0, chunk
        finally:
            # Closed at the yield above (the client left): close the request's stream now, not when it is
            # garbage-collected, so that its job is cancelled at once.
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, request: GenerationRequest) -> None:
        own_serve_identity(index)
        try:
            async for chunk in backend.stream(request, method):
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, done))
        except Exception as error:  # noqa: BLE001 — handed to the consumer
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def own_serve_identity(index: int) -> None:
    """Give the current task (choice `index` of a request with several) a Serve request identity of its own.

    Ray Serve (2.60) gives every handle call made while serving a request that request's internal id, and its
    router keeps the calls it is routing by that id: two calls routed at once for one request collide, and one of
    them is never routed (it waits forever). A task runs in a copy of its creator's context, so the identity set
    here is this choice's alone. The request id (logs, the engine job's identifier) gets the choice as a suffix."""
    try:
        from ray.serve import context
    except ImportError:  # not under Serve (the unit tests' stand-in path)
        return
    current = context._serve_request_context.get()
    if current is None or not current._internal_request_id:
        return  # outside a Serve request: every call gets fresh ids anyway
    context._serve_request_context.set(dataclasses.replace(
        current, _internal_request_id=f"{current._internal_request_id}-{index}",
        request_id=f"{current.request_id}-{index}" if current.request_id else ""))


# --- errors ---

def as_openai_error(error: BaseException, params: Mapping[str, str | None] | None = None) -> OpenAIError:
    """The OpenAI error for a failure on the request path (`params`: folio's field names -> the API's)."""
    if isinstance(error, OpenAIError):
        return error
    if not isinstance(error, RequestError):
        from folio.serve.failures import as_request_error

        error = as_request_error(error, "")
    message = str(error)
    if isinstance(error, FieldError):
        param = (params or {}).get(error.field, error.field)
        if param is not None and param != error.field:
            message = f"{param}: {error.problem}"
        return OpenAIError(400, message, param=param, code=error.status.lower())
    if isinstance(error, Overloaded):
        retry_after = getattr(error, "retry_after_s", None) or SERVE_REFUSAL_RETRY_AFTER_S
        return OpenAIError(429, message, type="rate_limit_error", code="overloaded",
                           headers={"Retry-After": http_retry_after(retry_after)})
    if isinstance(error, (ReplicaUnavailable, Cancelled)):  # Cancelled: by the server (a client that left reads
        return OpenAIError(503, message, type="server_error", code="unavailable")  # nothing)
    return OpenAIError(500, message, type="server_error", code=error.status.lower())


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


# --- helpers ---

async def _model_info(backend: Backend) -> ModelInfo:
    try:
        return await backend.model_info()
    except Exception as error:  # noqa: BLE001
        raise as_openai_error(error) from None


async def _adapters(backend: Backend) -> list[Any]:
    if backend.adapters is None:
        return []
    try:
        return await backend.adapters()
    except Exception as error:  # noqa: BLE001
        raise as_openai_error(error) from None


async def _resolve_model(backend: Backend, name: str, info: ModelInfo) -> Any:
    """The LoRA adapter a request's `model` names (None: the base model); 404 for anything else."""
    if name == info.model_name:
        return None
    adapters = await _adapters(backend)
    for adapter in adapters:
        if adapter.name == name:
            return adapter
    served = ", ".join(repr(n) for n in [info.model_name, *(a.name for a in adapters)])
    raise OpenAIError(404, f"The model '{name}' does not exist; this server serves {served}", param="model",
                      code="model_not_found")


def _with_adapter(requests: list[GenerationRequest], adapter: Any) -> list[GenerationRequest]:
    return requests if adapter is None else [dataclasses.replace(r, lora=adapter.name) for r in requests]


def _model_card(info: ModelInfo) -> dict[str, Any]:
    return {"id": info.model_name, "object": "model", "created": 0, "owned_by": "folio",
            "max_model_len": info.max_request_tokens}


def _adapter_card(adapter: Any, info: ModelInfo) -> dict[str, Any]:
    """A LoRA adapter as a model of its own (its `parent` the base model), as OpenAI-compatible servers list them."""
    return {**_model_card(info), "id": adapter.name, "parent": info.model_name, "root": adapter.path}


async def _render(template: ChatTemplate, messages: list[dict[str, Any]]) -> str:
    # Rendering runs user-influenced Jinja: off the event loop, which the other requests' streams share.
    return await asyncio.to_thread(template.render, messages)


def _response_id(backend: Backend) -> str:
    return backend.request_id() or uuid.uuid4().hex
