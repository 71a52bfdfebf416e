"""What a client sees when a request fails below the ingress: every failure becomes a folio.serve.errors
RequestError (a gRPC status that names the problem, never a traceback), set on the gRPC context the way Ray
Serve's proxy sends it back (raised for a stream; returned with an empty response for a unary call, so that the
context's trailing metadata, the retry hint, travels too)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from ray import serve
from ray.exceptions import LocalRayletDiedError, NodeDiedError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from folio.serve.errors import (
    RETRY_AFTER_KEY,
    SERVE_REFUSAL_RETRY_AFTER_S,
    Cancelled,
    InternalError,
    Overloaded,
    ReplicaUnavailable,
    RequestError,
)

logger = logging.getLogger(__name__)

_UNAVAILABLE = (RayActorError, WorkerCrashedError, NodeDiedError, LocalRayletDiedError, DeploymentUnavailableError,
                ReplicaUnavailableError)


def cancel_quietly(response: Any) -> None:
    """DeploymentResponseGenerator.cancel(), which re-raises the request's own failure (e.g. BackPressureError)
    when routing already failed: there is nothing left to cancel then."""
    try:
        response.cancel()
    except Exception:  # noqa: BLE001
        pass


def as_request_error(error: BaseException, request_id: str) -> RequestError:
    """The status a client should see for a failure below the ingress. An INTERNAL one names the request id
    under which the failure is logged here (a new one when the caller has none)."""
    request_id = request_id or new_request_id()
    cause = error
    if isinstance(error, RayTaskError) and error.cause is not None:
        cause = error.cause  # the replica's own exception (str(RayTaskError) is a traceback)
    if isinstance(cause, RequestError):
        return type(cause)(*cause.args)
    if isinstance(cause, BackPressureError):
        return Overloaded("the server is at capacity (too many queued requests); retry later",
                          retry_after_s=SERVE_REFUSAL_RETRY_AFTER_S)
    if isinstance(cause, _UNAVAILABLE):
        logger.warning("request %s: generator replica unavailable: %s", request_id, type(cause).__name__)
        return ReplicaUnavailable("the replica serving this request was lost; retry")
    if isinstance(cause, (RequestCancelledError, asyncio.CancelledError)):
        return Cancelled("the request was cancelled")
    logger.error("request %s failed", request_id, exc_info=error)
    return InternalError(f"internal error ({type(cause).__name__}); request id {request_id}")


def fail(grpc_context: Any, error: Exception) -> None:
    """Set the gRPC status and re-raise: the proxy sends the status set on the context with the exception (a
    stream's status travels only this way)."""
    error = set_status(grpc_context, error)
    raise error


def answer_failure(grpc_context: Any, error: Exception, response_type: str) -> Any:
    """A unary call's failure: the status set on the context, and an empty response that the proxy discards for
    it. Not raising spares the proxy and the ingress an exception's traceback and log per refusal, which made
    refusals in a flood slower than the work admitted; the context's trailing metadata (the retry hint) travels
    only this way. Raises without a gRPC context (Python callers)."""
    error = set_status(grpc_context, error)
    if grpc_context is None:
        raise error
    from folio.proto.folio.v1 import generation_pb2 as pb

    return getattr(pb, response_type)()


def set_status(grpc_context: Any, error: Exception) -> RequestError:
    import grpc

    if not isinstance(error, RequestError):
        error = as_request_error(error, current_request_id())
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, error.status))
        grpc_context.set_details(str(error))
        retry_after_s = getattr(error, "retry_after_s", None)
        if retry_after_s is not None:
            grpc_context.set_trailing_metadata([(RETRY_AFTER_KEY, f"{retry_after_s:g}")])
    return error


def current_request_id() -> str:
    """Serve's id of the current request; a new one where Serve has none (outside a request context, or a call
    through a handle that set none), so that logs and an INTERNAL status always name a real id."""
    try:
        request_id = serve.get_request_context().request_id
    except Exception:  # noqa: BLE001 — outside a request context
        request_id = ""
    return request_id or new_request_id()


def new_request_id() -> str:
    return uuid.uuid4().hex
