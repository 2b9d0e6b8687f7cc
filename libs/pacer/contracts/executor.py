"""pod-executor messages: pods, executor commands, executor events.

The pod-executor turns a job's :class:`~pacer.contracts.jobs.ResourcePlan`
into pods and keeps them there.  A *node* is a slot of the job (``worker-0``,
``ps-1``); a *pod* is one incarnation of a node (``<job>-worker-0-g3``): a
relaunch makes a new pod for the same node with the next ``generation``.
Each pod runs the trainer process plus its agent sidecar.

* :class:`PodSpec` is what a backend (local processes or Kubernetes) needs
  to create one pod; :class:`PodStatus` is what it reports back.
* :class:`ExecutorCommand` (``pacer.rpc.executor.<job>.command``) asks for a
  node action: ``restart`` (KILL_RESTART), ``migrate`` (a PS moved to new
  resources, the new one started before the old one stops), ``stop``.
* :class:`ExecutorEvent` (``pacer.events.executor.<job>.<kind>``) says what
  the executor did for a job: plan applied (with the overhead it paid), job
  failed (an unretryable node error), nodes torn down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pacer.codec import doc, message
from pacer.contracts.jobs import ResourcePlan

#: A pod's exit code when its bus credentials were refused for good (sysexits' EX_NOPERM): its job ended
#: and was torn down, or its token expired.  The agent exits with it after
#: ``pacer.runtime.RuntimeConfig.give_up_refused_s``; the pod then stops its trainer and ends with it too.
EXIT_REFUSED = 77


class PodPhase(str, enum.Enum):
    """Where a pod is: created but not running yet, running, or ended."""

    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"


@message("executor.PodSpec")
@dataclass(frozen=True, slots=True)
class PodSpec:
    """One pod to create: the trainer's command, its agent's command, resources.

    ``command`` and ``agent`` are argv lists run with the image's (or the
    local) Python.  The literal ``{pod_dir}`` in any argument or env value is
    replaced by the backend with a directory private to the pod that both
    containers share (a local directory; an ``emptyDir`` on Kubernetes): the
    agent's IPC file and the trainer's result file live there.
    """

    name: str = field(metadata=doc("pod name: <job>-<node>-g<generation>, unique per job"))
    job: str
    node: str = field(metadata=doc("the slot this pod fills: worker-<i> or ps-<i>"))
    role: str = field(metadata=doc("worker | ps"))
    index: int
    generation: int = field(metadata=doc("0 for the first pod of the node, +1 per relaunch"))
    cpu: float = field(metadata=doc("CPU limit (1.0 = one core)"))
    memory_mb: int = field(metadata=doc("memory limit (MiB); over it the pod is OOM-killed"))
    command: list[str] = field(metadata=doc("trainer argv"))
    agent: list[str] = field(default_factory=list, metadata=doc("agent sidecar argv; empty = no sidecar"))
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default=0, metadata=doc("the TF server port of the trainer (0: none)"))
    machine: str = field(default="", metadata=doc(
        "the machine the plan's placement prefers for this node (\"\": anywhere); "
        "Kubernetes: soft node affinity on kubernetes.io/hostname, local: ignored"))
    image: str = field(default="", metadata=doc(
        "the trainer container's image (a job's trainer.image; \"\": the executor's trainer image); "
        "Kubernetes only, the agent keeps the executor's image"))
    priority_class: str = field(default="", metadata=doc(
        "the job's scheduling.priority_class (\"\": none); Kubernetes: spec.priorityClassName"))
    queue: str = field(default="", metadata=doc("the job's Kueue LocalQueue (\"\": none)"))
    gang: str = field(default="", metadata=doc(
        "the job's gang scheduler: kueue | volcano (\"\": none); Kubernetes only"))
    gang_size: int = field(default=0, metadata=doc(
        "pods the gang admits together: the plan's PS plus workers (0: no gang)"))


@message("executor.PodStatus")
@dataclass(frozen=True, slots=True)
class PodStatus:
    """What a backend observed about one pod."""

    name: str
    job: str
    node: str
    role: str
    generation: int
    phase: PodPhase
    created_at: float = field(metadata=doc("unix time (s) the pod was created"))
    started_at: float = field(default=0.0, metadata=doc("unix time (s) the trainer started running (0: not yet)"))
    finished_at: float = field(default=0.0, metadata=doc("unix time (s) the trainer ended (0: not yet)"))
    exit_code: int | None = field(default=None, metadata=doc("trainer exit code; null while running or when killed by a signal"))
    signal: int | None = field(default=None, metadata=doc("signal that ended the trainer, if any"))
    reason: str = field(default="", metadata=doc("backend reason: OOMKilled, Evicted, NodeLost, ... (\"\": none)"))
    oom: bool = field(default=False, metadata=doc("the pod crossed its memory limit and was killed"))
    cpu: float = 0.0
    memory_mb: int = 0
    peak_rss_bytes: int = field(default=0, metadata=doc("largest resident memory seen (local backend)"))
    cpu_throttled_s: float = field(default=0.0, metadata=doc("time the trainer was held back by its CPU limit (local backend)"))
    host: str = field(default="", metadata=doc("machine / Kubernetes node the pod runs on"))


class ExecutorJobState(str, enum.Enum):
    """The executor's lifecycle of one job (``ExecutorJob.state``).

    ``starting`` (the first plan's pods are being created) -> ``running``
    (every node of a plan ran once: ``applied`` published) -> ``completing``
    (the job service said completed: workers get a grace to exit by
    themselves) -> ``tearing_down`` (every pod is being stopped) ->
    ``torn_down`` (no pod left; terminal).  ``failed`` replaces
    ``tearing_down`` when an unretryable node error ended the job; it also
    ends in ``torn_down``.
    """

    STARTING = "starting"
    RUNNING = "running"
    COMPLETING = "completing"
    TEARING_DOWN = "tearing_down"
    FAILED = "failed"
    TORN_DOWN = "torn_down"

    @property
    def active(self) -> bool:
        """Plans and node commands are applied (starting or running)."""
        return self in (ExecutorJobState.STARTING, ExecutorJobState.RUNNING)


class NodeIntent(str, enum.Enum):
    """Why the executor itself is stopping a node's pod (``NodeRecord.intent``); saved before the stop.

    The stop's exit is then not a failure: ``restart`` and ``resize`` start the
    node again at once (``resize`` with ``resize_cpu`` / ``resize_memory_mb``),
    ``migrate`` waits for the PS migration to start it on the next cluster.
    Cleared (``none``) when the next pod is created.
    """

    NONE = ""
    RESTART = "restart"
    MIGRATE = "migrate"
    RESIZE = "resize"


class MigrationPhase(str, enum.Enum):
    """Where a job's seamless PS migration is (DLRover-RM §5.2; ``ExecutorJob.migration``).

    ``none`` -> ``starting_ps`` (the new PS pods start beside the old cluster,
    which keeps training) -> ``draining`` (the chief checkpointed; every
    worker stops) -> ``none`` (shards restored, workers restarted on the new
    cluster, old PS stopped).
    """

    NONE = ""
    STARTING_PS = "starting_ps"
    DRAINING = "draining"


class NodePhase(str, enum.Enum):
    """Where a node (a slot of a job) is in the executor's lifecycle (``NodeRecord.state``).

    ``pending`` (its current pod is created, not running yet) -> ``running``
    -> ``stopping`` (the executor stops the pod to start it again; the
    record's ``intent`` says why) or ``relaunching`` (the pod ended, the next
    pod is due) -> ``pending`` again with the next generation.  ``finished``
    (the trainer exited 0) is terminal; ``removed`` (scaled away, stopped or
    torn down) leaves the slot free until a plan scales it back up.  The
    legal moves are one table in ``pacer_services.pod_executor.core.node``.
    """

    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    RELAUNCHING = "relaunching"
    FINISHED = "finished"
    REMOVED = "removed"


class CommandKind(str, enum.Enum):
    """Node actions the executor performs."""

    # KILL_RESTART: stop the node's pod, start a fresh one (same slot, same resources); for a PS a
    # stop-and-restart: checkpoint, stop training, a new PS, restore (no training on the old PS meanwhile)
    RESTART = "restart"
    MIGRATE = "migrate"  # start a replacement with new resources, then stop the old pod (a PS: seamlessly)
    STOP = "stop"  # stop the node for good (scale down a single node)


@message("executor.ExecutorCommand")
@dataclass(frozen=True, slots=True)
class ExecutorCommand:
    """``pacer.rpc.executor.<job>.command``: one node action; replied with :class:`CommandResult`."""

    job: str
    node: str
    kind: CommandKind
    reason: str = ""
    command_id: str = field(default="", metadata=doc("idempotency key: a repeated id is answered, not re-done"))
    cpu: float | None = field(default=None, metadata=doc("migrate: new CPU limit (null: unchanged)"))
    memory_mb: int | None = field(default=None, metadata=doc("migrate: new memory limit (null: unchanged)"))


@message("executor.CommandResult")
@dataclass(frozen=True, slots=True)
class CommandResult:
    job: str
    node: str
    command_id: str
    done: bool
    pod: str = field(default="", metadata=doc("the pod now serving the node"))
    detail: str = ""


@message("executor.JobQuery")
@dataclass(frozen=True, slots=True)
class JobQuery:
    """``pacer.rpc.executor.<job>.status`` (-> :class:`ExecutorStatus`) and ``.teardown``."""

    job: str


@message("executor.NodeInfo")
@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node of a job as the executor tracks it."""

    node: str
    role: str
    pod: str = field(metadata=doc("the current (or last) pod of the node"))
    phase: PodPhase
    cpu: float
    memory_mb: int
    restarts: int = field(metadata=doc("relaunches after retryable failures"))
    requested_restarts: int = field(metadata=doc("relaunches asked for (KILL_RESTART, migration)"))
    generation: int
    pending_s: float = field(default=0.0, metadata=doc("seconds the current pod was (or is) pending"))
    last_reason: str = field(default="", metadata=doc("classified reason of the last exit"))


@message("executor.ExecutorStatus")
@dataclass(frozen=True, slots=True)
class ExecutorStatus:
    job: str
    state: str = field(metadata=doc("an ExecutorJobState: starting | running | completing | tearing_down | failed | torn_down"))
    plan: ResourcePlan | None
    nodes: list[NodeInfo] = field(default_factory=list)
    backend: str = ""
    reason: str = ""


@message("executor.LogsQuery")
@dataclass(frozen=True, slots=True)
class LogsQuery:
    """``pacer.rpc.executor.<job>.logs`` -> :class:`LogsReply`: the tail of a node's trainer (or agent) log."""

    job: str
    node: str
    tail: int = field(default=200, metadata=doc("lines from the end, 1..5000"))
    container: str = field(default="trainer", metadata=doc("trainer | agent"))


@message("executor.LogsReply")
@dataclass(frozen=True, slots=True)
class LogsReply:
    job: str
    node: str
    pod: str
    text: str


class ExecutorEventKind(str, enum.Enum):
    APPLIED = "applied"  # a plan was applied (nodes started/stopped to match it)
    FAILED = "failed"  # an unretryable node error: the job must fail
    TORN_DOWN = "torn_down"  # every pod of the job is gone


@message("executor.ExecutorEvent")
@dataclass(frozen=True, slots=True)
class ExecutorEvent:
    """``pacer.events.executor.<job>.<kind>``: what the executor did for a job."""

    job: str
    kind: ExecutorEventKind
    ts: float
    reason: str = ""
    plan: ResourcePlan | None = None
    overhead_s: float = field(default=0.0, metadata=doc("applied: seconds from the plan to every new node running"))
    started: list[str] = field(default_factory=list, metadata=doc("nodes started by this plan"))
    stopped: list[str] = field(default_factory=list, metadata=doc("nodes stopped by this plan"))


@message("executor.MachineInfo")
@dataclass(frozen=True, slots=True)
class MachineInfo:
    """One machine pods can run on (a ready, schedulable Kubernetes node; locally, this host).

    ``free_*`` is what the scheduler can still give: allocatable minus the
    requests of every live pod on it, Pacer's or not (locally nothing is
    reserved: the whole machine).  ``held_*`` is the part of the used
    capacity that each Pacer job's own live pods hold there, so that a
    planner can add a job's own pods back when it re-places that job.
    """

    name: str = field(metadata=doc("the machine's name as node affinity matches it (the node's kubernetes.io/hostname label)"))
    cpu: float = field(metadata=doc("allocatable CPUs"))
    memory_mb: int = field(metadata=doc("allocatable memory (MiB)"))
    free_cpu: float
    free_memory_mb: int
    held_cpu: dict[str, float] = field(default_factory=dict, metadata=doc("job -> CPUs its live pods request here"))
    held_memory_mb: dict[str, int] = field(default_factory=dict, metadata=doc("job -> MiB its live pods request here"))


@message("executor.ClusterStatus")
@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """``pacer.events.cluster._cluster.status``: the backend's queue and capacity (for "is the cluster busy")."""

    ts: float
    backend: str
    pending_pods: int = field(metadata=doc("pods created but not running yet, over all jobs"))
    running_pods: int
    total_cpu: float = field(default=0.0, metadata=doc("CPUs of the machines pods run on (0: unknown)"))
    free_cpu: float = field(default=0.0, metadata=doc("total_cpu minus the CPU limits of live pods (where limits reserve capacity)"))
    total_memory_mb: int = 0
    free_memory_mb: int = 0
    reserves_capacity: bool = field(default=False, metadata=doc(
        "pods' requests reserve capacity (a scheduler admits pods against it, as on Kubernetes); "
        "false: machines are shared and free_* is the whole machine"))
    machines: list[MachineInfo] = field(default_factory=list, metadata=doc(
        "the machines pods can run on, with what is free on each (empty: unknown)"))


# ------------------------------------------------- the executor's own record (KV)


@message("executor.NodeRecord")
@dataclass(slots=True)
class NodeRecord:
    """One node (slot) of a job in the executor's KV record."""

    node: str
    role: str
    index: int
    cpu: float
    memory_mb: int
    generation: int = field(default=0, metadata=doc("generation of the node's current pod"))
    restarts: int = 0
    requested_restarts: int = 0
    handled: int = field(default=-1, metadata=doc("highest generation whose exit was handled"))
    state: NodePhase = field(default=NodePhase.PENDING, metadata=doc(
        "pending | running | stopping | relaunching | finished | removed (records written before this "
        "field: derived from finished / removed / intent on load)"))
    finished: bool = field(default=False, metadata=doc("the trainer exited 0: not relaunched (state finished)"))
    removed: bool = field(default=False, metadata=doc("scaled away or torn down: not relaunched (state removed)"))
    created_at: float = 0.0
    running_at: float = 0.0
    last_reason: str = ""
    deleting: list[str] = field(default_factory=list, metadata=doc("pods the executor itself is stopping"))
    restore: bool = field(default=False, metadata=doc("the next pod restores from the newest checkpoint"))
    intent: NodeIntent = field(default=NodeIntent.NONE, metadata=doc(
        "restart: the executor stops the pod to start it again; resize: to start it with "
        "resize_cpu / resize_memory_mb; migrate: to move it to the next cluster"))
    resize_cpu: float = field(default=0.0, metadata=doc(
        "rolling replacement: the CPU limit the node's next pod gets (0: no replacement due)"))
    resize_memory_mb: int = field(default=0, metadata=doc(
        "rolling replacement: the memory limit (MiB) the node's next pod gets (0: no replacement due)"))
    oom_memory_mb: int = field(default=0, metadata=doc(
        "the memory an OOM relaunch gave the node (0: none): a plan's replacement never gives it less"))


@message("executor.ExecutorJob")
@dataclass(slots=True)
class ExecutorJob:
    """The executor's durable record of one job (KV ``pacer-executor``, key ``<job>``).

    The pods themselves are not stored: after a restart the executor adopts
    what the backend lists and closes the gap to this record.
    """

    job: str
    state: ExecutorJobState = field(metadata=doc("starting | running | completing | tearing_down | failed | torn_down"))
    plan: ResourcePlan
    cluster: str = field(metadata=doc("ClusterDesc JSON: the TF addresses of every slot"))
    nodes: list[NodeRecord] = field(default_factory=list)
    plan_at: float = field(default=0.0, metadata=doc("when the current plan was received"))
    applied: bool = field(default=False, metadata=doc("the current plan's APPLIED event was published"))
    completing_since: float = 0.0
    reason: str = ""
    commands: list[str] = field(default_factory=list, metadata=doc("ids of the last executed commands (idempotency)"))
    migration: MigrationPhase = field(default=MigrationPhase.NONE, metadata=doc(
        "PS migration phase: \"\" | starting_ps | draining"))
    next_cluster: str = field(default="", metadata=doc("migration: the ClusterDesc JSON the job moves to"))
    retiring: list[str] = field(default_factory=list, metadata=doc("migration: old PS pods, stopped once the workers moved"))
    migration_at: float = 0.0
    checkpoint: str = field(default="", metadata=doc("migration: the shard checkpoint id the chief took on its way out"))
    migration_stop_first: bool = field(default=False, metadata=doc(
        "migration: a stop-and-restart (training stops at once) rather than a seamless move"))
    ps_lost_at: float = field(default=0.0, metadata=doc(
        "when a PS of the job last died unasked: workers that lose their PS right after are collateral, no budget"))
