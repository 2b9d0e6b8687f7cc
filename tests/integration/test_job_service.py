"""Job records are written with a revision check, against a real nats-server.

The job service runs in-process (the real runtime) with the shard service
fixture; "another writer" is a second connection writing the same KV key,
as a second job-service instance during a rolling update would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import InProcess, InProcessService, eventually, read_events
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.jobs import JobEvent, JobRecord, JobState
from pacer.data.criteo import generate
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, StaleRevision, ValidationError
from pacer.jobs.client import JobClient
from pacer_services.job_service.app import JobService, JobServiceConfig

pytestmark = pytest.mark.timeout(60)


async def test_a_stale_write_is_refused_and_the_loser_re_reads(bus: Bus) -> None:
    """Two writers read revision r; the first update wins, the second is refused until it re-reads."""
    kv = await bus.kv("test-cas")
    first = await Bus.kv_update(kv, "k", b"v0", None)
    with pytest.raises(StaleRevision):  # a creation of an existing key
        await Bus.kv_update(kv, "k", b"other", None)

    a_rev = b_rev = first  # both writers read the same revision
    a_rev = await Bus.kv_update(kv, "k", b"a", a_rev)
    with pytest.raises(StaleRevision) as lost:
        await Bus.kv_update(kv, "k", b"b", b_rev)
    assert lost.value.code == "conflict"
    assert (await kv.get("k")).value == b"a"  # the loser wrote nothing

    entry = await kv.get("k")  # re-read, re-apply
    assert entry.revision == a_rev
    b_rev = await Bus.kv_update(kv, "k", (entry.value or b"") + b"+b", entry.revision)
    assert (await kv.get("k")).value == b"a+b" and b_rev > a_rev


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "train.rec"
    generate(path, 2_000, seed=1)
    return path


def spec(name: str, data: Path) -> str:
    return f"name: {name}\nmodel: wide_deep\ndataset:\n  path: {data}\npolicies:\n  optimizer: none\n"


def config(tmp_path: Path) -> JobServiceConfig:
    """The job service's data in ``tmp_path/jobs``; the tests' dataset files (``tmp_path``) under its roots."""
    return JobServiceConfig(data_dir=tmp_path / "jobs", data_roots=(tmp_path,))


@pytest.fixture
async def jobs(nats_server: EmbeddedNats, shard_service: InProcessService,
               tmp_path: Path) -> AsyncIterator[InProcess[JobService]]:
    svc = InProcess(nats_server.url, lambda b: JobService(b, config(tmp_path)))
    await svc.start()
    yield svc
    await svc.stop()


async def other_writer(bus: Bus, job: str, change: Callable[[JobRecord], JobRecord]) -> JobRecord:
    """Another writer: read the record with its revision and store ``change(record)`` at that revision."""
    kv = await bus.kv(subjects.JOB_BUCKET)
    entry = await kv.get(job)
    assert entry.value is not None and entry.revision is not None
    rec = change(decode(JobRecord, entry.value))
    await Bus.kv_update(kv, job, encode(rec), entry.revision)
    return rec


async def stored(bus: Bus, job: str) -> JobRecord:
    kv = await bus.kv(subjects.JOB_BUCKET)
    entry = await kv.get(job)
    assert entry.value is not None
    return decode(JobRecord, entry.value)


async def test_the_service_re_applies_its_change_on_a_record_another_writer_moved(
        bus: Bus, jobs: InProcess[JobService], data: Path) -> None:
    client = JobClient(bus, timeout=10.0)
    rec = await client.submit("cas-1", spec("cas-1", data))
    assert rec.state is JobState.PLANNING
    svc = jobs.svc
    assert svc is not None

    await other_writer(bus, "cas-1", lambda r: replace(r, result={"note": "written elsewhere"}))
    stopped = await client.stop("cas-1", "enough")

    assert svc.counters.values["cas_conflicts"] == 1
    assert stopped.state is JobState.STOPPED
    assert stopped.result == {"note": "written elsewhere"}  # the other writer's change survives
    assert await stored(bus, "cas-1") == stopped


async def test_a_transition_the_re_read_record_no_longer_allows_is_refused(
        bus: Bus, jobs: InProcess[JobService], data: Path, nats_server: EmbeddedNats) -> None:
    client = JobClient(bus, timeout=10.0)
    await client.submit("cas-2", spec("cas-2", data))
    failed = await other_writer(bus, "cas-2", lambda r: replace(r, state=JobState.FAILED, reason="elsewhere"))

    with pytest.raises(Conflict, match="cannot stop a failed job"):
        await client.stop("cas-2")

    assert await stored(bus, "cas-2") == failed  # not overwritten
    planning = await read_events(nats_server.url, subjects.job_event("cas-2", "planning"), JobEvent)
    assert [e.state for e in planning] == [JobState.PLANNING]
    assert await read_events(nats_server.url, subjects.job_event("cas-2", "stopped"), JobEvent) == []


async def test_a_job_another_writer_created_first_is_a_conflict(
        bus: Bus, jobs: InProcess[JobService], data: Path) -> None:
    client = JobClient(bus, timeout=10.0)
    theirs = await client.submit("cas-3", spec("cas-3", data))
    kv = await bus.kv(subjects.JOB_BUCKET)
    await kv.delete("cas-3")
    svc = jobs.svc
    assert svc is not None
    svc.records.pop("cas-3")  # this instance forgot the job; another one creates it
    svc.revisions.pop("cas-3")
    svc.lifecycles.pop("cas-3")
    await Bus.kv_update(kv, "cas-3", encode(replace(theirs, reason="the other instance's")), None)

    with pytest.raises(Conflict, match="a job named 'cas-3' exists"):
        await client.submit("cas-3", spec("cas-3", data))

    assert (await stored(bus, "cas-3")).reason == "the other instance's"
    assert (await client.get("cas-3")).reason == "the other instance's"  # adopted, not overwritten


async def test_a_restarted_service_writes_at_the_revisions_it_loaded(
        bus: Bus, jobs: InProcess[JobService], data: Path, nats_server: EmbeddedNats, tmp_path: Path) -> None:
    client = JobClient(bus, timeout=10.0)
    await client.submit("cas-4", spec("cas-4", data))
    await jobs.stop()
    again = InProcess(nats_server.url, lambda b: JobService(b, config(tmp_path)))
    svc = await again.start()
    try:
        stopped = await client.stop("cas-4")
        assert stopped.state is JobState.STOPPED
        assert svc.counters.values["cas_conflicts"] == 0
    finally:
        await again.stop()


async def test_a_second_submission_of_a_name_is_a_conflict_naming_its_state(
        bus: Bus, jobs: InProcess[JobService], data: Path) -> None:
    client = JobClient(bus, timeout=10.0)
    await client.submit("cas-5", spec("cas-5", data))
    with pytest.raises(Conflict, match=r"a job named 'cas-5' exists \(planning\)"):
        await client.submit("cas-5", spec("cas-5", data))


async def test_a_job_keeps_the_namespace_it_was_submitted_to_and_the_list_filters_by_it(
        bus: Bus, jobs: InProcess[JobService], data: Path) -> None:
    client = JobClient(bus, timeout=10.0)
    a = await client.submit("ns-a", spec("ns-a", data), "team-a")
    b = await client.submit("ns-b", spec("ns-b", data), "team-b")
    plain = await client.submit("ns-default", spec("ns-default", data))
    assert (a.namespace, b.namespace, plain.namespace) == ("team-a", "team-b", "default")
    assert (await client.get("ns-a")).namespace == "team-a"  # stored, not only answered
    assert [r.job for r in (await client.list(namespaces=["team-a"])).jobs] == ["ns-a"]
    assert {r.job for r in (await client.list(namespaces=["team-a", "team-b"])).jobs} == {"ns-a", "ns-b"}
    assert {r.job for r in (await client.list()).jobs} == {"ns-a", "ns-b", "ns-default"}
    with pytest.raises(ValidationError, match="namespace"):
        await client.submit("ns-bad", spec("ns-bad", data), "Team_A")


async def test_events_a_dead_writer_left_in_a_record_are_published_by_a_restarted_service(
        bus: Bus, jobs: InProcess[JobService], data: Path, nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """A writer that stored a change and died before publishing its event left it in the record's outbox:
    the service publishes it when it starts (and its sweep would, later), then clears the outbox."""
    from pacer.contracts.jobs import OutboxEntry

    client = JobClient(bus, timeout=10.0)
    await client.submit("ob-1", spec("ob-1", data))
    await jobs.stop()
    kv = await bus.kv(subjects.JOB_BUCKET)
    entry = await kv.get("ob-1")
    assert entry.value is not None
    rec = decode(JobRecord, entry.value)
    assert rec.outbox == []  # published and cleared by the live service
    stopped = JobEvent("ob-1", JobState.STOPPED, rec.updated_at, reason="by a writer that died", previous=rec.state)
    left = replace(rec, state=JobState.STOPPED, reason=stopped.reason,
                   outbox=[OutboxEntry(subjects.job_event("ob-1", "stopped"), encode(stopped), "job-ob-1-test")])
    await Bus.kv_update(kv, "ob-1", encode(left), entry.revision)

    again = InProcess(nats_server.url, lambda b: JobService(b, config(tmp_path)))
    svc = await again.start()
    try:
        async def cleared() -> bool:
            e = await kv.get("ob-1")
            return e.value is not None and not decode(JobRecord, e.value).outbox

        await eventually(cleared, 20, "the outbox was never published")
        got = await read_events(nats_server.url, subjects.job_event("ob-1", "stopped"), JobEvent)
        assert [(e.state, e.reason) for e in got] == [(JobState.STOPPED, "by a writer that died")]
        # by its start-up sweep, or by its first write of the job (shard progress), whichever came first
        assert svc.counters.values["outbox_published"] >= 1
        # Swept again (nothing left): nothing is published twice.
        assert await svc.sweep_outboxes(min_age_s=0) == 0
        assert len(await read_events(nats_server.url, subjects.job_event("ob-1", "stopped"), JobEvent)) == 1
    finally:
        await again.stop()


async def test_a_stream_dataset_is_checked_and_followed_from_its_start(bus: Bus, jobs: InProcess[JobService]) -> None:
    """A ``jetstream://`` dataset: the stream must exist, be readable by direct get and not be Pacer's
    own; its first sequence is resolved and registered with the shard service, which appends the
    samples that arrive (and only those from the start)."""
    import msgpack
    from pacer.errors import ValidationError
    from pacer.shards.client import ShardAdmin

    schema = ("  schema:\n    label: click\n    dense: [price]\n    categorical: [user]\n"
              "  options: {start: new, max_wait_s: 0.2}\n")

    def stream_spec(name: str, stream: str) -> str:
        return (f"name: {name}\nmodel: wide_deep\ndataset:\n  path: jetstream://{stream}\n{schema}"
                "policies:\n  optimizer: none\n")

    client = JobClient(bus)
    for stream, needle in (("NOPE", "no JetStream stream 'NOPE'"), ("KV_pacer-jobs", "reserved"),
                           ("NODIRECT", "allow_direct off")):
        if stream == "NODIRECT":
            await bus.js.add_stream(name="NODIRECT", subjects=["NODIRECT.x"])
        with pytest.raises(ValidationError, match=needle):
            await client.submit("s-bad", stream_spec("s-bad", stream))
    await bus.js.add_stream(name="CLICKS", subjects=["CLICKS.x"], allow_direct=True)
    for _ in range(7):  # before the submission: not part of a dataset that starts at "new"
        await bus.js.publish("CLICKS.x", msgpack.packb({"click": 0, "price": 1.0, "user": "old"}))
    rec = await client.submit("s-ok", stream_spec("s-ok", "CLICKS"))
    assert rec.data_path == "jetstream://CLICKS" and rec.spec.dataset.options["first_seq"] == 8
    assert rec.columns == {"click": "float", "price": "float", "user": "string"}  # from the schema: no sample yet
    for i in range(30):
        await bus.js.publish("CLICKS.x", msgpack.packb({"click": i % 2, "price": float(i), "user": f"u{i}"}))
    admin = ShardAdmin(bus)

    async def appended() -> Any:
        st = await admin.status("s-ok", "train")
        return st if st.records_total == 30 else None

    st = await eventually(appended, 30, "the shard service appends the 30 new samples")
    assert st.mode.value == "streaming" and not st.closed
