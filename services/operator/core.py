"""The operator's decisions: what a PacerJob is, which Pacer job it is, what its status says.

Pure: no IO, no clock (``now`` comes in as an RFC 3339 string).  The shell
(:mod:`.app`) observes (the object from the watch, the job's record from
the job service) and then acts on what these functions return.

The Pacer job's name
--------------------
A PacerJob ``<name>`` in namespace ``<ns>`` with uid ``<uid>`` runs as the
Pacer job :func:`job_name`: ``<ns>-<name>`` made a DNS-1035 label (other
characters -> ``-``, cut to 40 characters, ``pj-`` in front if it would
not start with a letter) then ``-`` and the first 10 hex digits of the
SHA-256 of ``<ns>/<name>/<uid>``: at most 51 characters, the job-name rule
of :func:`pacer.jobs.spec.is_job_name`.

* Across namespaces: ``team-a/x-y`` and ``team-a-x/y`` read alike but hash
  differently, so two resources share a name only if 40 bits of SHA-256
  collide (about one chance in 10^12 for a pair; the readable part must
  match too).
* Within a namespace: the uid makes a PacerJob deleted and created again
  under the same name a new job.  The job service keeps every job's record
  and refuses a second submission of a name for good, so without the uid
  the new resource could never run.
* Restarts: the name is a function of the object, so an operator that
  restarts finds the job it submitted (``get``) instead of submitting
  again, whatever the status says.

``spec.name`` may be left out; when given it must be ``metadata.name``
(the spec file of ``pacer submit`` pasted under a resource of its name).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pacer import codec
from pacer.contracts.jobs import JobRecord, JobState
from pacer.jobs.lifecycle import TERMINAL
from pacer.jobs.spec import JOB_NAME_MAX_LEN, JobSpecError, parse_job_spec, validate_job_spec
from pacer.k8s_crd import FINALIZER, INVALID, PENDING

HASH_CHARS = 10  # 40 bits of SHA-256 in every job name
READABLE_CHARS = JOB_NAME_MAX_LEN - HASH_CHARS - 1  # 40
#: A condition message is cut here (metav1.Condition allows 32768): a spec's problems, not a dump.
MAX_MESSAGE = 4000
TERMINAL_PHASES = frozenset(s.value.capitalize() for s in TERMINAL)


def job_name(namespace: str, name: str, uid: str) -> str:
    """The Pacer job of a PacerJob (module docstring)."""
    digest = hashlib.sha256(f"{namespace}/{name}/{uid}".encode()).hexdigest()[:HASH_CHARS]
    readable = re.sub(r"[^a-z0-9-]", "-", f"{namespace}-{name}".lower())
    if not readable[:1].isalpha() or not readable[:1].isascii():
        readable = "pj-" + readable
    return f"{readable[:READABLE_CHARS].rstrip('-')}-{digest}"


def phase_of(state: JobState) -> str:
    """``status.phase`` of a job in ``state``: ``running`` -> ``Running``."""
    return state.value.capitalize()


class Malformed(ValueError):
    """An object the operator cannot even name (no metadata, name, namespace or uid): nothing can be
    written back to it, so it is only counted and logged."""


@dataclass(frozen=True, slots=True)
class Resource:
    """What the operator reads of one PacerJob object."""

    namespace: str
    name: str
    uid: str
    generation: int
    resource_version: str
    deleting: bool
    finalizers: tuple[str, ...]
    spec: Any  # whatever the object holds: checked by check_spec, never trusted
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def job(self) -> str:
        return job_name(self.namespace, self.name, self.uid)

    @property
    def has_finalizer(self) -> bool:
        return FINALIZER in self.finalizers


def read_resource(obj: Any) -> Resource:
    """A PacerJob from an API object; :class:`Malformed` when it has no usable identity."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        raise Malformed("no metadata")
    ids = {k: v for k in ("namespace", "name", "uid") if isinstance(v := meta.get(k), str) and v}
    if len(ids) < 3:
        raise Malformed(f"metadata without {', '.join(k for k in ('namespace', 'name', 'uid') if k not in ids)}")
    generation = meta.get("generation", 1)
    finalizers = meta.get("finalizers") or []
    status = obj.get("status")
    return Resource(
        namespace=ids["namespace"], name=ids["name"], uid=ids["uid"],
        generation=generation if type(generation) is int else 0,
        resource_version=str(meta.get("resourceVersion", "")),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(f for f in finalizers if isinstance(f, str)) if isinstance(finalizers, list) else (),
        spec=obj.get("spec"),
        status=dict(status) if isinstance(status, Mapping) else {},
    )


@dataclass(frozen=True, slots=True)
class Checked:
    """A PacerJob's spec as the job service will read it: the text to submit, or every problem."""

    text: str
    problems: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        return not self.problems


def check_spec(res: Resource) -> Checked:
    """The resource's spec named as its Pacer job, parsed as the job service parses a submission."""
    if not isinstance(res.spec, Mapping):
        try:
            validate_job_spec(res.spec)  # states what it got where a map belongs, as for a spec file
        except JobSpecError as exc:
            return Checked("", tuple(exc.problems))
        return Checked("", ("spec: must be a map",))
    problems: list[str] = []
    given = res.spec.get("name")
    if given is not None and given != res.name:
        problems.append(f"name: must be the resource's name ({res.name!r}) or left out, got {given!r} "
                        f"(the Pacer job is named {res.job})")
    try:
        text = json.dumps({**res.spec, "name": res.job}, allow_nan=False)
    except (TypeError, ValueError) as exc:  # nothing an API server stores, but never trusted
        return Checked("", (*problems, f"spec: not JSON data ({exc})"))
    try:
        parse_job_spec(text)  # the job service's parser, on the very text it will get
    except JobSpecError as exc:
        problems.extend(exc.problems)
    return Checked(text, tuple(problems))


