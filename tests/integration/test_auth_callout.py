"""Per-job agent users through nats-server's auth callout, against a real server.

The server's ``authorization`` block lists the static users (services,
``admin``) and an ``auth_callout`` whose issuer is an account key made here;
the responder (services/auth_callout) runs in-process with the ``auth``
user.  An agent of job A connects as ``agent-A`` with its job token: it may
use job A's agent, shard-rpc and checkpoint subjects, and the server refuses
it job B's; a wrong token, another job's token or a user that is no job's
agent is refused at connect, and so is a token of a job that has ended or of
an earlier job of the same name (the responder reads the job's record in
``pacer-jobs``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import msgpack
import nats
import nats.errors
import pytest
from nats.aio.client import Client
from pacer import authjwt, security, subjects
from pacer.agent import bucket as agent_bucket
from pacer.bus import Bus
from pacer.codec import encode
from pacer.contracts.jobs import JobRecord, JobState
from pacer.embedded import EmbeddedNats
from pacer.jobs.spec import parse_job_spec
from pacer.runtime import RuntimeConfig, run_service
from pacer_services.auth_callout import core
from pacer_services.auth_callout.app import AuthCalloutService

SECRET = "test-secret"
STATIC = {role: (f"pw-{role}", role) for role in security.ROLES}
JOB_CACHE_S = 0.1  # the responder's job cache here: an ended job is refused this soon
# Each job's record's submission time (stored by the fixture; test_agent_privileges' jobs too).
SUBMITTED = {"job-a": 1_700_000_000.5, "job-b": 1_700_000_100.0, "victim": 1_700_000_200.0,
             "mallory": 1_700_000_300.0}


def job_record(job: str, state: JobState = JobState.RUNNING, submitted_at: float | None = None) -> JobRecord:
    spec = parse_job_spec(f"name: {job}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    return JobRecord(job, spec, state, SUBMITTED[job] if submitted_at is None else submitted_at,
                     data_path="/data/train.rec", records=10)


def token_of(job: str, stream: str = "", submitted_at: float | None = None, ttl_s: float = 3600.0) -> str:
    """A token as the executor mints it for the pods of ``job`` (stored with ``submitted_at``)."""
    return authjwt.agent_token(SECRET, job, stream,
                               incarnation=authjwt.incarnation(SUBMITTED[job] if submitted_at is None else submitted_at),
                               expires=authjwt.token_expiry(time.time(), ttl_s))


async def store_jobs(url: str, *records: JobRecord) -> None:
    """Write job records as the job service does (the responder reads them)."""
    admin = await Bus.connect(url)
    try:
        kv = await admin.kv(subjects.JOB_BUCKET)
        for rec in records:
            await kv.put(rec.job, encode(rec))
    finally:
        await admin.close()


@pytest.fixture
async def callout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[EmbeddedNats]:
    issuer = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    auth = security.render_authorization(STATIC, security.Callout(issuer.public_key))
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=auth).start()
    monkeypatch.setenv("PACER_AUTH_ISSUER_SEED", issuer.seed)
    monkeypatch.setenv("PACER_AGENT_TOKEN_SECRET", SECRET)
    stop = asyncio.Event()
    url = security.with_credentials(srv.url, security.AUTH_SERVICE, STATIC[security.AUTH_SERVICE][0])

    async def factory(bus: Bus, rc: RuntimeConfig) -> AuthCalloutService:
        return AuthCalloutService(bus, core.CalloutKeys(issuer, SECRET), job_cache_s=JOB_CACHE_S)

    task = asyncio.create_task(run_service(factory, RuntimeConfig(nats_url=url), stop, install_signals=False))
    await store_jobs(security.with_credentials(srv.url, "admin", "pw-admin"), *map(job_record, SUBMITTED))
    admin = await Bus.connect(security.with_credentials(srv.url, "admin", "pw-admin"))
    try:
        for _ in range(100):  # until the responder listens
            try:
                await admin.nc.request(subjects.health(security.AUTH_SERVICE), b"", timeout=0.5)
                break
            except nats.errors.Error:
                await asyncio.sleep(0.05)
        yield srv
    finally:
        await admin.close()
        stop.set()
        await task
        srv.stop()


async def agent(srv: EmbeddedNats, job: str, token: str | None = None,
                user: str | None = None) -> tuple[Client, list[Exception]]:
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    user = user or security.agent_user(job)
    nc = await nats.connect(srv.url, user=user, password=token or token_of(job),
                            error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                            inbox_prefix=security.inbox_prefix(user))
    return nc, errors


async def violation(errors: list[Exception], subject: str, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if any("permissions violation" in str(e).lower() and subject.lower() in str(e).lower() for e in errors):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {subject}: {errors}")


async def test_an_agent_uses_its_own_jobs_subjects_and_not_another_jobs(callout: EmbeddedNats) -> None:
    watcher = await nats.connect(callout.url, user="admin", password="pw-admin")
    a, errors = await agent(callout, "job-a")
    try:
        seen = await watcher.subscribe("pacer.>")
        await watcher.flush()
        await watcher.flush()
        # its own job: heartbeats, the two-phase barrier, replies to a shard-service request
        await a.publish(subjects.agent_heartbeat("job-a"), b"hb")
        await a.subscribe(subjects.agent_phase("job-a", subjects.AgentPhase.PREPARE))
        await a.subscribe(subjects.agent_command("job-a", "worker-0"))
        await a.flush()
        msg = await seen.next_msg(timeout=2)
        assert msg.subject == subjects.agent_heartbeat("job-a") and msg.data == b"hb"

        async def shard_service(m: nats.aio.msg.Msg) -> None:
            await m.respond(b"leased")

        await watcher.subscribe(subjects.rpc(subjects.SHARD_SERVICE, "job-a", subjects.ShardOp.LEASE),
                                cb=shard_service)
        await watcher.flush()
        await watcher.flush()
        reply = await a.request(subjects.rpc(subjects.SHARD_SERVICE, "job-a", subjects.ShardOp.LEASE), b"{}",
                                timeout=3)
        assert reply.data == b"leased"
        assert errors == []
        # job B's subjects: refused by the server, nothing delivered
        for subject in (subjects.agent_heartbeat("job-b"), subjects.rpc(subjects.SHARD_SERVICE, "job-b", "lease"),
                        subjects.agent_phase("job-b", subjects.AgentPhase.COMMIT),
                        subjects.node_event("job-a", subjects.NodeEventKind.DIED),
                        subjects.executor_rpc("job-a", subjects.ExecutorOp.COMMAND)):
            await a.publish(subject, b"forged")
            await a.flush()
            await violation(errors, subject)
        for subject in (subjects.agent_phase("job-b", subjects.AgentPhase.PREPARE),
                        subjects.agent_command("job-b", "worker-0"), "_INBOX.>",
                        f"{security.inbox_prefix(security.agent_user('job-b'))}.>", subjects.events_of("node")):
            await a.subscribe(subject)
            await a.flush()
            await violation(errors, subject)
        while True:
            try:
                m = await seen.next_msg(timeout=0.3)
            except nats.errors.TimeoutError:
                break
            assert "job-b" not in m.subject and m.data != b"forged", m.subject
    finally:
        await a.close()
        await watcher.close()


@pytest.mark.parametrize("case", ["wrong token", "other job's token", "no job user", "static name"])
async def test_a_wrong_credential_is_refused(callout: EmbeddedNats, case: str) -> None:
    token, user = {
        "wrong token": ("0" * 64, None),
        "other job's token": (token_of("job-b"), None),
        "no job user": (token_of("job-a"), "intruder"),
        "static name": ("pw-agent-typo", "agent"),  # no static agent user: the callout refuses a name of no job
    }[case]
    with pytest.raises((nats.errors.Error, OSError)) as info:
        await agent(callout, "job-a", token=token, user=user)
    assert "authorization" in str(info.value).lower() or isinstance(info.value, nats.errors.NoServersError)


async def test_the_agent_bus_connects_through_the_url(callout: EmbeddedNats) -> None:
    """What a pod does: ``Bus.connect`` with the URL the executor gave it (user and token in it)."""
    url = security.with_credentials(callout.url, security.agent_user("job-a"), token_of("job-a"))
    bus = await Bus.connect(url, name="agent")
    try:
        admin = await Bus.connect(security.with_credentials(callout.url, "admin", "pw-admin"))
        try:
            await agent_bucket.ensure(admin.js)  # the executor's part: a pod may not make it
        finally:
            await admin.close()
        mine = agent_bucket.handle(bus.js)  # no JetStream API call: direct gets of its own key only
        rev = await mine.create(subjects.agent_primary_key("job-a"), b"worker-0")
        assert (await mine.get(subjects.agent_primary_key("job-a"))).value == b"worker-0" and rev >= 1
        with pytest.raises(nats.errors.Error):  # refused by the server: the put never gets its ack
            await mine.create(subjects.agent_primary_key("job-b"), b"worker-0")
    finally:
        await bus.close()


def test_the_embedded_stack_gives_pods_per_job_users(tmp_path: Path) -> None:
    """The stack's auth service admits the URL the executor builds for a job's pods, for that job only."""
    from pacer_services.cli.stack import Stack
    from pacer_services.pod_executor import launch

    st = Stack(tmp_path / "stack", services=["auth"]).start(ready_timeout=60)
    try:
        assert st.per_job_agents
        rec = job_record("job-a")
        asyncio.run(store_jobs(st.url_as("admin"), rec))  # the job service's part
        executor_env = st._credentials("executor")
        cfg = launch.LaunchConfig(executor_env["PACER_POD_NATS_URL"],
                                  agent_secret=executor_env["PACER_AGENT_TOKEN_SECRET"])
        creds = launch.pod_credentials(cfg, rec)
        assert creds["PACER_NATS_USER"] == security.agent_user("job-a") and "agent" not in st.passwords
        url = security.with_credentials(launch.pod_nats_url(cfg), creds["PACER_NATS_USER"],
                                        creds["PACER_NATS_PASSWORD"])
        assert "PACER_AGENT_TOKEN_SECRET" not in st._credentials("shard")

        async def as_pod() -> list[Exception]:
            errors: list[Exception] = []

            async def on_error(exc: Exception) -> None:
                errors.append(exc)

            bus = await Bus.connect(url, name="pod")
            bus.nc._error_cb = on_error
            try:
                await bus.nc.publish(subjects.agent_heartbeat("job-a"), b"hb")
                await bus.nc.publish(subjects.agent_heartbeat("job-b"), b"forged")
                await bus.nc.flush()
                await violation(errors, subjects.agent_heartbeat("job-b"))
            finally:
                await bus.close()
            return errors

        errors = asyncio.run(as_pod())
        assert not any(subjects.agent_heartbeat("job-a") in str(e) for e in errors)
    finally:
        st.stop()


async def test_two_agents_of_a_job_run_the_barrier_and_answer_commands(callout: EmbeddedNats) -> None:
    """Replies between agents (votes) and to the controller (node commands) pass through the JWT's ``resp``."""
    a, a_errors = await agent(callout, "job-a")
    b, b_errors = await agent(callout, "job-a")
    controller = await nats.connect(callout.url, user="controller", password="pw-controller",
                                    inbox_prefix=security.inbox_prefix("controller"))
    try:
        async def vote(m: nats.aio.msg.Msg) -> None:
            await m.respond(b"yes")

        async def command(m: nats.aio.msg.Msg) -> None:
            await m.respond(b"applied")

        await b.subscribe(subjects.agent_phase("job-a", subjects.AgentPhase.PREPARE), cb=vote)
        await b.subscribe(subjects.agent_command("job-a", "worker-1"), cb=command)
        await b.flush()
        await b.flush()
        assert (await a.request(subjects.agent_phase("job-a", subjects.AgentPhase.PREPARE), b"T=10",
                                timeout=3)).data == b"yes"
        assert (await controller.request(subjects.agent_command("job-a", "worker-1"), b"kill",
                                         timeout=3)).data == b"applied"
        await a.flush()
        await b.flush()
        assert a_errors == [] and b_errors == []
    finally:
        for nc in (a, b, controller):
            await nc.close()


