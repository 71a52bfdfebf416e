"""The ingress deployment (CPU): folio.v1.Generation behind Ray Serve's gRPC proxy, and the same API for Python
callers through the application's handle (folio.serve.client).

Each request is validated and tokenized here, then streamed from a generator replica through
`DeploymentHandle.options(stream=True)`. Errors become gRPC statuses that name the problem, never a traceback:
INVALID_ARGUMENT (the field first), RESOURCE_EXHAUSTED, UNAVAILABLE, CANCELLED, INTERNAL. When the client goes
away, Serve cancels this method; closing the generator stream here cancels the job on the replica, which releases
its pages.

Ray Serve's gRPC proxy calls the method named like the RPC with the request message and `grpc_context`; a status
set on the context travels back when the method raises (replica.py wraps the exception in gRPCStatusError).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import LocalRayletDiedError, NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)
from ray.serve.handle import DeploymentHandle

from folio import Tokenizer
from folio.serve.config import ServeConfig
from folio.serve.errors import Cancelled, InternalError, InvalidRequest, Overloaded, ReplicaUnavailable, RequestError
from folio.serve.schema import Chunk, Completion, EngineRequest, GenerationRequest, ModelInfo
from folio.serve.validation import to_engine_request

logger = logging.getLogger(__name__)

# Routers that match prompt text (EngineRequest.prompt) rather than token ids.
TEXT_ROUTERS = ("ray_prefix",)
_UNAVAILABLE = (RayActorError, WorkerCrashedError, NodeDiedError, LocalRayletDiedError, DeploymentUnavailableError,
                ReplicaUnavailableError)


@serve.deployment(name="Ingress")
class Ingress:
    def __init__(self, generator: DeploymentHandle, config: ServeConfig):
        from folio.serve.metrics import IngressMetrics

        self._generator = generator
        self._config = config
        self._tokenizer = Tokenizer.from_pretrained(config.model_path)
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._metrics = IngressMetrics(config.app_name)

    # --- gRPC (folio.v1.Generation) ---

    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:  # noqa: N802
        from folio.serve import grpc_convert

        try:
            generation = grpc_convert.request_from_proto(request)
            async for chunk in self._observed_stream(generation, "Generate"):
                yield grpc_convert.chunk_to_proto(chunk)
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            _fail(grpc_context, error)

    async def GenerateUnary(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.serve import grpc_convert

        try:
            generation = grpc_convert.request_from_proto(request)
            chunks = [chunk async for chunk in self._observed_stream(generation, "GenerateUnary")]
            return grpc_convert.completion_to_proto(Completion.from_chunks(chunks))
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            _fail(grpc_context, error)

    async def Tokenize(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.proto.folio.v1 import generation_pb2 as pb

        try:
            ids = await self.tokenize(request.text, request.add_bos if request.HasField("add_bos") else None,
                                      request.encode_special_tokens)
            return pb.TokenizeResponse(token_ids=ids)
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            _fail(grpc_context, error)

    async def ModelInfo(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.serve import grpc_convert

        try:
            return grpc_convert.model_info_to_proto(await self.model_info())
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            _fail(grpc_context, error)

    # --- Python (through serve.get_app_handle; see folio.serve.client) ---

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        async for chunk in self._observed_stream(request, "generate_stream"):
            yield chunk

    async def generate(self, request: GenerationRequest) -> Completion:
        return Completion.from_chunks([chunk async for chunk in self._observed_stream(request, "generate")])

    async def tokenize(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest("text", f"must be a string, got {type(text).__name__}")
        tokenizer = self._tokenizer
        add_bos = tokenizer.add_bos_token if add_bos is None else add_bos
        if add_bos and tokenizer.bos_token_id is None:
            raise InvalidRequest("add_bos", "the model's tokenizer has no BOS token")
        return tokenizer.encode(text, add_bos=add_bos, encode_special_tokens=encode_special_tokens)

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        self._info = await self._generator.model_info.remote()
                    except Exception as error:  # noqa: BLE001 — mapped to a status below
                        raise as_request_error(error, "") from None
        return self._info

    # --- the request path ---

    async def _observed_stream(self, request: GenerationRequest, method: str) -> AsyncIterator[Chunk]:
        """Stream one request and record its metrics, whatever its outcome."""
        start_s = time.monotonic()
        first_token_s: float | None = None
        status = "CANCELLED"  # if the caller leaves, the code below never runs past a yield
        num_tokens = 0
        try:
            async for chunk in self._stream(request, start_s):
                if chunk.token_ids and first_token_s is None:
                    first_token_s = time.monotonic()
                if chunk.finish is not None:
                    num_tokens = chunk.finish.usage.completion_tokens
                yield chunk
            status = "OK"
        except RequestError as error:
            status = error.status
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            ttft_s = None if first_token_s is None else first_token_s - start_s
            tpot_s = None
            if status == "OK" and first_token_s is not None and num_tokens > 1:
                tpot_s = (time.monotonic() - first_token_s) / (num_tokens - 1)
            self._metrics.record(method, status, ttft_s, tpot_s)

    async def _stream(self, request: GenerationRequest, start_s: float) -> AsyncIterator[Chunk]:
        request_id = _request_id()
        info = await self.model_info()
        engine_request = to_engine_request(request, self._tokenizer, info, request_id,
                                           max_constraint_chars=self._config.max_constraint_chars)
        if self._config.router in TEXT_ROUTERS:
            engine_request = dataclasses.replace(engine_request, prompt=self._prompt_text(request, engine_request))
        response = self._generator.options(stream=True).generate.remote(engine_request)
        ended = False  # the stream finished or failed: nothing left to cancel
        first_token_s: float | None = None
        try:
            async for chunk in response:
                if chunk.token_ids and first_token_s is None:
                    first_token_s = time.monotonic()
                if chunk.finish is not None:
                    # What the client waited, measured here rather than on the replica.
                    timings = chunk.finish.timings
                    timings.total_s = time.monotonic() - start_s
                    timings.time_to_first_token_s = (first_token_s or time.monotonic()) - start_s
                yield chunk
            ended = True
        except Exception as error:  # noqa: BLE001 — every failure becomes a status the client can act on
            ended = True
            raise as_request_error(error, request_id) from None
        finally:
            if not ended:
                # The client left: cancel the replica's job so that its pages are released.
                cancel_quietly(response)

    def _prompt_text(self, request: GenerationRequest, engine_request: EngineRequest) -> str:
        if request.text:
            return request.text
        ids = list(engine_request.input_ids)
        # Never empty: PrefixCacheAffinityRouter divides by the prompt's length.
        return self._tokenizer.decode(ids, decode_special_tokens=True) or " ".join(map(str, ids))


def cancel_quietly(response: Any) -> None:
    """DeploymentResponseGenerator.cancel(), which re-raises the request's own failure (e.g. BackPressureError)
    when routing already failed: there is nothing left to cancel then."""
    try:
        response.cancel()
    except Exception:  # noqa: BLE001
        pass


def as_request_error(error: BaseException, request_id: str) -> RequestError:
    """The status a client should see for a failure below the ingress."""
    cause = error
    if isinstance(error, RayTaskError) and error.cause is not None:
        cause = error.cause  # the replica's own exception (str(RayTaskError) is a traceback)
    if isinstance(cause, RequestError):
        return type(cause)(*cause.args)
    if isinstance(cause, BackPressureError):
        return Overloaded("the server is at capacity (too many queued requests); retry later")
    if isinstance(cause, _UNAVAILABLE):
        logger.warning("request %s: generator replica unavailable: %s", request_id, type(cause).__name__)
        return ReplicaUnavailable("the replica serving this request was lost; retry")
    if isinstance(cause, (RequestCancelledError, asyncio.CancelledError)):
        return Cancelled("the request was cancelled")
    logger.error("request %s failed", request_id, exc_info=error)
    return InternalError(f"internal error ({type(cause).__name__}); request id {request_id}")


def _fail(grpc_context: Any, error: Exception) -> None:
    """Set the gRPC status and re-raise: the proxy sends the status set on the context with the exception."""
    import grpc

    if not isinstance(error, RequestError):
        error = as_request_error(error, _request_id())
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, error.status))
        grpc_context.set_details(str(error))
    raise error


def _request_id() -> str:
    try:
        return serve.get_request_context().request_id
    except Exception:  # noqa: BLE001 — outside a request context
        return ""
