"""Every NATS subject and JetStream name Pacer uses, in one place.

The hierarchy is meant to be guessed by a dashboard author:

* ``pacer.rpc.<service>.<job>.<op>``   request/reply into a service
* ``pacer.events.<domain>.<job>.<kind>`` events, all kept in the
  ``PACER_EVENTS`` stream (subscribe to ``pacer.events.>`` for everything)
* ``pacer.shardlog.<job>``              the durable shard log of one job
* ``pacer.svc.<service>.health``        health of a running service instance
* ``pacer.deadletter.<service>``        messages a service refused for good

Builders check that ids are single subject tokens (no ``.``, ``*`` or ``>``),
so a hostile job id can never subscribe or publish outside its own subtree.
"""

from __future__ import annotations

from pacer.errors import ValidationError
from pacer.ids import is_token

PREFIX = "pacer"

# JetStream streams and buckets.
SHARD_LOG_STREAM = "PACER_SHARDLOG"
SHARD_LOG_SUBJECTS = f"{PREFIX}.shardlog.>"
EVENTS_STREAM = "PACER_EVENTS"
EVENTS_SUBJECTS = f"{PREFIX}.events.>"
SNAPSHOT_BUCKET = "pacer-shard-snapshots"

# Services.
SHARD_SERVICE = "shard"


def _tok(value: str, what: str) -> str:
    if not is_token(value):
        raise ValidationError(
            f"{what} {value!r} is not a valid id: use 1-64 of [A-Za-z0-9_-]", code="invalid"
        )
    return value


def rpc(service: str, job: str, op: str) -> str:
    """Request subject of ``op`` on ``service`` for one job."""
    return f"{PREFIX}.rpc.{service}.{_tok(job, 'job')}.{op}"


def rpc_wildcard(service: str) -> str:
    """What a service instance subscribes to: every job, every op."""
    return f"{PREFIX}.rpc.{service}.*.*"


def parse_rpc(subject: str) -> tuple[str, str]:
    """``pacer.rpc.<svc>.<job>.<op>`` -> (job, op)."""
    parts = subject.split(".")
    if len(parts) != 5:
        raise ValidationError(f"not an rpc subject: {subject!r}")
    return parts[3], parts[4]


def shard_log(job: str) -> str:
    return f"{PREFIX}.shardlog.{_tok(job, 'job')}"


def job_of_shard_log(subject: str) -> str:
    return subject.rsplit(".", 1)[-1]


def event(domain: str, job: str, kind: str) -> str:
    return f"{PREFIX}.events.{domain}.{_tok(job, 'job')}.{kind}"


def events_of(domain: str, job: str = "*", kind: str = "*") -> str:
    """A filter over events, e.g. ``events_of('node', kind='died')``."""
    return f"{PREFIX}.events.{domain}.{job}.{kind}"


def health(service: str) -> str:
    return f"{PREFIX}.svc.{service}.health"


def dead_letter(service: str) -> str:
    return f"{PREFIX}.deadletter.{service}"


# Shard-service operations (the ``<op>`` level of ``rpc``).
class ShardOp:
    REGISTER = "register"
    LEASE = "lease"  # combined report-and-get, also the heartbeat
    STATUS = "status"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    APPEND = "append"
    RETRY_FAILED = "retry_failed"
    ALL = (REGISTER, LEASE, STATUS, CHECKPOINT, RESTORE, APPEND, RETRY_FAILED)
    # What a job's own pods ask of its dataset (the trainer: leases, the chief's shard checkpoint and
    # restore, a status read).  Registering, appending to and re-opening a dataset are the job service's
    # and the operator's: a pod that could register could make the shard service cut millions of shards.
    POD = (LEASE, STATUS, CHECKPOINT, RESTORE)


# Event kinds published by the shard service under ``pacer.events.shard.<job>.<kind>``.
class ShardEventKind:
    REGISTERED = "registered"
    EPOCH_STARTED = "epoch_started"
    REQUEUED = "requeued"
    PARKED = "parked"
    FINISHED = "finished"
    CHECKPOINTED = "checkpointed"
    RESTORED = "restored"
    PROGRESS = "progress"


