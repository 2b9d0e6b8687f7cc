"""Job specs: parse a YAML or JSON document, validate it, and the default plan.

:func:`parse_job_spec` turns a user's document into a
:class:`~pacer.contracts.jobs.JobSpec`.  Every problem is reported at once in
one :class:`JobSpecError` (a :class:`~pacer.errors.ValidationError`), one
line per problem, each starting with the path of the bad field::

    dataset.path: required
    mode: must be asp or bsp, got 'sync'
    resources.worker_memory_mb: must be > 0, got 0
    epoch: unknown field (did you mean 'epochs'?)

Defaults (a field left out)
---------------------------
======================  =====================================================
``epochs``              1
``batch_size``          512 (global: records per step over all workers)
``mode``                ``asp``
``backup_workers``      0 (BSP only; must stay below the number of workers)
``model``               a bare name (``model: dcn``) or a map with ``name``
                        and any of the options of ``ModelConfig``, whose
                        defaults are ``ModelSpec``'s: hash_buckets 100000,
                        embed_dim 8, hidden [64, 32], cross_layers 3,
                        cin_layers [16, 16], learning_rate 0.05, adagrad
``dataset.format``      from the file name: ``.parquet``/``.pq`` ->
                        ``parquet``, ``.tfrecord(s)`` -> ``tfrecord``,
                        ``.csv`` -> ``criteo_csv`` (``csv`` with a
                        ``schema``), ``.tsv``/``.txt`` (optionally
                        ``.gz``) -> ``criteo_tsv`` (``tsv`` with a
                        ``schema``), ``jetstream://<STREAM>`` ->
                        ``stream``, anything else -> ``record``
``dataset.schema``      Criteo's (examples/schemas/criteo.yaml); a map as
                        in docs/data.md otherwise
``dataset.options``     csv/tsv: a header line, names from it; stream:
                        ``start: first``, ``max_wait_s: 5``, no
                        ``idle_close_s`` (runs until stopped)
``dataset.records``     0 = derived from the file when the job is planned
``dataset.name``        ``train``
``policies``            straggler ``antdt-nd``, optimizer ``brain``, no
                        ``params`` (the straggler policy's parameters,
                        e.g. ``{threshold: 2.5}``, sent in every
                        ``PolicyRequest.params``)
``export``              none: no SavedModel; ``{path, every_s}`` (or a bare
                        path: at the end only)
``resources``           none: the optimizer policy decides (zero-config)
``limits``              none: unbounded
``trainer``             none: Pacer's built-in trainer runs ``model``.  A
                        user's own program instead (docs/trainers.md): a map
                        with ``command`` (argv, required), ``ps_command``
                        (argv; empty = Pacer's TF PS), ``image`` and ``env``
                        (no ``PACER_*`` or ``TF_CONFIG`` names), or a bare
                        argv list.  With a trainer ``model`` may be left out
                        (its ``learning_rate`` still reaches the trainer).
``scheduling``          none: pods go to the default scheduler one by one.
                        Kubernetes only (docs/kubernetes.md, "Gang
                        scheduling and priorities"): ``priority_class`` (a
                        PriorityClass, DNS-1123 subdomain), ``queue`` (a
                        Kueue LocalQueue, DNS-1123 label) and ``gang``:
                        ``none`` (default), ``kueue`` (needs ``queue``) or
                        ``volcano``
======================  =====================================================

The job's name
--------------
``name`` is required and must be a DNS-1035 label (lowercase letters, digits
or ``-``, starting with a letter and ending with a letter or digit): it names
the job's Kubernetes Service and pods.  It is at most
:data:`JOB_NAME_MAX_LEN` (51) characters, so that the longest pod hostname,
``<job>-worker-9999``, stays within a DNS label's 63; a job has at most
:data:`MAX_NODES_PER_ROLE` (10000) workers and as many PS.  ``My_Job`` or a
52-character name is refused with a message that states the rule.

The default plan
----------------
Until the brain-optimizer exists the executor runs :func:`default_plan`:
2 workers and 2 PS, each with 1 CPU and 2048 MiB (a Wide&Deep chief with
flash checkpoints peaks near 1.5 GiB here).  Fields the user gave in
``resources`` win over these defaults.  Then ``limits`` clamp what was
defaulted: counts to ``max_workers`` / ``max_ps``; if the job's total CPU or
memory still exceeds ``max_cpu`` / ``max_memory_mb``, defaulted workers are
removed (down to one more than ``backup_workers``), then defaulted PS (down
to one), then defaulted per-node CPU / memory is scaled down (to at least
0.1 CPU / 128 MiB).  User values are never changed: a user value above a
limit is a validation error of the spec, and a plan that cannot fit the
limits without changing user values is a validation error naming the limit.
The clamp is :func:`pacer.jobs.limits.clamp`, which every brain plan goes
through too.

Documents from strangers
------------------------
A spec arrives from anyone holding the API token, so reading one costs at
most what its size allows.  :func:`load_spec_document` is the one YAML
reader of specs (:func:`parse_job_spec`, which the job service and the CLI
call, and the API's reading of a spec's name go through it).  It refuses a
text over :data:`MAX_SPEC_BYTES` (256 KiB), then composes the YAML into
nodes *before* building any value and refuses the document if a node is
reached twice (an alias, ``*name``: a job spec has no use for them, and a
few hundred bytes of nested aliases would otherwise unfold into gigabytes
wherever the value is printed or sent on), if it nests deeper than
:data:`MAX_SPEC_DEPTH`, or if a number is longer than
:data:`MAX_NUMBER_CHARS` (YAML 1.1 reads ``1:2:3:...`` as one base-60
integer, costly to build).  So an alias bomb is refused in time linear in
its text, without expanding it.  Dataset paths are at most
:data:`MAX_PATH_CHARS` characters without NUL; which files they may name
is the job service's decision (``PACER_DATA_ROOTS``).  Messages quote a
bad value shortened (:func:`_brief`), never at full length.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import reprlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import yaml

from pacer.contracts.jobs import (
    DataFormat,
    DatasetConfig,
    ExportConfig,
    GangScheduler,
    JobSpec,
    ModelConfig,
    ModelName,
    PlanSource,
    PolicyConfig,
    ResourceLimits,
    ResourcePlan,
    ResourceRequest,
    SchedulingConfig,
    TrainerConfig,
    TrainingMode,
)
from pacer.errors import ValidationError
from pacer.ids import MAX_TOKEN_LEN, is_token
from pacer.jobs.limits import MAX_NODES_PER_ROLE, LimitsError, clamp

OPTIMIZERS = ("adagrad", "adam", "sgd")  # as pacer.models.common.OPTIMIZERS (which imports TensorFlow)

#: The largest spec text read, in UTF-8 bytes (a real spec is well under 4 KiB).
MAX_SPEC_BYTES = 256 * 1024
#: How deep a spec's maps and lists may nest (a real spec: 4, ``policies.params.<name>: [...]``).
MAX_SPEC_DEPTH = 32
#: The longest number a spec may write (see the module docstring: base-60 integers).
MAX_NUMBER_CHARS = 64
#: The longest dataset path (Linux's PATH_MAX is 4096 bytes).
MAX_PATH_CHARS = 4096

# libyaml's composer when PyYAML was built with it (several times faster); the same nodes either way.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NUMBER_TAGS = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})


@dataclass(frozen=True, slots=True)
class DefaultPlan:
    """The numbers of the default plan (see the module docstring)."""

    workers: int = 2
    ps: int = 2
    worker_cpu: float = 1.0
    worker_memory_mb: int = 2048
    ps_cpu: float = 1.0
    ps_memory_mb: int = 2048
    min_cpu: float = 0.1  # floor when scaling defaulted CPU down to fit max_cpu
    min_memory_mb: int = 128  # floor when scaling defaulted memory down to fit max_memory_mb


DEFAULT_PLAN = DefaultPlan()

# A job's name becomes Kubernetes names: its headless Service (a DNS-1035
# label, the rule Kubernetes applies to Service names) and its pods'
# hostnames ``<job>-<node>`` (the TF ClusterSpec's DNS names, see the
# Kubernetes backend), DNS labels too: at most 63 characters.  The longest
# node name is the last worker's (clamp() keeps every plan within
# MAX_NODES_PER_ROLE), so that bounds the job name.
DNS_LABEL_MAX_LEN = 63
LONGEST_NODE = f"worker-{MAX_NODES_PER_ROLE - 1}"
JOB_NAME_MAX_LEN = DNS_LABEL_MAX_LEN - len(f"-{LONGEST_NODE}")  # 51
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
JOB_NAME_RULE = (f"a DNS-1035 label (it names the job's Kubernetes Service and pods): at most "
                 f"{JOB_NAME_MAX_LEN} lowercase letters, digits or '-', starting with a letter "
                 f"and ending with a letter or digit (a pod's hostname <job>-{LONGEST_NODE} must "
                 f"fit in {DNS_LABEL_MAX_LEN} characters)")


def is_job_name(value: str) -> bool:
    """Whether ``value`` is a valid job name (:data:`JOB_NAME_RULE`)."""
    return len(value) <= JOB_NAME_MAX_LEN and _DNS_1035.fullmatch(value) is not None


class JobSpecError(ValidationError):
    """A job spec document is malformed or carries values that are not allowed.

    ``problems`` holds one ``"<field path>: <what is wrong>"`` line each;
    the message joins them.
    """

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


# ------------------------------------------------------------------- checker


class _Checker:
    """Collects problems while reading plain data; never raises on its own."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, path: str, what: str) -> None:
        self.problems.append(f"{path}: {what}")

    def section(self, obj: Any, path: str, known: tuple[str, ...]) -> dict[str, Any] | None:
        """``obj`` as a map with string keys; unknown keys are reported with a hint."""
        if not isinstance(obj, Mapping):
            self.bad(path or "spec", f"must be a map, got {_kind(obj)}")
            return None
        out: dict[str, Any] = {}
        for key, value in obj.items():
            full = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.bad(full, "field names must be strings")
            elif key not in known:
                hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                tail = f" (did you mean '{hint[0]}'?)" if hint else f" (known: {', '.join(known)})"
                self.bad(full, "unknown field" + tail)
            else:
                out[key] = value
        return out

    def integer(self, obj: Mapping[str, Any], key: str, path: str, default: int | None,
                minimum: int, maximum: int | None = None) -> int | None:
        full = f"{path}.{key}" if path else key
        if key not in obj or obj[key] is None:
            return default
        v = obj[key]
        if type(v) is not int:
            self.bad(full, f"must be an integer, got {_kind(v)} {_brief(v)}")
            return default
        if v < minimum:
            self.bad(full, f"must be >= {minimum}, got {v}" if minimum != 1 else f"must be > 0, got {v}")
            return default
        if maximum is not None and v > maximum:
            self.bad(full, f"must be <= {maximum}, got {v}")
            return default
        return v

    def number(self, obj: Mapping[str, Any], key: str, path: str, default: float | None) -> float | None:
        """A positive finite number."""
        full = f"{path}.{key}" if path else key
        if key not in obj or obj[key] is None:
            return default
        v = obj[key]
        if type(v) not in (int, float):
            self.bad(full, f"must be a number, got {_kind(v)} {_brief(v)}")
            return default
        if not math.isfinite(v) or v <= 0:
            self.bad(full, f"must be > 0, got {v}")
            return default
        return float(v)

    def token(self, obj: Mapping[str, Any], key: str, path: str, default: str | None) -> str | None:
        full = f"{path}.{key}" if path else key
        if key not in obj or obj[key] is None:
            if default is None:
                self.bad(full, "required")
            return default
        v = obj[key]
        if type(v) is not str:
            self.bad(full, f"must be a string, got {_kind(v)} {_brief(v)}")
            return default
        if not is_token(v):
            self.bad(full, f"must be 1-{MAX_TOKEN_LEN} of letters, digits, '_' or '-', got {_brief(v)}")
            return default
        return v

    def job_name(self, obj: Mapping[str, Any]) -> str | None:
        if obj.get("name") is None:
            self.bad("name", "required")
            return None
        v = obj["name"]
        if type(v) is not str:
            self.bad("name", f"must be a string, got {_kind(v)} {_brief(v)}")
            return None
        if not is_job_name(v):
            self.bad("name", f"must be {JOB_NAME_RULE}, got {_brief(v)}")
            return None
        return v

    def text(self, obj: Mapping[str, Any], key: str, path: str, required: bool) -> str:
        full = f"{path}.{key}" if path else key
        if key not in obj or obj[key] is None:
            if required:
                self.bad(full, "required")
            return ""
        v = obj[key]
        if type(v) is not str:
            self.bad(full, f"must be a string, got {_kind(v)} {_brief(v)}")
            return ""
        if required and not v.strip():
            self.bad(full, "must not be empty")
        return v

    def choice(self, obj: Mapping[str, Any], key: str, path: str, enum_cls: Any, default: Any) -> Any:
        full = f"{path}.{key}" if path else key
        if key not in obj or obj[key] is None:
            if default is None:
                self.bad(full, "required")
            return default
        v = obj[key]
        names = [m.value for m in enum_cls]
        try:
            return enum_cls(v)
        except (ValueError, TypeError):
            self.bad(full, f"must be {_or(names)}, got {_brief(v)}")
            return default

    def int_list(self, obj: Mapping[str, Any], key: str, path: str, default: list[int]) -> list[int]:
        full = f"{path}.{key}" if path else key
        if key not in obj or obj[key] is None:
            return list(default)
        v = obj[key]
        if not isinstance(v, list):
            self.bad(full, f"must be a list of integers, got {_kind(v)} {_brief(v)}")
            return list(default)
        out: list[int] = []
        for i, x in enumerate(v):
            if type(x) is not int or x <= 0:
                self.bad(f"{full}[{i}]", f"must be an integer > 0, got {_brief(x)}")
            else:
                out.append(x)
        return out


