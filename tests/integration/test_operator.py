"""The operator end to end: PacerJob objects in the fake API server, jobs in the real job service.

What runs: a real nats-server with the stack's users and permissions (the
operator connects as its own user ``operator``, so its permissions are
exercised too), the shard service and the job service in-process, the
operator in-process, and the fake Kubernetes API server (``tests/fake_k8s.py``:
no API server can run here) serving the PacerJob CRD from
``deploy/base/crd-pacerjob.yaml``, its schema checked on every write.  The
test talks to the fake over HTTP as ``kubectl`` would.

What does not run: the pod-executor, so no pod and no TensorFlow.  A job
reaches ``planning`` on its own (the job service plans it); the test plays
the executor's one part the job's state needs, the ``applied`` event that
makes the job service move it to ``running`` (as tests/integration/test_jobs_ha.py
does).  Stopping is the job service's own answer to ``stop``.  Everything
the operator observes comes from the job service's records and events.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import InProcess, InProcessService, eventually
from fake_k8s import FakeK8s
from pacer import k8s_crd, security, subjects
from pacer.bus import Bus
from pacer.contracts.executor import ExecutorEvent, ExecutorEventKind
from pacer.contracts.jobs import JobRecord, JobState
from pacer.data.criteo import generate
from pacer.embedded import EmbeddedNats
from pacer.errors import NotFound
from pacer.jobs.client import JobClient
from pacer_services.job_service.app import JobService, JobServiceConfig
from pacer_services.operator.app import OperatorConfig, OperatorService
from pacer_services.operator.kube import KubeConfig
from pacer_services.shard_service.app import ShardServiceConfig

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
USERS = {user: (f"pw-{user}", user) for user in ("admin", "jobs", "shard", subjects.OPERATOR_SERVICE)}
WAIT = 30.0  # generous: the machine may be busy; every wait ends as soon as its condition holds


@pytest.fixture
def secure_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(store_dir=tmp_path / "nats", authorization=security.render_authorization(USERS)).start()
    yield srv
    srv.stop()


def url_as(srv: EmbeddedNats, user: str) -> str:
    return security.with_credentials(srv.url, user, USERS[user][0])


@pytest.fixture
def fake() -> Iterator[FakeK8s]:
    k = FakeK8s(namespace="team-a").start()
    k.install_crd(yaml.safe_load((ROOT / k8s_crd.CRD_FILE).read_text()))
    yield k
    k.stop()


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "train.rec"
    generate(path, 2_000, seed=1)
    return path


@pytest.fixture
async def admin(secure_nats: EmbeddedNats) -> AsyncIterator[Bus]:
    bus = await Bus.connect(url_as(secure_nats, "admin"), name="test-admin")
    yield bus
    await bus.close()


@pytest.fixture
async def services(secure_nats: EmbeddedNats, admin: Bus, tmp_path: Path) -> AsyncIterator[None]:
    await admin.ensure_streams()
    shard = InProcessService(url_as(secure_nats, "shard"), ShardServiceConfig(reap_interval_s=0.05,
                                                                              progress_interval_s=0.2))
    await shard.start()
    jobs = InProcess(url_as(secure_nats, "jobs"),
                     lambda b: JobService(b, JobServiceConfig(data_dir=tmp_path / "jobs", data_roots=(tmp_path,))))
    await jobs.start()
    yield
    await jobs.stop()
    await shard.stop()


def operator(srv: EmbeddedNats, fake: FakeK8s) -> InProcess[OperatorService]:
    cfg = OperatorConfig(namespaces=("team-a", "team-b"), kube=KubeConfig(fake.host), resync_s=0.3,
                         watch_timeout_s=60, retry_s=0.2, max_retry_s=2.0)
    return InProcess(url_as(srv, subjects.OPERATOR_SERVICE), lambda b: OperatorService(b, cfg))


@pytest.fixture
async def op(secure_nats: EmbeddedNats, fake: FakeK8s, services: None) -> AsyncIterator[InProcess[OperatorService]]:
    o = operator(secure_nats, fake)
    await o.start()
    yield o
    await o.stop()


class Kubectl:
    """What ``kubectl create/delete/patch`` send to the API server (here: the fake), over HTTP."""

    def __init__(self, host: str) -> None:
        self.host = host

    def _url(self, ns: str, name: str = "") -> str:
        return f"{self.host}/apis/{k8s_crd.API_VERSION}/namespaces/{ns}/{k8s_crd.PLURAL}" + (f"/{name}" if name else "")

    async def _send(self, method: str, url: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with aiohttp.ClientSession() as s, s.request(
                method, url, json=body, headers={"Content-Type": content_type}) as resp:
            out = await resp.json()
            assert resp.status < 300, (resp.status, out)
            return out

    async def create(self, ns: str, name: str, spec: Any) -> dict[str, Any]:
        obj = {"apiVersion": k8s_crd.API_VERSION, "kind": k8s_crd.KIND, "metadata": {"name": name}, "spec": spec}
        out: dict[str, Any] = await self._send("POST", self._url(ns), obj)
        return out

    async def delete(self, ns: str, name: str) -> None:
        await self._send("DELETE", self._url(ns, name))

    async def patch(self, ns: str, name: str, patch: dict[str, Any]) -> None:
        await self._send("PATCH", self._url(ns, name), patch, "application/merge-patch+json")


def spec(data: Path, **extra: Any) -> dict[str, Any]:
    return {"model": {"name": "wide_deep"}, "dataset": {"path": str(data)}, "policies": {"optimizer": "none"},
            **extra}


def status(fake: FakeK8s, name: str, ns: str = "team-a") -> dict[str, Any]:
    obj = fake.custom_object(k8s_crd.PLURAL, name, ns) or {}
    out: dict[str, Any] = obj.get("status") or {}
    return out


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in st.get("conditions", []) if c["type"] == kind]
    return found[0] if found else {}


async def applied(admin: Bus, job: str) -> None:
    """The executor's part: every node of the job runs (the job service then moves it to running)."""
    await admin.publish_durable(subjects.executor_event(job, ExecutorEventKind.APPLIED.value),
                                ExecutorEvent(job, ExecutorEventKind.APPLIED, time.time(), overhead_s=1.0))