async def test_a_streaming_jobs_pods_read_their_stream_and_nothing_else(callout: EmbeddedNats) -> None:
    """A token naming the job's stream (minted by the executor) grants direct gets and the info of that
    stream only: not another stream, not Pacer's KV, and no consumer (which would let the server
    deliver samples to any subject on the pod's behalf); a token whose stream was edited is refused."""
    from pacer.data.stream import StreamSource

    admin = await nats.connect(callout.url, user="admin", password="pw-admin")
    try:
        js = admin.jetstream()
        for name in ("ADS", "OTHER"):
            await js.add_stream(name=name, subjects=[f"{name}.samples"], allow_direct=True)
            for i in range(5):
                await js.publish(f"{name}.samples", msgpack.packb({"i": i, "click": i % 2}))
        kv = await js.key_value("pacer-jobs")  # made by the fixture, with the jobs' records
        await kv.put("victim", b"secret record")
    finally:
        await admin.close()

    token = token_of("job-a", "ADS")
    url = security.with_credentials(callout.url, security.agent_user("job-a"), token)
    src = await asyncio.to_thread(StreamSource, url, "ADS", first_seq=1)
    try:
        assert src.rows == 5 and (await asyncio.to_thread(src.read, 1, 4))["i"].tolist() == [1, 2, 3]
    finally:
        await asyncio.to_thread(src.close)

    a, errors = await agent(callout, "job-a", token=token)
    try:
        for subject in ("$JS.API.DIRECT.GET.OTHER", "$JS.API.DIRECT.GET.KV_pacer-jobs",
                        "$JS.API.STREAM.INFO.OTHER", "$JS.API.CONSUMER.CREATE.ADS", "$JS.API.CONSUMER.CREATE.ADS.x",
                        "$JS.API.STREAM.PURGE.ADS", "$JS.API.STREAM.MSG.DELETE.ADS"):
            await a.publish(subject, b'{"seq": 1}', reply=a.new_inbox())
            await a.flush()
            await violation(errors, subject)
    finally:
        await a.close()
    for forged in (token.replace("~ADS", "~OTHER"), token.replace("~ADS", "~KV_pacer-jobs"),
                   token_of("job-a", "KV_pacer-jobs")):
        with pytest.raises((nats.errors.Error, OSError)):
            await agent(callout, "job-a", token=forged)


