"""Gang scheduling and priorities: what the backend adds to every pod of a job with a ``scheduling`` section
(Kueue's pod-group labels, Volcano's scheduler and PodGroup, a priority class), and nothing without one.
Against the fake API server only: no Kueue or Volcano acts on what is sent.
(The fake API server, the backend and the watcher: k8s_backend_support.)"""

from __future__ import annotations

from dataclasses import replace

import k8s_backend_support
from fake_k8s import FakeK8s
from k8s_backend_support import JOB, NS, OWNER, spec
from pacer.contracts.executor import PodSpec
from pacer_services.pod_executor.backends.kubernetes import KubernetesBackend

fake = k8s_backend_support.fake
backend = k8s_backend_support.backend

NODES = ("ps-0", "ps-1", "worker-0", "worker-1", "worker-2")  # a gang of 5


def gang_pods(**fields: object) -> list[PodSpec]:
    return [replace(spec(node), **fields) for node in NODES]  # type: ignore[arg-type]


async def test_every_pod_of_a_kueue_job_joins_one_pod_group_of_the_jobs_size(
        fake: FakeK8s, backend: KubernetesBackend) -> None:
    for pod in gang_pods(gang="kueue", queue="team-a", gang_size=len(NODES)):
        await backend.create(pod)
    for node in NODES:
        md = fake.pods[(NS, f"{JOB}-{node}-g0")]["metadata"]
        assert md["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert md["labels"]["kueue.x-k8s.io/pod-group-name"] == JOB
        assert md["labels"]["pacer.io/node"] == node  # Pacer's own labels stay
        assert md["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "5"
        assert "schedulerName" not in fake.pods[(NS, f"{JOB}-{node}-g0")]["spec"]
    assert fake.requests_to("POST", "/podgroups") == []  # Kueue needs no object of Pacer's


async def test_a_volcano_job_gets_a_podgroup_before_its_first_pod_and_its_pods_name_it(
        fake: FakeK8s, backend: KubernetesBackend) -> None:
    fake.install_volcano_podgroups()
    for pod in gang_pods(gang="volcano", gang_size=len(NODES), priority_class="batch-high"):
        await backend.create(pod)
    group = fake.custom_object("podgroups", JOB, group="scheduling.volcano.sh")
    assert group is not None
    assert group["spec"] == {"minMember": 5, "priorityClassName": "batch-high"}
    assert group["metadata"]["labels"] == {"app.kubernetes.io/part-of": "pacer", "pacer.io/job": JOB}
    # Owned by the job's Service (deleted with it at teardown), as the job's Secrets are.
    service = fake.services[(NS, JOB)]
    assert [(r["kind"], r["name"], r["uid"]) for r in group["metadata"]["ownerReferences"]] == [
        ("Service", JOB, service["metadata"]["uid"])]
    # Created once, and before the first pod.
    creates = [r.path for r in fake.requests if r.method == "POST"]
    assert [p for p in creates if p.endswith("/podgroups")] == [
        f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups"]
    assert creates.index(f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups") < min(
        i for i, p in enumerate(creates) if p.endswith("/pods"))
    for node in NODES:
        pod = fake.pods[(NS, f"{JOB}-{node}-g0")]
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == JOB
        assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]


async def test_a_volcano_podgroup_another_instance_created_is_used_as_it_is(
        fake: FakeK8s, backend: KubernetesBackend) -> None:
    fake.install_volcano_podgroups()
    other = k8s_backend_support.new_backend(fake)
    try:
        await other.create(replace(spec("ps-0"), gang="volcano", gang_size=2))
    finally:
        await other.close()
        other.api.api_client.close()
    await backend.create(replace(spec("worker-0"), gang="volcano", gang_size=2))  # a 409 on the group: fine
    assert fake.pods[(NS, f"{JOB}-worker-0-g0")]["spec"]["schedulerName"] == "volcano"


async def test_a_plan_of_another_size_patches_the_podgroups_min_member_once(
        fake: FakeK8s, backend: KubernetesBackend) -> None:
    """Scaled from 5 to 7 nodes: the first pod of the new plan gives the group minMember 7 (one merge patch);
    its other pods send nothing more.  A group another instance created at another size is patched too."""
    fake.install_volcano_podgroups()
    for pod in gang_pods(gang="volcano", gang_size=5):
        await backend.create(pod)
    assert fake.requests_to("PATCH", f"/podgroups/{JOB}") == []
    for node in ("worker-3", "worker-4"):
        await backend.create(replace(spec(node), gang="volcano", gang_size=7))
    group = fake.custom_object("podgroups", JOB, group="scheduling.volcano.sh")
    assert group is not None and group["spec"]["minMember"] == 7, group
    assert len(fake.requests_to("PATCH", f"/podgroups/{JOB}")) == 1

    other = k8s_backend_support.new_backend(fake)  # knows nothing of the group: its create is a 409
    try:
        await other.create(replace(spec("worker-5"), gang="volcano", gang_size=8))
    finally:
        await other.close()
        other.api.api_client.close()
    group = fake.custom_object("podgroups", JOB, group="scheduling.volcano.sh")
    assert group is not None and group["spec"] == {"minMember": 8}, group


async def test_a_priority_class_lands_on_every_pod(fake: FakeK8s, backend: KubernetesBackend) -> None:
    for pod in gang_pods(priority_class="team-a.high"):
        await backend.create(pod)
    assert {fake.pods[(NS, f"{JOB}-{n}-g0")]["spec"]["priorityClassName"] for n in NODES} == {"team-a.high"}


async def test_a_job_without_scheduling_gets_none_of_it(fake: FakeK8s, backend: KubernetesBackend) -> None:
    for pod in gang_pods():
        await backend.create(pod)
    for node in NODES:
        pod = fake.pods[(NS, f"{JOB}-{node}-g0")]
        assert not {"priorityClassName", "schedulerName"} & pod["spec"].keys()
        assert not any(k.startswith(("kueue.", "scheduling.")) for k in pod["metadata"]["labels"])
        assert not any(k.startswith(("kueue.", "scheduling.")) for k in pod["metadata"].get("annotations") or {})
        assert pod["metadata"]["ownerReferences"] == [OWNER]
    assert fake.requests_to("POST", "/podgroups") == []
