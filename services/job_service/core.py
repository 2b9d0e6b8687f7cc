"""The job service's decisions: pure changes of one job's record (no IO, no clock, no bus).

A :data:`Change` takes the job's stored record and a trial copy of its
lifecycle and returns the new record and the lifecycle events of the edges
it took.  The service (:mod:`.app`) stores the record with a revision check
and publishes the events; when another writer stored the record first it
re-reads it and runs the same change again, so every guard lives inside the
change and judges the record as it is now.  Time comes in as ``now``.

Edges are taken only through :meth:`pacer.jobs.lifecycle.JobLifecycle.apply`
(the one transition table); a change that must not take an illegal edge
asks :func:`pacer.jobs.lifecycle.next_state` first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pacer.contracts.jobs import JobEvent, JobProgress, JobRecord, JobState
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetStatus
from pacer.jobs.lifecycle import TERMINAL, JobLifecycle, JobTrigger, next_state

#: (record, trial lifecycle) -> (new record, events of the edges taken).
Change = Callable[[JobRecord, JobLifecycle], tuple[JobRecord, list[JobEvent]]]

#: The node whose final report is the job's result (the chief evaluates the model).
CHIEF = "worker-0"


def taken(rec: JobRecord, events: Sequence[JobEvent]) -> tuple[JobRecord, list[JobEvent]]:
    """The record after the lifecycle ``events`` (state, reason, start and finish times), with the events."""
    for ev in events:
        rec = replace(rec, state=ev.state, reason=ev.reason or rec.reason)
        if ev.state is JobState.RUNNING and not rec.started_at:
            rec = replace(rec, started_at=ev.ts)
        if ev.state in TERMINAL:
            rec = replace(rec, finished_at=ev.ts)
    return rec, list(events)


def data_only(fn: Callable[[JobRecord], JobRecord]) -> Change:
    """A change of the record's data (progress, restarts, result, teardown) that takes no edge."""
    return lambda rec, lc: (fn(rec), [])


def transition(trigger: JobTrigger, now: float, reason: str = "") -> Change:
    """Take the edge ``trigger``; an edge the table does not allow raises ``IllegalJobTransition`` (a conflict)."""
    return lambda rec, lc: taken(rec, [lc.apply(trigger, now, reason)])


def submitted(first: JobEvent, now: float, reason: str) -> Change:
    """A new job: its ``submitted`` event, then accepted into ``planning`` (stored once, already planning)."""
    return lambda rec, lc: taken(rec, [first, lc.apply(JobTrigger.ACCEPT, now, reason)])


def fail_unless_over(now: float, reason: str) -> Change:
    """Fail the job if its state has a ``fail`` edge; a failure report about a job already over changes nothing."""
    def change(rec: JobRecord, lc: JobLifecycle) -> tuple[JobRecord, list[JobEvent]]:
        if next_state(lc.state, JobTrigger.FAIL) is None:
            return rec, []
        return taken(rec, [lc.apply(JobTrigger.FAIL, now, reason)])
    return change


def plan_applied(now: float, overhead_s: float) -> Change:
    """The executor runs every node of the plan: a planning job starts (and completes if its data is done)."""
    def change(rec: JobRecord, lc: JobLifecycle) -> tuple[JobRecord, list[JobEvent]]:
        if lc.state is not JobState.PLANNING:
            return rec, []  # a redelivered or late ``applied``
        return taken(rec, lc.start(now, f"plan applied in {overhead_s:.1f}s"))
    return change


def dataset_finished(dataset: str, now: float) -> Change:
    """Every shard of ``dataset`` is done: a running job whose datasets are all done completes."""
    def change(rec: JobRecord, lc: JobLifecycle) -> tuple[JobRecord, list[JobEvent]]:
        fin = None if lc.terminal else lc.dataset_done(dataset, now)
        return taken(rec, [fin] if fin is not None else [])
    return change


def node_relaunched(ev: NodeEvent) -> Callable[[JobRecord], JobRecord]:
    """Count a node's relaunch; ``ev.restarts`` counts the relaunches before this one, so a redelivery adds nothing."""
    def change(rec: JobRecord) -> JobRecord:
        by_node = {**rec.restarts_by_node, ev.node: max(rec.restarts_by_node.get(ev.node, 0), ev.restarts + 1)}
        return replace(rec, restarts_by_node=by_node, node_restarts=sum(by_node.values()))
    return change


def progress_of(st: DatasetStatus) -> JobProgress:
    """The job's progress from its training dataset's shard counts."""
    return JobProgress(shards_total=st.todo + st.doing + st.done + st.failed, shards_todo=st.todo,
                       shards_doing=st.doing, shards_done=st.done, shards_failed=st.failed,
                       records_done=st.records_done, records_total=st.records_total,
                       records_duplicated=st.records_duplicated, epoch=st.epoch,
                       records_reserved=st.records_reserved)


def lifecycle_of(rec: JobRecord, done: frozenset[str] | set[str] = frozenset()) -> JobLifecycle:
    """The lifecycle of a stored record; ``done``: datasets already seen finishing (they stay finished)."""
    lc = JobLifecycle(rec.job, [rec.spec.dataset.name], rec.state)
    if rec.progress.shards_total and rec.progress.shards_done >= rec.progress.shards_total:
        lc.done.add(rec.spec.dataset.name)
    lc.done |= set(done) & lc.datasets
    lc.reason = rec.reason
    return lc
