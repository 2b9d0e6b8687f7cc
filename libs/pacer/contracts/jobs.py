"""Job messages: the job spec a user submits, resource plans, lifecycle events.

A :class:`JobSpec` is the blueprint of a job (``JobSpec`` / ``Job``, as
``NodeSpec`` / ``Node``).  These classes only carry data: the rules (which
values are legal, the defaults, the plan used until the brain-optimizer
exists) live in :mod:`pacer.jobs.spec`, and the legal state transitions in
:mod:`pacer.jobs.lifecycle`.  Decoding checks types only, like every wire
message; :func:`pacer.jobs.spec.validate_job_spec` checks values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pacer.codec import doc, message
from pacer.ids import DEFAULT_NAMESPACE


class JobState(str, enum.Enum):
    """Where a job is in its life.

    ``submitted`` -> ``planning`` (spec accepted) -> ``running`` (plan applied,
    nodes started) -> ``completed`` (every dataset finished).  A running job
    goes back to ``planning`` to be re-planned or scaled.  ``planning`` and
    ``running`` end in ``failed`` after an unretryable error (the event says
    why); ``submitted``, ``planning`` and ``running`` end in ``stopped`` when
    the user stops the job.  ``completed``, ``failed`` and ``stopped`` are
    terminal.  The table of legal edges is
    :data:`pacer.jobs.lifecycle.TRANSITIONS`.
    """

    SUBMITTED = "submitted"
    PLANNING = "planning"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"


class ModelName(str, enum.Enum):
    """The model families the trainer builds (``pacer.models``)."""

    WIDE_DEEP = "wide_deep"
    XDEEPFM = "xdeepfm"
    DCN = "dcn"


class DataFormat(str, enum.Enum):
    """How a dataset file is laid out."""

    RECORD = "record"  # Pacer's fixed-width record file (O(1) shard reads)
    CRITEO_TSV = "criteo_tsv"  # a Criteo day file: label, 13 ints, 26 hex categoricals, tab-separated
    CRITEO_CSV = "criteo_csv"  # the same columns, comma-separated (as many projects ship it)
    PARQUET = "parquet"  # any columns; rows found from the footers alone
    CSV = "csv"  # any columns, comma-separated, a header line by default (dataset.options)
    TSV = "tsv"  # the same, tab-separated
    TFRECORD = "tfrecord"  # tf.train.Example records
    STREAM = "stream"  # a JetStream stream of msgpack samples (jetstream://<STREAM>): online learning


class TrainingMode(str, enum.Enum):
    """How workers apply gradients."""

    ASP = "asp"  # asynchronous: each worker pushes to the PS on its own
    BSP = "bsp"  # synchronous: a barrier per step (optionally with backup workers)


class GangScheduler(str, enum.Enum):
    """Who admits a job's pods all at once on Kubernetes (``SchedulingConfig.gang``)."""

    NONE = "none"  # each pod is scheduled on its own (the default scheduler)
    KUEUE = "kueue"  # Kueue's plain-pod integration: one pod group, admitted whole from a LocalQueue
    VOLCANO = "volcano"  # the Volcano scheduler with a PodGroup of minMember = every pod of the job


class PlanSource(str, enum.Enum):
    """Who decided a resource plan."""

    DEFAULT = "default"  # the documented default plan (pacer.jobs.spec.default_plan)
    USER = "user"  # the spec's ``resources`` (the rest filled from the defaults)
    BRAIN = "brain"  # the brain-optimizer


