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
* agents (and the trainers beside them) only their own job's agent
  subjects, the shard-rpc ops a pod needs (:data:`pacer.subjects.ShardOp.POD`:
  no dataset registration) and the direct get of their own key in the
  agents' KV bucket; they cannot command executors, publish node, job,
  controller or brain events, or use any other JetStream API.  There is no
  static agent user: every pod gets a per-job user (``agent-<job>``,
  :func:`agent_job_permissions`) admitted by the auth callout
  (:mod:`pacer.authjwt`), so no credential a pod holds reaches another job.

Replies reach a requester through ``allow_responses``: a service may answer
a request it received, never publish into an arbitrary inbox.  Each user
reads replies only in an inbox of its own: ``Bus.connect`` gives the client
the inbox prefix :func:`inbox_prefix` of its user (``_INBOX_<user>``), and a
user may subscribe to that prefix only, never to ``_INBOX.>``, so nobody can
read replies meant for another.  JetStream's API (``$JS.API.>``) is granted
to the services that own streams, consumers and KV buckets; acks
(``$JS.ACK.>``) to those that consume.

Where a client finds its credentials (:func:`connect_options`), first match
wins: credentials in the URL, then ``PACER_NATS_USER``/``_PASSWORD`` (or
``PACER_NATS_CREDS``), then the context file that ``pacer up`` writes
(:func:`load_context`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from pacer import subjects as S
from pacer.errors import ValidationError

INBOX_PREFIX = "_INBOX_"  # + the user's name: see inbox_prefix
JS_API = "$JS.API.>"
JS_ACK = "$JS.ACK.>"


def kv(bucket: str) -> str:
    """The subjects of a JetStream KV bucket (``$KV.<bucket>.>``): puts and deletes go there."""
    return f"$KV.{bucket}.>"


def object_store(bucket: str) -> str:
    """The subjects of a JetStream object store (``$O.<bucket>.>``): its chunks and meta entries."""
    return f"$O.{bucket}.>"


def inbox_prefix(user: str) -> str:
    """The reply inbox prefix of ``user``: ``_INBOX_<user>`` (nats-py ``connect(inbox_prefix=...)``).

    One subject token per user, so ``_INBOX_<user>.>`` never covers another
    user's inboxes (``_INBOX_agent.>`` does not match ``_INBOX_agent-j1.x``).
    A name that is not a safe token (dots, wildcards, spaces) is replaced by
    a digest of it.
    """
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", user):
        return INBOX_PREFIX + user
    return INBOX_PREFIX + "h" + hashlib.sha256(user.encode()).hexdigest()[:24]


def own_inbox(user: str) -> str:
    """What ``user`` may subscribe to for its replies: ``_INBOX_<user>.>``."""
    return f"{inbox_prefix(user)}.>"


def _rpc(service: str, op: str = "*") -> str:
    return f"{S.PREFIX}.rpc.{service}.*.{op}"


AUTH_SERVICE = "auth"  # the auth callout responder's user and service name
AUTH_CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"  # where nats-server asks it (auth_callout)


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
    sub = [*subscribe, S.health(name), own_inbox(name)]
    if js:
        pub += [JS_API, JS_ACK]
    return Permissions(publish=tuple(pub), subscribe=tuple(sub))


# The executor's "commands" are every op but the read-only ones.
_EXECUTOR_READS = [_rpc(S.EXECUTOR_SERVICE, S.ExecutorOp.STATUS), _rpc(S.EXECUTOR_SERVICE, S.ExecutorOp.LOGS)]
_EXECUTOR_ALL = f"{S.PREFIX}.rpc.{S.EXECUTOR_SERVICE}.>"
# Two instances of a service share its jobs by leases (pacer.ownership): the leases and the owners'
# fenced state live in one KV bucket; a request that reached the non-owner is forwarded to the owner.
_LEASES = kv(S.LEASE_BUCKET)
_AGENT_RPC = f"{S.PREFIX}.rpc.{S.AGENT_SERVICE}.>"  # global actions and node commands
_SHARD_RPC = _rpc(S.SHARD_SERVICE)


def _table() -> dict[str, Permissions]:
    readers = [*_EXECUTOR_READS, _rpc(S.JOB_SERVICE), _rpc(S.MONITOR_SERVICE), _rpc(S.BRAIN_SERVICE),
               _SHARD_RPC]
    return {
        S.SHARD_SERVICE: _service(
            S.SHARD_SERVICE,
            publish=[S.SHARD_LOG_SUBJECTS, _events("shard"), kv(S.SNAPSHOT_BUCKET),
                     object_store(S.SNAPSHOT_BUCKET), _LEASES, S.ownership_forward(S.SHARD_SERVICE)],
            subscribe=[_SHARD_RPC, S.EVENTS_SUBJECTS, S.ownership_forward(S.SHARD_SERVICE)]),
        S.MONITOR_SERVICE: _service(
            S.MONITOR_SERVICE,
            publish=[_events(S.MONITOR_SERVICE), _LEASES, S.ownership_forward(S.MONITOR_SERVICE)],
            subscribe=[_rpc(S.MONITOR_SERVICE), S.EVENTS_SUBJECTS, S.ownership_forward(S.MONITOR_SERVICE)]),
        S.JOB_SERVICE: _service(
            S.JOB_SERVICE,
            publish=[_events("job"), kv(S.JOB_BUCKET), _EXECUTOR_ALL, _rpc(S.BRAIN_SERVICE), _SHARD_RPC,
                     _rpc(S.MONITOR_SERVICE), _LEASES],  # a submission holds its name's lease (no forwarding)
            subscribe=[_rpc(S.JOB_SERVICE), S.EVENTS_SUBJECTS]),
        S.EXECUTOR_SERVICE: _service(
            S.EXECUTOR_SERVICE,
            publish=[_events("node"), _events(S.EXECUTOR_SERVICE), _events("cluster"), kv(S.EXECUTOR_BUCKET),
                     _AGENT_RPC, _SHARD_RPC, _rpc(S.JOB_SERVICE), _LEASES, S.ownership_forward(S.EXECUTOR_SERVICE)],
            subscribe=[_rpc(S.EXECUTOR_SERVICE), S.EVENTS_SUBJECTS, S.ownership_forward(S.EXECUTOR_SERVICE)]),
        # submits, stops, reads; its audit log
        "api": _service("api", publish=[*readers, _events("api")], subscribe=[S.EVENTS_SUBJECTS]),
        S.CONTROLLER_SERVICE: _service(
            S.CONTROLLER_SERVICE,
            publish=[_events(S.CONTROLLER_SERVICE), _policies(), _EXECUTOR_ALL, _AGENT_RPC, _SHARD_RPC,
                     _rpc(S.MONITOR_SERVICE), _rpc(S.JOB_SERVICE), _LEASES],
            subscribe=[S.EVENTS_SUBJECTS]),
        "policies": _service("policies", publish=[], subscribe=[S.policy_decide(p) for p in S.POLICY_BUILTINS],
                             js=False),
        S.BRAIN_SERVICE: _service(
            S.BRAIN_SERVICE,
            publish=[_events(S.BRAIN_SERVICE), S.events_of("job", kind=S.JobEventKind.PLAN),  # a re-plan
                     kv(S.BRAIN_BUCKET), kv(S.BRAIN_JOBS_BUCKET), _EXECUTOR_ALL,
                     _rpc(S.MONITOR_SERVICE), _rpc(S.JOB_SERVICE), _LEASES, S.ownership_forward(S.BRAIN_SERVICE)],
            subscribe=[_rpc(S.BRAIN_SERVICE), S.EVENTS_SUBJECTS, S.ownership_forward(S.BRAIN_SERVICE)]),
        # The auth callout responder (pacer.authjwt): the server's authorization requests, answered by reply.
        # Its only JetStream call: a stream-message get in the job bucket, the record of the job an agent
        # token names (is the job that incarnation, and still on?); no other API, no writes.
        AUTH_SERVICE: _service(AUTH_SERVICE, publish=[f"$JS.API.STREAM.MSG.GET.KV_{S.JOB_BUCKET}"],
                               subscribe=[AUTH_CALLOUT_SUBJECT], js=False),
        # The Kubernetes operator (services/operator): submits, reads and stops jobs, and hears the job events
        # (a plain subscription, its cue to read a record again).  Not list: it reads only the jobs of its
        # resources.  No JetStream, no executor, no other service's requests.
        S.OPERATOR_SERVICE: _service(
            S.OPERATOR_SERVICE,
            publish=[_rpc(S.JOB_SERVICE, op) for op in (S.JobOp.SUBMIT, S.JobOp.GET, S.JobOp.STOP)],
            subscribe=[_events("job")], js=False),
        # A person operating the stack (CLI, `pacer up`'s printed URL, tests): everything.
        "admin": Permissions(publish=(">",), subscribe=(">",), allow_responses=False),
    }


ROLES: tuple[str, ...] = tuple(_table())
POLICY_ROLE_PREFIX = "policy:"


def policy_user(name: str) -> str:
    """The NATS user of custom policy ``name``: ``policy-<name>``."""
    return f"policy-{name}"


def policy_permissions(name: str) -> Permissions:
    """A custom policy ``name``: receives its own decide subject, answers it, nothing else."""
    return Permissions(publish=(), subscribe=(S.policy_decide(name), own_inbox(policy_user(name))))


def agent_user(job: str) -> str:
    """The per-job agent user of ``job``: ``agent-<job>`` (never a static user's name)."""
    return f"{S.AGENT_SERVICE}-{job}"


#: Streams a job may never read: Pacer's own (its shard log, events, KV buckets and object stores).
RESERVED_STREAM_PREFIXES = ("KV_", "OBJ_", "PACER")


def check_data_stream(name: str) -> str:
    """``name`` if a job may train on that stream: 1-64 of ``[A-Za-z0-9_-]`` (it travels in a pod's
    password and permissions) and not one of Pacer's own (:data:`RESERVED_STREAM_PREFIXES`, any case):
    a pod reads its stream by direct gets, and the streams of the control plane hold other jobs' records."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValidationError(f"stream name {name!r}: a data stream's name is 1-64 of [A-Za-z0-9_-]")
    if name.upper().startswith(RESERVED_STREAM_PREFIXES):
        raise ValidationError(f"stream {name!r} is one of Pacer's own (names starting with "
                              f"{', '.join(RESERVED_STREAM_PREFIXES)} are reserved): it cannot be a dataset")
    return name


def stream_read_permissions(stream: str) -> tuple[str, ...]:
    """What reading one data stream takes (:mod:`pacer.data.stream`): its info and batched direct gets,
    both read-only; no consumer can be made, so the server delivers nothing anywhere on a pod's behalf."""
    stream = check_data_stream(stream)
    return (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}")


def agent_job_permissions(job: str, stream: str = "") -> Permissions:
    """The agents and trainers of one job: that job's subjects, and only what a pod needs of them.

    What an agent does (pacer.agent.agent): heartbeats, metrics and action
    results under ``pacer.events.agent.<job>.*``; the two-phase barrier
    ``pacer.agent.<job>.*``; global actions and node commands under
    ``pacer.rpc.agent.<job>.>``; the election key ``<job>.primary`` of the
    agents' KV bucket, written by publishing to its subject and read by a
    direct get whose subject names the key (``$JS.API.DIRECT.GET.<stream>.<key>``:
    the key is in the subject, so the permission is per job; a message get,
    whose subject travels in the payload, is not granted).  What a trainer
    does: the shard ops of :data:`pacer.subjects.ShardOp.POD` under
    ``pacer.rpc.shard.<job>.<op>`` (never ``register``).  It reads the events
    of its own job only.  No other JetStream API: the agents' bucket is made
    by the executor before any pod starts (:func:`pacer.agent.bucket.ensure`).  A streaming job's
    pods (``stream``) also read that one stream (:func:`stream_read_permissions`).
    """
    job = S._tok(job, "job")
    reads = stream_read_permissions(stream) if stream else ()
    kv_stream = f"KV_{S.AGENT_BUCKET}"
    key = f"$KV.{S.AGENT_BUCKET}.{S.agent_primary_key(job)}"
    return Permissions(
        publish=(S.events_of(S.AGENT_SERVICE, job=job), f"{S.PREFIX}.agent.{job}.*",
                 f"{S.PREFIX}.rpc.{S.AGENT_SERVICE}.{job}.>", *(S.rpc(S.SHARD_SERVICE, job, op) for op in S.ShardOp.POD),
                 key, f"$JS.API.DIRECT.GET.{kv_stream}.{key}", *reads),
        subscribe=(f"{S.PREFIX}.agent.{job}.*", f"{S.PREFIX}.rpc.{S.AGENT_SERVICE}.{job}.>",
                   S.events_of("*", job=job), S.health(S.AGENT_SERVICE), own_inbox(agent_user(job))))


def permissions(role: str, user: str = "") -> Permissions:
    """Publish/subscribe allow lists of ``role``: a name in :data:`ROLES` or ``policy:<name>``.

    ``user`` names the NATS user holding the role when it is not named after
    it (the stack names users after their roles): its own reply inbox
    replaces the role's.
    """
    if role.startswith(POLICY_ROLE_PREFIX):
        perms = policy_permissions(role[len(POLICY_ROLE_PREFIX):])
        default = policy_user(role[len(POLICY_ROLE_PREFIX):])
    else:
        table = _table()
        if role not in table:
            raise ValidationError(f"no NATS role {role!r}: one of {', '.join(ROLES)} or policy:<name>")
        perms, default = table[role], role
    if user and user != default:
        sub = tuple(own_inbox(user) if s == own_inbox(default) else s for s in perms.subscribe)
        perms = Permissions(perms.publish, sub, perms.allow_responses)
    return perms


@dataclass(frozen=True, slots=True)
class Callout:
    """The ``auth_callout`` of an authorization block: who signs the users it admits.

    ``issuer`` is the public nkey of the account (``A...``) whose seed the
    responder holds; every user of the block bypasses the callout
    (``auth_users``), every other connection is handed to the responder.
    """

    issuer: str


def render_authorization(users: Mapping[str, tuple[str, str]], callout: Callout | None = None) -> str:
    """``authorization { users = [...] }`` for ``users``: user name -> (password, role).

    Values are JSON strings, which the nats-server config syntax reads as
    quoted strings, so a subject such as ``$JS.API.>`` is never taken for a
    variable.  With ``callout``, connections of any other user go to the
    auth callout responder (:mod:`pacer.authjwt`).
    """
    lines = ["authorization {", "  users = ["]
    for user, (password, role) in sorted(users.items()):
        perms = json.dumps(permissions(role, user).to_conf())
        lines.append(f"    {{user: {json.dumps(user)}, password: {json.dumps(password)}, permissions: {perms}}}")
    lines.append("  ]")
    if callout is not None:
        lines += ["  auth_callout {", f"    issuer: {json.dumps(callout.issuer)}",
                  f"    auth_users: {json.dumps(sorted(users))}", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def with_credentials(url: str, user: str, password: str) -> str:
    """``nats://host:port`` -> ``nats://user:password@host:port`` (what a child process is given).

    A server list (``nats://a:1,nats://b:2``, a cluster) gets the credentials on every server.
    """
    if "," in url:
        return ",".join(with_credentials(u, user, password) for u in split_servers(url))
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


CONTEXT_ENV = "PACER_CONTEXT"
CONTEXT_FILE = Path(".pacer") / "context.json"  # `pacer up`'s default data dir, from where it was run


@dataclass(frozen=True, slots=True)
class Context:
    """Where and as whom the operator reaches a running stack (written by ``pacer up``, mode 0600)."""

    url: str
    user: str = ""
    password: str = ""
    ca: str = ""

    def servers(self) -> set[str]:
        return {_netloc(u) for u in split_servers(self.url)}


def write_context(path: Path, ctx: Context) -> Path:
    """Write ``ctx`` as JSON to ``path``, readable by its owner only (it holds a password)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": ctx.url, "user": ctx.user, "password": ctx.password, "ca": ctx.ca}, f, indent=2)
    path.chmod(0o600)  # also when it existed with wider rights
    return path


def load_context(environ: Mapping[str, str]) -> Context | None:
    """The context ``$PACER_CONTEXT`` names, else ``./.pacer/context.json``; None when there is none.

    A named file that cannot be read or parsed is an error (the operator
    asked for it); a missing default file is not.
    """
    named = environ.get(CONTEXT_ENV, "")
    path = Path(named) if named else CONTEXT_FILE
    if not named and not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValidationError(f"{CONTEXT_ENV}={path}: cannot read the context ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("url"), str):
        raise ValidationError(f"{path}: a context is a JSON object with at least a \"url\"")
    return Context(url=raw["url"], user=str(raw.get("user", "")), password=str(raw.get("password", "")),
                   ca=str(raw.get("ca", "")))


def default_url(environ: Mapping[str, str], fallback: str = "nats://127.0.0.1:4222") -> str:
    """``$PACER_NATS_URL``, else the context's URL, else ``fallback`` (what the CLI connects to)."""
    if environ.get("PACER_NATS_URL"):
        return environ["PACER_NATS_URL"]
    ctx = load_context(environ)
    return ctx.url if ctx is not None else fallback


def split_servers(url: str) -> list[str]:
    """``nats://a:1,nats://b:2`` -> the server URLs (a cluster's seeds); one URL -> itself."""
    return [u.strip() for u in url.split(",") if u.strip()]


def _netloc(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return f"{parts.hostname or ''}:{parts.port or 4222}"


def strip_userinfo(url: str) -> str:
    """``nats://user:pw@host:port`` -> ``nats://host:port``."""
    parts = urlsplit(url)
    if not parts.username and not parts.password:
        return url
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


# CA files of the servers this process itself started (an embedded Stack): server "host:port" -> CA.
# More specific than PACER_NATS_CA, which is one CA for every server: two TLS stacks in one
# process (tests) each keep their own.
_TRUSTED: dict[str, str] = {}


def trust(url: str, ca: str | None) -> None:
    """Verify the servers of ``url`` against ``ca`` in this process (``None``: forget them)."""
    for u in split_servers(url):
        if ca is None:
            _TRUSTED.pop(_netloc(u), None)
        else:
            _TRUSTED[_netloc(u)] = ca


def connect_options(url: str, environ: Mapping[str, str]) -> dict[str, object]:
    """The nats-py ``connect`` options the settings ask for (read by ``Bus.connect``).

    ``url`` may list several servers, comma-separated (``nats://a:1,nats://b:2``,
    a cluster): ``servers`` lists them without credentials and the
    credentials found go to every one of them.  First match wins:

    1. credentials in a URL (``nats://user:pass@host:port``);
    2. ``PACER_NATS_USER`` / ``PACER_NATS_PASSWORD``, or ``PACER_NATS_CREDS``
       (a NATS ``.creds`` file: JWT and nkey seed);
    3. the context file of ``pacer up`` (``$PACER_CONTEXT``, else
       ``./.pacer/context.json``), only when ``url`` names one of its servers.

    ``PACER_NATS_CA`` (else the context's CA) is a CA bundle: the connection
    uses TLS (when the server requires it) and checks the server's
    certificate against it; a CA registered with :func:`trust` for the
    server, by the process that started it, comes first.  The client's
    reply inboxes get the prefix of its user (:func:`inbox_prefix`), the
    only inboxes the server lets the user read.
    """
    servers = split_servers(url) or [url]
    out: dict[str, object] = {"servers": [strip_userinfo(u) for u in servers]}
    user = password = ""
    for u in servers:
        parts = urlsplit(u)
        if parts.username:
            user, password = unquote(parts.username), unquote(parts.password or "")
            break
    creds = environ.get("PACER_NATS_CREDS", "")
    ca = next((_TRUSTED[n] for n in map(_netloc, servers) if n in _TRUSTED), "") or environ.get("PACER_NATS_CA", "")
    if not user and not creds:
        user, password = environ.get("PACER_NATS_USER", ""), environ.get("PACER_NATS_PASSWORD", "")
    if (not user and not creds) or not ca:
        ctx = load_context(environ)
        if ctx is not None and {_netloc(u) for u in servers} & ctx.servers():
            if not user and not creds:
                user, password = ctx.user, ctx.password
            ca = ca or ctx.ca
    if user:
        out["user"], out["password"] = user, password
        out["inbox_prefix"] = inbox_prefix(user)
    if creds:
        out["user_credentials"] = creds
    if ca:
        import ssl

        out["tls"] = ssl.create_default_context(cafile=ca)
    return out
