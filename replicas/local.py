"""A local Ray cluster (its services on loopback) serving folio: what `folio serve` and the serving tests run.

    start_cluster(config)      ray.init on 127.0.0.1 (no dashboard by default) + Serve with folio's gRPC servicer
    deploy(config)             the application (ingress + generator replicas); blocks until it is healthy
    shutdown()                 Serve, then Ray
    record_server / running_server / join
                               `folio serve` records its cluster in server_record_path(); another process on the
                               machine reads it and joins that cluster (folio.serve.connect)

Where things listen: Ray's own services (GCS, raylet, object store, metrics agent) on 127.0.0.1; Serve's HTTP proxy
and Serve's gRPC proxy on config.http_host (Serve 2.60 binds the gRPC proxy to [::] and has no option for it:
folio.serve.proxy_setup rebinds it).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import HTTPOptions

import folio
from folio.serve import ingress_mode
from folio.serve.app import INGRESS_REFUSAL_HEADROOM, build_application, grpc_options, route_prefix
from folio.serve.config import ServeConfig
from folio.serve.proxy_gate import PROXY_LIMIT_ENV
from folio.serve.proxy_setup import GRPC_HOST_ENV

AUTH_MODE_ENV_VAR = "RAY_AUTH_MODE"  # ray._private.authentication.authentication_token_setup's
_haproxy: ingress_mode.LocalHAProxy | None = None  # the HAProxy of the cluster start_cluster started (direct mode)


def start_cluster(config: ServeConfig, num_cpus: float | None = None, log_to_driver: bool = False,
                  metrics_export_port: int | None = None, include_dashboard: bool = False) -> Any:
    """Start a single-node Ray cluster bound to 127.0.0.1 and Serve's proxies (gRPC on config.grpc_port); returns
    ray.init's context (address_info: gcs_address, metrics_export_port, ...). `metrics_export_port`: where Ray's
    metrics agent serves Prometheus text (folio's metrics among them); None: a free port Ray picks.
    `include_dashboard`: Ray's dashboard on 127.0.0.1:8265, which `serve status` and `ray list actors` need (it adds
    seconds to the start)."""
    _ensure_protos()
    _export_pythonpath()
    _loopback_only()
    # Serve's proxies set SO_REUSEPORT by default, so that a second server on this machine would share a port with
    # the first, each getting some of its connections. A local cluster never needs that: without it, a proxy whose
    # port was taken fails instead (ray reads this in the proxy process, started with this environment).
    os.environ["SERVE_SOCKET_REUSE_PORT_ENABLED"] = "0"
    # Serve's gRPC proxy binds where its HTTP proxy does (proxy_setup; Serve itself binds every interface).
    os.environ[GRPC_HOST_ENV] = config.http_host
    # The gRPC proxy refuses calls beyond what the application admits and queues before Serve handles them: in a
    # burst, refusals then cost the proxy microseconds instead of milliseconds of CPU (proxy_gate).
    os.environ[PROXY_LIMIT_ENV] = str(proxy_limit(config))
    global _haproxy
    _haproxy = ingress_mode.LocalHAProxy() if config.ingress_mode == "direct" else None
    try:
        with ingress_mode.local_environment(config.ingress_mode, _haproxy):  # (the cluster inherits it, not this one)
            context = ray.init(
                address="local",
                _node_ip_address="127.0.0.1",
                include_dashboard=include_dashboard,
                num_cpus=num_cpus if num_cpus is not None else max(2, os.cpu_count() or 2),
                log_to_driver=log_to_driver,
                configure_logging=False,
                # In every worker, before Serve's gRPC servers start: no call cancelled by gRPC in a burst (proxy_setup)
                runtime_env={"worker_process_setup_hook": "folio.serve.proxy_setup.setup_worker"},
                **({"_metrics_export_port": metrics_export_port} if metrics_export_port else {}),
            )
    except BaseException:
        _stop_haproxy()
        raise
    try:
        serve.start(
            http_options=HTTPOptions(host=config.http_host, port=config.http_port),
            grpc_options=grpc_options(config),
        )
    except BaseException:
        # A proxy that could not bind (its port taken) leaves Ray running: stop it, so that the caller's next
        # start_cluster is not refused as a second ray.init.
        shutdown()
        raise
    return context


def proxy_limit(config: ServeConfig) -> int:
    """Calls one gRPC server lets through at once: what the ingress replicas behind it admit and queue, and refuse
    in a moment. Serve's proxy serves all of them; in direct mode each ingress replica runs a server of its own."""
    per_ingress = config.ingress_admission_limit + config.ingress_queue_limit + INGRESS_REFUSAL_HEADROOM
    return per_ingress if config.ingress_mode == "direct" else config.ingress_replicas * per_ingress


def deploy(config: ServeConfig) -> serve.handle.DeploymentHandle:
    """Deploy (or update) the application named config.app_name and wait until it runs; returns its ingress
    handle. The route prefix is the HTTP API's path, and matters to gRPC too: Serve's gRPC proxy only routes to
    applications that have one (ray 2.60)."""
    return serve.run(build_application(config), name=config.app_name, route_prefix=route_prefix(config))


def shutdown() -> None:
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        _stop_haproxy()


def _stop_haproxy() -> None:
    global _haproxy
    if _haproxy is not None:
        _haproxy.stop()
        _haproxy = None


# --- the record of a running `folio serve`, for clients on the same machine ---

def server_record_path() -> Path:
    """Where `folio serve` records its cluster: $XDG_CACHE_HOME/folio/serve.json (~/.cache/folio/serve.json)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "folio" / "serve.json"


def record_server(config: ServeConfig, context: Any) -> Path:
    """Record the cluster this process started (start_cluster's context) and what it serves; the newest
    `folio serve` on the machine wins."""
    info = context.address_info
    record = {"pid": os.getpid(), "gcs_address": info["gcs_address"], "app_name": config.app_name,
              "grpc_port": config.grpc_port, "http_port": config.http_port,
              "metrics_port": info.get("metrics_export_port"),
              # ray.init turned token authentication on for this cluster unless the user said otherwise
              "auth_mode": os.environ.get(AUTH_MODE_ENV_VAR, "")}
    path = server_record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(record, indent=1) + "\n")
    temporary.replace(path)  # readers never see half a file
    return path


def forget_server() -> None:
    """Remove the record if it is this process's (a newer server's stays)."""
    path = server_record_path()
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def running_server() -> dict[str, Any]:
    """The record of the `folio serve` running on this machine; LookupError (saying what to do) when there is none."""
    path = server_record_path()
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise LookupError(f"no `folio serve` is running on this machine ({path} does not exist): start one "
                          "first") from None
    except (OSError, ValueError) as error:
        raise LookupError(f"cannot read {path}: {error}") from None
    if not _alive(record.get("pid")):
        raise LookupError(f"the `folio serve` recorded in {path} (pid {record.get('pid')}) is not running: start one "
                          "first")
    return record


def join(record: dict[str, Any]) -> None:
    """Connect this process as a driver to the cluster of a running_server() record. Its node is 127.0.0.1: left
    to itself, Ray would look for a raylet on another interface's address and retry forever. With token
    authentication (Ray's default for a cluster ray.init starts) it sends the user's token (~/.ray/auth_token,
    where that cluster's start saved it, or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH), as Ray does for a local cluster
    it finds itself (address="auto") and never for an explicit address."""
    _loopback_only()
    if record.get("auth_mode") == "token" and AUTH_MODE_ENV_VAR not in os.environ:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    ray.init(address=record["gcs_address"], _node_ip_address="127.0.0.1", log_to_driver=False)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True


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
