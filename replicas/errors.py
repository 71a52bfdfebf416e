"""Errors a caller can act on, each with the gRPC status it maps to (by name: this module imports no gRPC).

Raised by the ingress (validation) and by generator replicas; they cross Ray as the cause of a RayTaskError, so
they keep all their state in `args` (pickling re-creates them from it).
"""

from __future__ import annotations

import math

# A refusal's retry hint travels in gRPC trailing metadata under this key (seconds), and as HTTP's Retry-After.
RETRY_AFTER_KEY = "retry-after"
# The generator replica that served a streamed Generate call: trailing metadata under this key (diagnostics: load
# balance across replicas, seen from the client).
REPLICA_KEY = "folio-replica"
# The hint for a refusal by Serve's own bounded queues, which carry no estimate.
SERVE_REFUSAL_RETRY_AFTER_S = 1.0


class RequestError(Exception):
    """Base: `status` is a grpc.StatusCode name; `str(error)` is what the client reads."""

    status = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class FieldError(RequestError):
    """An error about one request field: `field` names it (the gRPC / Python field name) and the message starts
    with it."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.args = (field, problem)
        self.field = field
        self.problem = problem


class InvalidRequest(FieldError):
    """A request field is invalid."""

    status = "INVALID_ARGUMENT"


class Overloaded(RequestError):
    """Queues are full; retry later. `retry_after_s`: the server's estimate of when a retry may be admitted (sent
    as gRPC trailing metadata "retry-after" and HTTP's Retry-After), None when it has none."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.args = (message, retry_after_s)
        self.retry_after_s = retry_after_s


class ReplicaUnavailable(RequestError):
    """The replica serving the request was lost or is shutting down; retrying goes to a healthy one."""

    status = "UNAVAILABLE"


class Cancelled(RequestError):
    status = "CANCELLED"


class InternalError(RequestError):
    """A bug; the server log has the details, keyed by the request id in the message."""

    status = "INTERNAL"


class NotFound(FieldError):
    """A request names something the server does not have (a LoRA adapter)."""

    status = "NOT_FOUND"


class AlreadyExists(FieldError):
    status = "ALREADY_EXISTS"


class PermissionDenied(RequestError):
    """An admin RPC on a server whose config does not allow it."""

    status = "PERMISSION_DENIED"


class Unimplemented(FieldError):
    """The request uses a feature this server's engine lacks."""

    status = "UNIMPLEMENTED"


def http_retry_after(seconds: float) -> str:
    """HTTP's Retry-After takes whole seconds."""
    return str(max(1, math.ceil(seconds)))
