"""Pacer on a 3-server JetStream cluster (issue 13): replicas, failover, catch-up, fencing.

Every test runs against three real nats-servers clustered on loopback
(``nats_cluster`` in conftest).  Servers are killed with SIGKILL, as a crash
would; the clients are given every server's URL and fail over by themselves.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
import pytest
from conftest import connect_cluster, eventually, until_ok
from pacer import security, subjects
from pacer.bus import Bus
from pacer.embedded import EmbeddedCluster, http_json
from pacer_services.shard_service.effects import Fenced, ShardLogStore

T = TypeVar("T")
KV_BUCKET = "pacer-test-ha"


async def stream_leader(bus: Bus, stream: str) -> str:
    info = await until_ok(lambda: bus.js.stream_info(stream))
    assert info.cluster is not None and info.cluster.leader, info.cluster
    return info.cluster.leader


def local_stream_state(cluster: EmbeddedCluster, i: int, stream: str) -> dict[str, Any] | None:
    """The state of ``stream`` as server ``i`` itself stores it (its /jsz), or None if it has none."""
    _, jsz = http_json(f"http://127.0.0.1:{cluster.servers[i].monitor_port}/jsz?accounts=true&streams=true")
    for acc in jsz.get("account_details", []) or []:  # type: ignore[union-attr]
        for st in acc.get("stream_detail", []) or []:
            if st.get("name") == stream:
                state: dict[str, Any] = st.get("state", {})
                return state
    return None


@pytest.fixture
async def cbus(nats_cluster: EmbeddedCluster) -> Any:
    b = await connect_cluster(nats_cluster, "test-ha")
    await b.ensure_streams()
    yield b
    await b.close()


async def test_streams_and_kv_are_replicated_on_all_three_servers(nats_cluster: EmbeddedCluster, cbus: Bus) -> None:
    await until_ok(lambda: cbus.kv(KV_BUCKET))
    names = {s.server_name for s in nats_cluster.servers}
    for stream in (subjects.SHARD_LOG_STREAM, subjects.EVENTS_STREAM, f"KV_{KV_BUCKET}"):
        info = await cbus.js.stream_info(stream)
        assert info.config.num_replicas == 3, stream
        assert info.cluster is not None and info.cluster.replicas is not None
        # one leader and two followers, each on its own server
        assert {info.cluster.leader} | {p.name for p in info.cluster.replicas} == names, stream


async def test_killing_the_stream_leader_loses_nothing_acknowledged(nats_cluster: EmbeddedCluster, cbus: Bus) -> None:
    kv = await until_ok(lambda: cbus.kv(KV_BUCKET))
    await until_ok(lambda: kv.put("k", b"before"))
    subject = subjects.shard_log("job-ha")
    acked: dict[int, bytes] = {}  # stream sequence -> payload, only what the server acknowledged
    failed_attempts = 0
    stop = asyncio.Event()

    async def publisher() -> None:
        nonlocal failed_attempts
        i = 0
        while not stop.is_set():
            payload = f"m{i}".encode()
            try:
                # A retry after a lost ack carries the same Nats-Msg-Id: the server answers with the first copy.
                ack = await cbus.js.publish(subject, payload, timeout=1.0, headers={"Nats-Msg-Id": f"m{i}"})
            except (nats.errors.Error, TimeoutError):
                failed_attempts += 1
                await asyncio.sleep(0.05)
                continue
            acked[int(ack.seq)] = payload
            i += 1
            await asyncio.sleep(0.002)

    task = asyncio.create_task(publisher())
    try:
        await eventually(lambda: len(acked) >= 50, 30, "publishing before the kill")
        victim = nats_cluster.index_of(await stream_leader(cbus, subjects.SHARD_LOG_STREAM))
        nats_cluster.kill(victim)
        at_kill = len(acked)
        await eventually(lambda: len(acked) >= at_kill + 100, 60,
                         lambda: f"publishing after the kill: {len(acked) - at_kill} acked, {failed_attempts} failed")
        await until_ok(lambda: kv.put("k", b"after"))
        assert (await until_ok(lambda: kv.get("k"))).value == b"after"
        assert await stream_leader(cbus, subjects.SHARD_LOG_STREAM) != nats_cluster.servers[victim].server_name
    finally:
        stop.set()
        await task

    # Nothing acknowledged is lost, nothing is stored twice.
    for seq, payload in acked.items():
        assert (await until_ok(lambda s=seq: cbus.js.get_msg(subjects.SHARD_LOG_STREAM, s))).data == payload  # type: ignore[misc]
    info = await cbus.js.stream_info(subjects.SHARD_LOG_STREAM)
    assert info.state.messages == len(acked) == len(set(acked.values()))

    # The killed server comes back and catches up from its peers ...
    await asyncio.to_thread(nats_cluster.restart, victim)
    last = info.state.last_seq
    await eventually(lambda: (local_stream_state(nats_cluster, victim, subjects.SHARD_LOG_STREAM) or {}).get("last_seq") == last,
                     30, lambda: f"{local_stream_state(nats_cluster, victim, subjects.SHARD_LOG_STREAM)} vs last seq {last}")
    # ... and is then part of the quorum: with another server down everything is still there.
    other = next(i for i in range(3) if i != victim)
    nats_cluster.kill(other)
    for seq, payload in acked.items():
        assert (await until_ok(lambda s=seq: cbus.js.get_msg(subjects.SHARD_LOG_STREAM, s))).data == payload  # type: ignore[misc]
    assert (await until_ok(lambda: kv.get("k"))).value == b"after"


async def test_expected_last_sequence_fences_a_stale_writer_across_a_leader_change(
        nats_cluster: EmbeddedCluster, cbus: Bus) -> None:
    other = await connect_cluster(nats_cluster, "test-ha-b")
    try:
        old, new = ShardLogStore(cbus.js), ShardLogStore(other.js)
        job = "job-fence"
        s1 = await until_ok(lambda: old.append(job, [["r", 1]], expected_last_seq=0))
        # Both writers believe they own the job as of s1; the stream leader dies.
        nats_cluster.kill(nats_cluster.index_of(await stream_leader(cbus, subjects.SHARD_LOG_STREAM)))
        s2 = await until_ok(lambda: new.append(job, [["r", 2]], expected_last_seq=s1))
        assert s2 > s1
        # The stale writer is refused by the new stream leader ...
        with pytest.raises(Fenced):
            await until_ok(lambda: old.append(job, [["r", 3]], expected_last_seq=s1))
        # ... and so is a second writer that raced on the same sequence.
        with pytest.raises(Fenced):
            await until_ok(lambda: new.append(job, [["r", 3]], expected_last_seq=s1))
        assert await until_ok(lambda: old.last_seq(job)) == s2
        info = await until_ok(lambda: cbus.js.stream_info(subjects.SHARD_LOG_STREAM,
                                                          subjects_filter=subjects.shard_log(job)))
        assert info.state.subjects == {subjects.shard_log(job): 2}
    finally:
        await other.close()


async def test_a_retried_append_with_its_message_id_is_not_fenced_by_itself(
        nats_cluster: EmbeddedCluster, cbus: Bus) -> None:
    """An append whose ack was lost in a failover, sent again: with the same Nats-Msg-Id the server
    answers with the first copy's sequence (a duplicate), instead of a wrong-last-sequence error that
    would make the writer believe someone else took its job."""
    subject = subjects.shard_log("job-retry")
    # (retried: a stream just created may not have elected its leader yet; the message ids make it safe)
    s1 = int((await until_ok(lambda: cbus.js.publish(subject, b"a", headers={"Nats-Msg-Id": "a"}))).seq)
    hdrs = {"Nats-Msg-Id": "b", "Nats-Expected-Last-Subject-Sequence": str(s1)}
    s2 = int((await until_ok(lambda: cbus.js.publish(subject, b"b", headers=hdrs))).seq)
    nats_cluster.kill(nats_cluster.index_of(await stream_leader(cbus, subjects.SHARD_LOG_STREAM)))
    again = await until_ok(lambda: cbus.js.publish(subject, b"b", headers=hdrs))
    assert (int(again.seq), again.duplicate) == (s2, True)
    # Without the message id the same retry is refused: the writer would fence itself.
    with pytest.raises(nats.js.errors.BadRequestError):
        await until_ok(lambda: cbus.js.publish(
            subject, b"b", headers={"Nats-Expected-Last-Subject-Sequence": str(s1)}))


async def test_a_secured_cluster_admits_only_its_users_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ``authorization`` and ``tls`` blocks as a single server, on every server of the cluster."""
    from pacer.tls import ensure_server_tls, server_tls_config

    files = ensure_server_tls(tmp_path / "tls")
    users = {"shard": ("pw-shard", "shard"), "admin": ("pw-admin", "admin")}
    cluster = EmbeddedCluster(store_dir=tmp_path / "secure", authorization=security.render_authorization(users),
                              tls=server_tls_config(files)).start()
    try:
        monkeypatch.setenv("PACER_NATS_USER", "shard")
        monkeypatch.setenv("PACER_NATS_PASSWORD", "pw-shard")
        monkeypatch.setenv("PACER_NATS_CA", str(files.ca))
        bus = await connect_cluster(cluster, "secure-shard")
        try:
            await bus.ensure_streams()
            job = "job-secure"
            store = ShardLogStore(bus.js)
            s1 = await until_ok(lambda: store.append(job, [["r", 1]], expected_last_seq=0))
            cluster.kill(cluster.index_of(await stream_leader(bus, subjects.SHARD_LOG_STREAM)))
            assert await until_ok(lambda: store.append(job, [["r", 2]], expected_last_seq=s1)) > s1
        finally:
            await bus.close()
        ctx = ssl.create_default_context(cafile=str(files.ca))
        for password in ("wrong", None):
            with pytest.raises(nats.errors.Error):  # refused by every live server
                await nats.connect(servers=cluster.urls, user="shard" if password else None, password=password,
                                   tls=ctx, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    finally:
        cluster.stop()


@pytest.fixture
def taken_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, list[int]]]:
    """A listening port that ``pacer.embedded.free_port`` hands out first, as if another process had
    bound it between choosing and binding; yields (port, the ports handed out so far)."""
    import socket

    from pacer import embedded

    real, given = embedded.free_port, []

    def first_taken() -> int:
        given.append(port if not given else real())
        return given[-1]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(embedded, "free_port", first_taken)
        yield port, given


def test_a_fresh_cluster_whose_port_was_taken_meanwhile_starts_on_new_ports(
        tmp_path: Path, taken_port: tuple[int, list[int]]) -> None:
    """Ports are chosen free and bound a moment later: a port taken in between (seen as a setup error
    in a loaded test run) is not the cluster's failure."""
    cluster = EmbeddedCluster(store_dir=tmp_path / "c", size=3)
    try:
        cluster.start(timeout=20.0)
        assert cluster.meta_leader() is not None
        assert len(taken_port[1]) > 9  # built twice: 3 route ports + 3 x (client, monitor) each time
    finally:
        cluster.stop()


def test_a_single_server_whose_chosen_port_was_taken_meanwhile_takes_another(
        tmp_path: Path, taken_port: tuple[int, list[int]]) -> None:
    from pacer import embedded

    port = taken_port[0]
    server = embedded.EmbeddedNats(store_dir=tmp_path / "one")
    try:
        server.start(timeout=10.0)
        assert server.running and server.port != port
    finally:
        server.stop()
    # a port the caller gave is never changed: the clash is the caller's to see
    with pytest.raises(embedded.EmbeddedServerError):
        embedded.EmbeddedNats(store_dir=tmp_path / "fixed", port=port).start(timeout=5.0)