def _kind(v: Any) -> str:
    return {dict: "map", list: "list", str: "string", bool: "bool", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _or(names: list[str]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = 10
_REPR.maxlevel = 3


def _brief(v: Any) -> str:
    """``repr(v)`` for a message, shortened: a bad value of any size costs a line, not its size."""
    return _REPR.repr(v)


# -------------------------------------------------------------------- fields

TOP_LEVEL = ("name", "model", "dataset", "epochs", "batch_size", "mode", "backup_workers",
             "policies", "resources", "limits", "trainer", "export", "scheduling")
MODEL_FIELDS = ("name", "hash_buckets", "embed_dim", "hidden", "cross_layers", "cin_layers",
                "learning_rate", "optimizer")
DATASET_FIELDS = ("path", "format", "records", "test_path", "name", "schema", "options")
OPTION_FIELDS = ("delimiter", "header", "names")
STREAM_OPTION_FIELDS = ("start", "max_wait_s", "idle_close_s")
EXPORT_FIELDS = ("path", "every_s")
MAX_COLUMNS = 10_000  # names in dataset.options.names
POLICY_FIELDS = ("straggler", "optimizer", "params")
MAX_POLICY_PARAMS = 32  # a policy's knobs, not a data channel
RESOURCE_FIELDS = ("workers", "ps", "worker_cpu", "worker_memory_mb", "ps_cpu", "ps_memory_mb")
LIMIT_FIELDS = ("max_workers", "max_ps", "max_cpu", "max_memory_mb")
TRAINER_FIELDS = ("command", "ps_command", "image", "env")
SCHEDULING_FIELDS = ("priority_class", "queue", "gang")
# Kubernetes' name rules (k8s.io/apimachinery validation): a DNS-1123 label (a LocalQueue's name is one)
# and a DNS-1123 subdomain, dot-separated labels of at most 253 characters (a PriorityClass's name).
_DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN_MAX_LEN = 253
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def infer_format(path: str, own_schema: bool = False) -> DataFormat:
    """The layout of a dataset from its name (see the module docstring): text files are Criteo's
    unless the spec gives its own schema."""
    if path.startswith("jetstream://"):
        return DataFormat.STREAM
    name = path.lower().removesuffix(".gz")
    if name.endswith((".parquet", ".pq")):
        return DataFormat.PARQUET
    if name.endswith((".tfrecord", ".tfrecords", ".tfr")):
        return DataFormat.TFRECORD
    if name.endswith(".csv"):
        return DataFormat.CSV if own_schema else DataFormat.CRITEO_CSV
    if name.endswith((".tsv", ".txt")):
        return DataFormat.TSV if own_schema else DataFormat.CRITEO_TSV
    return DataFormat.RECORD


def _model(c: _Checker, raw: Any) -> ModelConfig | None:
    if raw is None:
        c.bad("model", "required")
        return None
    if isinstance(raw, str):
        raw = {"name": raw}
    m = c.section(raw, "model", MODEL_FIELDS)
    if m is None:
        return None
    name = c.choice(m, "name", "model", ModelName, None)
    d = ModelConfig(ModelName.WIDE_DEEP)
    opt = c.text(m, "optimizer", "model", required=False) or d.optimizer
    if opt not in OPTIMIZERS:
        c.bad("model.optimizer", f"must be {_or(list(OPTIMIZERS))}, got {_brief(opt)}")
    cross = c.integer(m, "cross_layers", "model", d.cross_layers, minimum=0)
    out = ModelConfig(
        name=name or ModelName.WIDE_DEEP,
        hash_buckets=c.integer(m, "hash_buckets", "model", d.hash_buckets, 1) or d.hash_buckets,
        embed_dim=c.integer(m, "embed_dim", "model", d.embed_dim, 1) or d.embed_dim,
        hidden=c.int_list(m, "hidden", "model", d.hidden),
        cross_layers=d.cross_layers if cross is None else cross,
        cin_layers=c.int_list(m, "cin_layers", "model", d.cin_layers),
        learning_rate=c.number(m, "learning_rate", "model", d.learning_rate) or d.learning_rate,
        optimizer=opt,
    )
    return out if name is not None else None


def _dataset(c: _Checker, raw: Any) -> DatasetConfig | None:
    if raw is None:
        c.bad("dataset", "required")
        return None
    if isinstance(raw, str):  # a bare path
        raw = {"path": raw}
    d = c.section(raw, "dataset", DATASET_FIELDS)
    if d is None:
        return None
    path = _data_path(c, d, "path", required=True)
    schema = _schema(c, d.get("schema"))
    fmt = c.choice(d, "format", "dataset", DataFormat, infer_format(path, own_schema=bool(schema)))
    records = c.integer(d, "records", "dataset", 0, minimum=0)
    return DatasetConfig(
        path=path,
        format=fmt,
        records=records or 0,
        test_path=_data_path(c, d, "test_path", required=False),
        name=c.token(d, "name", "dataset", "train") or "train",
        schema=schema,
        options=_data_options(c, d.get("options"), fmt),
    )


def _schema(c: _Checker, raw: Any) -> dict[str, Any]:
    """The feature schema as plain data, checked by :meth:`Schema.from_config` (``{}``: Criteo's)."""
    if raw is None or raw == {}:
        return {}
    if isinstance(raw, str):
        c.bad("dataset.schema", "must be a map (the CLI inlines a schema file named by its path; "
                                "give the schema itself when submitting through the API)")
        return {}
    from pacer.data.schema import Schema

    try:
        return Schema.from_config(raw, where="dataset.schema").to_config()
    except ValidationError as exc:
        c.problems.extend(str(exc).splitlines())
        return {}


def _data_options(c: _Checker, raw: Any, fmt: DataFormat) -> dict[str, Any]:
    """Reader options of delimited text: ``delimiter`` (one character), ``header`` (bool), ``names``."""
    if fmt is DataFormat.STREAM:
        return _stream_options(c, raw)
    if raw is None or raw == {}:
        return {}
    d = c.section(raw, "dataset.options", OPTION_FIELDS)
    if d is None:
        return {}
    if fmt not in (DataFormat.CSV, DataFormat.TSV):
        c.bad("dataset.options", f"only for the csv and tsv formats, not {fmt.value}")
        return {}
    out: dict[str, Any] = {}
    if "delimiter" in d:
        v = d["delimiter"]
        if type(v) is not str or len(v) != 1 or v in "\r\n\"":
            c.bad("dataset.options.delimiter", f"must be one character (not a quote or line break), got {_brief(v)}")
        else:
            out["delimiter"] = v
    if "header" in d:
        if type(d["header"]) is not bool:
            c.bad("dataset.options.header", f"must be true or false, got {_brief(d['header'])}")
        else:
            out["header"] = d["header"]
    if "names" in d:
        names = d["names"]
        if (not isinstance(names, list) or not names or len(names) > MAX_COLUMNS
                or any(type(n) is not str or not n or len(n) > MAX_TOKEN_LEN for n in names)):
            c.bad("dataset.options.names", f"must be a list of 1-{MAX_COLUMNS} column names "
                                           f"(strings of 1-{MAX_TOKEN_LEN} characters)")
        elif len(set(names)) != len(names):
            c.bad("dataset.options.names", "names a column twice")
        else:
            out["names"] = list(names)
    if out.get("header") is False and "names" not in out:
        c.bad("dataset.options.names", "required when header is false")
    return out


def _stream_options(c: _Checker, raw: Any) -> dict[str, Any]:
    """Options of a stream (docs/data.md): ``start`` (``first``: the stream's first sample, the default;
    ``new``: only samples published after the submission; or a sequence number), ``max_wait_s`` (a
    partial shard of new samples is trained after this long; default 5) and ``idle_close_s`` (the job
    completes once the stream got nothing new for this long; absent: it runs until stopped)."""
    d = c.section(raw if raw is not None else {}, "dataset.options", STREAM_OPTION_FIELDS)
    if d is None:
        return {}
    out: dict[str, Any] = {}
    start = d.get("start", "first")
    if start in ("first", "new") or (type(start) is int and start >= 1):
        out["start"] = start
    else:
        c.bad("dataset.options.start", f"must be first, new or a stream sequence (>= 1), got {_brief(start)}")
    for key, default in (("max_wait_s", 5.0), ("idle_close_s", None)):
        v = c.number(d, key, "dataset.options", default)
        if v is not None:
            out[key] = float(v)
    return out


def _export(c: _Checker, raw: Any) -> ExportConfig | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"path": raw}
    d = c.section(raw, "export", EXPORT_FIELDS)
    if d is None:
        return None
    path = c.text(d, "path", "export", required=True)
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        c.bad("export.path", f"at most {MAX_PATH_CHARS} characters, no NUL")
    every = 0.0
    if d.get("every_s") not in (None, 0):  # 0: at the end only
        every = c.number(d, "every_s", "export", 0.0) or 0.0
    return ExportConfig(path=path, every_s=every)


def is_dns_label(value: str) -> bool:
    """Whether ``value`` is a DNS-1123 label: at most 63 lowercase letters, digits or '-', alphanumeric at both ends."""
    return len(value) <= DNS_LABEL_MAX_LEN and _DNS_1123_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: str) -> bool:
    """Whether ``value`` is a DNS-1123 subdomain: DNS-1123 labels joined by '.', at most 253 characters."""
    return 0 < len(value) <= DNS_SUBDOMAIN_MAX_LEN and all(
        _DNS_1123_LABEL.fullmatch(part) for part in value.split("."))


