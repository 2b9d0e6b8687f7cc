"""Who may call the API and what they did: the bearer-token check and the audit log, as middlewares.

:class:`Access` holds the API's identities (:mod:`.identity`: its own tokens, and an OIDC issuer's
JWTs through :mod:`.oidc`).  ``auth`` puts the caller on the request (:data:`IDENTITY`); handlers ask
:func:`caller` and :func:`visible`.  ``audit`` records every mutating request, refused or not, as an
:class:`~pacer.contracts.jobs.AuditRecord` on ``pacer.events.api.<job>.audit`` and a log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.errors
from aiohttp import web
from pacer import codec, redact, subjects
from pacer.bus import Bus
from pacer.contracts.jobs import AuditRecord, JobRecord
from pacer.errors import NotFound, PacerError
from pacer.ids import is_token
from pacer.telemetry import Counters
from pacer_services.api import identity, oidc, openapi

log = logging.getLogger("pacer.api")

#: API paths without the token: they hold no job data.
OPEN_PATHS = frozenset({f"{openapi.API}/openapi.json"})

#: Methods that change something: their body must be JSON (the API's ``_json_only``) and are audited.
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})

#: The query parameter of RFC 6750 §2.3, refused on every route: a token in a URL leaks into logs.
TOKEN_QUERY = "access_token"

#: Request keys: the caller (set by :meth:`Access.auth`), and what a handler learnt for the audit record.
IDENTITY = web.RequestKey("identity", identity.Identity)
AUDIT_JOB = web.RequestKey("audit_job", str)
AUDIT_NAMESPACE = web.RequestKey("audit_namespace", str)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": redact.text(message)}}


class Access:
    """The API's callers: ``auth`` and ``audit`` middlewares over its identities."""

    def __init__(self, bus: Bus, counters: Counters, token: str, tokens_file: str,
                 oidc_cfg: oidc.OidcConfig | None) -> None:
        tokens = identity.load_tokens_file(Path(tokens_file)) if tokens_file else None
        self._ids = identity.identities(token, tokens, others=oidc_cfg is not None)
        self._oidc = oidc.OidcVerifier(oidc_cfg) if oidc_cfg is not None else None
        self.bus = bus
        self.counters = counters

    @web.middleware
    async def auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every ``/api/`` request carries ``Authorization: Bearer <token>`` (401 otherwise).

        A token in the URL (``?access_token=``, RFC 6750 §2.3) is refused
        whatever the header says: URLs are written to access logs, proxies
        and browser history, so a client that puts one there must be told,
        not served.  The dashboard's static files and ``/healthz`` (the
        readiness probe; it reveals no job) are open.
        """
        if not request.path.startswith("/api/"):
            return await handler(request)
        if TOKEN_QUERY in request.query:
            self.counters.inc("errors", code="unauthorized")
            return web.json_response(
                error_body("unauthorized", f"?{TOKEN_QUERY}= is refused: a token in a URL leaks into logs; "
                                           "send Authorization: Bearer <token>"),
                status=401, headers={"WWW-Authenticate": 'Bearer realm="pacer"'})
        if request.path in OPEN_PATHS:
            return await handler(request)
        given = ""
        scheme, _, cred = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given = cred.strip()
        who = self._ids.find(given)  # by the token's hash: no early exit on a matching prefix
        message = "missing bearer token" if not given else "wrong bearer token"
        if who is None and self._oidc is not None and oidc.looks_like_jwt(given):
            try:
                who = await self._oidc.identify(given)
            except oidc.TokenRefused as exc:
                message = f"token refused: {exc}"
        if who is None:
            self.counters.inc("errors", code="unauthorized")
            return web.json_response(error_body("unauthorized", f"{message}: send Authorization: Bearer <token>"),
                                     status=401, headers={"WWW-Authenticate": 'Bearer realm="pacer"'})
        request[IDENTITY] = who
        return await handler(request)

    @web.middleware
    async def audit(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every mutating ``/api/`` request, refused or not: an AuditRecord event and a log line (who,
        what, from where, outcome).  Outside ``auth`` and the API's error boundary: refused callers and failed
        requests are audited too."""
        if request.method not in MUTATING or not request.path.startswith("/api/"):
            return await handler(request)
        resp = await handler(request)
        who: identity.Identity | None = request.get(IDENTITY)
        outcome = "ok" if resp.status < 400 else error_code(resp)
        job = request.get(AUDIT_JOB) or request.match_info.get("job", "")
        record = AuditRecord(
            ts=time.time(), who=who.name if who else "", role=who.role.label if who else "",
            action=f"{request.method} {route_label(request) or request.path}"[:200],
            job=job if is_token(job) else "", namespace=request.get(AUDIT_NAMESPACE, ""),
            remote=request.remote or "", status=resp.status, outcome=outcome)
        log.info("audit", extra={"fields": codec.to_dict(record)})
        self.counters.inc("audited", outcome=outcome)
        try:
            await self.bus.publish_durable(subjects.api_audit(record.job), record)
        except (PacerError, nats.errors.Error) as exc:  # the log line above stays; the request is answered
            self.counters.inc("audit_lost")
            log.error("audit event not stored: %s", exc)
        return resp

    async def close(self) -> None:
        if self._oidc is not None:
            await self._oidc.close()


def caller(request: web.Request) -> identity.Identity:
    return request[IDENTITY]  # set by Access.auth for every /api/ route that needs a token


def visible(request: web.Request, record: JobRecord) -> JobRecord:
    """``record`` if the caller's namespaces hold it; else not_found with the job service's own words."""
    if not caller(request).sees(record.namespace):
        raise NotFound(f"no job named {record.job!r}")
    return record


def error_code(resp: web.StreamResponse) -> str:
    """The ``error.code`` of a JSON error response, else ``http_<status>``."""
    body = getattr(resp, "body", None)
    if isinstance(body, bytes | bytearray):
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
            code = json.loads(body)["error"]["code"]
            if isinstance(code, str):
                return code[:40]
    return f"http_{resp.status}"


def route_label(request: web.Request) -> str:
    """The matched route's template (``/api/v1/jobs/{job}``), "" when none matched (a 404)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else ""


