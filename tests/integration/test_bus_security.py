"""Bus security against a real nats-server configured with pacer.security's users.

Each test starts a server whose ``authorization`` block is what ``pacer up``
renders, then connects as one role and checks what the server lets it do:
a forbidden publish is refused by the server (a permissions violation
reaches the client's error callback) and nothing is delivered.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from pacer import security, subjects
from pacer.bus import Bus
from pacer.embedded import EmbeddedNats, free_port

ROLES = [*security.ROLES, "policy:my-policy"]
PASSWORDS = {role.replace(":", "-"): f"pw-{i}" for i, role in enumerate(ROLES)}
USERS = {user: (pw, role) for (user, pw), role in zip(PASSWORDS.items(), ROLES, strict=True)}


@pytest.fixture
def secure_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=security.render_authorization(USERS)).start()
    yield srv
    srv.stop()


async def connect(srv: EmbeddedNats, user: str) -> tuple[Client, list[Exception]]:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(srv.url, user=user, password=PASSWORDS[user], error_cb=on_error,
                            allow_reconnect=False, inbox_prefix=security.inbox_prefix(user))
    return nc, errors


async def settle(nc: Client) -> None:
    """Until the server has processed what ``nc`` sent: a subscription made before is live.

    Twice: right after connect nats-py may have one PING of its own in flight
    whose PONG would answer a single flush before the server read the SUB
    (seen in the server's trace as a NoResponders to the next request).
    """
    await nc.flush()
    await nc.flush()


async def violation(errors: list[Exception], subject: str, timeout: float = 2.0) -> str:
    """The permissions violation about ``subject`` that the server sent, waiting up to ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        for e in errors:
            if "permissions violation" in str(e).lower() and subject in str(e):
                return str(e)
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {subject}: {errors}")


async def test_without_credentials_nothing_connects(secure_server: EmbeddedNats) -> None:
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(secure_server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


@pytest.mark.parametrize("user", ["policy-my-policy", "policies", "monitor", "api", "shard"])
async def test_a_user_without_rights_cannot_command_an_executor(secure_server: EmbeddedNats, user: str) -> None:
    executor, _ = await connect(secure_server, "executor")
    intruder, errors = await connect(secure_server, user)
    try:
        sub = await executor.subscribe(subjects.rpc_wildcard(subjects.EXECUTOR_SERVICE))
        await settle(executor)
        cmd = subjects.executor_rpc("j1", subjects.ExecutorOp.COMMAND)
        await intruder.publish(cmd, b'{"kill": "worker-0"}')
        await intruder.flush()
        assert cmd in await violation(errors, cmd)
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.5)  # nothing reached the executor
    finally:
        await intruder.close()
        await executor.close()


@pytest.mark.parametrize("user", ["controller", "brain", "jobs"])
async def test_controller_brain_and_job_service_command_the_executor(secure_server: EmbeddedNats,
                                                                     user: str) -> None:
    executor, exec_errors = await connect(secure_server, "executor")
    sender, errors = await connect(secure_server, user)
    try:
        sub = await executor.subscribe(subjects.rpc_wildcard(subjects.EXECUTOR_SERVICE))

        async def answer() -> None:
            msg = await sub.next_msg(timeout=5)
            await msg.respond(b"applied")  # the reply goes back through allow_responses

        task = asyncio.create_task(answer())
        await settle(executor)
        reply = await sender.request(subjects.executor_rpc("j1", subjects.ExecutorOp.COMMAND), b"{}", timeout=5)
        await task
        assert reply.data == b"applied"
        assert errors == [] and exec_errors == []
    finally:
        await sender.close()
        await executor.close()


async def test_a_policy_cannot_publish_node_events_nor_answer_for_another_policy(
        secure_server: EmbeddedNats) -> None:
    watcher, _ = await connect(secure_server, "admin")
    policy, errors = await connect(secure_server, "policy-my-policy")
    try:
        seen = await watcher.subscribe(">")
        await settle(watcher)
        died = subjects.node_event("j1", subjects.NodeEventKind.DIED)
        await policy.publish(died, b'{"node": "worker-0"}')
        await policy.flush()
        assert died in await violation(errors, died)
        other = subjects.policy_decide("antdt-nd")
        await policy.subscribe(other)
        await policy.flush()
        assert other in await violation(errors, other)
        # its own decide subject is allowed
        own = await policy.subscribe(subjects.policy_decide("my-policy"))
        await policy.flush()
        with pytest.raises(nats.errors.TimeoutError):
            m = await seen.next_msg(timeout=0.5)
            pytest.fail(f"delivered: {m.subject}")
        assert own.subject == subjects.policy_decide("my-policy")
    finally:
        await policy.close()
        await watcher.close()


async def test_only_the_executor_publishes_node_events(secure_server: EmbeddedNats) -> None:
    watcher, _ = await connect(secure_server, "admin")
    executor, errors = await connect(secure_server, "executor")
    agent, agent_errors = await connect(secure_server, "monitor")  # reads node events, publishes none
    try:
        sub = await watcher.subscribe(subjects.events_of("node"))
        await settle(watcher)
        died = subjects.node_event("j1", subjects.NodeEventKind.DIED)
        await agent.publish(died, b"forged")
        await agent.flush()
        await violation(agent_errors, died)
        await executor.publish(died, b"real")
        await executor.flush()
        msg = await sub.next_msg(timeout=2)
        assert msg.data == b"real" and errors == []
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.3)
    finally:
        await agent.close()
        await executor.close()
        await watcher.close()


