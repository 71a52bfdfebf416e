"""A bound on the folio.v1.Generation calls one Serve gRPC proxy process has in flight: beyond it a call is refused
in the proxy itself, before Serve's request handling, with RESOURCE_EXHAUSTED and a retry hint.

Why: the ingress's admission control (folio.serve.admission) decides precisely, but each call it refuses first
crosses Serve's proxy, which costs that Python process milliseconds of CPU per call. In a burst of thousands of
calls that shares the CPU with the replicas, the refusals took CPU from admitted work: a flood of 2,000 calls at two
demo replicas on two cores ran the admitted ones at 0.66x the rate of a closed loop of 64 streams. Refused here,
a call costs microseconds.

The bound (PROXY_LIMIT_ENV) is set by the clusters `folio serve` starts (folio.serve.local): what the application
admits and queues, plus the ingress's refusal headroom. Without it there is no gate. One gate per proxy process,
shared by every application the proxy serves. Refusals are counted in folio_proxy_refused_requests_total.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator
from typing import Any

from folio.serve.admission import Admission
from folio.serve.errors import RETRY_AFTER_KEY, Overloaded

PROXY_LIMIT_ENV = "FOLIO_PROXY_MAX_IN_FLIGHT"
GATED_PREFIX = "/folio.v1.Generation/Generate"  # Generate and GenerateUnary; never health checks

_gate: Admission | None = None
_refused = None


def gate_limit() -> int:
    try:
        return int(os.environ.get(PROXY_LIMIT_ENV, "0"))
    except ValueError:
        return 0


def _shared_gate(limit: int) -> Admission:
    global _gate
    if _gate is None:
        _gate = Admission(limit)
    return _gate


def _refuse(context: Any, method: str, error: Overloaded) -> None:
    import grpc

    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
    context.set_details(str(error))
    context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{error.retry_after_s:g}"),))
    _count(method)


def _count(method: str) -> None:
    global _refused
    if _refused is None:
        from ray.util.metrics import Counter

        _refused = Counter("folio_proxy_refused_requests_total", tag_keys=("method",),
                           description="gRPC calls the proxy refused (RESOURCE_EXHAUSTED) before Serve handled them: "
                                       "the application was full (folio.serve.proxy_gate)")
    _refused.inc(tags={"method": method.rsplit("/", 1)[-1]})


def gated(service_method: str, handler: Any) -> Any:
    """`handler` (one of the proxy's methods) behind the process's gate, when one is configured."""
    limit = gate_limit()
    if limit <= 0 or not service_method.startswith(GATED_PREFIX):
        return handler
    gate = _shared_gate(limit)
    if inspect.isasyncgenfunction(handler):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async with gate.admitted():
                    async for message in handler(request, context):
                        yield message
            except Overloaded as error:
                _refuse(context, service_method, error)

        return stream
    if inspect.iscoroutinefunction(handler):
        async def unary(request: Any, context: Any) -> Any:
            try:
                async with gate.admitted():
                    return await handler(request, context)
            except Overloaded as error:
                _refuse(context, service_method, error)
                return b""  # (the proxy's methods return serialized bytes; the status set above is sent)

        return unary
    return handler