def _scheduling(c: _Checker, raw: Any) -> SchedulingConfig | None:
    if raw is None:
        return None
    d = c.section(raw, "scheduling", SCHEDULING_FIELDS)
    if d is None:
        return None
    priority = c.text(d, "priority_class", "scheduling", required=False)
    if priority and not is_dns_subdomain(priority):
        c.bad("scheduling.priority_class", "must be a DNS-1123 subdomain (a PriorityClass name: lowercase "
                                           f"letters, digits, '-' and '.', at most {DNS_SUBDOMAIN_MAX_LEN}), "
                                           f"got {_brief(priority)}")
    queue = c.text(d, "queue", "scheduling", required=False)
    if queue and not is_dns_label(queue):
        c.bad("scheduling.queue", f"must be a DNS-1123 label (a LocalQueue name: at most {DNS_LABEL_MAX_LEN} "
                                  f"lowercase letters, digits or '-', alphanumeric at both ends), got {_brief(queue)}")
    gang = c.choice(d, "gang", "scheduling", GangScheduler, GangScheduler.NONE)
    if gang is GangScheduler.KUEUE and not queue:
        c.bad("scheduling.queue", "required with gang kueue (the LocalQueue that admits the job)")
    return SchedulingConfig(priority_class=priority, queue=queue, gang=gang)


