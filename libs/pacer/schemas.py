"""Export the wire contracts to ``proto-schemas/`` and check the export is current.

The message dataclasses in :mod:`pacer.contracts` are the single source of
each schema.  ``python -m pacer.schemas export`` writes one JSON Schema per
registered message to ``proto-schemas/<domain>/<Name>.v<version>.json`` and a
generated ``README.md`` (messages, subjects, encoding); ``python -m
pacer.schemas check`` lists the files that are missing, different or stale,
and ``tests/unit/test_contracts.py`` fails when there are any.  Both commands
take an optional directory; the default is ``proto-schemas/`` in the repository
root (the nearest directory above the working directory with a
``pyproject.toml``).

:data:`RPC_CONTRACTS` and :data:`SHARD_EVENT_CONTRACTS` say which message goes
with which subject; clients, services and tests can reuse them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pacer.contracts  # noqa: F401  (registers every message with the codec)
from pacer import codec, subjects
from pacer.contracts import agent, brain, common, executor, jobs, monitor, nodes, policy, shards
from pacer.subjects import NodeEventKind, ShardEventKind, ShardOp

SCHEMA_DIR = "proto-schemas"
README = "README.md"


class RpcContract(NamedTuple):
    """Request and success-reply message of one rpc op."""

    request: type[Any]
    reply: type[Any]


#: Shard-service ops (``pacer.rpc.shard.<job>.<op>``) -> request and reply types.
#: Any op may instead reply with :data:`ERROR_REPLY` (``{"error": ErrorReply}``).
RPC_CONTRACTS: dict[str, RpcContract] = {
    ShardOp.REGISTER: RpcContract(shards.DatasetSpec, shards.DatasetStatus),
    ShardOp.LEASE: RpcContract(shards.LeaseRequest, shards.LeaseReply),
    ShardOp.STATUS: RpcContract(shards.DatasetRef, shards.DatasetStatus),
    ShardOp.CHECKPOINT: RpcContract(shards.CheckpointRequest, shards.CheckpointReply),
    ShardOp.RESTORE: RpcContract(shards.CheckpointRequest, shards.DatasetStatus),
    ShardOp.APPEND: RpcContract(shards.AppendRequest, shards.DatasetStatus),
    ShardOp.RETRY_FAILED: RpcContract(shards.DatasetRef, shards.DatasetStatus),
}

#: The error reply of every rpc op.
ERROR_REPLY: type[Any] = common.ErrorEnvelope


def _kinds(holder: type) -> list[str]:
    """The string constants of an event-kind class, in definition order."""
    return [v for k, v in vars(holder).items() if k.isupper() and isinstance(v, str)]


#: Shard event kinds (``pacer.events.shard.<job>.<kind>``) -> message type.
SHARD_EVENT_CONTRACTS: dict[str, type[Any]] = {
    kind: shards.ProgressEvent if kind == ShardEventKind.PROGRESS else shards.ShardEvent
    for kind in _kinds(ShardEventKind)
}

#: Node event kinds (``pacer.events.node.<job>.<kind>``) -> message type.
NODE_EVENT_CONTRACTS: dict[str, type[Any]] = {
    kind: nodes.NodeEvent for kind in _kinds(NodeEventKind)
}

#: Reply of ``pacer.svc.<service>.health`` (the request body is ignored).
HEALTH_REPLY: type[Any] = common.Health

#: Agent and monitor events (``pacer.events.<domain>.<job>.<kind>``) -> message type.
OTHER_EVENT_CONTRACTS: list[tuple[str, str, type[Any]]] = [
    (subjects.AGENT_SERVICE, subjects.AgentEventKind.METRICS, agent.AgentMetrics),
    (subjects.AGENT_SERVICE, subjects.AgentEventKind.HEARTBEAT, agent.Heartbeat),
    (subjects.AGENT_SERVICE, subjects.AgentEventKind.ACTION, agent.ActionResult),
    (subjects.MONITOR_SERVICE, subjects.MonitorEventKind.STATISTICS, monitor.JobStatistics),
    ("job", subjects.JobEventKind.PLAN, jobs.ResourcePlan),
    *(("job", state.value, jobs.JobEvent) for state in jobs.JobState),
    *((subjects.EXECUTOR_SERVICE, kind.value, executor.ExecutorEvent) for kind in executor.ExecutorEventKind),
    (subjects.CONTROLLER_SERVICE, "decision", policy.ControllerDecision),
    (subjects.BRAIN_SERVICE, "decision", brain.BrainDecision),
]


class OtherRpc(NamedTuple):
    subject: str  # built with the job placeholder
    request: type[Any]
    reply: type[Any] | None
    meaning: str


def _other_rpcs() -> list[OtherRpc]:
    """Requests into services other than the shard service (what controllers and tools send)."""
    return [
        OtherRpc(subjects.agent_global_action(_JOB), agent.GlobalAction, agent.ActionResult,
                 "served by the job's primary agent: applied by every trainer in one iteration"),
        OtherRpc(subjects.agent_command(_JOB, "__node__"), agent.NodeCommand, agent.ActionResult,
                 "one node's agent (e.g. KILL_RESTART)"),
        OtherRpc(subjects.monitor_stats(_JOB), monitor.StatsQuery, monitor.JobStatistics,
                 "the monitor's current statistics of a job"),
        OtherRpc(subjects.job_rpc(_JOB, subjects.JobOp.SUBMIT), jobs.SubmitRequest, jobs.JobRecord,
                 "submit a job spec (YAML/JSON); `invalid` names every bad field"),
        OtherRpc(subjects.job_rpc(_JOB, subjects.JobOp.GET), jobs.JobQuery, jobs.JobRecord,
                 "one job: state, plan, progress, result"),
        OtherRpc(subjects.job_rpc(subjects.ALL_JOBS, subjects.JobOp.LIST), jobs.ListRequest, jobs.JobList,
                 "jobs, newest first"),
        OtherRpc(subjects.job_rpc(_JOB, subjects.JobOp.STOP), jobs.StopRequest, jobs.JobRecord,
                 "stop a job; its pods are torn down"),
        OtherRpc(subjects.brain_rpc(_JOB, subjects.BrainOp.PLAN), brain.PlanRequest, jobs.ResourcePlan,
                 "a new job's first plan (warm start from the config DB, defaults on a cold start)"),
        OtherRpc(subjects.brain_rpc(subjects.ALL_JOBS, subjects.BrainOp.HISTORY), brain.HistoryQuery,
                 brain.HistoryList, "the config DB of finished jobs"),
        OtherRpc(subjects.policy_decide("__policy__"), policy.PolicyRequest,
                 policy.PolicyDecision, "a straggler policy service (built-in or your own) decides for one window"),
        OtherRpc(subjects.executor_rpc(_JOB, subjects.ExecutorOp.COMMAND), executor.ExecutorCommand,
                 executor.CommandResult, "node action: restart (KILL_RESTART), migrate, stop"),
        OtherRpc(subjects.executor_rpc(_JOB, subjects.ExecutorOp.STATUS), executor.JobQuery,
                 executor.ExecutorStatus, "the job's nodes and pods as the executor tracks them"),
        OtherRpc(subjects.executor_rpc(_JOB, subjects.ExecutorOp.LOGS), executor.LogsQuery,
                 executor.LogsReply, "the tail of a node's trainer or agent log"),
        OtherRpc(subjects.executor_rpc(_JOB, subjects.ExecutorOp.TEARDOWN), executor.JobQuery,
                 executor.ExecutorStatus, "delete every pod of the job"),
        OtherRpc(subjects.agent_phase(_JOB, subjects.AgentPhase.PREPARE), agent.Prepare, agent.Vote,
                 "internal: two-phase global action, one vote per participant"),
        OtherRpc(subjects.agent_phase(_JOB, subjects.AgentPhase.COMMIT), agent.Commit, agent.Ack,
                 "internal: commit of a prepared action"),
        OtherRpc(subjects.agent_phase(_JOB, subjects.AgentPhase.ABORT), agent.Abort, None,
                 "internal: abort of a prepared action"),
    ]


# ------------------------------------------------------------------ files


def schema_name(cls: type[Any]) -> str:
    """The schema name of a message class, e.g. ``shard.LeaseRequest``."""
    return str(cls.__pacer_schema__.name)


def schema_path(cls: type[Any]) -> str:
    """Where ``cls``'s schema lives under ``proto-schemas/``: ``<domain>/<Name>.v<version>.json``."""
    sch = cls.__pacer_schema__
    domain, dot, name = sch.name.partition(".")
    if not dot or not domain or not name:
        raise ValueError(f"message name {sch.name!r} is not <domain>.<Name>")
    return f"{domain}/{name}.v{sch.version}.json"


