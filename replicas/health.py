"""The standard gRPC health service (grpc.health.v1.Health) on folio's endpoint, answered by the ingress.

Serve's gRPC proxy sends every method it registered to the application's ingress method of the same name
(folio.serve.grpc_servicer registers Health beside folio.v1.Generation), so Check, Watch and List are ingress
methods: the Ingress deployment inherits them from HealthMixin.

Services: "" (the server as a whole) and "folio.v1.Generation". Both are SERVING while at least one generator
replica passes its own health check (Generator.check_health: the engine thread alive and making progress) and this
ingress replica is not shutting down; NOT_SERVING otherwise. Any other name is NOT_FOUND for Check and
SERVICE_UNKNOWN for Watch, as the protocol says (https://github.com/grpc/grpc/blob/master/doc/health-checking.md).

The generators are asked with `DeploymentHandle.broadcast("check_health")`: one call to every running replica that
bypasses the replicas' request queues, so a server busy with generations still answers within the timeout (a
routed call would wait behind them and report a loaded server as down). No running replica at all raises at
once. The answer is shared for PROBE_MAX_AGE_S by every health call of this ingress replica, so probes that arrive
by the hundred cost one broadcast a second.

Which application answers: the proxy routes by the request's `application` metadata. Without it, Serve (2.60,
ProxyRouter.get_handle_for_endpoint) routes to the only application when exactly one is deployed -- folio serve's
and the Helm chart's case, which is what Kubernetes' grpc probes (they cannot send metadata) rely on -- and answers
NOT_FOUND ("Application metadata not set") when there are several.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_SERVICE = "folio.v1.Generation"
SERVICES = ("", GENERATION_SERVICE)
PROBE_MAX_AGE_S = 1.0  # a generator probe's answer serves every health call for this long
PROBE_TIMEOUT_S = 2.0  # generator replicas that have not all answered by then count as not serving
WATCH_PERIOD_S = 1.0  # how often a Watch stream re-evaluates the status


class UnknownService(LookupError):
    """Check of a service this server does not have (gRPC NOT_FOUND)."""


class GeneratorProbe:
    """Whether any generator replica is healthy, asked at most once per `max_age_s` however many callers ask
    (one probe in flight at a time; a caller that goes away does not cancel it for the others)."""

    def __init__(self, handle: Any, max_age_s: float = PROBE_MAX_AGE_S, timeout_s: float = PROBE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self._handle = handle
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._answer: tuple[bool, str] | None = None
        self._answered_s = 0.0
        self._probe: asyncio.Future | None = None

    async def healthy(self) -> tuple[bool, str]:
        """(healthy, why) -- why says how many replicas answered, or what failed."""
        if self._answer is not None and self._clock() - self._answered_s < self._max_age_s:
            return self._answer
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._probe)

    async def _ask(self) -> tuple[bool, str]:
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            results = await self._handle.broadcast("check_health").results_async(
                timeout_s=self._timeout_s, return_exceptions=True)
            num_healthy = sum(not isinstance(result, BaseException) for result in results)
            answer = (num_healthy > 0, f"{num_healthy} of {len(results)} generator replicas healthy")
        except DeploymentUnavailableError:
            answer = (False, "no generator replica is running")
        except TimeoutError:
            answer = (False, f"generator replicas did not answer within {self._timeout_s:g} s")
        except Exception as error:  # noqa: BLE001 — any failure to ask is an unhealthy answer, never a crash
            answer = (False, f"generator probe failed: {type(error).__name__}: {error}")
        finally:
            self._probe = None
        if self._answer is None or answer[0] != self._answer[0]:
            logger.log(logging.INFO if answer[0] else logging.WARNING, "health: %s (%s)",
                       "SERVING" if answer[0] else "NOT_SERVING", answer[1])
        self._answer, self._answered_s = answer, self._clock()
        return answer


def replica_draining() -> bool:
    """Whether Serve began shutting down the replica this runs in. Serve (2.60) tells user code nothing until its
    drain is over (__del__ runs once no request is left, and a Watch stream would be one for the whole
    graceful_shutdown_timeout_s), so this reads the flag the replica sets when the controller asks it to stop:
    ReplicaActor._replica_impl._shutting_down, the actor instance found by its id in Ray's worker. False outside a
    replica, or if a Ray upgrade moved any of it (tests/test_serving_health.py's drain test would then fail)."""
    try:
        from ray._private.worker import global_worker

        actor_id = global_worker.core_worker.get_actor_id()
        return bool(global_worker.actors[actor_id]._replica_impl._shutting_down)
    except Exception:  # noqa: BLE001 — not in a replica, or Serve's internals changed: never fail a health call
        return False


class HealthMixin:
    """grpc.health.v1.Health's methods for the Ingress deployment, which sets `self._generator` (the generator
    deployment's handle)."""

    _generator: Any
    _health_probe: GeneratorProbe | None = None

    @staticmethod
    def draining() -> bool:
        return replica_draining()

    async def serving_status(self, service: str) -> tuple[str, str]:
        """("SERVING" | "NOT_SERVING", why) of one of SERVICES; raises UnknownService for any other name."""
        if service not in SERVICES:
            raise UnknownService(f"unknown service {service!r}; this server has {', '.join(map(repr, SERVICES))}")
        if self.draining():
            return "NOT_SERVING", "the ingress is shutting down"
        if self._health_probe is None:
            self._health_probe = GeneratorProbe(self._generator)
        healthy, why = await self._health_probe.healthy()
        return ("SERVING" if healthy else "NOT_SERVING"), why

    # --- gRPC (grpc.health.v1.Health) ---

    async def Check(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802 — the RPC's name
        from grpc_health.v1 import health_pb2

        try:
            status, _ = await self.serving_status(request.service)
        except UnknownService as error:
            _set_status(grpc_context, "NOT_FOUND", str(error))
            raise
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:  # noqa: N802
        """The status now, then each change. Ends after NOT_SERVING once the ingress drains, so that a watcher
        never holds a replica that shuts down (clients watch again, and reach a live replica)."""
        from grpc_health.v1 import health_pb2

        sent = None
        while True:
            draining = self.draining()  # read first: a status read after it says NOT_SERVING too
            try:
                status, _ = await self.serving_status(request.service)
            except UnknownService:
                status = "SERVICE_UNKNOWN"  # the protocol's answer to Watch: the service may appear later
            if status != sent:
                yield health_pb2.HealthCheckResponse(status=status)
                sent = status
            if draining:
                return
            await asyncio.sleep(WATCH_PERIOD_S)

    async def List(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        from grpc_health.v1 import health_pb2

        statuses = {}
        for service in SERVICES:
            status, _ = await self.serving_status(service)
            statuses[service] = health_pb2.HealthCheckResponse(status=status)
        return health_pb2.HealthListResponse(statuses=statuses)


def _set_status(grpc_context: Any, code: str, details: str) -> None:
    """The status the proxy sends with the exception raised next (as folio.serve.failures.fail does)."""
    if grpc_context is not None:
        import grpc

        grpc_context.set_code(getattr(grpc.StatusCode, code))
        grpc_context.set_details(details)
