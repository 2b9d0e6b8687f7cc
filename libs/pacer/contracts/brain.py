"""brain-optimizer messages: plan requests and the config DB of finished jobs.

The job service asks ``pacer.rpc.brain.<job>.plan`` for a new job's first
plan (DLRover-RM Alg. 1 warm start from similar finished jobs; documented
defaults on a cold start); ``pacer.rpc.brain._all.history`` lists the config
DB.  Finished jobs are recorded from the job lifecycle events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pacer.codec import doc, message
from pacer.contracts.jobs import JobSpec


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