@message("job.ModelConfig")
@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to train and its sizes (the fields of ``pacer.models.common.ModelSpec``)."""

    name: ModelName
    hash_buckets: int = field(default=100_000, metadata=doc("hash buckets per categorical field, > 0"))
    embed_dim: int = field(default=8, metadata=doc("embedding width, > 0"))
    hidden: list[int] = field(default_factory=lambda: [64, 32], metadata=doc("DNN layer widths, each > 0"))
    cross_layers: int = field(default=3, metadata=doc("DCN: cross layers, >= 0"))
    cin_layers: list[int] = field(default_factory=lambda: [16, 16], metadata=doc("xDeepFM: feature maps per CIN layer"))
    learning_rate: float = field(default=0.05, metadata=doc("> 0"))
    optimizer: str = field(default="adagrad", metadata=doc("adagrad, adam or sgd"))


@message("job.DatasetConfig")
@dataclass(frozen=True, slots=True)
class DatasetConfig:
    """The training data of a job (and optionally held-out data for evaluation)."""

    path: str = field(metadata=doc("what to train on, read in place: a file, a glob (day=*/part-*.parquet) or an "
                                   "fsspec URL (s3://, gs://, hdfs://, file://), or a JetStream stream (jetstream://<STREAM>)"))
    format: DataFormat = field(metadata=doc("layout; the spec parser infers it from the file name when absent"))
    records: int = field(default=0, metadata=doc("record count; 0 = derived from the file"))
    test_path: str = field(default="", metadata=doc("held-out file for evaluation; empty = none"))
    name: str = field(default="train", metadata=doc("dataset id in the shard service (an id token)"))
    schema: dict[str, Any] = field(default_factory=dict, metadata=doc(
        "the feature schema (pacer.data.schema.Schema.from_config: label, dense, categorical, multi_hot, "
        "weight); empty = Criteo's (examples/schemas/criteo.yaml)"))
    options: dict[str, Any] = field(default_factory=dict, metadata=doc(
        "reader options of csv/tsv: delimiter, header (bool), names (column names); of a stream: start "
        "(first | new | a sequence), max_wait_s, idle_close_s"))


@message("job.ExportConfig")
@dataclass(frozen=True, slots=True)
class ExportConfig:
    """Where the chief writes SavedModels for serving, and how often."""

    path: str = field(metadata=doc("directory (local or fsspec URL); each export is a new subdirectory"))
    every_s: float = field(default=0.0, metadata=doc("seconds between exports while training; 0 = at the end only"))


@message("job.PolicyConfig")
@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Names of the policy services a job uses (built-in or a user's own)."""

    straggler: str = field(default="antdt-nd", metadata=doc("straggler-mitigation policy service"))
    optimizer: str = field(default="brain", metadata=doc("resource-optimizer policy service"))
    params: dict[str, Any] = field(default_factory=dict, metadata=doc(
        "parameters of the straggler policy, sent in every PolicyRequest.params (scalars and lists)"))


@message("job.ResourceRequest")
@dataclass(frozen=True, slots=True)
class ResourceRequest:
    """Resources the user asks for; every field is optional (absent = Pacer decides)."""

    workers: int | None = None
    ps: int | None = None
    worker_cpu: float | None = field(default=None, metadata=doc("CPUs per worker"))
    worker_memory_mb: int | None = field(default=None, metadata=doc("memory per worker, MiB"))
    ps_cpu: float | None = field(default=None, metadata=doc("CPUs per PS"))
    ps_memory_mb: int | None = field(default=None, metadata=doc("memory per PS, MiB"))


@message("job.ResourceLimits")
@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Upper bounds on any plan for the job, whoever makes it; absent = unbounded."""

    max_workers: int | None = None
    max_ps: int | None = None
    max_cpu: float | None = field(default=None, metadata=doc("CPUs of all the job's nodes together"))
    max_memory_mb: int | None = field(default=None, metadata=doc("memory of all the job's nodes together, MiB"))


@message("job.TrainerConfig")
@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """A user's own training program, run instead of Pacer's built-in trainer (docs/trainers.md).

    Every worker pod runs ``command``; every PS pod runs ``ps_command``, or
    Pacer's plain TensorFlow PS server when it is empty.  Pacer gives the
    processes the cluster (``TF_CONFIG``), the shard service, the agent IPC
    and the job's settings as environment variables (the contract is
    :class:`pacer.trainer.sdk.TrainerEnv`); ``pacer.trainer.sdk`` reads them.
    Exit codes: 0 finished, 75 restart me (KILL_RESTART), anything else failed.
    """

    command: list[str] = field(metadata=doc(
        "worker argv; a leading 'python' is the image's Python; '{pod_dir}' is the pod's own directory"))
    ps_command: list[str] = field(default_factory=list, metadata=doc(
        "PS argv (it must serve on its TF_CONFIG address); empty = Pacer's TensorFlow PS server"))
    image: str = field(default="", metadata=doc(
        "container image of the trainer on Kubernetes (\"\": the executor's trainer image); local backend: ignored"))
    env: dict[str, str] = field(default_factory=dict, metadata=doc(
        "extra environment; names starting with PACER_ and TF_CONFIG are Pacer's and refused"))


@message("job.SchedulingConfig")
@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """How a job's pods are queued and admitted on Kubernetes (ignored by the local backend)."""

    priority_class: str = field(default="", metadata=doc(
        "a PriorityClass name (DNS-1123 subdomain) set as every pod's priorityClassName (\"\": none)"))
    queue: str = field(default="", metadata=doc(
        "the Kueue LocalQueue the job is submitted to (DNS-1123 label); required with gang kueue"))
    gang: GangScheduler = field(default=GangScheduler.NONE, metadata=doc(
        "none | kueue | volcano: admit every PS and worker of the job at once (docs/kubernetes.md)"))


