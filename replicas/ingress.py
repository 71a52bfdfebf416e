"""The ingress deployment (CPU): folio.v1.Generation behind Ray Serve's gRPC proxy, grpc.health.v1.Health
(folio.serve.health), the OpenAI-compatible HTTP API behind Serve's HTTP proxy (folio.serve.openai_api), and the
same API for Python callers through the application's handle (folio.serve.client).

Every request is admitted first (folio.serve.admission: refused at once with RESOURCE_EXHAUSTED and a retry hint
when the application is full), then validated and tokenized on worker threads, then streamed from a generator
replica through `DeploymentHandle.options(stream=True)` (a unary call's completion comes whole). Errors become gRPC
statuses that name the problem, never a traceback: INVALID_ARGUMENT (the field first), RESOURCE_EXHAUSTED,
UNAVAILABLE, CANCELLED, INTERNAL. When the client goes away, Serve cancels this method; closing the generator stream
here cancels the job on the replica, which releases its pages.

Ray Serve's gRPC proxy calls the method named like the RPC with the request message and `grpc_context`; a status
set on the context travels back when the method raises (replica.py wraps the exception in gRPCStatusError) or, with
the context's trailing metadata, when a unary method returns normally (folio.serve.failures).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from folio import Tokenizer
from folio.serve.adapter_rpcs import AdapterRpcs
from folio.serve.adapters import IngressAdapters
from folio.serve.admission import Admission
from folio.serve.config import ServeConfig
from folio.serve.errors import REPLICA_KEY, InvalidRequest, ReplicaUnavailable, RequestError
from folio.serve.failures import answer_failure, as_request_error, cancel_quietly, current_request_id, fail
from folio.serve.health import HealthMixin
from folio.serve.ingress_mode import handle_for_this_process, running_mode
from folio.serve.schema import Chunk, Completion, EngineRequest, GenerationRequest, ModelInfo
from folio.serve.token_channel import ChannelServer, channel_chunks
from folio.serve.validation import (
    RequestLimits,
    check_prompt_bytes,
    check_text_bytes,
    request_limits,
    to_engine_request,
)

logger = logging.getLogger(__name__)

# Routers that match prompt text (EngineRequest.prompt) rather than token ids.
TEXT_ROUTERS = ("ray_prefix",)
VALIDATION_THREADS = 2
# How often a request whose replica was lost before sending it anything is sent again.
RETRIES_BEFORE_FIRST_CHUNK = 2


@serve.deployment(name="Ingress")
@serve.ingress()  # HTTP: the OpenAI-compatible API, built per replica by __serve_build_asgi_app__
class Ingress(HealthMixin, AdapterRpcs):  # grpc.health.v1.Health: Check, Watch, List; LoRA admin RPCs
    def __init__(self, generator: DeploymentHandle, config: ServeConfig):
        from folio.serve.metrics import IngressMetrics

        self._generator = handle_for_this_process(generator)  # (direct mode: gRPC to the generator replicas)
        self._config = config
        self._tokenizer = Tokenizer.from_pretrained(config.model_path)
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._channel: ChannelServer | None = None  # (config.token_channel: started at the first streamed request)
        self._channel_lock = asyncio.Lock()
        self._metrics = IngressMetrics(config.app_name)
        self._admission = Admission(config.ingress_admission_limit, config.ingress_queue_limit)
        self._adapters: IngressAdapters | None = None  # the LoRA registry's view, made at first use (needs Ray)
        self._limits: RequestLimits | None = None  # once the replicas' model info is known (its context)
        # Tokenizing and validating a request takes up to milliseconds per kilobyte of prompt: done off the event
        # loop, so that one large request never stalls the others' streams.
        self._validation_pool = ThreadPoolExecutor(max_workers=VALIDATION_THREADS, thread_name_prefix="validate")
        if running_mode() != config.ingress_mode:  # (a cluster-wide setting: the cluster's environment decides)
            logger.warning("ingress_mode is %r but this cluster runs %r (folio.serve.ingress_mode)",
                           config.ingress_mode, running_mode())

    # --- gRPC (folio.v1.Generation) ---

    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:  # noqa: N802
        from folio.serve import grpc_convert

        try:
            generation = self._from_proto(request, "Generate")
            async for chunk in self._observed_stream(generation, "Generate"):
                if chunk.finish is not None and chunk.finish.replica_id and grpc_context is not None:
                    grpc_context.set_trailing_metadata([(REPLICA_KEY, chunk.finish.replica_id)])
                yield grpc_convert.chunk_to_proto(chunk)
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            fail(grpc_context, error)

    async def GenerateUnary(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.serve import grpc_convert

        try:
            generation = self._from_proto(request, "GenerateUnary")
            chunks = [chunk async for chunk in self._observed_stream(generation, "GenerateUnary", stream=False)]
            return grpc_convert.completion_to_proto(Completion.from_chunks(chunks))
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            return answer_failure(grpc_context, error, "GenerateUnaryResponse")

    async def Tokenize(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.proto.folio.v1 import generation_pb2 as pb

        try:
            ids = await self.tokenize(request.text, request.add_bos if request.HasField("add_bos") else None,
                                      request.encode_special_tokens)
            return pb.TokenizeResponse(token_ids=ids)
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            return answer_failure(grpc_context, error, "TokenizeResponse")

    async def ModelInfo(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from folio.serve import grpc_convert

        try:
            info = dataclasses.replace(await self.model_info(), adapters=tuple(await self.list_loras()))
            return grpc_convert.model_info_to_proto(info)
        except Exception as error:  # noqa: BLE001 — a status, never a traceback
            return answer_failure(grpc_context, error, "ModelInfoResponse")

    # --- HTTP (the OpenAI-compatible API, folio.serve.openai_api; Serve calls this once the replica is built) ---

    def __serve_build_asgi_app__(self) -> Any:  # noqa: N807 — Serve's name
        from folio.serve import openai_api
        from folio.serve.chat_template import ChatTemplate

        return openai_api.build_app(openai_api.Backend(
            stream=self._observed_stream, model_info=self.model_info, tokenizer=self._tokenizer,
            tokenize=self.tokenize, chat_template=ChatTemplate.from_model_dir(self._config.model_path),
            request_id=current_request_id, health=lambda: self.serving_status(""), adapters=self.list_loras))

    # --- Python (through serve.get_app_handle; see folio.serve.client) ---

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        async for chunk in self._observed_stream(request, "generate_stream"):
            yield chunk

    async def generate(self, request: GenerationRequest) -> Completion:
        return Completion.from_chunks([chunk async for chunk in self._observed_stream(request, "generate",
                                                                                    stream=False)])

    async def tokenize(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest("text", f"must be a string, got {type(text).__name__}")
        tokenizer = self._tokenizer
        add_bos = tokenizer.add_bos_token if add_bos is None else add_bos
        if add_bos and tokenizer.bos_token_id is None:
            raise InvalidRequest("add_bos", "the model's tokenizer has no BOS token")
        check_text_bytes("text", text, await self._request_limits())
        return await asyncio.get_running_loop().run_in_executor(
            self._validation_pool, lambda: tokenizer.encode(text, add_bos=add_bos,
                                                            encode_special_tokens=encode_special_tokens))

    def admission_stats(self) -> dict[str, int]:
        """This ingress replica's admission state (folio.serve.admission): requests sent to the generators, waiting
        for a slot, refused so far; and the two limits."""
        a = self._admission
        return {"in_flight": a.in_flight, "waiting": a.num_waiting, "refused": a.num_refused, "limit": a.limit,
                "max_waiting": a.max_waiting}

    async def _request_limits(self) -> RequestLimits:
        """The config's request limits; the prompt-byte bound follows the replicas' context (their model info)."""
        if self._limits is None:
            self._limits = request_limits(self._config, self._tokenizer, await self.model_info())
        return self._limits

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

    def _from_proto(self, request: Any, method: str) -> GenerationRequest:
        """The message as a GenerationRequest; one refused here is counted in the metrics like any other."""
        from folio.serve import grpc_convert

        try:
            return grpc_convert.request_from_proto(request)
        except Exception as error:
            self._metrics.record(method, error.status if isinstance(error, RequestError) else "INTERNAL")
            raise

    async def _observed_stream(self, request: GenerationRequest, method: str, stream: bool = True
                               ) -> AsyncIterator[Chunk]:
        """Stream one request and record its metrics, whatever its outcome. stream=False: the completion comes as
        one Chunk (unary calls)."""
        start_s = time.monotonic()
        first_token_s: float | None = None
        status = "CANCELLED"  # if the caller leaves, the code below never runs past a yield
        num_tokens = 0
        try:
            async with self._admission.admitted():
                async for chunk in self._stream(request, start_s, stream):
                    if chunk.token_ids and first_token_s is None:
                        first_token_s = time.monotonic()
                        if not stream and chunk.finish is not None:
                            first_token_s = start_s + chunk.finish.timings.time_to_first_token_s
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

    async def _stream(self, request: GenerationRequest, start_s: float, stream: bool = True) -> AsyncIterator[Chunk]:
        request_id = current_request_id()
        info = await self.model_info()
        check_prompt_bytes(request, await self._request_limits())  # before tokenizing: a huge prompt costs nothing more
        engine_request = await asyncio.get_running_loop().run_in_executor(
            self._validation_pool, self._engine_request, request, info, request_id)
        if not stream:
            engine_request = dataclasses.replace(engine_request, stream=False)
        engine_request = await self._with_adapter(request, engine_request)
        channel = await self._token_channel() if stream and self._config.token_channel else None
        if channel is not None:
            engine_request = dataclasses.replace(engine_request, reply_to=channel.address)
        for attempt in range(1 + RETRIES_BEFORE_FIRST_CHUNK):
            if attempt:  # (a fresh id: nothing a replica of the failed call still sends can reach this attempt)
                engine_request = dataclasses.replace(engine_request, request_id=f"{request_id}.retry{attempt}")
            response = self._generator.options(stream=True).generate.remote(engine_request)
            chunks = response if channel is None else channel_chunks(channel.open(engine_request.request_id),
                                                                     response)
            ended = False  # the stream finished or failed: nothing left to cancel
            first_token_s: float | None = None
            any_chunk = False
            try:
                async for chunk in chunks:
                    if chunk.token_ids and first_token_s is None:
                        first_token_s = time.monotonic()
                    if chunk.finish is not None:
                        _as_client_waited(chunk.finish.timings, start_s,
                                          (first_token_s or time.monotonic()) if stream else None)
                    any_chunk = True
                    yield chunk
                ended = True
                return
            except Exception as error:  # noqa: BLE001 — every failure becomes a status the client can act on
                ended = True
                request_error = as_request_error(error, request_id)
                # A replica lost before it sent anything: the client has seen nothing, so the request can start
                # again elsewhere (folio's router ranks the lost replica last; Serve's own routers probe it). Calls
                # over gRPC meet this whenever a replica is killed: the call is accepted before the process is gone.
                if any_chunk or attempt == RETRIES_BEFORE_FIRST_CHUNK or not isinstance(request_error,
                                                                                       ReplicaUnavailable):
                    raise request_error from None
                logger.warning("request %s: retrying on another replica (%d of %d)", request_id, attempt + 1,
                               RETRIES_BEFORE_FIRST_CHUNK)
            finally:
                if not ended:
                    # The client left: cancel the replica's job so that its pages are released.
                    cancel_quietly(response)
                if channel is not None:
                    channel.close(engine_request.request_id)
                    await chunks.aclose()

    async def _token_channel(self) -> ChannelServer:
        """This replica's end of the token channel, listening on its node's address from the first use on."""
        async with self._channel_lock:
            if self._channel is None:
                import ray

                channel = ChannelServer()
                await channel.start(ray.util.get_node_ip_address())
                self._channel = channel
        return self._channel

    def _engine_request(self, request: GenerationRequest, info: ModelInfo, request_id: str) -> EngineRequest:
        """Validate and tokenize (a validation thread)."""
        engine_request = to_engine_request(request, self._tokenizer, info, request_id, limits=self._limits)
        if self._config.router in TEXT_ROUTERS:
            engine_request = dataclasses.replace(engine_request, prompt=self._prompt_text(request, engine_request))
        return engine_request

    def _prompt_text(self, request: GenerationRequest, engine_request: EngineRequest) -> str:
        if request.text:
            return request.text
        ids = list(engine_request.input_ids)
        # Never empty: PrefixCacheAffinityRouter divides by the prompt's length.
        return self._tokenizer.decode(ids, decode_special_tokens=True) or " ".join(map(str, ids))


def _as_client_waited(timings: Any, start_s: float, first_token_s: float | None) -> None:
    """A request's Timings as its client waited, measured at the ingress rather than on the replica, from start_s.
    first_token_s: when its first token (or else its end) arrived here; None for a unary completion, which arrives
    whole: its first token came when the replica's time after its first token began."""
    replica_after_first_s = timings.total_s - timings.time_to_first_token_s
    timings.total_s = time.monotonic() - start_s
    if first_token_s is not None:
        timings.time_to_first_token_s = first_token_s - start_s
    else:
        timings.time_to_first_token_s = max(0.0, timings.total_s - replica_after_first_s)
