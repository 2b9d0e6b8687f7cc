"""brain-optimizer messages: plan requests and the config DB of finished jobs.

The job service asks ``pacer.rpc.brain.<job>.plan`` for a new job's first
plan (DLRover-RM Alg. 1 warm start from similar finished jobs; documented
defaults on a cold start); ``pacer.rpc.brain._all.history`` lists the config
DB.  Finished jobs are recorded from the job lifecycle events.  A running
zero-config job is re-planned by the brain: each re-plan is a plan event
(``pacer.events.job.<job>.plan``) and a :class:`BrainDecision` that says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pacer.codec import doc, message
from pacer.contracts.jobs import JobSpec, ResourcePlan


@message("brain.PlanRequest")
@dataclass(frozen=True, slots=True)
class PlanRequest:
    """A job's first plan: its spec and its dataset's record count (-> jobs.ResourcePlan)."""

    job: str
    spec: JobSpec
    records: int = field(default=0, metadata=doc("training records (0: unknown)"))


@message("brain.HistoryQuery")
@dataclass(frozen=True, slots=True)
class HistoryQuery:
    """List the config DB (-> :class:`HistoryList`), newest first."""

    model: str = field(default="", metadata=doc("only jobs of this model family (\"\": all)"))
    limit: int = field(default=50, metadata=doc("1..1000"))


@message("brain.HistoryEntry")
@dataclass(frozen=True, slots=True)
class HistoryEntry:
    job: str
    model: str
    dataset: str
    records: int
    workers: int
    ps: int
    worker_cpu: float
    ps_cpu: float
    throughput: float = field(metadata=doc("samples/s under the final plan"))
    finished_at: float
    succeeded: bool


@message("brain.HistoryList")
@dataclass(frozen=True, slots=True)
class HistoryList:
    jobs: list[HistoryEntry] = field(default_factory=list)


@message("brain.BrainDecision")
@dataclass(frozen=True, slots=True)
class BrainDecision:
    """``pacer.events.brain.<job>.decision``: the brain re-planned a running job (the plan itself goes out as a plan event)."""

    job: str
    ts: float = field(metadata=doc("monitor time (s) of the statistics the decision was made on"))
    stage: str = field(metadata=doc("sample | adjust (DLRover 2023 §4.2)"))
    rule: str = field(metadata=doc("sample-oom | sample-saturated | optimize | oom | hot-ps | model | idle-ps"))
    plan: ResourcePlan
    previous: ResourcePlan | None = field(default=None, metadata=doc("the plan in force before"))
    measured_throughput: float = field(default=0.0, metadata=doc("samples/s measured under the previous plan (0: not measured)"))
    predicted_throughput: float = field(default=0.0, metadata=doc("samples/s the new plan is expected to reach (0: not predicted)"))