def _data_path(c: _Checker, d: Mapping[str, Any], key: str, required: bool) -> str:
    """A dataset file's path as text the OS can take: at most MAX_PATH_CHARS, no NUL (which files
    it may name is the job service's check, against its data roots)."""
    v = c.text(d, key, "dataset", required)
    if len(v) > MAX_PATH_CHARS:
        c.bad(f"dataset.{key}", f"at most {MAX_PATH_CHARS} characters, got {len(v)}")
        return ""
    if "\0" in v:
        c.bad(f"dataset.{key}", "must not contain a NUL character")
        return ""
    return v


def _policies(c: _Checker, raw: Any) -> PolicyConfig:
    d = PolicyConfig()
    if raw is None:
        return d
    p = c.section(raw, "policies", POLICY_FIELDS)
    if p is None:
        return d
    return PolicyConfig(
        straggler=c.token(p, "straggler", "policies", d.straggler) or d.straggler,
        optimizer=c.token(p, "optimizer", "policies", d.optimizer) or d.optimizer,
        params=_policy_params(c, p.get("params")),
    )


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _policy_params(c: _Checker, raw: Any) -> dict[str, Any]:
    """``policies.params``: the straggler policy's knobs (``{threshold: 2.5}``), passed as PolicyRequest.params."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        c.bad("policies.params", f"must be a map of name: value, got {_kind(raw)} {_brief(raw)}")
        return {}
    if len(raw) > MAX_POLICY_PARAMS:
        c.bad("policies.params", f"at most {MAX_POLICY_PARAMS} parameters, got {len(raw)}")
        return {}
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not k:
            c.bad("policies.params", f"parameter names must be strings, got {_brief(k)}")
        elif isinstance(v, float) and not math.isfinite(v):
            c.bad(f"policies.params.{k}", f"must be a finite number, got {_brief(v)}")
        elif _scalar(v) or (isinstance(v, list) and all(_scalar(x) for x in v)):
            out[k] = list(v) if isinstance(v, list) else v
        else:
            c.bad(f"policies.params.{k}", f"must be a number, string, boolean or a list of them, got {_kind(v)}")
    return out


def _resources(c: _Checker, raw: Any) -> ResourceRequest | None:
    if raw is None:
        return None
    r = c.section(raw, "resources", RESOURCE_FIELDS)
    if r is None:
        return None
    return ResourceRequest(
        workers=c.integer(r, "workers", "resources", None, 1, MAX_NODES_PER_ROLE),
        ps=c.integer(r, "ps", "resources", None, 1, MAX_NODES_PER_ROLE),
        worker_cpu=c.number(r, "worker_cpu", "resources", None),
        worker_memory_mb=c.integer(r, "worker_memory_mb", "resources", None, 1),
        ps_cpu=c.number(r, "ps_cpu", "resources", None),
        ps_memory_mb=c.integer(r, "ps_memory_mb", "resources", None, 1),
    )


def _limits(c: _Checker, raw: Any) -> ResourceLimits | None:
    if raw is None:
        return None
    lim = c.section(raw, "limits", LIMIT_FIELDS)
    if lim is None:
        return None
    return ResourceLimits(
        max_workers=c.integer(lim, "max_workers", "limits", None, 1, MAX_NODES_PER_ROLE),
        max_ps=c.integer(lim, "max_ps", "limits", None, 1, MAX_NODES_PER_ROLE),
        max_cpu=c.number(lim, "max_cpu", "limits", None),
        max_memory_mb=c.integer(lim, "max_memory_mb", "limits", None, 1),
    )


def _argv(c: _Checker, obj: Mapping[str, Any], key: str, required: bool) -> list[str]:
    full = f"trainer.{key}"
    v = obj.get(key)
    if v is None or v == []:
        if required:
            c.bad(full, "required: the program's argv, e.g. [python, /app/train.py]")
        return []
    if not isinstance(v, list):
        c.bad(full, f"must be a list of strings (an argv, no shell), got {_kind(v)} {_brief(v)}")
        return []
    for i, a in enumerate(v):
        if type(a) is not str or (i == 0 and not a.strip()):
            c.bad(f"{full}[{i}]", f"must be a{' non-empty' if i == 0 else ''} string, got {_kind(a)} {_brief(a)}")
    return [a for a in v if type(a) is str]


def _trainer(c: _Checker, raw: Any) -> TrainerConfig | None:
    if raw is None:
        return None
    if isinstance(raw, list):  # a bare argv
        raw = {"command": raw}
    t = c.section(raw, "trainer", TRAINER_FIELDS)
    if t is None:
        return None
    command = _argv(c, t, "command", required=True)
    ps_command = _argv(c, t, "ps_command", required=False)
    image = c.text(t, "image", "trainer", required=False)
    if image and (image != image.strip() or " " in image):
        c.bad("trainer.image", f"must be an image reference without spaces, got {_brief(image)}")
    env: dict[str, str] = {}
    raw_env = t.get("env")
    if raw_env is not None and not isinstance(raw_env, Mapping):
        c.bad("trainer.env", f"must be a map of NAME: value, got {_kind(raw_env)} {_brief(raw_env)}")
    elif raw_env is not None:
        for k, v in raw_env.items():
            if type(k) is not str or not _ENV_NAME.fullmatch(k):
                c.bad(f"trainer.env.{k}", "must be a variable name (letters, digits and '_', not starting with a digit)")
            elif k.startswith("PACER_") or k == "TF_CONFIG":
                c.bad(f"trainer.env.{k}", "is set by Pacer (PACER_* and TF_CONFIG are the trainer contract)")
            elif type(v) is not str:
                c.bad(f"trainer.env.{k}", f"must be a string (quote it), got {_kind(v)} {_brief(v)}")
            else:
                env[k] = v
    return TrainerConfig(command=command, ps_command=ps_command, image=image, env=env)


def _cross_checks(c: _Checker, spec: JobSpec) -> None:
    """Rules between fields; only run when every field alone was fine."""
    if spec.backup_workers and spec.mode is not TrainingMode.BSP:
        c.bad("backup_workers", f"only allowed with mode bsp, got {spec.backup_workers} with mode {spec.mode.value}")
    r, lim = spec.resources, spec.limits
    if r is not None and r.workers is not None and spec.backup_workers >= r.workers:
        c.bad("backup_workers", f"must be < resources.workers ({r.workers}), got {spec.backup_workers}")
    if r is not None and r.workers is not None and spec.batch_size < r.workers:
        c.bad("batch_size", f"must be >= resources.workers ({r.workers}) so every worker gets records, "
                            f"got {spec.batch_size}")
    if spec.dataset.format is DataFormat.STREAM:
        if not spec.dataset.path.startswith("jetstream://"):
            c.bad("dataset.path", f"a stream dataset is named jetstream://<STREAM>, got {_brief(spec.dataset.path)}")
        if spec.epochs != 1:
            c.bad("epochs", f"a stream is trained once, in order (online learning): must be 1, got {spec.epochs}")
        if spec.dataset.test_path:
            c.bad("dataset.test_path", "a streaming job has no held-out file: score its periodic exports "
                                       "(export.every_s) on a later window of the stream")
        if spec.dataset.records:
            c.bad("dataset.records", "a stream's record count grows: leave it out (idle_close_s ends the job)")
    if lim is not None and lim.max_workers is not None and spec.backup_workers >= lim.max_workers:
        c.bad("backup_workers", f"must be < limits.max_workers ({lim.max_workers}), got {spec.backup_workers}")
    if r is None or lim is None:
        return
    pairs = (("workers", r.workers, "max_workers", lim.max_workers), ("ps", r.ps, "max_ps", lim.max_ps),
             ("worker_cpu", r.worker_cpu, "max_cpu", lim.max_cpu), ("ps_cpu", r.ps_cpu, "max_cpu", lim.max_cpu),
             ("worker_memory_mb", r.worker_memory_mb, "max_memory_mb", lim.max_memory_mb),
             ("ps_memory_mb", r.ps_memory_mb, "max_memory_mb", lim.max_memory_mb))
    for field_name, value, limit_name, limit in pairs:
        if value is not None and limit is not None and value > limit:
            c.bad(f"resources.{field_name}", f"{value} exceeds limits.{limit_name} ({limit})")


def validate_job_spec(data: Any) -> JobSpec:
    """Build a :class:`JobSpec` from plain data (a map), or raise :class:`JobSpecError`."""
    c = _Checker()
    top = c.section(data, "", TOP_LEVEL)
    if top is None:
        raise JobSpecError(c.problems)
    name = c.job_name(top)
    trainer = _trainer(c, top.get("trainer"))
    if top.get("model") is None and top.get("trainer") is not None:
        model: ModelConfig | None = ModelConfig(ModelName.WIDE_DEEP)  # not run; its learning_rate is passed on
    else:
        model = _model(c, top.get("model"))
    dataset = _dataset(c, top.get("dataset"))
    epochs = c.integer(top, "epochs", "", 1, 1) or 1
    batch_size = c.integer(top, "batch_size", "", 512, 1) or 512
    mode = c.choice(top, "mode", "", TrainingMode, TrainingMode.ASP)
    backup = c.integer(top, "backup_workers", "", 0, 0) or 0
    policies = _policies(c, top.get("policies"))
    resources = _resources(c, top.get("resources"))
    limits = _limits(c, top.get("limits"))
    export = _export(c, top.get("export"))
    scheduling = _scheduling(c, top.get("scheduling"))
    if c.problems or name is None or model is None or dataset is None:
        raise JobSpecError(c.problems)
    spec = JobSpec(name=name, model=model, dataset=dataset, epochs=epochs, batch_size=batch_size,
                   mode=mode, backup_workers=backup, policies=policies, resources=resources,
                   limits=limits, trainer=trainer, export=export, scheduling=scheduling)
    _cross_checks(c, spec)
    if c.problems:
        raise JobSpecError(c.problems)
    return spec


def parse_job_spec(source: str | bytes | Mapping[str, Any]) -> JobSpec:
    """Parse a job spec given as YAML or JSON text (JSON is YAML) or as a map; validate it."""
    if isinstance(source, Mapping):
        return validate_job_spec(source)
    return validate_job_spec(load_spec_document(source))


def load_spec_document(source: str | bytes) -> Any:
    """The plain data of a spec's YAML (or JSON) text, not yet validated; :class:`JobSpecError` when the
    text is too large, not YAML, or uses what a spec must not (module docstring: aliases, deep
    nesting, overlong numbers).  Its cost is linear in the text's size."""
    raw = source if isinstance(source, bytes) else source.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_SPEC_BYTES:
        raise JobSpecError([f"spec: {len(raw)} bytes, larger than the {MAX_SPEC_BYTES} a spec may have"])
    text = raw.decode("utf-8", "replace")
    loader = _YAML_LOADER(text)
    try:
        node = loader.get_single_node()  # composed only: an alias is the very node it names, not a copy
        if node is None:
            return None
        _check_nodes(node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise JobSpecError([f"spec: not valid YAML or JSON{where}: {getattr(exc, 'problem', None) or exc}"]) from None
    except RecursionError:  # the pure-Python composer recurses per level (libyaml stops at 1000)
        raise JobSpecError([f"spec: nested deeper than {MAX_SPEC_DEPTH} levels"]) from None
    except (ValueError, OverflowError) as exc:  # a value YAML's own rules cannot build, e.g. 2024-13-01
        raise JobSpecError([f"spec: a value cannot be read: {_brief(str(exc))}"]) from None
    finally:
        loader.dispose()


def _check_nodes(root: Any) -> None:
    """Refuse a composed document that reuses a node (an alias), nests maps and lists deeper than
    :data:`MAX_SPEC_DEPTH` (the top one is level 1) or has an overlong number.

    Iterative, each node visited once: a bomb of nested aliases is refused
    at its first reuse, having cost no more than its text.  Breadth first,
    so that a reuse is found before the depth its chain of aliases reaches.
    """
    seen: set[int] = set()  # every node stays alive in the tree meanwhile, so ids are unique
    todo: deque[tuple[Any, int]] = deque([(root, 1)])
    while todo:
        node, depth = todo.popleft()
        if id(node) in seen:
            raise JobSpecError([f"spec: aliases are not allowed in a job spec (the value anchored at "
                                f"{_where(node)} is used again); write the value out"])
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode | yaml.SequenceNode) and depth > MAX_SPEC_DEPTH:
            raise JobSpecError([f"spec: nested deeper than {MAX_SPEC_DEPTH} levels at {_where(node)}"])
        if isinstance(node, yaml.MappingNode):
            todo.extend((part, depth + 1) for pair in node.value for part in pair)
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, depth + 1) for item in node.value)
        elif node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
            raise JobSpecError([f"spec: a number of {len(node.value)} characters at {_where(node)}; "
                                f"at most {MAX_NUMBER_CHARS}"])