async def get(admin: Bus, job: str) -> JobRecord | None:
    try:
        return await JobClient(admin, timeout=5.0).get(job)
    except NotFound:
        return None


async def test_a_pacerjob_runs_reports_and_stops_when_deleted(
        fake: FakeK8s, op: InProcess[OperatorService], admin: Bus, data: Path) -> None:
    kubectl = Kubectl(fake.host)
    await kubectl.create("team-a", "ctr", spec(data, epochs=2))
    planning = await eventually(lambda: (s := status(fake, "ctr")).get("phase") == "Planning" and s, WAIT,
                                lambda: f"status: {status(fake, 'ctr')}")
    job = planning["jobName"]
    assert job.startswith("team-a-ctr-")
    assert condition(planning, "Valid")["status"] == "True"
    assert condition(planning, "Submitted")["status"] == "True"
    obj = fake.custom_object(k8s_crd.PLURAL, "ctr")
    assert obj is not None and obj["metadata"]["finalizers"] == [k8s_crd.FINALIZER]
    rec = await get(admin, job)
    assert rec is not None and rec.spec.name == job and rec.spec.epochs == 2  # the resource's spec, named for it
    assert rec.namespace == "team-a"  # the team's: its API callers see it, other teams' do not

    # The same name in another namespace is another job.
    await kubectl.create("team-b", "ctr", spec(data))
    other = await eventually(lambda: status(fake, "ctr", "team-b").get("jobName"), WAIT)
    assert other != job and (other_rec := await eventually(lambda: get(admin, other), WAIT))
    assert other_rec.namespace == "team-b"

    await applied(admin, job)
    running = await eventually(lambda: (s := status(fake, "ctr")).get("phase") == "Running"
                               and s.get("progressText") and s, WAIT, lambda: f"status: {status(fake, 'ctr')}")
    assert condition(running, "Running")["status"] == "True"
    assert condition(running, "Finished")["status"] == "False"
    assert running["plan"]["workers"] == 2 and running["plan"]["source"] == "default"  # the job service's plan
    assert running["progress"]["shards_total"] > 0 and running["progressText"].endswith(" shards)")
    # Read again every resync, written only when something changed: a settled status is not rewritten.
    assert op.svc is not None
    counts = op.svc.counters.values
    writes, seen = len(fake.requests_to("PATCH", "/team-a/pacerjobs/ctr/status")), counts["reconciles"]
    await eventually(lambda: counts["reconciles"] >= seen + 6, WAIT)
    assert len(fake.requests_to("PATCH", "/team-a/pacerjobs/ctr/status")) == writes
    assert status(fake, "ctr") == running

    await kubectl.delete("team-a", "ctr")
    await eventually(lambda: fake.custom_object(k8s_crd.PLURAL, "ctr") is None, WAIT,
                     lambda: f"still there: {fake.custom_object(k8s_crd.PLURAL, 'ctr')}")
    rec = await get(admin, job)  # the object went only after its job was stopped
    assert rec is not None and rec.state is JobState.STOPPED and "PacerJob team-a/ctr deleted" in rec.reason
    rec_b = await get(admin, other)
    assert rec_b is not None and rec_b.state is not JobState.STOPPED  # the other team's job goes on
    assert counts["submitted"] == 2 and counts["stopped"] == 1 and counts["finalizers_removed"] == 1
    assert counts["internal_errors"] == 0 and counts["reconcile_errors"] == 0