async def refused_within(connect: Callable[[], Awaitable[Client]], timeout: float = 10.0) -> None:
    """Connect until the server refuses (the responder's job cache lets a live view linger a little)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            nc = await connect()
        except (nats.errors.Error, OSError) as exc:
            assert "authorization" in str(exc).lower() or isinstance(exc, nats.errors.NoServersError), exc
            return
        await nc.close()
        assert asyncio.get_running_loop().time() < deadline, "still admitted"
        await asyncio.sleep(JOB_CACHE_S / 2)


async def test_a_jobs_token_stops_working_when_the_job_ends(callout: EmbeddedNats) -> None:
    token = token_of("job-a")
    a, _ = await agent(callout, "job-a", token=token)  # admitted while the job runs
    await a.close()
    admin = security.with_credentials(callout.url, "admin", "pw-admin")
    # Completed, its pods still finishing (the chief's result): they may still connect.
    await store_jobs(admin, job_record("job-a", JobState.COMPLETED))
    await asyncio.sleep(2 * JOB_CACHE_S)  # past the responder's cache of the running record
    a, _ = await agent(callout, "job-a", token=token)
    await a.close()
    # Torn down: every pod is gone, nothing of the job may connect any more.
    await store_jobs(admin, replace(job_record("job-a", JobState.COMPLETED), torn_down=True))
    await refused_within(lambda: agent_nc(callout, "job-a", token))
    # Another job is not affected.
    b, _ = await agent(callout, "job-b")
    await b.close()


async def test_a_later_job_of_the_same_name_gets_a_new_token_and_the_old_one_is_refused(
        callout: EmbeddedNats) -> None:
    from pacer_services.pod_executor import launch

    cfg = launch.LaunchConfig(callout.url, agent_secret=SECRET)
    first = job_record("job-a")
    old = launch.pod_credentials(cfg, first)["PACER_NATS_PASSWORD"]
    nc = await agent_nc(callout, "job-a", old)  # admitted while it is the job's incarnation
    await nc.close()
    # The job ended, its record was removed, and a new job of the same name was submitted.
    second = replace(first, submitted_at=first.submitted_at + 3600.0, state=JobState.SUBMITTED)
    await store_jobs(security.with_credentials(callout.url, "admin", "pw-admin"), second)
    new = launch.pod_credentials(cfg, second)["PACER_NATS_PASSWORD"]
    assert new != old
    await refused_within(lambda: agent_nc(callout, "job-a", old))
    nc = await agent_nc(callout, "job-a", new)
    await nc.close()


async def test_an_expired_token_is_refused(callout: EmbeddedNats) -> None:
    exp = int(time.time())  # expired now
    stale = authjwt.agent_token(SECRET, "job-a", incarnation=authjwt.incarnation(SUBMITTED["job-a"]), expires=exp)
    with pytest.raises((nats.errors.Error, OSError)):
        await agent_nc(callout, "job-a", stale)


async def agent_nc(srv: EmbeddedNats, job: str, token: str) -> Client:
    return (await agent(srv, job, token=token))[0]