# ------------------------------------------------------------------ status


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_conditions(old: Any, new: list[Condition], generation: int, now: str) -> list[dict[str, Any]]:
    """``new`` as ``status.conditions``: a condition whose status did not change keeps its
    ``lastTransitionTime``, so an unchanged status is written as it already is (and not written)."""
    before = {c.get("type"): c for c in old if isinstance(c, Mapping)} if isinstance(old, list) else {}
    out = []
    for c in new:
        status = "True" if c.status else "False"
        prev = before.get(c.type)
        since = prev.get("lastTransitionTime") if prev is not None and prev.get("status") == status else None
        out.append({"type": c.type, "status": status, "reason": c.reason, "message": _cut(c.message),
                    "lastTransitionTime": since if isinstance(since, str) and since else now,
                    "observedGeneration": generation})
    return out


def _cut(text: str) -> str:
    if len(text) <= MAX_MESSAGE:
        return text
    return text[:MAX_MESSAGE] + f"... ({len(text) - MAX_MESSAGE} more characters)"


def _first_line(problems: tuple[str, ...] | list[str]) -> str:
    if not problems:
        return ""
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return problems[0].splitlines()[0][:300] + more


def invalid_status(res: Resource, problems: tuple[str, ...] | list[str], now: str,
                   reason: str = "InvalidSpec") -> dict[str, Any]:
    """The spec was refused, by the parser (``InvalidSpec``) or by the job service (``Rejected``): no job."""
    return {
        "phase": INVALID, "jobName": res.job, "message": _first_line(problems),
        "observedGeneration": res.generation,
        "conditions": merge_conditions(res.status.get("conditions"), [
            Condition("Valid", False, reason, "\n".join(problems)),
            Condition("Submitted", False, "NotSubmitted", "the spec must be fixed first"),
        ], res.generation, now),
    }


def pending_status(res: Resource, error: str, now: str) -> dict[str, Any]:
    """Valid, not submitted yet: ``error`` says what is retried."""
    return {
        "phase": PENDING, "jobName": res.job, "message": error.splitlines()[0][:300] if error else "",
        "observedGeneration": res.generation,
        "conditions": merge_conditions(res.status.get("conditions"), [
            Condition("Valid", True, "SpecValid"),
            Condition("Submitted", False, "Pending", error),
        ], res.generation, now),
    }


def progress_text(rec: JobRecord) -> str:
    """``37% (15/40 shards)``; empty before the shard service reported anything."""
    p = rec.progress
    if p.shards_total <= 0:
        return ""
    if p.records_total > 0:
        pct = min(100, p.records_done * 100 // p.records_total)
    else:
        pct = p.shards_done * 100 // p.shards_total
    return f"{pct}% ({p.shards_done}/{p.shards_total} shards)"


def submitted_generation(res: Resource) -> int:
    """The generation whose spec the job runs: as the status recorded it, else (a status lost before it
    was written, or cleared) the current one."""
    g = res.status.get("submittedGeneration")
    return g if type(g) is int and g > 0 else res.generation


def job_status(res: Resource, rec: JobRecord, now: str) -> dict[str, Any]:
    """The status of a resource whose job exists: the job's phase, plan, progress and conditions."""
    phase = phase_of(rec.state)
    running = rec.state is JobState.RUNNING
    over = rec.state in TERMINAL
    since = submitted_generation(res)
    changed = res.generation != since
    conditions = [
        Condition("Valid", True, "SpecValid"),
        Condition("Submitted", True, "Submitted", f"Pacer job {rec.job}"),
        Condition("Running", running, "Running" if running else phase, rec.reason if running else ""),
        Condition("Finished", over, phase if over else "NotFinished", rec.reason if over else ""),
        Condition("SpecApplied", not changed, "SpecImmutable" if changed else "Submitted",
                  f"the job runs the spec of generation {since}: a Pacer job's spec cannot change; delete the "
                  "resource and create it again" if changed else f"generation {since}"),
    ]
    out: dict[str, Any] = {
        "phase": phase, "jobName": rec.job, "message": rec.reason.splitlines()[0][:300] if rec.reason else "",
        "observedGeneration": res.generation, "submittedGeneration": since,
        "progress": codec.to_dict(rec.progress), "progressText": progress_text(rec),
        "conditions": merge_conditions(res.status.get("conditions"), conditions, res.generation, now),
    }
    if rec.plan is not None:
        out["plan"] = codec.to_dict(rec.plan)
    return out


def status_changes(res: Resource, desired: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch taking the stored status to ``desired`` (fields it lacks are removed); None when
    they are equal, so that writing a status never triggers another write."""
    if _plain(res.status) == _plain(desired):
        return None
    patch: dict[str, Any] = {k: None for k in res.status if k not in desired}
    patch.update(desired)
    return patch


def _plain(obj: Any) -> Any:
    """JSON's view of a value (``1.0`` and ``1`` are one number on the wire)."""
    return json.loads(json.dumps(obj))


def needs_polling(res: Resource) -> bool:
    """Whether the periodic resync should look at the job again: anything but an ended job (or an
    invalid spec) whose status is current."""
    settled = res.status.get("phase") in TERMINAL_PHASES | {INVALID}
    return res.deleting or not settled or res.status.get("observedGeneration") != res.generation
