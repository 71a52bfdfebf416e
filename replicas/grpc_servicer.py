"""The servicer function Ray Serve's gRPC proxy is started with (gRPCOptions.grpc_servicer_functions).

It registers folio.v1.Generation like the generated `add_GenerationServicer_to_server`, and the standard health
service grpc.health.v1.Health (answered by the ingress: folio.serve.health) -- in the one function, so that every
config that names it (deploy/serve.yaml, the Helm chart's, users' own) serves health checks too. It works around a
Ray Serve (2.60) proxy bug that would otherwise leak the job of a client that disconnects mid-stream (and a health
Watch stream on the ingress):

The proxy's server-streaming handler is an async generator that yields each message to grpc, which then awaits
the network write. A client cancellation arriving during that write cancels grpc's task, not the handler, and the
handler is later closed with GeneratorExit at its `yield` -- a path on which the proxy never cancels the request it
sent to the ingress (ray-project/ray PR 42665, unmerged). The ingress and the generator replica then run the job to
its end, holding its pages. Cancellations that arrive while the proxy awaits the next result are handled.

The fix: run the proxy's handler in a task of its own that only ever waits inside the proxy's code (messages go to
an unbounded queue), stream from that queue, and cancel the task when the stream is closed or cancelled, or the RPC
ends in any other way (grpc's done callback). The cancellation then always lands where the proxy handles it: the
request is cancelled on the ingress, which cancels the generator replica's job (folio.serve.ingress). The queue holds
at most one completion per request.

The proxy's handler may thus finish after grpc released the call, and grpc's servicer context dereferences the
released call in peer() / peer_identities() / peer_identity_key() / auth_context() (a segfault): the handler gets a
context that answers those from a snapshot taken while the call was alive, and forwards everything else (plain
attribute reads and writes in grpc's RPC state).

Malformed requests: grpc parses each request with the method's deserializer before any handler runs, and bytes that
do not parse made it end the call with UNKNOWN and a Python class name in the details. The proxy's methods get a
deserializer that returns a MalformedRequest instead, which their handler refuses with INVALID_ARGUMENT
("malformed request: ...") without calling the proxy (TolerantRegistration, refusing_malformed).

This module runs inside the proxy process: it imports only asyncio, grpc and its generated code, nothing of the
engine.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from folio.proto.folio.v1 import generation_pb2_grpc
from folio.serve.errors import RETRY_AFTER_KEY, SERVE_REFUSAL_RETRY_AFTER_S
from folio.serve.proxy_gate import gated

_DONE = object()


def add_GenerationServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 — grpc's naming
    """Register folio.v1.Generation and grpc.health.v1.Health on `server` (Serve's gRPCGenericServer, or any grpc
    server)."""
    factory = getattr(server, "service_handler_factory", None)
    target = server
    if callable(factory):
        # gRPCGenericServer builds every method's handler with this factory while the service registers.
        server.service_handler_factory = cancellation_safe(factory)
        target = TolerantRegistration(server)  # (its handlers, made by the factory, refuse malformed requests)
    try:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, target)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, target)
    finally:
        if callable(factory):
            server.service_handler_factory = factory


def cancellation_safe(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make_handler(*args: Any, **kwargs: Any) -> Any:
        method = kwargs.get("service_method", args[0] if args else "")
        handler = gated(method, with_retry_hint(refusing_malformed(factory(*args, **kwargs))))
        return decoupled(handler) if inspect.isasyncgenfunction(handler) else handler

    return make_handler


def decoupled(handler: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """`handler`'s stream, produced by a task that is cancelled when the stream is closed or the RPC ends."""

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for message in handler(request, SnapshotContext(context)):
                    queue.put_nowait((message, None))
            except BaseException as error:  # noqa: BLE001 — re-raised by the consumer
                queue.put_nowait((_DONE, error))
                if isinstance(error, asyncio.CancelledError):
                    raise
                return
            queue.put_nowait((_DONE, None))

        task = asyncio.ensure_future(pump())
        if hasattr(context, "add_done_callback"):
            context.add_done_callback(lambda _context: task.cancel())  # a no-op once the handler finished
        try:
            while True:
                message, error = await queue.get()
                if message is _DONE:
                    if error is not None:
                        raise error
                    return
                yield message
        finally:
            task.cancel()

    return stream