# Node events (published by the pod-executor) under ``pacer.events.node.<job>.<kind>``.
class NodeEventKind:
    CREATED = "created"  # a pod was made for the node (pending)
    RUNNING = "running"  # its trainer runs
    DIED = "died"  # it ended without finishing (reason says why; relaunch says if a new pod follows)
    FINISHED = "finished"  # the trainer exited 0


def node_event(job: str, kind: str) -> str:
    """``pacer.events.node.<job>.<kind>`` (kinds in :class:`NodeEventKind`)."""
    return event("node", job, kind)


# ------------------------------------------------------------------ executor
# The pod-executor: plans and node commands in, pods and node events out.
EXECUTOR_SERVICE = "executor"
EXECUTOR_BUCKET = "pacer-executor"  # JetStream KV: key <job> -> the executor's record of the job


class ExecutorOp:
    COMMAND = "command"  # executor.ExecutorCommand -> executor.CommandResult
    STATUS = "status"  # executor.JobQuery -> executor.ExecutorStatus
    LOGS = "logs"  # executor.LogsQuery -> executor.LogsReply
    TEARDOWN = "teardown"  # executor.JobQuery -> executor.ExecutorStatus (every pod of the job deleted)
    ALL = (COMMAND, STATUS, LOGS, TEARDOWN)


def executor_rpc(job: str, op: str) -> str:
    """``pacer.rpc.executor.<job>.<op>`` with op in :class:`ExecutorOp`."""
    return rpc(EXECUTOR_SERVICE, job, op)


def executor_event(job: str, kind: str) -> str:
    """``pacer.events.executor.<job>.<kind>``: applied | failed | torn_down (executor.ExecutorEvent)."""
    return event(EXECUTOR_SERVICE, job, kind)


# ------------------------------------------------------------------ cluster
# Cluster-wide information (AntDT V-D "third party information"): the
# executor publishes its backend's queue and capacity; the monitor derives
# "is the cluster busy" from it.  The job level of the subject is a fixed
# token, as these events concern no single job.
CLUSTER_SCOPE = "_cluster"


def cluster_status() -> str:
    """``pacer.events.cluster._cluster.status``: executor.ClusterStatus, every few seconds."""
    return event("cluster", CLUSTER_SCOPE, "status")


# ------------------------------------------------------------------ jobs
# The job service: submissions, the lifecycle of each job, its plan.
JOB_SERVICE = "jobs"
JOB_BUCKET = "pacer-jobs"  # JetStream KV: key <job> -> jobs.JobRecord (read by the executor and the API)
LEASE_BUCKET = "pacer-leases"  # per-job ownership of a service's instances (pacer.ownership): leases and fenced state


def ownership_forward(service: str, instance: str = "*") -> str:
    """Where a service instance receives requests forwarded to it as the owner of their job (pacer.ownership)."""
    return f"{PREFIX}.svc.{service}.{instance}.forward"
ALL_JOBS = "_all"  # the job token of requests about no single job (list)


class JobOp:
    SUBMIT = "submit"  # jobs.SubmitRequest -> jobs.JobRecord (on pacer.rpc.jobs.<name>.submit)
    GET = "get"  # jobs.JobQuery -> jobs.JobRecord
    LIST = "list"  # jobs.ListRequest -> jobs.JobList (on pacer.rpc.jobs._all.list)
    STOP = "stop"  # jobs.StopRequest -> jobs.JobRecord
    ALL = (SUBMIT, GET, LIST, STOP)


def job_rpc(job: str, op: str) -> str:
    """``pacer.rpc.jobs.<job>.<op>`` with op in :class:`JobOp`."""
    return rpc(JOB_SERVICE, job, op)


# The Kubernetes operator (services/operator): PacerJob resources -> job-service requests.  It serves no
# subject of its own but its health; it reads the job events as cues.
OPERATOR_SERVICE = "operator"


class JobEventKind:
    """``pacer.events.job.<job>.<kind>``: a lifecycle state (jobs.JobEvent) or the plan."""

    PLAN = "plan"  # jobs.ResourcePlan: the plan the executor applies
    EXPORTED = "exported"  # jobs.ModelExported: the chief wrote a SavedModel (export.path)
    # and one kind per JobState value: submitted, planning, running, completed, failed, stopped


