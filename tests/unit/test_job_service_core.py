"""The job service's pure changes: build a record and a lifecycle, assert on the new record and events."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pacer.contracts.jobs import JobProgress, JobRecord, JobState
from pacer.contracts.nodes import NodeEvent
from pacer.jobs.lifecycle import IllegalJobTransition, JobLifecycle, JobTrigger
from pacer.jobs.spec import parse_job_spec
from pacer_services.job_service import core

SPEC = parse_job_spec("name: j\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")


def record(state: JobState, **kw: object) -> JobRecord:
    return replace(JobRecord("j", SPEC, state, submitted_at=1.0), **kw)  # type: ignore[arg-type]


def run(change: core.Change, rec: JobRecord) -> tuple[JobRecord, list[JobState], JobLifecycle]:
    lc = core.lifecycle_of(rec)
    new, events = change(rec, lc)
    assert new.state is lc.state  # the record and the lifecycle move together
    return new, [e.state for e in events], lc


def test_a_submission_is_stored_once_already_planning() -> None:
    lc, first = JobLifecycle.submitted("j", ["train"], 5.0)
    rec = record(JobState.SUBMITTED)
    new, events = core.submitted(first, 5.0, "plan: default")(rec, lc)
    assert [e.state for e in events] == [JobState.SUBMITTED, JobState.PLANNING]
    assert (new.state, new.reason) == (JobState.PLANNING, "plan: default")


def test_an_applied_plan_starts_a_planning_job_once() -> None:
    new, events, _ = run(core.plan_applied(10.0, 2.5), record(JobState.PLANNING))
    assert events == [JobState.RUNNING]
    assert (new.started_at, new.reason) == (10.0, "plan applied in 2.5s")
    again, events, _ = run(core.plan_applied(11.0, 1.0), new)  # redelivered
    assert (again, events) == (new, [])


def test_an_applied_plan_completes_a_job_whose_data_finished_while_it_was_re_planned() -> None:
    rec = record(JobState.PLANNING, progress=JobProgress(shards_total=4, shards_done=4))
    new, events, _ = run(core.plan_applied(10.0, 1.0), rec)
    assert events == [JobState.RUNNING, JobState.COMPLETED]
    assert (new.started_at, new.finished_at) == (10.0, 10.0)


def test_a_finished_dataset_completes_a_running_job_and_nothing_else() -> None:
    new, events, _ = run(core.dataset_finished("train", 20.0), record(JobState.RUNNING, started_at=3.0))
    assert events == [JobState.COMPLETED]
    assert (new.started_at, new.finished_at) == (3.0, 20.0)  # the first start is kept
    stopped = record(JobState.STOPPED, finished_at=9.0)
    assert run(core.dataset_finished("train", 20.0), stopped)[:2] == (stopped, [])
    planning = record(JobState.PLANNING)
    new, events, lc = run(core.dataset_finished("train", 20.0), planning)
    assert (new, events, lc.done) == (planning, [], {"train"})  # remembered for the next start


@pytest.mark.parametrize("state", [JobState.PLANNING, JobState.RUNNING])
def test_a_failure_report_fails_a_job_that_can_fail(state: JobState) -> None:
    new, events, _ = run(core.fail_unless_over(30.0, "node worker-1 failed"), record(state))
    assert events == [JobState.FAILED]
    assert (new.reason, new.finished_at) == ("node worker-1 failed", 30.0)


@pytest.mark.parametrize("state", [JobState.SUBMITTED, JobState.COMPLETED, JobState.FAILED, JobState.STOPPED])
def test_a_failure_report_leaves_a_job_without_a_fail_edge(state: JobState) -> None:
    rec = record(state)
    assert run(core.fail_unless_over(30.0, "late"), rec)[:2] == (rec, [])


def test_stopping_a_terminal_job_is_refused_by_the_table() -> None:
    rec = record(JobState.COMPLETED)
    with pytest.raises(IllegalJobTransition, match="cannot stop a completed job"):
        run(core.transition(JobTrigger.STOP, 1.0, "user"), rec)


def test_a_relaunch_is_counted_once_per_restart() -> None:
    died = NodeEvent(job="j", node="worker-1", kind="died", ts=1.0, restarts=0, relaunch=True)
    once = core.node_relaunched(died)(record(JobState.RUNNING))
    assert (once.node_restarts, once.restarts_by_node) == (1, {"worker-1": 1})
    assert core.node_relaunched(died)(once) == once  # a redelivered event changes nothing
    twice = core.node_relaunched(replace(died, restarts=1))(once)
    assert (twice.node_restarts, twice.restarts_by_node) == (2, {"worker-1": 2})


def test_a_stored_record_gives_back_its_lifecycle() -> None:
    lc = core.lifecycle_of(record(JobState.RUNNING, reason="r"))
    assert (lc.state, lc.done, lc.reason) == (JobState.RUNNING, set(), "r")
    done = core.lifecycle_of(record(JobState.RUNNING, progress=JobProgress(shards_total=2, shards_done=2)))
    assert done.done == {"train"}
    kept = core.lifecycle_of(record(JobState.PLANNING), done={"train", "other"})
    assert kept.done == {"train"}  # only the job's own datasets
