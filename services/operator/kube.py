"""A small asyncio client of the Kubernetes API, for one namespaced custom resource (the operator's effects).

Why not a Kubernetes client library: the operator needs six calls on one
resource (list, watch, get, merge-patch of the object and of its status,
nothing else), and ``aiohttp`` is already a dependency of every service.
The official ``kubernetes`` client is synchronous (the executor runs it in
threads, one per blocking call; a watch would hold a thread for good),
``kubernetes_asyncio`` would be a second client of the same API, and kopf
brings its own reactor, storage of handler progress in annotations and
finalizer handling: the framework would own the loop this service's
runtime owns (``pacer.runtime``).  A client this size is also what the tests
can run against the fake API server (``tests/fake_k8s.py``) over real HTTP.

Where the API server is (:meth:`KubeConfig.from_env`): ``PACER_KUBE_HOST``
(a URL used without credentials: ``kubectl proxy``, the tests), else in a
pod the ``KUBERNETES_SERVICE_HOST``/``_PORT`` the kubelet sets, with the
ServiceAccount's token (re-read for every request: projected tokens are
rotated) and its CA.

Errors: an answer other than 2xx is a :class:`KubeError` with the status
code and the ``reason`` of the API's ``Status`` (``NotFound``, ``Conflict``,
``Expired``...); a connection that fails is a :class:`KubeError` with code 0.
Both are temporary for the caller but 404, 409, 410 and 422, which say
something about the object.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from pacer import k8s_crd
from pacer.errors import PacerError

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"


class KubeError(PacerError):
    """The API server refused a request or could not be reached (``status`` 0)."""

    code = "kubernetes"

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else message,
                         temporary=status == 0 or status == 429 or status >= 500)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KubeConfig:
    url: str
    token_file: Path | None = None  # None: no Authorization header
    ca_file: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KubeConfig:
        env = os.environ if env is None else env
        if env.get("PACER_KUBE_HOST"):
            return cls(env["PACER_KUBE_HOST"].rstrip("/"))
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("PACER_KUBE_HOST is unset and this is not a pod (no KUBERNETES_SERVICE_HOST): "
                             "outside a cluster run `kubectl proxy` and set PACER_KUBE_HOST=http://127.0.0.1:8001")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", SA_DIR / "token", SA_DIR / "ca.crt")


def own_namespace(default: str = "default") -> str:
    """The namespace of this pod's ServiceAccount, else ``default``."""
    path = SA_DIR / "namespace"
    try:
        return path.read_text().strip() or default
    except OSError:
        return default


class KubeClient:
    """The PacerJob endpoints of one API server.  Make it inside the event loop; :meth:`close` it."""

    def __init__(self, cfg: KubeConfig, request_timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        self.request_timeout_s = request_timeout_s
        ssl_ctx: ssl.SSLContext | bool = True
        if cfg.ca_file is not None:
            ssl_ctx = ssl.create_default_context(cafile=str(cfg.ca_file))
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx))

    async def close(self) -> None:
        await self.session.close()

    def _path(self, namespace: str, name: str = "", sub: str = "") -> str:
        path = f"{self.cfg.url}/apis/{k8s_crd.GROUP}/{k8s_crd.VERSION}/namespaces/{namespace}/{k8s_crd.PLURAL}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.cfg.token_file is not None:
            try:
                headers["Authorization"] = "Bearer " + self.cfg.token_file.read_text().strip()
            except OSError as exc:
                raise KubeError(0, "NoToken", f"cannot read the service account token: {exc}") from None
        return headers

    async def _call(self, method: str, url: str, body: Any = None, params: dict[str, str] | None = None,
                    content_type: str = "application/json") -> Any:
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        try:
            async with self.session.request(method, url, data=data, params=params, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise _error(resp.status, text)
                return json.loads(text) if text else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(0, "Unreachable", f"{method} {url}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # not JSON
            raise KubeError(0, "BadResponse", f"{method} {url}: not JSON ({exc})") from None

    async def list(self, namespace: str) -> tuple[list[dict[str, Any]], str]:
        """The namespace's PacerJobs and the list's resourceVersion (where a watch continues from)."""
        out = await self._call("GET", self._path(namespace))
        if not isinstance(out, dict) or not isinstance(out.get("items"), list):
            raise KubeError(0, "BadResponse", f"list of {namespace}: not a list")
        rv = str((out.get("metadata") or {}).get("resourceVersion", ""))
        return [i for i in out["items"] if isinstance(i, dict)], rv

    async def watch(self, namespace: str, resource_version: str, timeout_s: float) -> AsyncIterator[dict[str, Any]]:
        """The namespace's change events after ``resource_version`` (``{"type", "object"}``), until the server
        ends the watch (about ``timeout_s``).  An ``ERROR`` event (410 Expired: the version is too old) is
        raised as a :class:`KubeError`; the caller lists again."""
        params = {"watch": "true", "resourceVersion": resource_version, "timeoutSeconds": str(int(timeout_s)),
                  "allowWatchBookmarks": "true"}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout_s, sock_read=timeout_s + 30)
        try:
            async with self.session.get(self._path(namespace), params=params, headers=self._headers(),
                                        timeout=timeout) as resp:
                if resp.status >= 300:
                    raise _error(resp.status, await resp.text())
                buf = b""
                async for chunk in resp.content.iter_any():  # not readline: one object may be a MiB long
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield _event(line)
                if buf.strip():
                    yield _event(buf)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeError(0, "Unreachable", f"watch {namespace}: {type(exc).__name__}: {exc}") from None

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            out = await self._call("GET", self._path(namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return out if isinstance(out, dict) else None

    async def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the object (metadata: finalizers); with ``metadata.resourceVersion`` in it the
        server refuses (409) a change to an object that changed meanwhile."""
        out = await self._call("PATCH", self._path(namespace, name), patch, content_type=MERGE_PATCH)
        return out if isinstance(out, dict) else {}

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the status subresource (lists, e.g. conditions, are replaced whole)."""
        out = await self._call("PATCH", self._path(namespace, name, "status"), {"status": status},
                               content_type=MERGE_PATCH)
        return out if isinstance(out, dict) else {}


def _error(status: int, text: str) -> KubeError:
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        return KubeError(status, str(body.get("reason", "")), str(body.get("message", ""))[:500])
    return KubeError(status, "", text[:500])


def _event(line: bytes) -> dict[str, Any]:
    try:
        ev = json.loads(line)
    except ValueError:
        raise KubeError(0, "BadResponse", f"a watch event that is not JSON: {line[:200]!r}") from None
    if not isinstance(ev, dict):
        raise KubeError(0, "BadResponse", "a watch event that is not an object")
    if ev.get("type") == "ERROR":
        raw = ev.get("object")
        obj: dict[str, Any] = raw if isinstance(raw, dict) else {}
        raise KubeError(int(obj.get("code") or 0) or 500, str(obj.get("reason", "")), str(obj.get("message", "")))
    return ev