def job_event(job: str, kind: str) -> str:
    return event("job", job, kind)


# ------------------------------------------------------------------ agents
# The agent sidecars (one per PS/worker process) of a job.  Events land in
# PACER_EVENTS like every ``pacer.events.>`` subject; the two-phase barrier
# subjects (``pacer.agent.<job>.<phase>``) are core NATS only (not stored):
# they are the agents' internal protocol, request/reply with many replies.
AGENT_SERVICE = "agent"
AGENT_BUCKET = "pacer-agents"  # JetStream KV: key ``<job>.primary`` -> agent.PrimaryRecord (per-message TTL)


class AgentEventKind:
    METRICS = "metrics"  # agent.AgentMetrics, every k trainer steps
    HEARTBEAT = "heartbeat"  # agent.Heartbeat, after a second of silence or a change (agent.reporting)
    ACTION = "action"  # agent.ActionResult, one per global action or node command
    ALL = (METRICS, HEARTBEAT, ACTION)


class AgentPhase:
    PREPARE = "prepare"  # agent.Prepare -> agent.Vote (one reply per participant)
    COMMIT = "commit"  # agent.Commit -> agent.Ack
    ABORT = "abort"  # agent.Abort (no reply)
    ALL = (PREPARE, COMMIT, ABORT)


# The one rpc op of the agent service (served by the primary agent of the job).
AGENT_GLOBAL_ACTION = "global_action"


def agent_metrics(job: str) -> str:
    """``pacer.events.agent.<job>.metrics``."""
    return event(AGENT_SERVICE, job, AgentEventKind.METRICS)


def agent_heartbeat(job: str) -> str:
    """``pacer.events.agent.<job>.heartbeat``."""
    return event(AGENT_SERVICE, job, AgentEventKind.HEARTBEAT)


def agent_action(job: str) -> str:
    """``pacer.events.agent.<job>.action``."""
    return event(AGENT_SERVICE, job, AgentEventKind.ACTION)


def agent_global_action(job: str) -> str:
    """``pacer.rpc.agent.<job>.global_action``: GlobalAction -> ActionResult, served by the primary."""
    return rpc(AGENT_SERVICE, job, AGENT_GLOBAL_ACTION)


def agent_command(job: str, node: str) -> str:
    """``pacer.rpc.agent.<job>.<node>.command``: NodeCommand -> ActionResult, served by that node's agent."""
    return f"{PREFIX}.rpc.{AGENT_SERVICE}.{_tok(job, 'job')}.{_tok(node, 'node')}.command"


def agent_phase(job: str, phase: str) -> str:
    """``pacer.agent.<job>.<phase>`` with phase in :class:`AgentPhase` (prepare | commit | abort)."""
    if phase not in AgentPhase.ALL:
        raise ValidationError(f"unknown agent phase {phase!r}")
    return f"{PREFIX}.agent.{_tok(job, 'job')}.{phase}"


def agent_primary_key(job: str) -> str:
    """KV key (in :data:`AGENT_BUCKET`) naming the job's primary agent: ``<job>.primary``."""
    return f"{_tok(job, 'job')}.primary"


# ------------------------------------------------------------------ monitor
# The monitor (AntDT V-D) folds agent metrics, heartbeats, node events and
# shard progress into per-job statistics; it publishes them periodically and
# answers queries.
MONITOR_SERVICE = "monitor"


class MonitorOp:
    STATS = "stats"  # monitor.StatsQuery -> monitor.JobStatistics
    ALL = (STATS,)


class MonitorEventKind:
    STATISTICS = "statistics"  # monitor.JobStatistics, every interval per job with recent data


def monitor_stats(job: str) -> str:
    """``pacer.rpc.monitor.<job>.stats``: StatsQuery -> JobStatistics (NotFound for an unknown job)."""
    return rpc(MONITOR_SERVICE, job, MonitorOp.STATS)


