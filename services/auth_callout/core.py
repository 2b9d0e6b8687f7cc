"""The decision of the auth callout: a server's authorization request in, a signed answer out.

Pure: the request JWT, the keys and ``now`` in; the response JWT out (no
IO, no clock).  nats-server sends, for every connection whose user is not
one of the static users (``auth_users``), an ``authorization_request`` JWT
signed by the server naming the user's connect options and a user nkey the
server made for this connection.  The answer is an
``authorization_response`` JWT for that nkey and server, signed by the
issuer account, carrying either a user JWT (the permissions) or an error:

* user ``agent-<job>`` with password :func:`pacer.authjwt.agent_token` of
  that job: a user JWT with :func:`pacer.security.agent_job_permissions`
  (the job's agent, shard-rpc and checkpoint subjects only, its own reply
  inbox, replies through ``resp``), placed in the global account;
* anything else: an error, so the server refuses the connection
  (``Authorization Violation`` to the client).

A request that is not a valid server-signed JWT gets no answer at all:
there is no user nkey and server id to address one to; the server times
the connection out.
"""

from __future__ import annotations

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


def decide(request_jwt: str, keys: CalloutKeys, now: int) -> Verdict:
    """The answer to one authorization request."""
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

    def answer(nats: dict[str, Any]) -> str:
        body = {"sub": user_nkey, "aud": server_id,
                "nats": {**nats, "type": "authorization_response", "version": 2}}
        return authjwt.encode_jwt(body, keys.issuer, now)

    job = user[len(AGENT_PREFIX):] if user.startswith(AGENT_PREFIX) else ""
    try:
        perms = security.agent_job_permissions(job, authjwt.token_stream(token)) if job else None
    except ValidationError:  # a malformed job, or a reserved or malformed stream name
        perms = None
    if perms is None or not authjwt.token_ok(keys.agent_secret, job, token):
        why = "wrong token" if perms is not None else "not a job's agent user"
        return Verdict(answer({"error": f"user {user!r} refused: {why}"}), "refused", user, why)
    user_jwt = authjwt.encode_jwt(_user_claims(user_nkey, user, perms), keys.issuer, now)
    return Verdict(answer({"jwt": user_jwt}), "admitted", user)