def _where(node: Any) -> str:
    return f"line {node.start_mark.line + 1}, column {node.start_mark.column + 1}"


def load_job_spec(path: str) -> JobSpec:
    """Read and parse a job spec file (``.yaml``, ``.yml`` or ``.json``); a schema file it names is read."""
    with open(path, encoding="utf-8") as f:
        data = load_spec_document(f.read())
    inline_schema_file(data, os.path.dirname(path))
    return validate_job_spec(data)


def inline_schema_file(data: Any, base_dir: str) -> bool:
    """Replace a ``dataset.schema`` that names a YAML file (relative to ``base_dir``) by the schema in it
    (its top level, or under ``schema:``), in place; whether it did.  A client does this before it sends
    a spec: the services read no files of the client's."""
    dataset = data.get("dataset") if isinstance(data, dict) else None
    if not isinstance(dataset, dict) or not isinstance(dataset.get("schema"), str):
        return False
    path = os.path.join(base_dir, dataset["schema"])
    try:
        with open(path, encoding="utf-8") as f:
            doc = load_spec_document(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        raise JobSpecError([f"dataset.schema: cannot read the schema file {path}: {exc}"]) from None
    dataset["schema"] = doc.get("schema", doc) if isinstance(doc, dict) else doc
    return True


def spec_to_json(spec: JobSpec) -> str:
    """The spec as JSON text that :func:`parse_job_spec` reads back to an equal spec."""
    from pacer.codec import to_dict

    return json.dumps(_drop_none(to_dict(spec)), indent=2, sort_keys=True)


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    return obj


# -------------------------------------------------------------- default plan


def default_plan(spec: JobSpec, defaults: DefaultPlan = DEFAULT_PLAN) -> ResourcePlan:
    """The plan the executor applies until the brain-optimizer exists (module docstring).

    Pure and deterministic.  Raises :class:`JobSpecError` naming the limit if
    the user's own resources leave no way to fit it.
    """
    req = spec.resources or ResourceRequest()
    user = {f for f in RESOURCE_FIELDS if getattr(req, f) is not None}
    min_workers = spec.backup_workers + 1
    plan = ResourcePlan(
        job=spec.name,
        workers=req.workers if req.workers is not None else max(defaults.workers, min_workers),
        ps=req.ps if req.ps is not None else defaults.ps,
        worker_cpu=req.worker_cpu if req.worker_cpu is not None else defaults.worker_cpu,
        worker_memory_mb=req.worker_memory_mb if req.worker_memory_mb is not None else defaults.worker_memory_mb,
        ps_cpu=req.ps_cpu if req.ps_cpu is not None else defaults.ps_cpu,
        ps_memory_mb=req.ps_memory_mb if req.ps_memory_mb is not None else defaults.ps_memory_mb,
        source=PlanSource.USER if user else PlanSource.DEFAULT,
    )
    try:
        clamped = clamp(plan, spec.limits, user=user, min_workers=min_workers, min_cpu=defaults.min_cpu,
                        min_memory_mb=defaults.min_memory_mb)
    except LimitsError as exc:
        raise JobSpecError(exc.problems) from None
    plan, notes = clamped.plan, list(clamped.notes)
    given = ", ".join(f for f in RESOURCE_FIELDS if f in user)
    head = f"user resources ({given}), the rest default" if user else "default plan"
    return replace(plan, reason="; ".join([head, *notes]))

