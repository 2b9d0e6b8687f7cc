"""The operator's pure decisions: a PacerJob's Pacer job name, what it reads of an object, its spec checked as the
job service checks it, and its status from a job record."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pacer.contracts.jobs import JobProgress, JobRecord, JobState, PlanSource, ResourcePlan
from pacer.jobs.spec import JOB_NAME_MAX_LEN, is_job_name, parse_job_spec
from pacer.k8s_crd import FINALIZER
from pacer_services.operator import core

SPEC = {"model": {"name": "wide_deep"}, "dataset": {"path": "/data/train.rec"}, "epochs": 2}
T0, T1 = "2026-12-01T10:00:00Z", "2026-12-01T10:05:00Z"


def resource(spec: Any = ..., **kw: Any) -> core.Resource:
    base: dict[str, Any] = {"namespace": "team-a", "name": "ctr", "uid": "0b6f-1", "generation": 1,
                            "resource_version": "7", "deleting": False, "finalizers": (),
                            "spec": dict(SPEC) if spec is ... else spec}
    return core.Resource(**{**base, **kw})


def record(res: core.Resource, state: JobState = JobState.RUNNING, **kw: Any) -> JobRecord:
    spec = parse_job_spec(core.check_spec(res).text)
    plan = ResourcePlan(res.job, 3, 2, 1.0, 2048, 0.5, 1024, PlanSource.BRAIN, reason="warm start")
    return JobRecord(res.job, spec, state, time.time(), plan=plan, **kw)


# ------------------------------------------------------------------ names


def test_a_job_name_is_readable_and_a_valid_job_name() -> None:
    name = core.job_name("team-a", "ctr", "0b6f-1")
    assert name.startswith("team-a-ctr-") and len(name) == len("team-a-ctr-") + core.HASH_CHARS
    assert is_job_name(name)
    assert core.job_name("team-a", "ctr", "0b6f-1") == name  # a function of the object: restarts find it


def test_names_that_read_alike_across_namespaces_do_not_collide() -> None:
    a = core.job_name("team-a", "x-y", "u")
    b = core.job_name("team-a-x", "y", "u")
    assert a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]  # the readable part is the same ...
    assert a != b  # ... the hash is not


def test_a_resource_created_again_under_its_name_is_a_new_job() -> None:
    assert core.job_name("team-a", "ctr", "uid-1") != core.job_name("team-a", "ctr", "uid-2")


@pytest.mark.parametrize(("ns", "name"), [
    ("0-numbers-first", "j"),  # a namespace may start with a digit, a job name may not
    ("team-a", "x" * 253),  # the longest object name
    ("a" * 63, "with.dots.in.it"),  # a DNS subdomain, not a label
])
def test_any_kubernetes_name_gives_a_valid_job_name(ns: str, name: str) -> None:
    job = core.job_name(ns, name, "uid")
    assert is_job_name(job), job
    assert len(job) <= JOB_NAME_MAX_LEN


label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)


@settings(max_examples=200, deadline=None, database=None)
@given(label, st.lists(label, min_size=1, max_size=4).map(".".join), st.uuids().map(str))
def test_every_name_is_a_valid_job_name(ns: str, name: str, uid: str) -> None:
    assert is_job_name(core.job_name(ns, name, uid))


# ------------------------------------------------------------------ reading an object


def test_read_resource() -> None:
    obj = {"metadata": {"namespace": "n", "name": "a", "uid": "u", "generation": 3, "resourceVersion": "42",
                        "finalizers": [FINALIZER, "other/x"], "deletionTimestamp": T0},
           "spec": {"epochs": 1}, "status": {"phase": "Running"}}
    res = core.read_resource(obj)
    assert (res.key, res.generation, res.resource_version) == ("n/a", 3, "42")
    assert res.deleting and res.has_finalizer and res.status == {"phase": "Running"}


@pytest.mark.parametrize("obj", [None, [], {"spec": {}}, {"metadata": []}, {"metadata": {"name": "a", "uid": "u"}},
                                 {"metadata": {"namespace": "n", "name": "", "uid": "u"}},
                                 {"metadata": {"namespace": "n", "name": 5, "uid": "u"}}])
def test_an_object_without_identity_is_malformed(obj: Any) -> None:
    with pytest.raises(core.Malformed):
        core.read_resource(obj)


def test_odd_fields_of_a_named_object_are_read_as_absent() -> None:
    res = core.read_resource({"metadata": {"namespace": "n", "name": "a", "uid": "u", "generation": "x",
                                           "finalizers": "f"}, "spec": [1], "status": "broken"})
    assert (res.generation, res.finalizers, res.status, res.spec) == (0, (), {}, [1])


# ------------------------------------------------------------------ the spec


def test_a_valid_spec_is_submitted_under_the_job_name() -> None:
    res = resource()
    checked = core.check_spec(res)
    assert checked.valid
    assert parse_job_spec(checked.text).name == res.job


def test_the_spec_may_name_the_resource_but_nothing_else() -> None:
    assert core.check_spec(resource({**SPEC, "name": "ctr"})).valid
    checked = core.check_spec(resource({**SPEC, "name": "other"}))
    assert checked.problems[0].startswith("name: must be the resource's name ('ctr')")


def test_every_problem_is_listed_with_its_field_path() -> None:
    bad = {"model": {"name": "gpt"}, "dataset": {}, "epochs": 0, "mode": "bsp", "backup_workers": 1,
           "epoch": 3, "resources": {"workers": -1}}
    problems = core.check_spec(resource(bad)).problems
    for path in ("model.name:", "dataset.path:", "epochs:", "epoch:", "resources.workers:"):
        assert any(p.startswith(path) for p in problems), (path, problems)


@pytest.mark.parametrize("spec", [[1, 2], "model: dcn", None, 5])
def test_a_spec_that_is_not_a_map_is_a_problem_not_a_crash(spec: Any) -> None:
    problems = core.check_spec(resource(spec)).problems
    assert problems and problems[0].startswith("spec: must be a map"), problems


# ------------------------------------------------------------------ status


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_a_running_jobs_status() -> None:
    res = resource()
    rec = record(res, progress=JobProgress(shards_total=40, shards_done=15, records_done=3700, records_total=10000))
    status = core.job_status(res, rec, T0)
    assert (status["phase"], status["jobName"], status["observedGeneration"]) == ("Running", res.job, 1)
    assert status["plan"]["workers"] == 3 and status["plan"]["source"] == "brain"
    assert status["progress"]["shards_done"] == 15
    assert status["progressText"] == "37% (15/40 shards)"
    cond = conditions(status)
    assert cond["Running"]["status"] == "True" and cond["Finished"]["status"] == "False"
    assert cond["Valid"]["reason"] == "SpecValid" and cond["SpecApplied"]["status"] == "True"
    assert all(c["lastTransitionTime"] == T0 for c in cond.values())


def test_an_ended_job_says_why() -> None:
    res = resource()
    status = core.job_status(res, record(res, JobState.FAILED, reason="worker-1: exit 2 (user error)"), T0)
    cond = conditions(status)
    assert status["phase"] == "Failed" and status["message"] == "worker-1: exit 2 (user error)"
    assert (cond["Finished"]["status"], cond["Finished"]["reason"]) == ("True", "Failed")
    assert cond["Finished"]["message"] == "worker-1: exit 2 (user error)"
    assert (cond["Running"]["status"], cond["Running"]["reason"]) == ("False", "Failed")


def test_an_unchanged_status_is_not_written_again_and_a_change_moves_only_its_conditions_time() -> None:
    res = resource()
    first = core.job_status(res, record(res, JobState.PLANNING), T0)
    stored = replace(res, status=first)
    assert core.status_changes(stored, core.job_status(stored, record(res, JobState.PLANNING), T1)) is None
    running = core.job_status(stored, record(res, JobState.RUNNING), T1)
    patch = core.status_changes(stored, running)
    assert patch is not None and patch["phase"] == "Running"
    cond = conditions(running)
    assert cond["Running"]["lastTransitionTime"] == T1  # False -> True
    assert cond["Valid"]["lastTransitionTime"] == T0  # still True since T0
    assert cond["Finished"]["lastTransitionTime"] == T0  # still False


def test_a_field_the_new_status_lacks_is_removed_by_the_patch() -> None:
    res = replace(resource(), status={"phase": "Pending", "stale": 1})
    patch = core.status_changes(res, core.pending_status(res, "bus down", T0))
    assert patch is not None and patch["stale"] is None


def test_a_spec_changed_after_submission_is_reported_not_applied() -> None:
    res = replace(resource(), generation=2, status={"submittedGeneration": 1})
    cond = conditions(core.job_status(res, record(res), T0))
    assert (cond["SpecApplied"]["status"], cond["SpecApplied"]["reason"]) == ("False", "SpecImmutable")
    assert "generation 1" in cond["SpecApplied"]["message"]


def test_an_invalid_spec_lists_every_problem() -> None:
    res = resource({"model": {"name": "gpt"}, "dataset": {}})
    checked = core.check_spec(res)
    status = core.invalid_status(res, checked.problems, T0)
    cond = conditions(status)
    assert status["phase"] == "Invalid" and "and 1 more problems" in status["message"]
    assert (cond["Valid"]["status"], cond["Valid"]["reason"]) == ("False", "InvalidSpec")
    assert cond["Valid"]["message"].splitlines() == list(checked.problems)
    assert cond["Submitted"]["status"] == "False"


def test_a_huge_problem_list_is_cut() -> None:
    res = resource()
    status = core.invalid_status(res, [f"x{i}: bad" * 50 for i in range(500)], T0)
    assert len(conditions(status)["Valid"]["message"]) < core.MAX_MESSAGE + 100


def test_only_settled_resources_are_left_out_of_polling() -> None:
    res = resource()
    done = replace(res, status=core.job_status(res, record(res, JobState.COMPLETED), T0))
    assert not core.needs_polling(done)
    assert core.needs_polling(replace(done, generation=2))  # edited since
    assert core.needs_polling(replace(done, deleting=True))
    assert core.needs_polling(replace(res, status=core.job_status(res, record(res), T0)))  # running: progress