def _messages() -> list[type[Any]]:
    return sorted(set(codec.REGISTRY.values()), key=schema_path)


def _render_json(cls: type[Any]) -> str:
    return json.dumps(codec.json_schema(cls), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render() -> dict[str, str]:
    """Every generated file: relative path (posix) -> content."""
    files = {schema_path(cls): _render_json(cls) for cls in _messages()}
    files[README] = render_readme()
    return dict(sorted(files.items()))


def _problems(dest: Path) -> list[tuple[str, str]]:
    expected = render()
    out: list[tuple[str, str]] = []
    for rel, text in expected.items():
        path = dest / rel
        if not path.is_file():
            out.append((rel, "missing"))
        elif path.read_bytes() != text.encode("utf-8"):
            out.append((rel, "different"))
    for rel in _present_json(dest):
        if rel not in expected:
            out.append((rel, "stale"))
    return sorted(out)


def _present_json(dest: Path) -> list[str]:
    if not dest.is_dir():
        return []
    return sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.json") if p.is_file())


def export(dest: Path) -> list[Path]:
    """Write every schema and the README under ``dest``; delete stale schema files.

    Files whose content is already right are left untouched.  Returns the
    paths of all generated files.
    """
    dest = Path(dest)
    expected = render()
    written: list[Path] = []
    for rel, text in expected.items():
        path = dest / rel
        data = text.encode("utf-8")
        if not path.is_file() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        written.append(path)
    for rel in _present_json(dest):
        if rel not in expected:
            stale = dest / rel
            stale.unlink()
            parent = stale.parent
            if parent != dest and not any(parent.iterdir()):
                parent.rmdir()
    return written


def check(dest: Path) -> list[str]:
    """Relative names of the files under ``dest`` that are missing, different or stale."""
    return [rel for rel, _ in _problems(Path(dest))]


# ----------------------------------------------------------------- README

_JOB = "__job__"  # a valid id token, replaced by ``<job>`` in the tables


def _job(subject: str) -> str:
    return subject.replace(f".{_JOB}.", ".<job>.")


def _first_line(text: str) -> str:
    return text.strip().split("\n\n", 1)[0].replace("\n", " ").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _link(cls: type[Any]) -> str:
    return f"[`{schema_name(cls)}`]({schema_path(cls)})"


def render_readme() -> str:
    """The content of ``proto-schemas/README.md``."""
    missing = set(ShardOp.ALL) ^ set(RPC_CONTRACTS)
    if missing:
        raise RuntimeError(f"RPC_CONTRACTS and ShardOp.ALL differ: {sorted(missing)}")
    lines = [
        "# Pacer wire contracts",
        "",
        "Generated by `python -m pacer.schemas export` from the message classes in",
        "`libs/pacer/contracts/` and the subjects in `libs/pacer/subjects.py`.",
        "Do not edit these files by hand: `tests/unit/test_contracts.py` fails when",
        "they and the code drift apart (`python -m pacer.schemas check` lists the",
        "files that differ).",
        "",
        "## Encoding",
        "",
        "Every message is a [msgpack](https://msgpack.org) map from field name to",
        "value; `bytes` fields are msgpack `bin` (`contentEncoding: msgpack-bin` in",
        "the schemas), strings are `str`, enums travel as their string value.",
        "Receivers validate every field against its type and reject a bad message",
        "with error code `bad_message`, naming the field. Unknown fields are",
        "ignored, so a newer sender may add fields with a default; removing a",
        "field, making it required or changing its type needs a new version",
        "(`.v2`). A reply is either the success message of the op or an error",
        '`{"error": ErrorReply}` (`common.ErrorEnvelope`); a success reply never',
        "has a top-level `error` field, so a client can tell the two apart before",
        "decoding. `ErrorReply.code` is stable (`bad_message`, `invalid`,",
        "`not_found`, `conflict`, `unavailable`, ...) and `temporary` says whether",
        "the same request may succeed later.",
        "",
        "## Messages",
        "",
        "| Message | Version | Schema | Description |",
        "| --- | --- | --- | --- |",
    ]
    for cls in _messages():
        sch = cls.__pacer_schema__
        lines.append(
            f"| `{sch.name}` | {sch.version} | [{schema_path(cls)}]({schema_path(cls)}) "
            f"| {_cell(_first_line(sch.doc))} |"
        )
    svc = subjects.SHARD_SERVICE
    lines += [
        "",
        "## Subjects",
        "",
        "`<job>` is a job id (1-64 of `[A-Za-z0-9_-]`); `<service>` is a service",
        f"name (e.g. `{svc}`).",
        "",
        "### Shard service requests (request/reply)",
        "",
        f"Every instance subscribes to `{subjects.rpc_wildcard(svc)}`. Any op may",
        f"reply with {_link(ERROR_REPLY)} instead of its reply type.",
        "",
        "| Subject | Request | Reply |",
        "| --- | --- | --- |",
    ]
    for op in ShardOp.ALL:
        c = RPC_CONTRACTS[op]
        lines.append(
            f"| `{_job(subjects.rpc(svc, _JOB, op))}` | {_link(c.request)} | {_link(c.reply)} |"
        )
    lines += [
        "",
        "### Events",
        "",
        f"Kept in the JetStream stream `{subjects.EVENTS_STREAM}` (`{subjects.EVENTS_SUBJECTS}`).",
        "",
        "| Subject | Message |",
        "| --- | --- |",
    ]
    for kind, cls in SHARD_EVENT_CONTRACTS.items():
        lines.append(f"| `{_job(subjects.event('shard', _JOB, kind))}` | {_link(cls)} |")
    for kind, cls in NODE_EVENT_CONTRACTS.items():
        lines.append(f"| `{_job(subjects.event('node', _JOB, kind))}` | {_link(cls)} |")
    for domain, kind, cls in OTHER_EVENT_CONTRACTS:
        lines.append(f"| `{_job(subjects.event(domain, _JOB, kind))}` | {_link(cls)} |")
    lines += [
        "",
        "### Agent and monitor requests (request/reply)",
        "",
        f"Errors come back as {_link(ERROR_REPLY)}. The job's primary agent is named by the key",
        f"`<job>.primary` of the JetStream KV bucket `{subjects.AGENT_BUCKET}` ({_link(agent.PrimaryRecord)}).",
        "",
        "| Subject | Request | Reply | Meaning |",
        "| --- | --- | --- | --- |",
    ]
    for r in _other_rpcs():
        reply = _link(r.reply) if r.reply is not None else "none"
        subject = _job(r.subject).replace("__node__", "<node>").replace("__policy__", "<name>")
        lines.append(f"| `{subject}` | {_link(r.request)} | {reply} | {r.meaning} |")
    lines += [
        "",
        "### Services",
        "",
        "| Subject | Message | Meaning |",
        "| --- | --- | --- |",
        f"| `{subjects.health('<service>')}` | {_link(HEALTH_REPLY)} (reply) "
        "| health of each running instance; the request body is ignored |",
        f"| `{subjects.dead_letter('<service>')}` | the refused message's original bytes "
        "| messages a service refused for good; headers `Pacer-Error` (why) and "
        "`Pacer-Subject` (where it was received) |",
        "",
    ]
    return "\n".join(lines)


# -------------------------------------------------------------------- CLI


def repo_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) holding ``pyproject.toml``."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file():
            return d
    raise FileNotFoundError(f"no pyproject.toml at or above {here}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pacer.schemas", description="Export or check the wire schemas."
    )
    parser.add_argument("command", choices=["export", "check"])
    parser.add_argument("dir", nargs="?", type=Path, help=f"default: <repo root>/{SCHEMA_DIR}")
    args = parser.parse_args(argv)
    if args.dir is not None:
        dest: Path = args.dir
    else:
        try:
            dest = repo_root() / SCHEMA_DIR
        except FileNotFoundError as exc:
            parser.error(f"{exc}; pass the schema directory")
    if args.command == "export":
        paths = export(dest)
        print(f"wrote {len(paths)} files under {dest}")
        return 0
    problems = _problems(dest)
    for rel, why in problems:
        print(f"{why}: {dest / rel}")
    if problems:
        print("schemas are out of date: run `python -m pacer.schemas export`", file=sys.stderr)
        return 1
    print(f"{dest}: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
