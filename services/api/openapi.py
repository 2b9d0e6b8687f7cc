"""The OpenAPI 3.1 document of the HTTP API, served at ``GET /api/v1/openapi.json``.

Built, not written by hand: the bodies are the wire contracts' own JSON
Schemas (:func:`pacer.codec.json_schema`, the ones exported to
``proto-schemas/``), so the document cannot drift from the messages the API
returns.  Each contract's ``$defs`` are hoisted into ``components/schemas``
under their schema names (``job.JobRecord``) and the references rewritten.
Pure: no IO.
"""

from __future__ import annotations

from typing import Any

from pacer import codec
from pacer.contracts.executor import ExecutorStatus, LogsReply
from pacer.contracts.jobs import JobList, JobRecord, JobState
from pacer.contracts.monitor import JobStatistics
from pacer.jobs.spec import MAX_SPEC_BYTES, MAX_SPEC_DEPTH

#: The prefix of every API route: a breaking change gets ``/api/v2`` beside it.
API = "/api/v1"

#: The contracts the API returns, as JSON (enums as their values, bytes as hex).
CONTRACTS: tuple[type[Any], ...] = (JobRecord, JobList, ExecutorStatus, JobStatistics, LogsReply)

_DROP = ("$schema", "$id", "$defs", "x-pacer-version", "x-pacer-encoding")


def _rewrite(node: Any) -> Any:
    """``#/$defs/<name>`` -> ``#/components/schemas/<name>``, everywhere in ``node``."""
    if isinstance(node, dict):
        out = {k: _rewrite(v) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            out["$ref"] = "#/components/schemas/" + ref[len("#/$defs/"):]
        return out
    if isinstance(node, list):
        return [_rewrite(v) for v in node]
    return node


def component_schemas() -> dict[str, Any]:
    """Every contract the API returns and everything they reference, by schema name."""
    out: dict[str, Any] = {}
    for cls in CONTRACTS:
        schema = codec.json_schema(cls)
        for name, sub in schema.get("$defs", {}).items():
            out.setdefault(name, _rewrite(sub))
        out[schema["title"]] = _rewrite({k: v for k, v in schema.items() if k not in _DROP})
    out["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["code", "message"],
            "properties": {"code": {"type": "string", "examples": ["invalid", "not_found", "unauthorized"]},
                           "message": {"type": "string"}},
        }},
    }
    out["JobPage"] = {
        "type": "object",
        "required": ["job", "nodes", "statistics", "unavailable"],
        "properties": {
            "job": _ref("job.JobRecord"),
            "nodes": {"anyOf": [_ref("executor.ExecutorStatus"), {"type": "null"}]},
            "statistics": {"anyOf": [_ref("monitor.JobStatistics"), {"type": "null"}]},
            "unavailable": {"type": "object", "additionalProperties": {"type": "string"},
                            "description": "part (nodes, statistics) -> why its service did not answer"},
        },
    }
    out["Caller"] = {
        "type": "object",
        "required": ["name", "role", "namespaces"],
        "properties": {
            "name": {"type": "string", "description": "the token's name (the tokens file's, or the OIDC subject)"},
            "role": {"type": "string", "enum": ["viewer", "submitter", "admin"]},
            "namespaces": {"type": "array", "items": {"type": "string"}, "description": '"*": every namespace'},
        },
    }
    out["SubmitBody"] = {
        "description": f"The job spec as a JSON object, or its YAML (or JSON) text under `spec`.  At most "
                       f"{MAX_SPEC_BYTES} bytes of spec, nested at most {MAX_SPEC_DEPTH} levels; YAML aliases "
                       "(`*name`) are refused (400).",
        "oneOf": [
            {"type": "object", "required": ["spec"], "additionalProperties": False,
             "properties": {"spec": {"type": "string", "minLength": 1}}},
            {"allOf": [_ref("job.JobSpec")], "not": {"required": ["spec"]},
             "description": "the job spec as an object, typed here in its full form (job.JobSpec, what a "
                            "job record holds); the short forms of docs/operations.md (`model: dcn`, a bare "
                            "dataset path, `export: <path>`) are accepted as well"},
        ],
    }
    out["StopBody"] = {"type": "object", "properties": {"reason": {"type": "string"}}}
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*statuses: int) -> dict[str, Any]:
    why = {400: "invalid request (the message names the field)",
           401: "missing or wrong bearer token, or a token in the URL (`?access_token=` is refused)",
           403: "the caller's role or namespaces do not allow it (a viewer submitting or stopping)",
           404: "no such job (or another team's: the same answer)", 409: "conflict (exists, or already finished)", 413: "body larger than 1 MiB",
           415: "mutating requests take application/json", 503: "the service behind it does not answer"}
    return {str(s): _json("Error", why[s]) for s in statuses}


def _query(name: str, schema: dict[str, Any], description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": description}


_JOB = {"name": "job", "in": "path", "required": True, "description": "the job's name",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}}


