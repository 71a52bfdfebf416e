"""Ports picked for a local cluster's processes (folio.serve.ports)."""

import socket

from folio.serve import ports


def test_ports_come_from_between_rays_worker_range_and_the_ephemeral_range():
    span = ports.unassigned_port_range()
    assert span.start == ports.RAY_WORKER_PORTS_END and span.stop == max(span.start, ports.ephemeral_port_start())
    picked = [ports.free_loopback_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)  # never the same port twice
    if len(span):
        assert all(port in span for port in picked)
    for port in picked:  # each one can be bound right away
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_an_empty_range_falls_back_to_a_port_the_kernel_picks(monkeypatch):
    kernel_start = ports.ephemeral_port_start()
    monkeypatch.setattr(ports, "ephemeral_port_start", lambda: 10000)
    assert len(ports.unassigned_port_range()) == 0
    port = ports.free_loopback_port()
    assert port >= kernel_start  # (the kernel's pick, from its own range)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