def monitor_statistics(job: str) -> str:
    """``pacer.events.monitor.<job>.statistics``: the monitor's periodic JobStatistics."""
    return event(MONITOR_SERVICE, job, MonitorEventKind.STATISTICS)


def monitor_inputs() -> list[str]:
    """The event filters the monitor consumes from PACER_EVENTS (never its own statistics); the live
    heartbeats (:data:`LIVE_EVENTS`) it hears on a plain subscription."""
    return [
        events_of(AGENT_SERVICE, kind=AgentEventKind.METRICS),
        events_of("node"),
        events_of("shard", kind=ShardEventKind.PROGRESS),
        events_of("cluster", kind="status"),
    ]


# ------------------------------------------------------------------ which events are stored
#: Every event domain (``pacer.events.<domain>.<job>.<kind>``).  A publish permission under
#: ``pacer.events`` outside these is refused by tests/unit/test_event_storage.py.
EVENT_DOMAINS = ("agent", "api", "brain", "cluster", "controller", "executor", "job", MONITOR_SERVICE, "node",
                 "shard")

#: The job token of an audit record whose request named no readable job.
NO_JOB = "_none"


def api_audit(job: str) -> str:
    """``pacer.events.api.<job>.audit``: the audit log of mutating API requests (contracts.jobs.AuditRecord)."""
    return event("api", job or NO_JOB, "audit")

#: Events that are live only: delivered to whoever subscribes, never stored in PACER_EVENTS.  Each
#: agent's heartbeat, every second, is two thirds of all events at scale and a liveness ping that the
#: next one replaces (docs/scale.md): storing it cost the server a write, a delivery and an ack each.
LIVE_EVENTS = (events_of(AGENT_SERVICE, kind=AgentEventKind.HEARTBEAT),)


def stored_events() -> list[str]:
    """The subjects of PACER_EVENTS: every domain's events but :data:`LIVE_EVENTS`."""
    out = []
    for domain in EVENT_DOMAINS:
        if domain == AGENT_SERVICE:  # the one domain with a live kind: its other kinds one by one
            out += [s for k in AgentEventKind.ALL if (s := events_of(domain, kind=k)) not in LIVE_EVENTS]
        else:
            out.append(f"{PREFIX}.events.{domain}.>")
    return out


# ------------------------------------------------------------------ policies
# A straggler policy is a service answering ``pacer.policy.<name>.decide``
# (policy.PolicyRequest -> policy.PolicyDecision), in a queue group named
# after the policy; built-in and user policies alike.
POLICY_BUILTINS = ("antdt-nd", "antdt-dd", "lb-bsp", "backup-workers", "pacer-adaptive", "none")


def policy_decide(name: str) -> str:
    """``pacer.policy.<name>.decide``."""
    return f"{PREFIX}.policy.{_tok(name, 'policy')}.decide"


# ------------------------------------------------------------------ controller
CONTROLLER_SERVICE = "controller"


def controller_decision(job: str) -> str:
    """``pacer.events.controller.<job>.decision``: policy.ControllerDecision, one per decision round."""
    return event(CONTROLLER_SERVICE, job, "decision")


# ------------------------------------------------------------------ brain
BRAIN_SERVICE = "brain"
BRAIN_BUCKET = "pacer-brain-history"  # JetStream KV: key <job> -> a finished job's record (JSON), the config DB
BRAIN_JOBS_BUCKET = "pacer-brain-jobs"  # JetStream KV: key <job> -> brain.RunningJob, what the executor runs


class BrainOp:
    PLAN = "plan"  # brain.PlanRequest -> jobs.ResourcePlan
    HISTORY = "history"  # brain.HistoryQuery -> brain.HistoryList (on pacer.rpc.brain._all.history)
    ALL = (PLAN, HISTORY)


def brain_decision(job: str) -> str:
    """``pacer.events.brain.<job>.decision``: brain.BrainDecision, one per re-plan of a running job."""
    return event(BRAIN_SERVICE, job, "decision")


def brain_rpc(job: str, op: str) -> str:
    """``pacer.rpc.brain.<job>.<op>`` with op in :class:`BrainOp`."""
    return rpc(BRAIN_SERVICE, job, op)
