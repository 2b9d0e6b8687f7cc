"""The embedded stack's nats-server listens on its client port only (issue 21, finding 10).

NATS' HTTP monitoring port has no authentication: ``/connz`` listed every
user name and subscription to anything on the host.  A secured stack runs
its server without it and checks its health over the client port, as the
operator (:func:`pacer.embedded.nats_probe`).
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from pacer import security
from pacer.embedded import EmbeddedNats, nats_probe
from pacer_services.cli.stack import Stack


def listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("tls", [True, False])
def test_a_secured_stack_has_no_monitoring_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tls: bool) -> None:
    monkeypatch.setenv("PACER_NATS_TLS", "1" if tls else "0")
    st = Stack(tmp_path / "stack", services=[]).start(ready_timeout=60)
    try:
        assert isinstance(st.nats, EmbeddedNats) and st.nats.proc is not None
        assert listening_ports(st.nats.proc.pid) == {st.nats.port}
        assert "http" not in (st.data_dir / "nats" / "nats-server.conf").read_text().split("authorization")[0]
        # Its health is probed as the operator over the client port; nothing else gets an answer.
        ca = str(st.ca_file) if st.ca_file is not None else ""
        assert nats_probe(st.nats.port, "admin", st.passwords["admin"], ca)
        assert not nats_probe(st.nats.port, "admin", "wrong", ca)
        assert not nats_probe(st.nats.port, "", "", ca)
    finally:
        st.stop()


def test_the_probe_says_no_until_jetstream_answers(tmp_path: Path) -> None:
    """A bare test server keeps its monitoring port; the probe agrees with it, and with a stopped server."""
    users = {"admin": ("pw-admin", "admin"), "policies": ("pw-policies", "policies")}
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=security.render_authorization(users),
                       monitoring=False, probe_user="admin", probe_password="pw-admin").start()
    try:
        assert srv.healthy() and srv.monitor_port == 0
        assert nats_probe(srv.port, "policies", "pw-policies") is False  # a user without JetStream's API
        srv.stop()
        assert not nats_probe(srv.port, "admin", "pw-admin")
    finally:
        srv.stop()
