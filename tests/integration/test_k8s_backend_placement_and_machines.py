"""Placement and machines: a placed pod prefers its machine softly; machines are the ready, schedulable,
tolerated nodes with what is free; through the real executor on the bus too.
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

import time
from dataclasses import replace

import k8s_backend_support
import pytest
import yaml
from conftest import InProcess
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, TEMPLATE, new_backend, spec, until
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.executor import ClusterStatus
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.embedded import EmbeddedNats
from pacer.jobs.spec import parse_job_spec
from pacer_services.pod_executor.app import ExecutorConfig, ExecutorService

# The fixtures of k8s_backend_support (pytest finds them as attributes of this module).
fake = k8s_backend_support.fake
backend = k8s_backend_support.backend


# -- placement and machines ---------------------------------------------------


def preferred_hosts(pod: dict[str, object]) -> list[tuple[int, list[str]]]:
    """(weight, hostnames) of each preferred node-affinity term on kubernetes.io/hostname."""
    terms = (pod["spec"].get("affinity", {}).get("nodeAffinity", {})  # type: ignore[attr-defined]
             .get("preferredDuringSchedulingIgnoredDuringExecution", []))
    return [(t["weight"], e["values"]) for t in terms for e in t["preference"]["matchExpressions"]
            if e["key"] == "kubernetes.io/hostname" and e["operator"] == "In"]


async def test_a_placed_pod_prefers_its_machine_softly(fake: FakeK8s) -> None:
    """The placement becomes a preferred (never a required) node affinity, added to the template's own."""
    tpl = yaml.safe_load(TEMPLATE.read_text())
    own = {"weight": 5, "preference": {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}}
    tpl["spec"]["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [own]}}
    b = new_backend(fake, template=tpl)
    try:
        await b.create(replace(spec("worker-0"), machine="node-b"))
        await b.create(replace(spec("worker-1"), machine="Not A Hostname!"))  # could not match: dropped
        pod = fake.pods[(NS, "job1-worker-0-g0")]
        affinity = pod["spec"]["affinity"]["nodeAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity
        assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0] == own
        assert preferred_hosts(pod) == [(100, ["node-b"])]
        assert preferred_hosts(fake.pods[(NS, "job1-worker-1-g0")]) == []
        assert tpl["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [own]
    finally:
        b.api.api_client.close()


async def test_machines_are_ready_schedulable_nodes_with_what_is_free(fake: FakeK8s) -> None:
    fake.add_node("node-a", "8", "32Gi")
    fake.add_node("node-b", "4", "16Gi", hostname="b.example")  # affinity matches the hostname label
    fake.add_node("node-cordoned", "64", "256Gi", unschedulable=True)
    fake.add_node("node-down", "64", "256Gi", ready=False)
    fake.add_node("node-gpu", "32", "128Gi", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    fake.add_node("node-pref", "2", "8Gi", taints=[{"key": "spot", "effect": "PreferNoSchedule"}])
    b = new_backend(fake, machines_every_s=0.0, cluster_machines=True)
    try:
        await b.create(spec("worker-0"))  # 1.5 CPUs / 2 GiB + the agent's 100m / 128 MiB
        await b.create(spec("ps-0", job="job2"))
        await b.create(spec("worker-1"))  # never scheduled: holds nothing
        fake.set_running("job1-worker-0-g0", node="node-a")
        fake.set_running("job2-ps-0-g0", node="node-a")
        fake.add_foreign_pod("web-1", "other", "node-b", "1500m", "3Gi")
        fake.add_foreign_pod("done-1", "other", "node-b", "2", "8Gi", phase="Succeeded")
        fake.terminate("job2-ps-0-g0", 0)  # Succeeded: its requests are free again
        machines = {m.name: m for m in await b.machines()}
        assert sorted(machines) == ["b.example", "node-a", "node-pref"]
        a, bb = machines["node-a"], machines["b.example"]
        assert (a.cpu, a.memory_mb) == (8.0, 32 * 1024)
        assert a.free_cpu == pytest.approx(8 - 1.6) and a.free_memory_mb == 32 * 1024 - 2048 - 128
        assert a.held_cpu == {"job1": pytest.approx(1.6)} and a.held_memory_mb == {"job1": 2048 + 128}
        # a foreign pod counts against the free capacity, not as anyone's own
        assert (bb.free_cpu, bb.free_memory_mb, bb.held_cpu) == (2.5, 13 * 1024, {})
        listed = fake.requests_to("GET", "/api/v1/pods")
        assert listed and listed[-1].query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"
    finally:
        b.api.api_client.close()


async def test_tolerated_taints_count_and_listing_is_throttled(fake: FakeK8s) -> None:
    fake.add_node("node-gpu", "32", "128Gi", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    tpl = yaml.safe_load(TEMPLATE.read_text())
    tpl["spec"]["tolerations"] = [{"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    only_worker = new_backend(fake, template={"worker": tpl, "ps": yaml.safe_load(TEMPLATE.read_text())},
                              cluster_machines=True)
    both = new_backend(fake, template={"worker": tpl, "ps": tpl}, machines_every_s=3600.0, cluster_machines=True)
    try:
        assert await only_worker.machines() == []  # a PS could not go there
        assert [m.name for m in await both.machines()] == ["node-gpu"]
        fake.add_node("node-new", "8", "32Gi")
        nodes_before = len(fake.requests_to("GET", "/api/v1/nodes"))
        assert [m.name for m in await both.machines()] == ["node-gpu"]  # reused within machines_every_s
        assert len(fake.requests_to("GET", "/api/v1/nodes")) == nodes_before
    finally:
        only_worker.api.api_client.close()
        both.api.api_client.close()


async def test_machines_unknown_when_the_api_fails() -> None:
    b = new_backend("http://127.0.0.1:9", machines_every_s=0.0, cluster_machines=True)  # nothing listens there
    try:
        assert await b.machines() == []
    finally:
        b.api.api_client.close()


async def test_without_cluster_machines_nothing_outside_the_namespace_is_listed(fake: FakeK8s) -> None:
    """The base install grants no ClusterRole: the backend then never asks for nodes or other namespaces."""
    fake.add_node("node-a", "8", "32Gi")
    b = new_backend(fake, machines_every_s=0.0)
    try:
        await b.create(spec("worker-0"))
        assert await b.machines() == []
        assert fake.requests_to("GET", "/api/v1/nodes") == [] and fake.requests_to("GET", "/api/v1/pods") == []
    finally:
        b.api.api_client.close()


async def test_machines_unknown_without_the_cluster_role(fake: FakeK8s, caplog: pytest.LogCaptureFixture) -> None:
    """The setting without the ClusterRole: 403s, machines unknown, a warning naming the component; and the
    backend still creates and lists the namespace's pods."""
    fake.add_node("node-a", "8", "32Gi")
    fake.forbidden |= {"nodes", "pods/all-namespaces"}
    b = new_backend(fake, machines_every_s=0.0, cluster_machines=True)
    try:
        assert await b.machines() == []
        assert fake.requests_to("GET", "/api/v1/nodes")  # it did ask, and was refused
        assert "cluster-placement" in caplog.text
        await b.create(spec("worker-0"))
        assert [s.name for s in await b.list()] == ["job1-worker-0-g0"]
        fake.forbidden.clear()  # the ClusterRole granted later: the next try reports the machines
        assert [m.name for m in await b.machines()] == ["node-a"]
    finally:
        b.api.api_client.close()


async def test_the_executor_places_pods_and_reports_machines(fake: FakeK8s, nats_server: EmbeddedNats,
                                                             bus: Bus) -> None:
    """A plan with a placement, through the real executor and the fake API server: each pod prefers its
    node's machine; the ClusterStatus on the bus lists the machines, with what the job holds."""
    fake.add_node("node-a", "8", "32Gi")
    fake.add_node("node-b", "8", "32Gi")
    statuses: list[ClusterStatus] = []

    async def on_status(m: Msg) -> None:
        statuses.append(decode(ClusterStatus, m.data))

    await bus.nc.subscribe(subjects.cluster_status(), cb=on_status)
    job_spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    rec = JobRecord(JOB, job_spec, JobState.PLANNING, time.time(), data_path="/data/train.rec", records=1000)
    await (await bus.kv(subjects.JOB_BUCKET)).put(JOB, encode(rec))
    backend = new_backend(fake, machines_every_s=0.0, cluster_machines=True)
    cfg = ExecutorConfig(backend="kubernetes", cluster_every_s=0.1, durable="executor-k8s-test", reconcile_s=0.2)
    svc = InProcess(nats_server.url, lambda b: ExecutorService(b, backend, cfg))
    await svc.start()
    try:
        plan = ResourcePlan(JOB, 2, 1, 1.0, 1024, 2.0, 2048, PlanSource.BRAIN,
                            placement={"ps-0": "node-b", "worker-0": "node-b", "worker-1": "node-a"})
        await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), plan)
        names = {f"{JOB}-{n}-g0" for n in ("ps-0", "worker-0", "worker-1")}
        await until(lambda: names <= {name for _, name in fake.pods})
        assert preferred_hosts(fake.pods[(NS, f"{JOB}-ps-0-g0")]) == [(100, ["node-b"])]
        assert preferred_hosts(fake.pods[(NS, f"{JOB}-worker-0-g0")]) == [(100, ["node-b"])]
        assert preferred_hosts(fake.pods[(NS, f"{JOB}-worker-1-g0")]) == [(100, ["node-a"])]
        fake.set_running(f"{JOB}-ps-0-g0", node="node-b")
        await until(lambda: any(m.held_cpu for s in statuses[-1:] for m in s.machines), timeout=15)
        last = statuses[-1]
        assert last.backend == "kubernetes" and last.reserves_capacity
        by_name = {m.name: m for m in last.machines}
        assert sorted(by_name) == ["node-a", "node-b"]
        # ps-0's trainer (2 CPU) and its agent sidecar (100m): PS pods have an agent too.
        assert by_name["node-b"].held_cpu[JOB] == pytest.approx(2.1) and by_name["node-b"].free_cpu == pytest.approx(5.9)
        assert last.total_cpu == 16.0 and last.free_cpu == pytest.approx(13.9)
    finally:
        await svc.stop()
        await backend.close()
        backend.api.api_client.close()
