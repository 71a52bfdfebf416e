"""A local Ray cluster on loopback serving folio: what `folio serve` and the serving tests run.

    start_cluster(config)      ray.init on 127.0.0.1 (no dashboard) + Serve with folio's gRPC servicer
    deploy(config)             the application (ingress + generator replicas); blocks until it is healthy
    shutdown()                 Serve, then Ray
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import HTTPOptions

import folio
from folio.serve.app import build_application, grpc_options, route_prefix
from folio.serve.config import ServeConfig


def start_cluster(config: ServeConfig, num_cpus: float | None = None, log_to_driver: bool = False,
                  metrics_export_port: int | None = None) -> None:
    """Start a single-node Ray cluster bound to 127.0.0.1 and Serve's proxies (gRPC on config.grpc_port).
    `metrics_export_port`: where Ray's metrics agent serves Prometheus text (folio's metrics among them)."""
    _ensure_protos()
    _export_pythonpath()
    _loopback_only()
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus if num_cpus is not None else max(2, os.cpu_count() or 2),
        log_to_driver=log_to_driver,
        configure_logging=False,
        **({"_metrics_export_port": metrics_export_port} if metrics_export_port else {}),
    )
    serve.start(
        http_options=HTTPOptions(host=config.http_host, port=config.http_port),
        grpc_options=grpc_options(config),
    )


def deploy(config: ServeConfig) -> serve.handle.DeploymentHandle:
    """Deploy (or update) the application named config.app_name and wait until it runs; returns its ingress
    handle. The route prefix matters to gRPC too: Serve's gRPC proxy only routes to applications that have one
    (ray 2.60), though the ingress answers no HTTP request."""
    return serve.run(build_application(config), name=config.app_name, route_prefix=route_prefix(config))


def shutdown() -> None:
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _loopback_only() -> None:
    """Keep every Ray service on 127.0.0.1. On Linux Ray binds its services to the node's address and resolves
    even "127.0.0.1" to a reachable interface (services.resolve_ip_for_localhost); its single-machine mode, the
    default on macOS and Windows, keeps them on loopback. The node address is decided in this process (and passed
    to the processes it starts); the environment variable is for those that read the setting themselves."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _ensure_protos() -> None:
    """Generate the gRPC modules when a source checkout has not been built (the proxy imports them). An installed
    wheel carries only the generated modules: nothing to do."""
    from folio.proto import compile as protos_compile

    if protos_compile.proto_files() and not protos_compile.is_current():
        protos_compile.compile_protos()


def _export_pythonpath() -> None:
    """Workers (the gRPC proxy, the replicas) must import the folio this process imported. ray.init starts the
    local cluster's processes with this process's environment, so putting the checkout that holds this folio on
    PYTHONPATH reaches them all. A regular install needs nothing (site-packages is every worker's, and must not
    move ahead of the standard library). folio.serve, folio.router and folio.proto come from the install either
    way (replicas/, router/, protos/ are mapped into folio's namespace): a checkout serves once installed with
    `pip install -e .`."""
    holder = Path(folio.__file__).resolve().parent.parent
    if holder in {Path(sysconfig.get_path(name)).resolve() for name in ("purelib", "platlib")}:
        return
    root = str(holder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if root not in sys.path:
        sys.path.insert(0, root)
