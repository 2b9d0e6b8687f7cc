"""The CLI's client of the HTTP API: what ``pacer submit/jobs/job/logs/stop`` use with ``--api``.

A team's user then needs only an API token (its role and namespaces, :mod:`pacer_services.api.identity`)
and a route to the API, no NATS credentials and no route to NATS.  The token is read from
``$PACER_API_TOKEN`` or from the file ``$PACER_API_TOKEN_FILE`` names (its first line), never from the
command line, where ``ps`` shows it to every local user.  ``$PACER_API_CA`` names the CA bundle of an
HTTPS API with a private CA.

The methods mirror :class:`pacer.jobs.client.JobClient` (the commands run one body over either), and
an error reply becomes the same :class:`~pacer.errors.PacerError` class the bus client raises
(``{"error": {"code", "message"}}``; 503 is temporary), so exit codes do not depend on the way in.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
from pacer.codec import from_dict
from pacer.contracts.executor import ExecutorStatus, LogsReply
from pacer.contracts.jobs import JobList, JobRecord, JobState
from pacer.contracts.monitor import JobStatistics
from pacer.errors import PacerError, ValidationError, remote_error

T = TypeVar("T")

API_URL_ENV = "PACER_API_URL"
API_TOKEN_ENV = "PACER_API_TOKEN"
API_TOKEN_FILE_ENV = "PACER_API_TOKEN_FILE"
API_CA_ENV = "PACER_API_CA"
PREFIX = "/api/v1"


def api_token(environ: Mapping[str, str]) -> str:
    """The bearer token: ``$PACER_API_TOKEN``, else the first line of ``$PACER_API_TOKEN_FILE``."""
    if environ.get(API_TOKEN_ENV):
        return environ[API_TOKEN_ENV].strip()
    path = environ.get(API_TOKEN_FILE_ENV, "")
    if not path:
        raise ValidationError(f"--api needs a token: set {API_TOKEN_ENV}, or {API_TOKEN_FILE_ENV} to a file "
                              "holding it (a token is never taken from the command line)")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"{API_TOKEN_FILE_ENV}={path}: cannot read the token ({exc})") from None
    if not lines or not lines[0].strip():
        raise ValidationError(f"{API_TOKEN_FILE_ENV}={path}: the file is empty")
    return lines[0].strip()


class ApiClient:
    """Requests to the HTTP API with a bearer token; one ``aiohttp`` session, closed by :meth:`close`."""

    def __init__(self, url: str, token: str, timeout: float = 30.0, ca_file: str = "") -> None:
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValidationError(f"--api {url!r}: expected an http:// or https:// URL")
        ssl_ctx: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout), connector=aiohttp.TCPConnector(ssl=ssl_ctx))

    @classmethod
    def from_env(cls, url: str, environ: Mapping[str, str] = os.environ) -> ApiClient:
        return cls(url, api_token(environ), ca_file=environ.get(API_CA_ENV, ""))

    async def close(self) -> None:
        await self.session.close()

    async def _call(self, method: str, path: str, params: Mapping[str, str] | None = None,
                    body: Any = None) -> Any:
        kw: dict[str, Any] = {"params": dict(params or {})}
        if body is not None:  # a mutating route wants a JSON body (the API answers 415 otherwise)
            kw["data"] = json.dumps(body)
            kw["headers"] = {"Content-Type": "application/json"}
        try:
            async with self.session.request(method, f"{self.url}{PREFIX}{path}", **kw) as resp:
                text = await resp.text()
                status = resp.status
        except aiohttp.ClientError as exc:
            raise remote_error("unavailable", f"cannot reach the API at {self.url} ({type(exc).__name__}: "
                               f"{exc})", True) from None
        except TimeoutError:
            raise remote_error("unavailable", f"the API at {self.url} did not answer in time", True) from None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        if status >= 400:
            err = data.get("error") if isinstance(data, dict) else None
            if not isinstance(err, dict):
                raise remote_error("unavailable" if status >= 502 else "internal",
                                   f"HTTP {status} from {self.url}: {text[:200]}", status >= 502)
            raise remote_error(str(err.get("code", "internal")), str(err.get("message", "")), status == 503)
        return data

    def _decode(self, cls: type[T], data: Any) -> T:
        try:
            return from_dict(cls, data)
        except PacerError as exc:
            raise remote_error("bad_message", f"the API's reply is not a {cls.__name__}: {exc.message}",
                               False) from None

    # -------------------------------------------------- JobClient's methods

    async def submit(self, name: str, spec_text: str, namespace: str = "") -> JobRecord:
        """``POST /jobs`` with the spec text; ``namespace`` empty: the API's choice (the caller's only one)."""
        params = {"namespace": namespace} if namespace else {}
        return self._decode(JobRecord, await self._call("POST", "/jobs", params, {"spec": spec_text}))

    async def get(self, job: str) -> JobRecord:
        return (await self.view(job))[0]

    async def list(self, limit: int = 100, state: JobState | None = None) -> JobList:
        params = {"limit": str(limit), **({"state": state.value} if state else {})}
        return self._decode(JobList, await self._call("GET", "/jobs", params))

    async def stop(self, job: str, reason: str = "stopped by the user") -> JobRecord:
        return self._decode(JobRecord, await self._call("POST", f"/jobs/{quote(job, safe='')}/stop",
                                                        body={"reason": reason}))

    async def logs(self, job: str, node: str, tail: int = 200, container: str = "trainer") -> LogsReply:
        params = {"node": node, "tail": str(tail), "container": container}
        return self._decode(LogsReply, await self._call("GET", f"/jobs/{quote(job, safe='')}/logs", params))

    async def view(self, job: str) -> tuple[JobRecord, ExecutorStatus | None, JobStatistics | None, dict[str, str]]:
        """``GET /jobs/{job}``: the record, the executor's and the monitor's parts (None when that service
        did not answer) and why each missing part is missing."""
        data = await self._call("GET", f"/jobs/{quote(job, safe='')}")
        if not isinstance(data, dict):
            raise remote_error("bad_message", "the API's job reply is not a JSON object", False)
        nodes = self._decode(ExecutorStatus, data["nodes"]) if data.get("nodes") else None
        stats = self._decode(JobStatistics, data["statistics"]) if data.get("statistics") else None
        missing = data.get("unavailable") or {}
        return (self._decode(JobRecord, data.get("job")), nodes, stats,
                {str(k): str(v) for k, v in missing.items()} if isinstance(missing, dict) else {})
