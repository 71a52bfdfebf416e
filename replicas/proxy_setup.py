"""Run in every worker process of a cluster `folio serve` starts (Ray's worker_process_setup_hook), before Serve's
gRPC servers start: raise gRPC's limits on calls waiting to be picked up, and bind the gRPC proxy and the replicas'
gRPC servers (direct mode, folio.serve.ingress_mode) to the host `folio serve` serves on (GRPC_HOST_ENV; Serve binds
every interface otherwise).

gRPC's C core cancels incoming calls (status CANCELLED, details "CANCELLED") at random once more than
`grpc.server.max_pending_requests` (1,000) have arrived but not yet been taken by the server's Python loop, and all of
them beyond the hard limit (3,000). A burst of 2,000 concurrent requests at Serve's proxy, whose Python loop takes
calls one at a time, lost about 5% that way: "spurious CANCELLED" a client cannot tell from its own cancellation.
With the limits raised, every call reaches the proxy and then folio's admission control, which answers
RESOURCE_EXHAUSTED with a retry hint. Memory per waiting call is a few kilobytes.

Serve builds the server from ray.serve._private.constants.DEFAULT_GRPC_SERVER_OPTIONS (ray 2.60) and offers no
option for it: the hook extends that list in place, once Serve's gRPC module is imported. Serve binds its gRPC proxy
to "[::]:port" through default_impl.add_grpc_address, looked up when the proxy starts, with no option either: the
hook replaces that function when GRPC_HOST_ENV names a host. Imports nothing of the engine.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

GRPC_HOST_ENV = "FOLIO_GRPC_HOST"

MAX_PENDING_CALLS = 100_000
PENDING_CALL_OPTIONS = (
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
)


# Patched right after Serve's module holding add_grpc_address (which imports the gRPC server's module and its
# options) has run, so that workers that never run Serve do not pay the half second importing ray.serve takes.
TRIGGER_MODULE = "ray.serve._private.default_impl"


def setup_worker() -> None:
    if TRIGGER_MODULE in sys.modules:
        patch_serve()
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def patch_serve() -> None:
    from ray.serve._private import constants, default_impl

    raise_grpc_pending_limits(constants.DEFAULT_GRPC_SERVER_OPTIONS)
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    if not getattr(default_impl.add_grpc_address, "folio_host", None):
        default_impl.add_grpc_address = bound_to(host, default_impl.add_grpc_address)
    # The replicas' inter-deployment gRPC servers (calls between deployments in direct mode, folio.serve
    # .ingress_mode) bind "[::]:0" through tls_utils.add_port_to_grpc_server, which the replica module imported by
    # name before it imported default_impl: patched in both places, whichever imported first.
    from ray._common import tls_utils

    for module in (tls_utils, sys.modules.get("ray.serve._private.replica")):
        if module is not None and not getattr(module.add_port_to_grpc_server, "folio_host", None):
            module.add_port_to_grpc_server = bound_to(host, module.add_port_to_grpc_server)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds TRIGGER_MODULE through the other finders, and runs patch_serve once it has executed."""

    def find_spec(self, name: str, path=None, target=None):
        if name != TRIGGER_MODULE:
            return None
        sys.meta_path.remove(self)  # once: the real finders locate it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module) -> None:
            exec_module(module)
            patch_serve()

        spec.loader.exec_module = exec_then_patch
        return spec


def raise_grpc_pending_limits(options: list) -> None:
    present = {key for key, _ in options}
    options.extend(option for option in PENDING_CALL_OPTIONS if option[0] not in present)


def bound_to(host: str, add_address):
    """A function adding a port to a gRPC server (Serve's add_grpc_address, Ray's add_port_to_grpc_server), with
    a wildcard host ("[::]:port", "0.0.0.0:port") replaced by `host`."""

    def add(server, address: str):
        bind_host, port = address.rsplit(":", 1)
        if bind_host not in ("[::]", "0.0.0.0", ""):
            return add_address(server, address)
        return add_address(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    add.folio_host = host
    return add
