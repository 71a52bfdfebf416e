"""Free loopback ports for the processes of a local cluster.

A port found free by binding port 0 comes from the kernel's ephemeral range, the range every process that binds
port 0 or opens a connection draws from too. Ray's processes do both while a cluster starts (its core workers bind
port 0; its workers take ports from 10002-19999, Ray's default worker range), so such a port can be taken between
the pick and Serve's proxy binding it, which then fails to start. Ports are picked from below the ephemeral range
and above Ray's worker range instead, where nothing is handed out automatically.
"""

from __future__ import annotations

import random
import socket

RAY_WORKER_PORTS_END = 20000  # one past Ray's default max_worker_port
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LINUX_EPHEMERAL_START = 32768
_handed_out: set[int] = set()
_rng = random.SystemRandom()


def ephemeral_port_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's setting; its default where it cannot be read)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LINUX_EPHEMERAL_START


def unassigned_port_range() -> range:
    """The ports between Ray's worker range and the ephemeral range (empty where the ephemeral range starts lower)."""
    return range(RAY_WORKER_PORTS_END, max(RAY_WORKER_PORTS_END, ephemeral_port_start()))


def free_loopback_port(host: str = "127.0.0.1", attempts: int = 1000) -> int:
    """A TCP port on `host` that nobody listens on now, from unassigned_port_range(), and not one this process
    handed out before (a port picked for a cluster is not bound until the cluster starts). Falls back to a port the
    kernel picks where that range is empty or full."""
    ports = unassigned_port_range()
    if len(ports):
        for _ in range(attempts):
            port = _rng.choice(ports)
            if port in _handed_out:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    _handed_out.add(port)
    return port
