"""Who may publish and subscribe to what on the bus: NATS users per service.

Every permission is derived from :mod:`pacer.subjects`, so a renamed
subject moves its permission with it.  :func:`permissions` answers, for one
role (a service of the stack, ``agent``, ``admin`` or ``policy:<name>``),
the subjects it may publish to and subscribe to; :func:`render_authorization`
turns users and their roles into the ``authorization { users = [...] }``
block of a nats-server config.

What the lists enforce (the issue's threat model: anything that reaches
NATS must not command executors, forge node deaths or answer for another
policy):

* executor commands (``pacer.rpc.executor.*.command`` / ``teardown``) only
  from the controller, the brain and the job service;
* node events (``pacer.events.node.>``) only from the executor;
* the shard log only from the shard service;
* a policy only receives its own ``pacer.policy.<name>.decide`` and may
  publish nothing but the replies to the requests it got
  (``allow_responses``); it has no JetStream API at all;
* agents (and the trainers beside them) only agent, shard-rpc and
  checkpoint subjects; they cannot command executors or publish node,
  job, controller or brain events.  (Not yet per job: static users cannot
  name a job; see docs/operations.md.)

Replies reach a requester through ``allow_responses``: a service may answer
a request it received, never publish into an arbitrary inbox.  JetStream's
API (``$JS.API.>``) is granted to the services that own streams, consumers
and KV buckets; acks (``$JS.ACK.>``) to those that consume.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from pacer import subjects as S
from pacer.errors import ValidationError

INBOX = "_INBOX.>"
JS_API = "$JS.API.>"
JS_ACK = "$JS.ACK.>"


def kv(bucket: str) -> str:
    """The subjects of a JetStream KV bucket (``$KV.<bucket>.>``): puts and deletes go there."""
    return f"$KV.{bucket}.>"


def object_store(bucket: str) -> str:
    """The subjects of a JetStream object store (``$O.<bucket>.>``): its chunks and meta entries."""
    return f"$O.{bucket}.>"


def _rpc(service: str, op: str = "*") -> str:
    return f"{S.PREFIX}.rpc.{service}.*.{op}"


def _events(domain: str) -> str:
    return S.events_of(domain, job="*", kind="*")


def _policies() -> str:
    return f"{S.PREFIX}.policy.*.decide"


@dataclass(frozen=True, slots=True)
class Permissions:
    """Allow lists of one NATS user; everything not listed is denied."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True

    def to_conf(self) -> dict[str, object]:
        out: dict[str, object] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.allow_responses:
            out["allow_responses"] = True
        return out


# Every service of the stack subscribes to its health subject and sends what it refuses for good
# to its dead-letter subject; it requests with an inbox of its own and uses JetStream.
def _service(name: str, publish: list[str], subscribe: list[str], js: bool = True) -> Permissions:
    pub = [*publish, S.dead_letter(name), S.health(name)]
    sub = [*subscribe, S.health(name), INBOX]
    if js:
        pub += [JS_API, JS_ACK]
    return Permissions(publish=tuple(pub), subscribe=tuple(sub))


# The executor's "commands" are every op but the read-only ones.
_EXECUTOR_READS = [_rpc(S.EXECUTOR_SERVICE, S.ExecutorOp.STATUS), _rpc(S.EXECUTOR_SERVICE, S.ExecutorOp.LOGS)]
_EXECUTOR_ALL = f"{S.PREFIX}.rpc.{S.EXECUTOR_SERVICE}.>"
_AGENT_RPC = f"{S.PREFIX}.rpc.{S.AGENT_SERVICE}.>"  # global actions and node commands
_AGENT_PROTOCOL = f"{S.PREFIX}.agent.>"  # the two-phase barrier between agents
_SHARD_RPC = _rpc(S.SHARD_SERVICE)


