"""brain-optimizer messages: plan requests and the config DB of finished jobs.

The job service asks ``pacer.rpc.brain.<job>.plan`` for a new job's first
plan (DLRover-RM Alg. 1 warm start from similar finished jobs; documented
defaults on a cold start); ``pacer.rpc.brain._all.history`` lists the config
DB.  Finished jobs are recorded from the job lifecycle events.  A running
zero-config job is re-planned by the brain: each re-plan is a plan event
(``pacer.events.job.<job>.plan``) and a :class:`BrainDecision` that says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pacer.codec import doc, message
from pacer.contracts.jobs import JobSpec, ResourcePlan
from pacer.ids import DEFAULT_NAMESPACE


class BrainStage(str, enum.Enum):
    """Where a zero-config job's resources are in their life (DLRover 2023 §4.2).

    ``sample``: a cold job runs the sample plan (one worker and a few PS with
    C_max CPUs) to measure what a worker and the PS need; the sample-stage
    rules (``sample-oom``, ``sample-saturated``) keep it in ``sample``.
    -> ``adjust``: the sample was measured and the ``optimize`` rule (Eq.
    10-11) decided the job's plan, or the job started warm (DLRover-RM
    Alg. 1: no sample).  ``adjust`` is where the job stays until it ends
    (rules ``oom``, ``hot-ps``, ``idle-ps``, ``model``); the only way back
    is an ``optimize`` plan that the cluster round could not carry out
    (withdrawn: the sample goes on and optimize is decided again).
    """

    SAMPLE = "sample"
    ADJUST = "adjust"


class BrainRule(str, enum.Enum):
    """Why the brain re-planned a running job (``BrainDecision.rule``); each rule belongs to a stage.

    In ``sample``: ``sample-oom`` (a node died of OOM: a worker's memory, or
    the PS count, doubled) and ``sample-saturated`` (the PS ran at their
    CPU limit: more PS CPU, sample on).  From ``sample`` to ``adjust``:
    ``optimize`` (DLRover 2023 Eq. 10-11).  In ``adjust``: ``oom``
    (DLRover-RM §5.3: memory raised before a predicted OOM), ``hot-ps``
    and ``idle-ps`` (DLRover 2023 §4.2's rules while the model cannot be
    fitted) and ``model`` (DLRover-RM Eq. 1-14: the fitted model's Pareto
    candidates and the cluster's weighted greedy choice).  Every rule but
    ``model`` is decided first in a cluster round.
    """

    SAMPLE_OOM = "sample-oom"
    SAMPLE_SATURATED = "sample-saturated"
    OPTIMIZE = "optimize"
    OOM = "oom"
    HOT_PS = "hot-ps"
    IDLE_PS = "idle-ps"
    MODEL = "model"


@message("brain.PlanRequest")
@dataclass(frozen=True, slots=True)
class PlanRequest:
    """A job's first plan: its spec and its dataset's record count (-> jobs.ResourcePlan)."""

    job: str
    spec: JobSpec
    records: int = field(default=0, metadata=doc("training records (0: unknown)"))
    namespace: str = field(default=DEFAULT_NAMESPACE, metadata=doc("the job's team: its jobs share the team's quota"))


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
    stage: BrainStage = field(metadata=doc("sample | adjust (DLRover 2023 §4.2), after the decision"))
    rule: BrainRule = field(metadata=doc("sample-oom | sample-saturated | optimize | oom | hot-ps | idle-ps | model"))
    plan: ResourcePlan
    previous: ResourcePlan | None = field(default=None, metadata=doc("the plan in force before"))
    measured_throughput: float = field(default=0.0, metadata=doc("samples/s measured under the previous plan (0: not measured)"))
    predicted_throughput: float = field(default=0.0, metadata=doc("samples/s the new plan is expected to reach (0: not predicted)"))


@message("brain.NodeSize")
@dataclass(frozen=True, slots=True)
class NodeSize:
    """One node's pod as the executor last created it (from its ``created`` / ``running`` node events)."""

    node: str
    role: str = field(metadata=doc("worker | ps | chief"))
    cpu: float
    memory_mb: int


@message("brain.RunningJob")
@dataclass(frozen=True, slots=True)
class RunningJob:
    """The brain's record of what the executor runs for a job (KV ``pacer-brain-jobs``, key ``<job>``).

    Built only from the executor's events (``applied`` and node events), read
    by the brain's durable consumer; written with a revision check; deleted
    when the job ends.  A restarted brain starts from it and the consumer
    delivers what happened since.
    """

    job: str
    plan: ResourcePlan | None = field(default=None, metadata=doc("the plan of the executor's last applied event"))
    applied_at: float = field(default=0.0, metadata=doc("that event's ts"))
    nodes: list[NodeSize] = field(default_factory=list, metadata=doc("every node's pod as last created, by name"))
    seq: int = field(default=0, metadata=doc("stream sequence of the last event applied to this record (idempotence)"))
