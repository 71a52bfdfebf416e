"""The servicer function Ray Serve's gRPC proxy is started with (gRPCOptions.grpc_servicer_functions).

It registers folio.v1.Generation like the generated `add_GenerationServicer_to_server`, and works around a Ray Serve
(2.60) proxy bug that would otherwise leak the job of a client that disconnects mid-stream:

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

This module runs inside the proxy process: it imports only asyncio, grpc's generated code and nothing of the engine.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from folio.proto.folio.v1 import generation_pb2_grpc

_DONE = object()


def add_GenerationServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 — grpc's naming
    """Register folio.v1.Generation on `server` (Serve's gRPCGenericServer, or any grpc server)."""
    factory = getattr(server, "service_handler_factory", None)
    if callable(factory):
        # gRPCGenericServer builds every method's handler with this factory while the service registers.
        server.service_handler_factory = cancellation_safe(factory)
    try:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    finally:
        if callable(factory):
            server.service_handler_factory = factory


def cancellation_safe(factory: Callable[..., Any]) -> Callable[..., Any]:
    def make_handler(*args: Any, **kwargs: Any) -> Any:
        handler = factory(*args, **kwargs)
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