class SnapshotContext:
    """grpc's servicer context, with the queries that read the C call answered from a snapshot (see above)."""

    def __init__(self, context: Any):
        self._context = context
        self._peer = context.peer()
        self._peer_identities = context.peer_identities()
        self._peer_identity_key = context.peer_identity_key()
        self._auth_context = context.auth_context()

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> Any:
        return self._peer_identities

    def peer_identity_key(self) -> Any:
        return self._peer_identity_key

    def auth_context(self) -> Any:
        return self._auth_context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class MalformedRequest:
    """What a method's request deserializer returns for bytes that do not parse as its message."""

    def __init__(self, error: Exception):
        self.details = f"malformed request: {str(error) or type(error).__name__}"

    def refuse(self, context: Any) -> None:
        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        context.set_details(self.details)


def tolerant_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 — refused by the handler (refusing_malformed)
            return MalformedRequest(error)

    return parse


def _tolerant(method_handler: Any) -> Any:
    """A grpc.RpcMethodHandler whose (single) request is parsed by tolerant_deserializer."""
    deserialize = getattr(method_handler, "request_deserializer", None)
    if deserialize is None or method_handler.request_streaming:
        return method_handler
    return method_handler._replace(request_deserializer=tolerant_deserializer(deserialize))


class TolerantRegistration:
    """`server` as a generated add_*Servicer_to_server function sees it: each method it registers parses its
    request with tolerant_deserializer. For servers whose handlers refuse MalformedRequest (Serve's, with
    cancellation_safe's factory)."""

    def __init__(self, server: Any):
        self._server = server

    def add_generic_rpc_handlers(self, generic_handlers: Any) -> None:
        for generic in generic_handlers:
            methods = getattr(generic, "_method_handlers", None)  # grpc's DictionaryGenericHandler (Serve reads it)
            if isinstance(methods, dict):
                generic._method_handlers = {name: _tolerant(h) for name, h in methods.items()}
        self._server.add_generic_rpc_handlers(generic_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(
            service_name, {name: _tolerant(h) for name, h in method_handlers.items()})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def refusing_malformed(handler: Any) -> Any:
    """`handler` (a proxy method), refusing a MalformedRequest with INVALID_ARGUMENT instead of sending it on."""
    if inspect.isasyncgenfunction(handler):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                request.refuse(context)
                return
            async for message in handler(request, context):
                yield message

        return stream
    if inspect.iscoroutinefunction(handler):
        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, MalformedRequest):
                request.refuse(context)
                return b""  # (the proxy's methods return serialized bytes; the status set above is sent)
            return await handler(request, context)

        return unary
    return handler


# Retry hints: the ingress refuses a request it cannot admit with RESOURCE_EXHAUSTED and "retry after N s" in the
# details. Serve carries only the code and details of a failed request from the ingress to the proxy (not its
# trailing metadata), so the hint is put back into trailing metadata here, where the proxy answers the client:
# "retry-after" (seconds), which clients read without parsing messages. Serve's own refusals (its bounded queues)
# get the default hint.
_RETRY_AFTER = re.compile(r"retry after ([0-9]+(?:\.[0-9]+)?) s")


def retry_after_s(details: str | None) -> float:
    match = _RETRY_AFTER.search(details or "")
    return float(match.group(1)) if match else SERVE_REFUSAL_RETRY_AFTER_S


def _add_retry_hint(context: Any) -> None:
    try:
        if context.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return
        details = context.details()
        if isinstance(details, bytes):
            details = details.decode("utf-8", errors="replace")
        seconds = retry_after_s(details)
        if not _RETRY_AFTER.search(details or ""):  # Serve's own refusal: say it as folio's do
            context.set_details(f"{details or 'the server is at capacity'}; retry after {seconds:g} s")
        context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{seconds:g}"),))
    except Exception:  # noqa: BLE001 — a hint only; the call may already be gone
        pass


def with_retry_hint(handler: Any) -> Any:
    """`handler` (a proxy method), adding the "retry-after" trailing metadata to RESOURCE_EXHAUSTED answers."""
    if inspect.isasyncgenfunction(handler):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for message in handler(request, context):
                    yield message
            finally:
                _add_retry_hint(context)

        return stream
    if inspect.iscoroutinefunction(handler):
        async def unary(request: Any, context: Any) -> Any:
            try:
                return await handler(request, context)
            finally:
                _add_retry_hint(context)

        return unary
    return handler
