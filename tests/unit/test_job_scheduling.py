"""A job spec's ``scheduling`` section: parsing, validation with field paths, and what every pod gets."""

from __future__ import annotations

import time

import pytest
from pacer.contracts.executor import PodSpec
from pacer.contracts.jobs import (
    GangScheduler,
    JobRecord,
    JobState,
    PlanSource,
    ResourcePlan,
    SchedulingConfig,
)
from pacer.jobs.spec import JobSpecError, parse_job_spec, spec_to_json
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor import launch

BASE = "name: j1\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n"
CLUSTER = ClusterDesc(("127.0.0.1:7000", "127.0.0.1:7001"), ("127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102"))


def problems(extra: str) -> list[str]:
    with pytest.raises(JobSpecError) as e:
        parse_job_spec(BASE + extra)
    return e.value.problems


def test_no_scheduling_section_is_none() -> None:
    assert parse_job_spec(BASE).scheduling is None


def test_a_full_section_is_read_and_survives_the_round_trip() -> None:
    spec = parse_job_spec(BASE + "scheduling:\n  priority_class: team-a.high\n  queue: team-a\n  gang: kueue\n")
    assert spec.scheduling == SchedulingConfig(priority_class="team-a.high", queue="team-a", gang=GangScheduler.KUEUE)
    assert parse_job_spec(spec_to_json(spec)) == spec


def test_defaults_are_no_gang_and_no_names() -> None:
    spec = parse_job_spec(BASE + "scheduling: {priority_class: low}\n")
    assert spec.scheduling == SchedulingConfig(priority_class="low")
    assert spec.scheduling.gang is GangScheduler.NONE


def test_kueue_needs_a_queue() -> None:
    assert problems("scheduling: {gang: kueue}\n") == [
        "scheduling.queue: required with gang kueue (the LocalQueue that admits the job)"]


@pytest.mark.parametrize(("extra", "path"), [
    ("scheduling: {priority_class: High_Prio}\n", "scheduling.priority_class"),
    ("scheduling: {priority_class: a..b}\n", "scheduling.priority_class"),
    (f"scheduling: {{priority_class: {'a' * 254}}}\n", "scheduling.priority_class"),
    ("scheduling: {priority_class: 5}\n", "scheduling.priority_class"),
    ("scheduling: {queue: team.a, gang: kueue}\n", "scheduling.queue"),  # a label: no dots
    (f"scheduling: {{queue: {'q' * 64}}}\n", "scheduling.queue"),
    ("scheduling: {queue: -q}\n", "scheduling.queue"),
    ("scheduling: {gang: slurm}\n", "scheduling.gang"),
    ("scheduling: {gangs: kueue}\n", "scheduling.gangs"),
    ("scheduling: kueue\n", "scheduling"),
])
def test_bad_values_are_refused_with_their_path(extra: str, path: str) -> None:
    found = problems(extra)
    assert len(found) == 1 and found[0].startswith(path + ": "), found


def test_the_longest_legal_names_pass() -> None:
    sub = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters
    spec = parse_job_spec(BASE + f"scheduling: {{priority_class: {sub}, queue: {'q' * 63}}}\n")
    assert spec.scheduling is not None and spec.scheduling.priority_class == sub


def pods(extra: str) -> list[PodSpec]:
    spec = parse_job_spec(BASE + extra)
    rec = JobRecord("j1", spec, JobState.RUNNING, time.time(), data_path="/data/train.rec", records=1000)
    plan = ResourcePlan("j1", 3, 2, 1.0, 1024, 1.0, 1024, PlanSource.BRAIN)
    cfg = launch.LaunchConfig("nats://127.0.0.1:4222")
    return [launch.pod_spec(rec, plan, CLUSTER, role, i, 0, 1.0, 1024, 7000 + i, cfg)
            for role, n in (("ps", 2), ("worker", 3)) for i in range(n)]


def test_every_pod_of_a_gang_carries_the_section_and_the_gang_size_is_ps_plus_workers() -> None:
    for pod in pods("scheduling: {priority_class: high, queue: team-a, gang: kueue}\n"):
        assert (pod.priority_class, pod.queue, pod.gang, pod.gang_size) == ("high", "team-a", "kueue", 5)
    for pod in pods("scheduling: {gang: volcano}\n"):
        assert (pod.priority_class, pod.queue, pod.gang, pod.gang_size) == ("", "", "volcano", 5)


def test_no_gang_means_no_gang_fields() -> None:
    for pod in pods("scheduling: {priority_class: high, queue: team-a}\n") + pods(""):
        assert (pod.gang, pod.gang_size) == ("", 0)
    assert {p.priority_class for p in pods("")} == {""}