def document(version: str = "1") -> dict[str, Any]:
    """The OpenAPI document."""
    json_body = {"content": {"application/json": {"schema": _ref("SubmitBody")}}, "required": True}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Pacer HTTP API",
            "version": version,
            "description": "Jobs, their live events and logs.  Every /api route wants `Authorization: Bearer "
                           "<token>`, the event stream too; a token in the URL (`?access_token=`) "
                           "is refused (401).  POST bodies are application/json (415 otherwise).  A token has a "
                           "role (viewer, submitter, admin) and namespaces: a caller sees its namespaces' jobs "
                           "only (another team's job is a 404) and a viewer may not submit or stop (403).",
        },
        "servers": [{"url": ".", "description": "relative: works behind a path prefix"}],
        "security": [{"bearer": []}],
        "paths": {
            f"{API}/jobs": {
                "get": {
                    "operationId": "listJobs", "summary": "Jobs, newest first",
                    "parameters": [
                        _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}, "at most"),
                        _query("state", {"type": "string", "enum": [s.value for s in JobState]}, "only this state"),
                    ],
                    "responses": {"200": _json("job.JobList", "the jobs"), **_errors(400, 401, 503)},
                },
                "post": {
                    "operationId": "submitJob", "summary": "Submit a job",
                    "parameters": [_query("namespace", {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"},
                                          "the job's team (default: the caller's only namespace, else `default`)")],
                    "requestBody": json_body,
                    "responses": {"201": _json("job.JobRecord", "the job, submitted"),
                                  **_errors(400, 401, 403, 409, 413, 415, 503)},
                },
            },
            f"{API}/jobs/{{job}}": {
                "get": {
                    "operationId": "getJob", "summary": "A job with its nodes and statistics when known",
                    "parameters": [_JOB],
                    "responses": {"200": _json("JobPage", "the job"), **_errors(400, 401, 404, 503)},
                },
            },
            f"{API}/jobs/{{job}}/stop": {
                "post": {
                    "operationId": "stopJob", "summary": "Stop a job",
                    "parameters": [_JOB],
                    "requestBody": {"required": False,
                                    "content": {"application/json": {"schema": _ref("StopBody")}}},
                    "responses": {"200": _json("job.JobRecord", "the job, stopped"),
                                  **_errors(400, 401, 403, 404, 409, 413, 415, 503)},
                },
            },
            f"{API}/jobs/{{job}}/logs": {
                "get": {
                    "operationId": "jobLogs", "summary": "The tail of one node's log",
                    "parameters": [
                        _JOB,
                        _query("node", {"type": "string"}, "e.g. worker-0", required=True),
                        _query("tail", {"type": "integer", "minimum": 1, "maximum": 5000, "default": 200}, "lines"),
                        _query("container", {"type": "string", "enum": ["trainer", "agent"], "default": "trainer"},
                               "which container"),
                    ],
                    "responses": {"200": _json("executor.LogsReply", "the lines"), **_errors(400, 401, 404, 503)},
                },
            },
            f"{API}/whoami": {
                "get": {
                    "operationId": "whoami", "summary": "Who the bearer token is: its name, role and namespaces "
                                                        "(the dashboard's sign-in checks a token with it)",
                    "responses": {"200": _json("Caller", "the caller"), **_errors(401)},
                },
            },
            f"{API}/events": {
                "get": {
                    "operationId": "jobEvents",
                    "summary": "Server-Sent Events of one job: history, `replayed`, then live",
                    "description": "Each event is `id: <PACER_EVENTS sequence>`, `event: <domain>.<kind>`, "
                                   "`data: <the message as JSON>`.  Reconnect with Last-Event-ID to resume.  "
                                   "The token goes in the Authorization header (a browser reads the stream "
                                   "with fetch(); EventSource cannot set headers).",
                    "parameters": [
                        _query("job", {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "the job", required=True),
                        _query("replay", {"type": "string", "enum": ["1", "0", "true", "false", "yes", "no"],
                                          "default": "1"}, "send the stored history first"),
                        _query("last_event_id", {"type": "integer", "minimum": 0}, "as the Last-Event-ID header"),
                        {"name": "Last-Event-ID", "in": "header", "required": False,
                         "schema": {"type": "integer", "minimum": 0},
                         "description": "resume after this event (what a reconnecting client sends)"},
                    ],
                    "responses": {
                        "200": {"description": "the stream",
                                "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                        **_errors(400, 401, 503),
                    },
                },
            },
            f"{API}/openapi.json": {
                "get": {
                    "operationId": "openapi", "summary": "This document", "security": [],
                    "responses": {"200": {"description": "OpenAPI 3.1",
                                          "content": {"application/json": {"schema": {"type": "object"}}}}},
                },
            },
            "/healthz": {
                "get": {
                    "operationId": "health", "summary": "Readiness: 503 while NATS is unreachable", "security": [],
                    "responses": {
                        "200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                        "503": {"description": "degraded",
                                "content": {"application/json": {"schema": {"type": "object"}}}},
                    },
                },
            },
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "PACER_API_TOKEN"},
            },
            "schemas": component_schemas(),
        },
    }
