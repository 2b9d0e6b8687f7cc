"""Ports for servers that bind them later (TF PS and workers, nats-servers) come from below the ephemeral range.

An outgoing connection takes its local port from the ephemeral range: a port picked there and bound seconds
later was found taken ("Could not start gRPC server" of a TF worker, beside a loaded test run).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pacer.embedded import (
    LISTEN_PORTS_ENV,
    LISTEN_PORTS_FROM,
    _ephemeral_low,
    free_port,
    listen_range,
)
from pacer.trainer.cluster import ClusterDesc


def test_a_free_port_is_below_the_ephemeral_range_and_bindable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LISTEN_PORTS_ENV, raising=False)
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


def test_a_listen_range_of_the_environment_is_used_and_a_bad_one_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LISTEN_PORTS_ENV, "23000-24500")
    assert listen_range() == (23000, 24500)
    assert all(23000 <= free_port() < 24500 for _ in range(50))
    for bad in ("23000", "24500-23000", "80-2000", "a-b", "23000-70000"):
        monkeypatch.setenv(LISTEN_PORTS_ENV, bad)
        with pytest.raises(ValueError, match=LISTEN_PORTS_ENV):
            listen_range()


def test_two_test_workers_pick_from_disjoint_slices() -> None:
    from conftest import _split_listen_ports

    envs = [{"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "2"} for i in range(2)]
    for env in envs:
        _split_listen_ports(env)
    (a_low, a_high), (b_low, b_high) = (listen_range(env) for env in envs)
    assert LISTEN_PORTS_FROM == a_low < a_high == b_low < b_high == _ephemeral_low()
    alone = {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "1"}
    _split_listen_ports(alone)
    assert LISTEN_PORTS_ENV not in alone  # one worker: the whole range