@message("job.JobSpec")
@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job as submitted: what to train on what, how, and under which limits.

    Written by users as YAML or JSON (``examples/jobs/``) and parsed by
    :func:`pacer.jobs.spec.parse_job_spec`.  ``resources`` may be left out
    entirely: a zero-config job is planned by its optimizer policy.
    """

    name: str = field(metadata=doc("job id (an id token: letters, digits, '_' and '-')"))
    model: ModelConfig
    dataset: DatasetConfig
    epochs: int = field(default=1, metadata=doc(">= 1"))
    batch_size: int = field(default=512, metadata=doc("global batch: records per step over all workers"))
    mode: TrainingMode = TrainingMode.ASP
    backup_workers: int = field(default=0, metadata=doc("BSP only: slowest workers a step does not wait for"))
    policies: PolicyConfig = field(default_factory=PolicyConfig)
    resources: ResourceRequest | None = None
    limits: ResourceLimits | None = None
    trainer: TrainerConfig | None = field(default=None, metadata=doc(
        "the user's own training program (absent: Pacer's built-in trainer for ``model``)"))
    export: ExportConfig | None = field(default=None, metadata=doc("SavedModel export (absent: none)"))
    scheduling: SchedulingConfig | None = field(default=None, metadata=doc(
        "Kubernetes priority class, queue and gang scheduling (absent: none)"))


@message("job.ResourcePlan")
@dataclass(frozen=True, slots=True)
class ResourcePlan:
    """How many PS and workers a job gets, with CPU and memory per node."""

    job: str
    workers: int
    ps: int
    worker_cpu: float
    worker_memory_mb: int
    ps_cpu: float
    ps_memory_mb: int
    source: PlanSource
    reason: str = field(default="", metadata=doc("why this plan: defaults used, values clamped by limits"))
    placement: dict[str, str] = field(default_factory=dict, metadata=doc(
        "node (ps-<i>, worker-<i>) -> the machine it should run on (Dike); a preference, not a guarantee; "
        "empty: anywhere"))


@message("job.JobEvent")
@dataclass(frozen=True, slots=True)
class JobEvent:
    """A job entered ``state`` at ``ts`` (seconds since the epoch)."""

    job: str
    state: JobState
    ts: float
    reason: str = field(default="", metadata=doc("why: failure reason, stop requester, re-plan cause"))
    previous: JobState | None = field(default=None, metadata=doc("the state left; none for the first event"))


@message("job.AuditRecord")
@dataclass(frozen=True, slots=True)
class AuditRecord:
    """``pacer.events.api.<job>.audit``: one mutating API request (submit, stop), whatever came of it.

    The job token is ``_none`` when the request named no readable job (a body that is not a spec).
    """

    ts: float
    who: str = field(metadata=doc("the caller's identity (its tokens-file name; \"\" when no token matched)"))
    role: str = field(metadata=doc("viewer | submitter | admin (\"\": unknown caller)"))
    action: str = field(metadata=doc("the route: \"POST /api/v1/jobs\", \"POST /api/v1/jobs/{job}/stop\""))
    job: str = field(metadata=doc("the job acted on (\"\" when the request named none)"))
    namespace: str = field(default="", metadata=doc("the job's namespace, when known"))
    remote: str = field(default="", metadata=doc("where the request came from (the peer address)"))
    status: int = field(default=0, metadata=doc("the HTTP status answered"))
    outcome: str = field(default="", metadata=doc("ok, or the error code: unauthorized, forbidden, invalid, ..."))


# ------------------------------------------------------------ job service rpc


@message("job.SubmitRequest")
@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """``pacer.rpc.jobs.<name>.submit``: a job spec document (YAML or JSON text) -> :class:`JobRecord`.

    The document is validated by the job service (an ``invalid`` error reply
    lists every bad field, one ``<path>: <problem>`` per line).  The subject's
    job token must equal the spec's ``name``.
    """

    spec: str = field(metadata=doc("the job spec as YAML or JSON text"))
    namespace: str = field(default=DEFAULT_NAMESPACE, metadata=doc(
        "the team the job belongs to (a Kubernetes namespace name): who may see and stop it through the API"))


@message("job.JobQuery")
@dataclass(frozen=True, slots=True)
class JobQuery:
    """``pacer.rpc.jobs.<job>.get`` -> :class:`JobRecord` (``not_found`` for an unknown job)."""

    job: str


@message("job.StopRequest")
@dataclass(frozen=True, slots=True)
class StopRequest:
    """``pacer.rpc.jobs.<job>.stop`` -> :class:`JobRecord`; stopping a terminal job is a ``conflict``."""

    job: str
    reason: str = "stopped by the user"


@message("job.ListRequest")
@dataclass(frozen=True, slots=True)
class ListRequest:
    """``pacer.rpc.jobs._all.list`` -> :class:`JobList`, newest first."""

    limit: int = field(default=100, metadata=doc("at most this many jobs, 1..1000"))
    state: JobState | None = field(default=None, metadata=doc("only jobs in this state (absent: all)"))
    namespaces: list[str] = field(default_factory=list, metadata=doc("only jobs of these namespaces (empty: all)"))


@message("job.JobProgress")
@dataclass(frozen=True, slots=True)
class JobProgress:
    """Shard counts of the job's training dataset (from the shard service's progress events)."""

    shards_total: int = 0
    shards_todo: int = 0
    shards_doing: int = 0
    shards_done: int = 0
    shards_failed: int = 0
    records_done: int = 0
    records_total: int = 0
    records_duplicated: int = field(default=0, metadata=doc("records served more than once (re-served after a node died)"))
    epoch: int = 0
    records_reserved: int = field(default=0, metadata=doc(
        "records served again because the gradients they were trained with were discarded (BSP backup workers)"))


@message("job.OutboxEntry")
@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """An event stored with the record change it reports, published after the write (the job service's outbox)."""

    subject: str
    data: bytes = field(metadata=doc("the encoded event"))
    msg_id: str = field(default="", metadata=doc("JetStream Nats-Msg-Id: a second publish within the "
                                                  "stream's duplicate window is stored once"))


@message("job.JobRecord")
@dataclass(frozen=True, slots=True)
class JobRecord:
    """Everything the job service knows about one job (stored in KV ``pacer-jobs``)."""

    job: str
    spec: JobSpec
    state: JobState
    submitted_at: float
    reason: str = field(default="", metadata=doc("why the job is in its state (failure reason, ...)"))
    updated_at: float = 0.0
    started_at: float = field(default=0.0, metadata=doc("first time the job was running (0: never)"))
    finished_at: float = field(default=0.0, metadata=doc("time it reached a terminal state (0: not yet)"))
    plan: ResourcePlan | None = None
    progress: JobProgress = field(default_factory=JobProgress)
    node_restarts: int = field(default=0, metadata=doc("pods relaunched after failures or KILL_RESTART"))
    restarts_by_node: dict[str, int] = field(default_factory=dict, metadata=doc("node -> its relaunches"))
    result: dict[str, Any] = field(default_factory=dict, metadata=doc("the chief's final report: auc, logloss, steps, ..."))
    data_path: str = field(default="", metadata=doc("the dataset the workers read in place: a resolved local path or glob, "
                                                    "or a URL"))
    eval_path: str = field(default="", metadata=doc("the held-out dataset (\"\": none)"))
    columns: dict[str, str] = field(default_factory=dict, metadata=doc(
        "the dataset's columns and kinds (float, int, string, list<...>), read from its metadata at submit"))
    index_dir: str = field(default="", metadata=doc("where the row-offset indexes of csv/tfrecord datasets are kept"))
    exported: str = field(default="", metadata=doc("the newest SavedModel the chief exported (\"\": none yet)"))
    records: int = field(default=0, metadata=doc("records in the training dataset"))
    torn_down: bool = field(default=False, metadata=doc("every pod of the job is gone"))
    namespace: str = field(default=DEFAULT_NAMESPACE, metadata=doc("the job's team (SubmitRequest.namespace)"))
    outbox: list[OutboxEntry] = field(default_factory=list, metadata=doc(
        "events of a stored change not yet known to be published (a writer that died before publishing "
        "leaves them here; any instance publishes them)"))


@message("job.ModelExported")
@dataclass(frozen=True, slots=True)
class ModelExported:
    """``pacer.events.job.<job>.exported``: where the job's newest SavedModel is (serving-ready)."""

    job: str
    path: str = field(metadata=doc("the SavedModel directory (serving_default: raw columns in, probability out)"))
    exports: int = field(default=1, metadata=doc("SavedModels the job wrote so far (periodic ones included)"))


@message("job.JobList")
@dataclass(frozen=True, slots=True)
class JobList:
    jobs: list[JobRecord] = field(default_factory=list)
