"""Ports for servers that bind them later (TF PS and workers, nats-servers) come from below the ephemeral range.

An outgoing connection takes its local port from the ephemeral range: a port picked there and bound seconds
later was found taken ("Could not start gRPC server" of a TF worker, beside a loaded test run).
"""

from __future__ import annotations

import socket
from pathlib import Path

from pacer.embedded import LISTEN_PORTS_FROM, _ephemeral_low, free_port
from pacer.trainer.cluster import ClusterDesc


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    high = _ephemeral_low()
    for _ in range(50):
        port = free_port()
        assert LISTEN_PORTS_FROM <= port < high, (port, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", port))


def test_a_port_in_use_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(200):
            port = free_port()
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", port))  # would raise if free_port gave a port a socket holds
            held.append(s)
    finally:
        for s in held:
            s.close()


def test_a_local_cluster_has_distinct_ports() -> None:
    for _ in range(20):
        c = ClusterDesc.local(3, 8)
        ports = [int(a.rsplit(":", 1)[1]) for a in (*c.ps, *c.workers)]
        assert len(c.ps) == 3 and len(c.workers) == 8 and len(set(ports)) == 11, ports


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert _ephemeral_low(f) == 40000
    assert _ephemeral_low(tmp_path / "missing") == 32768
