"""The job lifecycle: legal state transitions in one table, applied in one place.

:class:`JobLifecycle` is a pure state machine for one job: no IO, no clock
(``now`` comes in as an argument).  Every change goes through
:meth:`JobLifecycle.apply`, which looks the ``(state, trigger)`` edge up in
:data:`TRANSITIONS` and raises :class:`IllegalJobTransition` for anything
else; it returns the :class:`~pacer.contracts.jobs.JobEvent` to publish.
The job service owns one per job and handles a job's messages in order, so
the object needs no locking.

A job completes when every one of its datasets is done
(:meth:`JobLifecycle.dataset_done`); it fails, with the error as the reason,
on an unretryable error (:meth:`JobLifecycle.error`), while temporary errors
leave the job as it is so that the caller retries.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from pacer.contracts.jobs import JobEvent, JobState
from pacer.errors import Conflict, PacerError

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "IllegalJobTransition",
    "JobLifecycle",
    "JobState",
    "JobTrigger",
    "next_state",
]


class JobTrigger(str, enum.Enum):
    """What happened to a job; together with its state it selects one edge of :data:`TRANSITIONS`."""

    ACCEPT = "accept"  # the spec was validated and the job stored
    START = "start"  # the plan was applied and the nodes started
    FINISH = "finish"  # every dataset of the job is done
    FAIL = "fail"  # an unretryable error (a reason is required)
    STOP = "stop"  # the user asked to stop the job
    REPLAN = "replan"  # a new plan is needed (scale, re-plan after a profile)


S, T = JobState, JobTrigger

#: The only legal edges: (state, trigger) -> next state.  Anything else raises.
TRANSITIONS: dict[tuple[JobState, JobTrigger], JobState] = {
    # accepted: the spec is valid, the optimizer policy is asked for a plan
    (S.SUBMITTED, T.ACCEPT): S.PLANNING,
    # the user stopped the job before it was planned
    (S.SUBMITTED, T.STOP): S.STOPPED,
    # plan applied, PS and worker nodes started
    (S.PLANNING, T.START): S.RUNNING,
    # no plan can be made or applied (e.g. limits below what the job needs)
    (S.PLANNING, T.FAIL): S.FAILED,
    # the user stopped the job while it was being planned
    (S.PLANNING, T.STOP): S.STOPPED,
    # every dataset finished (shard service reports all shards DONE)
    (S.RUNNING, T.FINISH): S.COMPLETED,
    # an unretryable error: a node failed beyond its restarts, a dataset parked shards, ...
    (S.RUNNING, T.FAIL): S.FAILED,
    # the user stopped the running job; nodes are torn down
    (S.RUNNING, T.STOP): S.STOPPED,
    # re-plan or scale: the optimizer makes a new plan, nodes keep their shards
    (S.RUNNING, T.REPLAN): S.PLANNING,
}

#: States without outgoing edges.
TERMINAL: frozenset[JobState] = frozenset(s for s in JobState if not any(src is s for src, _ in TRANSITIONS))


class IllegalJobTransition(Conflict):
    """Raised by :meth:`JobLifecycle.apply` for an edge not in :data:`TRANSITIONS` (or whose guard fails)."""

    def __init__(self, job: str, state: JobState, trigger: JobTrigger, why: str = ""):
        legal = sorted(t.value for (s, t) in TRANSITIONS if s is state)
        detail = why or f"legal here: {', '.join(legal) if legal else 'none (terminal state)'}"
        super().__init__(f"job {job}: cannot {trigger.value} a {state.value} job ({detail})")
        self.job, self.state, self.trigger = job, state, trigger


def next_state(state: JobState, trigger: JobTrigger) -> JobState | None:
    """The state ``trigger`` leads to from ``state``, or ``None`` if the edge is illegal."""
    return TRANSITIONS.get((state, trigger))


class JobLifecycle:
    """The state of one job and the datasets it waits for; changes only through :meth:`apply`."""

    def __init__(self, job: str, datasets: Iterable[str], state: JobState = JobState.SUBMITTED):
        self.job = job
        self.state = state
        self.datasets: frozenset[str] = frozenset(datasets)
        if not self.datasets:
            raise ValueError("a job needs at least one dataset")
        self.done: set[str] = set()
        self.reason = ""

    @classmethod
    def submitted(cls, job: str, datasets: Iterable[str], now: float) -> tuple[JobLifecycle, JobEvent]:
        """A new job and its first event (``submitted``)."""
        lc = cls(job, datasets)
        return lc, JobEvent(job, JobState.SUBMITTED, now)

    def copy(self) -> JobLifecycle:
        """A trial copy: a caller takes edges on it and keeps it only once the result is stored."""
        lc = JobLifecycle(self.job, self.datasets, self.state)
        lc.done, lc.reason = set(self.done), self.reason
        return lc

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def datasets_done(self) -> bool:
        return self.done >= self.datasets

    def apply(self, trigger: JobTrigger, now: float, reason: str = "") -> JobEvent:
        """Take the edge ``(state, trigger)``; the one place where illegal transitions are rejected."""
        target = TRANSITIONS.get((self.state, trigger))
        if target is None:
            raise IllegalJobTransition(self.job, self.state, trigger)
        if trigger is JobTrigger.FAIL and not reason.strip():
            raise IllegalJobTransition(self.job, self.state, trigger, "a failure needs a reason")
        if trigger is JobTrigger.FINISH and not self.datasets_done:
            left = ", ".join(sorted(self.datasets - self.done))
            raise IllegalJobTransition(self.job, self.state, trigger, f"datasets not done: {left}")
        event = JobEvent(self.job, target, now, reason, previous=self.state)
        self.state = target
        self.reason = reason
        return event

    def dataset_done(self, dataset: str, now: float) -> JobEvent | None:
        """Record that ``dataset`` finished; the ``completed`` event once all are done and the job runs.

        A job re-planning when its last dataset finishes completes on the
        next :meth:`start` instead.
        """
        if dataset not in self.datasets:
            raise PacerError(f"job {self.job}: unknown dataset {dataset!r}", code="not_found")
        self.done.add(dataset)
        if self.state is JobState.RUNNING and self.datasets_done:
            return self.apply(JobTrigger.FINISH, now, "every dataset finished")
        return None

    def start(self, now: float, reason: str = "plan applied") -> list[JobEvent]:
        """``planning -> running``, then ``completed`` at once if every dataset is already done."""
        events = [self.apply(JobTrigger.START, now, reason)]
        if self.datasets_done:
            events.append(self.apply(JobTrigger.FINISH, now, "every dataset finished"))
        return events

    def error(self, exc: PacerError, now: float) -> JobEvent | None:
        """Fail the job on an unretryable error; ``None`` for a temporary one (the caller retries)."""
        if exc.temporary:
            return None
        return self.apply(JobTrigger.FAIL, now, f"{exc.code}: {exc.message}")