async def test_invalid_and_malformed_resources_get_conditions_and_no_job(
        fake: FakeK8s, op: InProcess[OperatorService], admin: Bus, data: Path, tmp_path: Path) -> None:
    kubectl = Kubectl(fake.host)
    # Past the CRD's schema (types are right) but not the job-spec parser.
    await kubectl.create("team-a", "bad", {"name": "not-bad", "model": {"name": "dcn"}, "dataset": {},
                                           "epochs": 0, "backup_workers": 1})
    invalid = await eventually(lambda: (s := status(fake, "bad")).get("phase") == "Invalid" and s, WAIT,
                               lambda: f"status: {status(fake, 'bad')}")
    valid = condition(invalid, "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    lines = valid["message"].splitlines()
    for path in ("name:", "dataset.path:", "epochs:"):
        assert any(line.startswith(path) for line in lines), (path, lines)
    assert condition(invalid, "Submitted")["status"] == "False"
    assert await get(admin, invalid["jobName"]) is None  # nothing submitted
    obj = fake.custom_object(k8s_crd.PLURAL, "bad")
    assert obj is not None and not obj["metadata"].get("finalizers")  # nothing to stop: deleting is immediate

    # Objects the schema would refuse, stored anyway (an older CRD): a spec that is no map, a broken status.
    fake.store_unchecked(k8s_crd.PLURAL, {"apiVersion": k8s_crd.API_VERSION, "kind": k8s_crd.KIND,
                                          "metadata": {"name": "listy"}, "spec": [1, 2]})
    fake.store_unchecked(k8s_crd.PLURAL, {"apiVersion": k8s_crd.API_VERSION, "kind": k8s_crd.KIND,
                                          "metadata": {"name": "odd", "finalizers": "x"}, "spec": "model: dcn",
                                          "status": "garbage"})
    for name in ("listy", "odd"):
        st = await eventually(lambda name=name: (s := status(fake, name)).get("phase") == "Invalid" and s, WAIT,
                              lambda name=name: f"status of {name}: {status(fake, name)}")
        assert condition(st, "Valid")["message"].startswith("spec: must be a map"), st
    # An API server before 1.30 refuses any write to such an object, its status's too: counted, and on.
    assert op.svc is not None
    fake.ratcheting = False
    fake.store_unchecked(k8s_crd.PLURAL, {"apiVersion": k8s_crd.API_VERSION, "kind": k8s_crd.KIND,
                                          "metadata": {"name": "older"}, "spec": [3]})
    await eventually(lambda: op.svc is not None and op.svc.counters.values["status_refused"] >= 1, WAIT)
    assert status(fake, "older") == {}

    # A spec the parser takes but the job service refuses (its dataset is not there): Rejected, with why.
    await kubectl.create("team-a", "nodata", spec(tmp_path / "missing.rec"))
    rejected = await eventually(lambda: (s := status(fake, "nodata")).get("phase") == "Invalid" and s, WAIT,
                                lambda: f"status: {status(fake, 'nodata')}")
    assert condition(rejected, "Valid")["reason"] == "Rejected"
    assert "dataset.path" in condition(rejected, "Valid")["message"]

    # Fixed by an edit (a new generation): now it is submitted.
    await kubectl.patch("team-a", "bad", {"spec": {"name": None, "dataset": {"path": str(data)}, "epochs": 1,
                                                    "backup_workers": None}})
    fixed = await eventually(lambda: (s := status(fake, "bad")).get("phase") == "Planning" and s, WAIT,
                             lambda: f"status: {status(fake, 'bad')}")
    assert fixed["observedGeneration"] == 2 and fixed["submittedGeneration"] == 2
    assert condition(fixed, "Valid")["status"] == "True"
    assert await get(admin, fixed["jobName"]) is not None

    counts = op.svc.counters.values
    assert counts["invalid_specs"] == 3 and counts["rejected"] == 1 and counts["submitted"] == 1
    assert counts["internal_errors"] == 0
    listed = await JobClient(admin, timeout=5.0).list()
    assert [r.job for r in listed.jobs] == [fixed["jobName"]]  # the only job: no invalid one slipped through


async def test_a_restarted_operator_resumes_without_submitting_again_and_a_delete_waits_for_it(
        secure_nats: EmbeddedNats, fake: FakeK8s, services: None, admin: Bus, data: Path) -> None:
    kubectl = Kubectl(fake.host)
    first = operator(secure_nats, fake)
    await first.start()
    await kubectl.create("team-a", "ctr", spec(data))
    st = await eventually(lambda: (s := status(fake, "ctr")).get("phase") == "Planning" and s, WAIT,
                          lambda: f"status: {status(fake, 'ctr')}")
    job = st["jobName"]
    submitted_at = (await get(admin, job)).submitted_at  # type: ignore[union-attr]
    await first.stop()

    await applied(admin, job)  # the job runs while no operator is there
    await eventually(lambda: _state(admin, job, JobState.RUNNING), WAIT)
    second = operator(secure_nats, fake)
    await second.start()
    await eventually(lambda: status(fake, "ctr").get("phase") == "Running", WAIT,
                     lambda: f"status: {status(fake, 'ctr')}")
    assert second.svc is not None and second.svc.counters.values["submitted"] == 0
    listed = await JobClient(admin, timeout=5.0).list()
    assert [r.job for r in listed.jobs] == [job]
    assert listed.jobs[0].submitted_at == submitted_at
    await second.stop()

    # Deleted while no operator runs: the finalizer keeps the object, and the job runs on ...
    await kubectl.delete("team-a", "ctr")
    marked = fake.custom_object(k8s_crd.PLURAL, "ctr")
    assert marked is not None and marked["metadata"].get("deletionTimestamp")
    assert await _state(admin, job, JobState.RUNNING)
    # ... until an operator is back: it stops the job, then lets the object go.
    third = operator(secure_nats, fake)
    await third.start()
    try:
        await eventually(lambda: fake.custom_object(k8s_crd.PLURAL, "ctr") is None, WAIT)
        assert await _state(admin, job, JobState.STOPPED)
    finally:
        await third.stop()


async def _state(admin: Bus, job: str, state: JobState) -> bool:
    rec = await get(admin, job)
    return rec is not None and rec.state is state


async def test_the_operator_may_do_only_what_it_needs_on_the_bus(secure_nats: EmbeddedNats) -> None:
    """Its user submits, reads and stops jobs and hears job events; commanding an executor, listing every
    job or reading another service's events is refused by the server."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    bus = await Bus.connect(url_as(secure_nats, subjects.OPERATOR_SERVICE), name="op-test")
    bus.nc._error_cb = on_error  # type: ignore[attr-defined]
    try:
        for subject in (subjects.executor_rpc("j1", subjects.ExecutorOp.COMMAND),
                        subjects.job_rpc(subjects.ALL_JOBS, subjects.JobOp.LIST)):
            await bus.nc.publish(subject, b"{}")
        await bus.nc.subscribe(subjects.events_of("node"))
        await bus.nc.flush()
        await eventually(lambda: len(errors) >= 3, 5.0, lambda: f"errors: {errors}")
        text = " ".join(str(e).lower() for e in errors)
        assert text.count("permissions violation") >= 3, text
        errors.clear()
        await bus.nc.subscribe(subjects.events_of("job"))
        await bus.nc.publish(subjects.job_rpc("j1", subjects.JobOp.GET), b"{}")
        # A forbidden publish after them: the server answers in order, so once its violation is here, one
        # for the allowed operations above would be too.
        sentinel = subjects.executor_rpc("j2", subjects.ExecutorOp.COMMAND)
        await bus.nc.publish(sentinel, b"{}")
        await bus.nc.flush()
        await eventually(lambda: len(errors) >= 1, 5.0, lambda: f"errors: {errors}")
        assert len(errors) == 1 and sentinel.lower() in str(errors[0]).lower(), errors
    finally:
        await bus.close()
