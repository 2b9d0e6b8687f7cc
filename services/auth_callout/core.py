"""The decision of the auth callout: a server's authorization request in, a signed answer out.

Pure: the request JWT, the keys and ``now`` in; the response JWT out (no
IO, no clock).  nats-server sends, for every connection whose user is not
one of the static users (``auth_users``), an ``authorization_request`` JWT
signed by the server naming the user's connect options and a user nkey the
server made for this connection.  The answer is an
``authorization_response`` JWT for that nkey and server, signed by the
issuer account, carrying either a user JWT (the permissions) or an error:

* user ``agent-<job>`` with a password :func:`pacer.authjwt.agent_token` of
  that job that has not expired, whose incarnation is the job's record's and
  whose job has not ended and been torn down: a user JWT with
  :func:`pacer.security.agent_job_permissions` (the job's agent, shard-rpc
  and checkpoint subjects only, its own reply inbox, replies through
  ``resp``), placed in the global account;
* anything else: an error, so the server refuses the connection
  (``Authorization Violation`` to the client).

A request that is not a valid server-signed JWT gets no answer at all:
there is no user nkey and server id to address one to; the server times
the connection out.

Two steps, so the shell can look the job up in between (:func:`check`, then
:func:`conclude` with the job's :class:`JobView`): only a token whose MAC and
expiry are right costs a lookup, so made-up passwords never reach the job
records.  :func:`decide` does both with a synchronous lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pacer import authjwt, security
from pacer.errors import ValidationError

AGENT_PREFIX = security.agent_user("")  # "agent-"


@dataclass(frozen=True, slots=True)
class CalloutKeys:
    """What the responder holds: the issuer account's key pair and the agents' token secret."""

    issuer: authjwt.KeyPair
    agent_secret: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to send (``response``: a JWT, or None for no answer), and what it was for metrics."""

    response: str | None
    outcome: str  # admitted | refused | malformed
    user: str = ""
    reason: str = ""


def _user_claims(user_nkey: str, name: str, perms: security.Permissions) -> dict[str, Any]:
    nats: dict[str, Any] = {
        "pub": {"allow": list(perms.publish)},
        "sub": {"allow": list(perms.subscribe)},
        "subs": -1, "data": -1, "payload": -1,  # no limits beyond the server's own
        "type": "user", "version": 2,
    }
    if perms.allow_responses:
        nats["resp"] = {"max": 1, "ttl": 0}  # as allow_responses: true (one reply, the server's default TTL)
    return {"sub": user_nkey, "aud": authjwt.GLOBAL_ACCOUNT, "name": name, "nats": nats}


@dataclass(frozen=True, slots=True)
class JobView:
    """What the callout needs of a job's record: its incarnation and whether it has ended."""

    incarnation: str
    ended: bool  # in a terminal state and torn down (every pod gone): nothing of the job may still connect


@dataclass(frozen=True, slots=True)
class Pending:
    """A request whose token is right for its job, pending the job's record (:func:`conclude`)."""

    user_nkey: str
    server_id: str
    user: str
    job: str
    token: authjwt.AgentToken
    perms: security.Permissions


def _answer(keys: CalloutKeys, now: int, user_nkey: str, server_id: str, nats: dict[str, Any]) -> str:
    body = {"sub": user_nkey, "aud": server_id, "nats": {**nats, "type": "authorization_response", "version": 2}}
    return authjwt.encode_jwt(body, keys.issuer, now)


def _refuse(keys: CalloutKeys, now: int, user_nkey: str, server_id: str, user: str, why: str) -> Verdict:
    return Verdict(_answer(keys, now, user_nkey, server_id, {"error": f"user {user!r} refused: {why}"}),
                   "refused", user, why)


def check(request_jwt: str, keys: CalloutKeys, now: int) -> Verdict | Pending:
    """The answer to a request, or :class:`Pending` if it names a job's agent with a valid, unexpired token."""
    try:
        claims = authjwt.decode_jwt(request_jwt, authjwt.PREFIX_SERVER)
        req = claims["nats"]
        if req.get("type") != "authorization_request":
            raise ValidationError(f"not an authorization request: {req.get('type')!r}")
        user_nkey = str(req["user_nkey"])
        authjwt.decode_public(user_nkey, authjwt.PREFIX_USER)
        server_id = str(req["server_id"]["id"])
        authjwt.decode_public(server_id, authjwt.PREFIX_SERVER)
        opts = req.get("connect_opts") or {}
    except (ValidationError, KeyError, TypeError, AttributeError) as exc:
        return Verdict(None, "malformed", reason=str(exc))
    user, token = str(opts.get("user") or ""), str(opts.get("pass") or "")
    job = user[len(AGENT_PREFIX):] if user.startswith(AGENT_PREFIX) else ""
    try:
        perms = security.agent_job_permissions(job, authjwt.token_stream(token)) if job else None
    except ValidationError:  # a malformed job, or a reserved or malformed stream name
        perms = None
    if perms is None:
        return _refuse(keys, now, user_nkey, server_id, user, "not a job's agent user")
    parsed = authjwt.parse_token(token)
    if parsed is None or not authjwt.token_mac_ok(keys.agent_secret, job, token):
        return _refuse(keys, now, user_nkey, server_id, user, "wrong token")
    if parsed.expires <= now:
        return _refuse(keys, now, user_nkey, server_id, user, "token expired")
    return Pending(user_nkey, server_id, user, job, parsed, perms)


def refuse(p: Pending, keys: CalloutKeys, now: int, why: str) -> Verdict:
    """Refuse ``p`` for a reason of the shell's (its job's record could not be read)."""
    return _refuse(keys, now, p.user_nkey, p.server_id, p.user, why)


def conclude(p: Pending, keys: CalloutKeys, now: int, job: JobView | None) -> Verdict:
    """Admit ``p`` if its job exists, is the token's incarnation and has not ended (``None``: no record)."""
    if job is None:
        return _refuse(keys, now, p.user_nkey, p.server_id, p.user, "no such job")
    if job.incarnation != p.token.incarnation:
        return _refuse(keys, now, p.user_nkey, p.server_id, p.user, "token of an earlier job of that name")
    if job.ended:
        return _refuse(keys, now, p.user_nkey, p.server_id, p.user, "job has ended")
    user_jwt = authjwt.encode_jwt(_user_claims(p.user_nkey, p.user, p.perms), keys.issuer, now)
    return Verdict(_answer(keys, now, p.user_nkey, p.server_id, {"jwt": user_jwt}), "admitted", p.user)


def decide(request_jwt: str, keys: CalloutKeys, now: int,
           lookup: Callable[[str], JobView | None] = lambda job: None) -> Verdict:
    """The answer to one authorization request, ``lookup`` giving a job's view (None: no such job)."""
    step = check(request_jwt, keys, now)
    return step if isinstance(step, Verdict) else conclude(step, keys, now, lookup(step.job))