async def test_the_shard_service_appends_to_its_log_stream_and_another_service_cannot(
        secure_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_NATS_USER", "shard")
    monkeypatch.setenv("PACER_NATS_PASSWORD", PASSWORDS["shard"])
    bus = await Bus.connect(secure_server.url, name="shard")  # credentials from the settings
    agent, errors = await connect(secure_server, "controller")  # JetStream's API, but not the log's subjects
    try:
        await bus.ensure_streams()
        ack = await bus.js.publish(subjects.shard_log("j1"), b"entry")
        assert ack.stream == subjects.SHARD_LOG_STREAM and ack.seq == 1
        await agent.publish(subjects.shard_log("j1"), b"forged")
        await agent.flush()
        await violation(errors, subjects.shard_log("j1"))
        info = await bus.js.stream_info(subjects.SHARD_LOG_STREAM)
        assert info.state.messages == 1
    finally:
        await agent.close()
        await bus.close()


async def test_credentials_in_the_url_win_over_the_settings(
        secure_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_NATS_USER", "shard")
    monkeypatch.setenv("PACER_NATS_PASSWORD", "wrong")
    bus = await Bus.connect(security.with_credentials(secure_server.url, "monitor", PASSWORDS["monitor"]))
    try:
        await bus.nc.publish(subjects.events_of("monitor", job="j1", kind="statistics"), b"{}")
        await bus.nc.flush()
        assert bus.nc.is_connected
    finally:
        await bus.close()


def test_unknown_roles_are_refused() -> None:
    from pacer.errors import ValidationError

    with pytest.raises(ValidationError):
        security.permissions("root")
    with pytest.raises(ValidationError):
        security.permissions("policy:a.>")


def test_only_controller_brain_and_jobs_may_publish_executor_commands() -> None:
    cmd = "pacer.rpc.executor.*.command"
    for role in security.ROLES:
        pub = security.permissions(role).publish
        may = any(p in (">", "pacer.rpc.executor.>", cmd) for p in pub)
        assert may == (role in ("controller", "brain", "jobs", "admin")), role
    node = [r for r in security.ROLES if any(p in (">", "pacer.events.node.*.*") for p in
                                             security.permissions(r).publish)]
    assert sorted(node) == ["admin", "executor"]


async def test_the_health_check_probes_with_the_services_own_user(
        secure_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import socket

    import msgpack

    spec = importlib.util.spec_from_file_location("healthcheck", Path(__file__).parents[2] / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    shard, errors = await connect(secure_server, "shard")
    try:
        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(msgpack.packb({"instance": f"{socket.gethostname()}-1", "status": "ready"}))

        await shard.subscribe(subjects.health("shard"), cb=answer)
        await settle(shard)
        monkeypatch.setenv("PACER_NATS_USER", "shard")
        monkeypatch.setenv("PACER_NATS_PASSWORD", PASSWORDS["shard"])
        assert await hc.probe("shard", secure_server.url, 2.0, False) == 0
        monkeypatch.setenv("PACER_NATS_USER", "policy-my-policy")  # may not publish the shard service's health subject
        monkeypatch.setenv("PACER_NATS_PASSWORD", PASSWORDS["policy-my-policy"])
        assert await hc.probe("shard", secure_server.url, 0.5, False) == 1
        monkeypatch.delenv("PACER_NATS_USER")  # no user: the server refuses the connection
        assert await hc.probe("shard", secure_server.url, 0.5, False) == 1
        assert errors == []
    finally:
        await shard.close()


def connz(srv: EmbeddedNats) -> list[dict[str, object]]:
    """The server's view of its client connections (monitoring endpoint ``/connz``)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{srv.monitor_port}/connz", timeout=2) as r:
        conns: list[dict[str, object]] = json.load(r)["connections"]
    return conns


async def test_tls_with_the_stacks_own_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pacer.tls import ensure_server_tls, server_tls_config

    files = ensure_server_tls(tmp_path / "tls")
    assert ensure_server_tls(tmp_path / "tls") == files and files.ca.read_bytes() == files.ca.read_bytes()
    assert files.key.stat().st_mode & 0o077 == 0
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=security.render_authorization(USERS),
                       tls=server_tls_config(files)).start()
    try:
        monkeypatch.setenv("PACER_NATS_USER", "shard")
        monkeypatch.setenv("PACER_NATS_PASSWORD", PASSWORDS["shard"])
        monkeypatch.setenv("PACER_NATS_CA", str(files.ca))
        bus = await Bus.connect(srv.url, name="tls", connect_timeout=3)
        try:
            await bus.ensure_streams()
            assert bus.nc.is_connected
            conns = [c for c in await asyncio.to_thread(connz, srv) if c.get("name") == "tls"]
            assert conns and conns[0].get("tls_version"), conns  # the server sees a TLS connection
        finally:
            await bus.close()
        # A client that trusts another CA is refused by its own TLS check.
        other = ensure_server_tls(tmp_path / "other")
        with pytest.raises(Exception):  # noqa: B017 - ssl or nats error, both end the connect
            await nats.connect(srv.url, user="shard", password=PASSWORDS["shard"], allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=2,
                               tls=__import__("ssl").create_default_context(cafile=str(other.ca)))
    finally:
        srv.stop()


def test_a_tls_stack_gives_its_services_the_ca_and_they_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pacer_services.cli.stack import Stack

    monkeypatch.setenv("PACER_NATS_CA", "")  # restored after: the stack points this process at its CA
    st = Stack(tmp_path / "stack", services=["shard"], tls=True, policy_users=["mine"]).start(ready_timeout=60)
    try:
        assert st.ca_file is not None and os.environ["PACER_NATS_CA"] == str(st.ca_file)
        # the custom policy's own user: its decide subject, not another policy's, nor node events
        errors: list[Exception] = []

        async def as_policy() -> None:
            async def on_error(exc: Exception) -> None:
                errors.append(exc)

            bus = await Bus.connect(st.url_as("policy-mine"), name="mine")
            bus.nc._error_cb = on_error
            try:
                await bus.nc.subscribe(subjects.policy_decide("mine"))
                await bus.nc.publish(subjects.node_event("j", subjects.NodeEventKind.DIED), b"forged")
                await bus.nc.flush()
                await violation(errors, subjects.node_event("j", subjects.NodeEventKind.DIED))
                assert not any(subjects.policy_decide("mine") in str(e) for e in errors)
            finally:
                await bus.close()

        asyncio.run(as_policy())
        conf = (tmp_path / "stack" / "nats" / "nats-server.conf").read_text()
        assert "tls {" in conf and "authorization {" in conf
        log = (tmp_path / "stack" / "nats" / "nats-server.log").read_text()
        assert [line for line in log.splitlines() if "Violation" in line and "policy-mine" not in line] == []
    finally:
        st.stop()


# ------------------------------------------------------------------ reply inboxes of their own
async def test_a_policy_cannot_read_replies_meant_for_others(secure_server: EmbeddedNats) -> None:
    policy, errors = await connect(secure_server, "policy-my-policy")
    controller, ctl_errors = await connect(secure_server, "controller")
    executor, _ = await connect(secure_server, "executor")
    try:
        for foreign in ("_INBOX.>", f"{security.inbox_prefix('controller')}.>", "_INBOX_controller.*"):
            await policy.subscribe(foreign)
            await policy.flush()
            await violation(errors, foreign.lower())  # nats-py lowercases the subject of the error
        sub = await executor.subscribe(subjects.rpc_wildcard(subjects.EXECUTOR_SERVICE))

        async def answer() -> None:
            msg = await sub.next_msg(timeout=5)
            assert msg.reply.startswith(security.inbox_prefix("controller") + ".")  # the requester's own inbox
            await msg.respond(b"secret plan")

        task = asyncio.create_task(answer())
        await settle(executor)
        reply = await controller.request(subjects.executor_rpc("j1", subjects.ExecutorOp.COMMAND), b"{}", timeout=5)
        await task
        assert reply.data == b"secret plan" and ctl_errors == []
    finally:
        for nc in (policy, controller, executor):
            await nc.close()


@pytest.mark.parametrize("role", [r for r in ROLES if r != "admin"])
async def test_every_role_gets_its_replies_through_its_own_inbox(
        secure_server: EmbeddedNats, role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Request/reply, and for the roles with JetStream a stream lookup, a KV read and a KV watch."""
    user = role.replace(":", "-")
    admin = await Bus.connect(security.with_credentials(secure_server.url, "admin", PASSWORDS["admin"]))
    monkeypatch.setenv("PACER_NATS_USER", user)
    monkeypatch.setenv("PACER_NATS_PASSWORD", PASSWORDS[user])
    bus = await Bus.connect(secure_server.url, name=user)
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    bus.nc._error_cb = on_error
    try:
        assert bus.nc._inbox_prefix.decode() == security.inbox_prefix(user)
        perms = security.permissions(role, user)
        if role.startswith(security.POLICY_ROLE_PREFIX):  # a policy only answers: its reply goes out
            decide = subjects.policy_decide("my-policy")

            async def pong(m: nats.aio.msg.Msg) -> None:
                await m.respond(b"pong")

            await bus.nc.subscribe(decide, cb=pong)
            await settle(bus.nc)
            assert (await admin.nc.request(decide, b"ping", timeout=3)).data == b"pong"
        else:  # a request on the role's own health subject, answered by the admin into the role's inbox
            async def answer(m: nats.aio.msg.Msg) -> None:
                assert m.reply.startswith(security.inbox_prefix(user) + ".")
                await m.respond(b"pong")

            health = next(p for p in perms.publish if p.startswith("pacer.svc."))
            await admin.nc.subscribe(health, cb=answer)
            await settle(admin.nc)
            assert (await bus.nc.request(health, b"ping", timeout=3)).data == b"pong"
        if security.JS_API in perms.publish:
            await admin.ensure_streams()
            info = await bus.js.stream_info(subjects.EVENTS_STREAM)
            assert info.config.name == subjects.EVENTS_STREAM
            kv = await admin.kv("sec-test")
            await kv.put("k", b"v1")
            mine = await bus.js.key_value("sec-test")
            assert (await mine.get("k")).value == b"v1"
            watcher = await mine.watch("k")  # a push consumer delivering into the user's inbox
            first = await watcher.updates(timeout=3)
            while first is None:  # the client's "initial values done" marker may come first: read on
                first = await watcher.updates(timeout=3)
            assert first.value == b"v1"
            await watcher.stop()
        await bus.nc.flush()
        assert [e for e in errors if "violation" in str(e).lower()] == []
    finally:
        await bus.close()
        await admin.close()


async def test_a_list_of_servers_gets_the_credentials_of_any(secure_server: EmbeddedNats) -> None:
    """``nats://a,nats://user:pw@b``: the credentials go to every server (here the first, the live one)."""
    dead = f"nats://127.0.0.1:{free_port()}"
    url = f"{secure_server.url},{security.with_credentials(dead, 'shard', PASSWORDS['shard'])}"
    opts = security.connect_options(url, {})
    assert opts["servers"] == [secure_server.url, dead] and opts["user"] == "shard"
    bus = await Bus.connect(url, name="two-servers")
    try:
        await bus.ensure_streams()  # the shard user's JetStream rights: it is connected as shard
        assert bus.nc.connected_url is not None and bus.nc.connected_url.port == secure_server.port
    finally:
        await bus.close()