def _table() -> dict[str, Permissions]:
    readers = [*_EXECUTOR_READS, _rpc(S.JOB_SERVICE), _rpc(S.MONITOR_SERVICE), _rpc(S.BRAIN_SERVICE),
               _SHARD_RPC]
    return {
        S.SHARD_SERVICE: _service(
            S.SHARD_SERVICE,
            publish=[S.SHARD_LOG_SUBJECTS, _events("shard"), kv(S.SNAPSHOT_BUCKET),
                     object_store(S.SNAPSHOT_BUCKET)],
            subscribe=[_SHARD_RPC, S.EVENTS_SUBJECTS]),
        S.MONITOR_SERVICE: _service(
            S.MONITOR_SERVICE,
            publish=[_events(S.MONITOR_SERVICE)],
            subscribe=[_rpc(S.MONITOR_SERVICE), S.EVENTS_SUBJECTS]),
        S.JOB_SERVICE: _service(
            S.JOB_SERVICE,
            publish=[_events("job"), kv(S.JOB_BUCKET), _EXECUTOR_ALL, _rpc(S.BRAIN_SERVICE), _SHARD_RPC,
                     _rpc(S.MONITOR_SERVICE)],
            subscribe=[_rpc(S.JOB_SERVICE), S.EVENTS_SUBJECTS]),
        S.EXECUTOR_SERVICE: _service(
            S.EXECUTOR_SERVICE,
            publish=[_events("node"), _events(S.EXECUTOR_SERVICE), _events("cluster"), kv(S.EXECUTOR_BUCKET),
                     _AGENT_RPC, _SHARD_RPC, _rpc(S.JOB_SERVICE)],
            subscribe=[_rpc(S.EXECUTOR_SERVICE), S.EVENTS_SUBJECTS]),
        "api": _service("api", publish=readers, subscribe=[S.EVENTS_SUBJECTS]),  # submits, stops, reads
        S.CONTROLLER_SERVICE: _service(
            S.CONTROLLER_SERVICE,
            publish=[_events(S.CONTROLLER_SERVICE), _policies(), _EXECUTOR_ALL, _AGENT_RPC, _SHARD_RPC,
                     _rpc(S.MONITOR_SERVICE), _rpc(S.JOB_SERVICE)],
            subscribe=[S.EVENTS_SUBJECTS]),
        "policies": _service("policies", publish=[], subscribe=[S.policy_decide(p) for p in S.POLICY_BUILTINS],
                             js=False),
        S.BRAIN_SERVICE: _service(
            S.BRAIN_SERVICE,
            publish=[_events(S.BRAIN_SERVICE), S.events_of("job", kind=S.JobEventKind.PLAN),  # a re-plan
                     kv(S.BRAIN_BUCKET), kv(S.BRAIN_JOBS_BUCKET), _EXECUTOR_ALL,
                     _rpc(S.MONITOR_SERVICE), _rpc(S.JOB_SERVICE)],
            subscribe=[_rpc(S.BRAIN_SERVICE), S.EVENTS_SUBJECTS]),
        # An agent sidecar and the trainer processes of its pod (they share the pod's credentials).
        S.AGENT_SERVICE: Permissions(
            publish=(_events(S.AGENT_SERVICE), _AGENT_PROTOCOL, _AGENT_RPC, kv(S.AGENT_BUCKET), _SHARD_RPC,
                     S.health(S.AGENT_SERVICE), S.dead_letter(S.AGENT_SERVICE), JS_API, JS_ACK),
            subscribe=(_AGENT_PROTOCOL, _AGENT_RPC, S.health(S.AGENT_SERVICE), INBOX, S.EVENTS_SUBJECTS)),
        # The operator (CLI, `pacer up`'s printed URL, tests): everything.
        "admin": Permissions(publish=(">",), subscribe=(">",), allow_responses=False),
    }


ROLES: tuple[str, ...] = tuple(_table())
POLICY_ROLE_PREFIX = "policy:"


def policy_permissions(name: str) -> Permissions:
    """A custom policy ``name``: receives its own decide subject, answers it, nothing else."""
    return Permissions(publish=(), subscribe=(S.policy_decide(name), INBOX))


def permissions(role: str) -> Permissions:
    """Publish/subscribe allow lists of ``role``: a name in :data:`ROLES` or ``policy:<name>``."""
    if role.startswith(POLICY_ROLE_PREFIX):
        return policy_permissions(role[len(POLICY_ROLE_PREFIX):])
    table = _table()
    if role not in table:
        raise ValidationError(f"no NATS role {role!r}: one of {', '.join(ROLES)} or policy:<name>")
    return table[role]


def render_authorization(users: Mapping[str, tuple[str, str]]) -> str:
    """``authorization { users = [...] }`` for ``users``: user name -> (password, role).

    Values are JSON strings, which the nats-server config syntax reads as
    quoted strings, so a subject such as ``$JS.API.>`` is never taken for a
    variable.
    """
    lines = ["authorization {", "  users = ["]
    for user, (password, role) in sorted(users.items()):
        perms = json.dumps(permissions(role).to_conf())
        lines.append(f"    {{user: {json.dumps(user)}, password: {json.dumps(password)}, permissions: {perms}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def with_credentials(url: str, user: str, password: str) -> str:
    """``nats://host:port`` -> ``nats://user:password@host:port`` (what a child process is given)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def connect_options(url: str, environ: Mapping[str, str]) -> dict[str, object]:
    """The nats-py ``connect`` options the settings ask for (read by ``Bus.connect``).

    * ``PACER_NATS_USER`` / ``PACER_NATS_PASSWORD``: user and password,
      unless ``url`` carries its own (``nats://user:pass@host:port`` wins:
      it is how the executor hands pods their credentials);
    * ``PACER_NATS_CREDS``: a NATS ``.creds`` file (JWT and nkey seed);
    * ``PACER_NATS_CA``: a CA bundle: the connection uses TLS and checks the
      server's certificate against it.
    """
    out: dict[str, object] = {}
    if not urlsplit(url).username:
        user, password = environ.get("PACER_NATS_USER", ""), environ.get("PACER_NATS_PASSWORD", "")
        if user:
            out["user"], out["password"] = user, password
    creds = environ.get("PACER_NATS_CREDS", "")
    if creds:
        out["user_credentials"] = creds
    ca = environ.get("PACER_NATS_CA", "")
    if ca:
        import ssl

        out["tls"] = ssl.create_default_context(cafile=ca)
    return out
