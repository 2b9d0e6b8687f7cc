"""A small in-process fake of the Kubernetes REST endpoints the pod-executor uses.

No Kubernetes API server can run on the development machine (docs/design.md), so
:mod:`pacer_services.pod_executor.backends.kubernetes` is tested against this fake over
real HTTP, with the official ``kubernetes`` client.  It implements only:

* ``POST/GET /api/v1/namespaces/{ns}/pods`` (list with ``labelSelector``;
  ``watch=true`` streams newline-delimited JSON events with resourceVersions,
  replays history after a given ``resourceVersion``, ends after
  ``timeoutSeconds``, answers a compacted version with a 410 ``ERROR`` event),
* ``GET/DELETE /api/v1/namespaces/{ns}/pods/{name}`` and ``.../log``,
* ``PATCH /api/v1/namespaces/{ns}/pods/{name}/resize`` (in-place pod
  vertical scaling, Kubernetes >= 1.33): a strategic merge patch of
  ``spec.containers[].resources`` (cpu and memory only) is merged into the
  container of the same name, and into its status if it is running, as if
  a kubelet applied it at once (:meth:`FakeK8s.set_running` fills
  ``containerStatuses[].resources`` as a 1.33 kubelet does).  Anything else
  in the patch, or a memory limit lowered under a ``NotRequired`` resize
  policy (1.33 refuses that), is a 422; another patch type is a 415.
  :attr:`FakeK8s.kubelet_resizes` off leaves the statuses alone (a pending
  resize, though without the ``PodResizePending`` condition);
  ``"pods/resize"`` in :attr:`FakeK8s.forbidden` makes it a 403 (no RBAC);
  :attr:`FakeK8s.resize_subresource` off makes the fake a server before
  1.33: ``.../resize`` is a 404 for every pod and statuses carry no
  ``resources``,
* ``POST/GET/DELETE /api/v1/namespaces/{ns}/services[/{name}]``,
* ``POST /api/v1/namespaces/{ns}/secrets`` (create only: what the executor
  may do; a test reads :attr:`FakeK8s.secrets`, with ``stringData`` moved
  into base64 ``data`` as the API server does).  The garbage collector is
  modelled for one case: deleting a Service deletes the Secrets whose
  ``ownerReferences`` name its uid (the executor's per-job credentials);
  ``"secrets"`` in :attr:`FakeK8s.forbidden` makes the create a 403,
* ``GET /api/v1/nodes`` (a ``NodeList`` shaped as the real API returns it:
  labels with ``kubernetes.io/hostname``, ``spec.unschedulable`` and
  ``taints``, ``status.capacity`` / ``allocatable`` quantities and the
  ``Ready`` condition among the kubelet's conditions; tests add nodes with
  :meth:`FakeK8s.add_node`) and ``GET /api/v1/pods`` (every namespace, with
  the ``status.phase!=...`` field selector); ``"nodes"`` and
  ``"pods/all-namespaces"`` in :attr:`FakeK8s.forbidden` make them 403s (a
  service account without a ClusterRole),
* ``GET /apis/apps/v1/namespaces/{ns}/deployments/{name}`` and
  ``.../replicasets/{name}``: what the executor reads to find its own
  Deployment; :meth:`FakeK8s.run_executor` creates the Deployment ->
  ReplicaSet -> Pod chain a Deployment controller would, and
  :attr:`FakeK8s.forbidden` makes a resource answer 403 (no RBAC).
* namespaced custom resources (what the operator, ``services/operator``,
  uses), for each CustomResourceDefinition a test installs
  (:meth:`FakeK8s.install_crd`, e.g. with ``deploy/base/crd-pacerjob.yaml``):
  ``POST/GET /apis/{group}/{version}/namespaces/{ns}/{plural}`` (list, and
  ``watch=true`` as for pods), ``GET/PATCH/DELETE .../{plural}/{name}`` and
  ``PATCH .../{name}/status``.  Like an API server: an object is checked
  against the CRD's ``openAPIV3Schema`` on every write (a 422 naming the
  first bad field; with the ``openapi-schema-validator`` package, which
  reads OpenAPI's ``nullable``), an update's unchanged values excepted
  (:attr:`FakeK8s.ratcheting`, as 1.30 does); ``generation`` starts at 1 and grows with
  each change of ``spec``; with the status subresource, a create drops
  ``status``, the object's endpoint ignores ``status`` and ``.../status``
  changes nothing else.  Patches are JSON merge patches only (415
  otherwise); a ``metadata.resourceVersion`` in one must be the object's
  (else 409 ``Conflict``: a compare-and-set).  Deletion with finalizers
  marks the object (``deletionTimestamp``, a ``MODIFIED`` event) and keeps
  it until a patch removes its last finalizer (then ``DELETED``); adding a
  finalizer to an object being deleted is a 422.  Not modelled: pruning of
  fields the schema does not know, CEL rules, defaulting, server-side apply.
  :meth:`FakeK8s.store_unchecked` stores an object past the schema (what an
  API server may hold from an older CRD).
  Volcano's PodGroups (``scheduling.volcano.sh/v1beta1``, created by the
  executor for a job with ``gang: volcano``) are served this way once a test
  calls :meth:`FakeK8s.install_volcano_podgroups` (a minimal CRD:
  ``spec.minMember`` an integer >= 0, ``spec.priorityClassName`` a string;
  no Volcano scheduler acts on them).

It is a fake: nothing is scheduled (``spec.nodeName`` is whatever a test
sets), no admission, no RBAC.  It validates what a real API server would reject first (missing or
non-DNS-1123 names, duplicate names -> 409 ``AlreadyExists``, unknown
names -> 404 ``NotFound``, ownerReferences without apiVersion, kind, name
or uid, or with more than one controller -> 422), assigns ``resourceVersion``, ``uid`` and
``creationTimestamp``, and records every request for assertions.  There is
no kubelet (but a resize is applied at once, above): tests move pods through phases with :meth:`FakeK8s.set_running`,
:meth:`FakeK8s.terminate`, :meth:`FakeK8s.evict` and
:meth:`FakeK8s.image_pull_error`.  Deletion removes the pod at once (as the
API server does for a pod whose kubelet confirmed the kill).

Concurrency: the server runs on its own event loop in a daemon thread, so the
blocking client (called from other threads) never waits on the test's loop.
The test helpers are plain functions that run on the server's loop and wait
for it; they may be called from any thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime as dt
import json
import re
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"


@dataclass
class Request:
    """One request the fake received."""

    method: str
    path: str
    query: dict[str, str]
    body: Any = None


@dataclass
class _Watch:
    ns: str
    selector: dict[str, str]
    resource: str = "pods"  # or a custom resource's "<plural>.<group>"
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)


@dataclass
class _Crd:
    """A custom resource the fake serves, read from its CustomResourceDefinition (:meth:`FakeK8s.install_crd`)."""

    group: str
    version: str
    plural: str
    kind: str
    schema: dict[str, Any]  # the version's openAPIV3Schema
    status_subresource: bool

    @property
    def resource(self) -> str:
        return f"{self.plural}.{self.group}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _error(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status(code, reason, message), status=code)


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """Merge ``patch`` into ``into`` as a (strategic) merge patch merges maps: recursively, null deletes."""
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def _bytes(quantity: str) -> float:
    """A memory quantity (``512Mi``, ``2G``, ``1073741824``) in bytes (enough of Kubernetes' syntax)."""
    m = re.fullmatch(r"([0-9.]+)([KMGTE]i|[kMGTE])?", str(quantity))
    if m is None:
        raise ValueError(f"quantity {quantity!r} not understood by the fake")
    powers = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "E": 10**18,
              "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Ei": 2**60}
    return float(m.group(1)) * powers.get(m.group(2) or "", 1)


_ABSENT = object()


def _at(obj: Any, path: list[Any]) -> Any:
    """The value at ``path`` (keys and indexes) in ``obj``, or a marker when there is none."""
    for part in path:
        try:
            obj = obj[part]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    return obj


def _parse_selector(text: str) -> dict[str, str]:
    """Equality-based label selectors only (``a=b,c==d``): all the backend sends."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.replace("==", "=").partition("=")
        out[key] = value
    return out


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class FakeK8s:
    """The fake API server; ``start()`` it, point a client at :attr:`host`, ``stop()`` it."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace  # the helpers' default namespace
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.apps: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource, ns, name) -> Deployment/ReplicaSet
        self.forbidden: set[str] = set()  # resources ("replicasets", "pods/resize", ...) that answer 403 Forbidden
        self.resize_subresource = True  # False: a server before 1.33, without pods/{name}/resize (404)
        self.kubelet_resizes = True  # False: a resize stays pending (status keeps the old resources)
        # Custom resources: an update may keep a value its CRD's schema refuses (Kubernetes >= 1.30,
        # CRDValidationRatcheting); False: every write checks the whole object (1.28, 1.29).
        self.ratcheting = True
        self.logs: dict[tuple[str, str, str], str] = {}
        self.requests: list[Request] = []
        self.rv = 0
        self.compacted_rv = 0  # watches from before this version get 410 Gone
        self._history: list[tuple[int, str, str, str, dict[str, Any]]] = []  # (rv, type, resource, ns, object)
        self.crds: dict[tuple[str, str, str], _Crd] = {}  # (group, version, plural) -> what it serves
        self.custom: dict[tuple[str, str, str], dict[str, Any]] = {}  # (<plural>.<group>, ns, name) -> object
        self._watches: list[_Watch] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-k8s", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle -----------------------------------------------------------

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeK8s:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        base = "/api/v1/namespaces/{ns}"
        app.router.add_post(base + "/pods", self._create_pod)
        app.router.add_get(base + "/pods", self._list_pods)
        app.router.add_get(base + "/pods/{name}", self._get_pod)
        app.router.add_delete(base + "/pods/{name}", self._delete_pod)
        app.router.add_get(base + "/pods/{name}/log", self._pod_log)
        app.router.add_patch(base + "/pods/{name}/resize", self._resize_pod)
        app.router.add_post(base + "/services", self._create_service)
        app.router.add_get(base + "/services", self._list_services)
        app.router.add_get(base + "/services/{name}", self._get_service)
        app.router.add_delete(base + "/services/{name}", self._delete_service)
        app.router.add_post(base + "/secrets", self._create_secret)
        app.router.add_get("/api/v1/nodes", self._list_nodes)
        app.router.add_get("/api/v1/pods", self._list_all_pods)
        app.router.add_get("/apis/apps/v1/namespaces/{ns}/{resource:deployments|replicasets}/{name}", self._get_apps)
        custom = "/apis/{group}/{version}/namespaces/{ns}/{plural}"  # after apps: its routes are tried first
        app.router.add_post(custom, self._create_custom)
        app.router.add_get(custom, self._list_custom)
        app.router.add_get(custom + "/{name}", self._get_custom)
        app.router.add_patch(custom + "/{name}", self._patch_custom)
        app.router.add_patch(custom + "/{name}/status", self._patch_custom)
        app.router.add_delete(custom + "/{name}", self._delete_custom)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()

    async def _stop(self) -> None:
        for w in self._watches:
            w.queue.put_nowait(("end", None))
        if self._runner is not None:
            await self._runner.cleanup()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        async def go() -> T:
            return fn(*args)

        result: T = self._call(go())
        return result

    # -- recording -----------------------------------------------------------

    async def _record(self, request: web.Request) -> Any:
        body = await request.json() if request.can_read_body else None
        self.requests.append(Request(request.method, request.path, dict(request.query), body))
        return body

    def requests_to(self, method: str, path_suffix: str = "") -> list[Request]:
        """Recorded requests with this method whose path ends with ``path_suffix``."""
        return [r for r in list(self.requests) if r.method == method and r.path.endswith(path_suffix)]

    # -- storage and events --------------------------------------------------

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _emit(self, etype: str, ns: str, pod: dict[str, Any], resource: str = "pods") -> None:
        snapshot = copy.deepcopy(pod)
        self._history.append((self.rv, etype, resource, ns, snapshot))
        for w in self._watches:
            if w.resource == resource and w.ns == ns and _matches(snapshot, w.selector):
                w.queue.put_nowait(("event", {"type": etype, "object": snapshot}))

    def _validate_meta(self, body: Any, kind: str) -> web.Response | None:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            return _error(400, "BadRequest", f"{kind}: body is not an object with metadata")
        name = body["metadata"].get("name")
        if not name:
            return _error(422, "Invalid", f"{kind}: metadata.name: Required value")
        if len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
            return _error(422, "Invalid", f"{kind} {name!r}: metadata.name: Invalid value: a lowercase RFC 1123 subdomain")
        for k, v in (body["metadata"].get("labels") or {}).items():
            if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
                return _error(422, "Invalid", f"{kind} {name!r}: metadata.labels[{k}]: Invalid value: {v!r}")
        refs = body["metadata"].get("ownerReferences") or []
        for i, ref in enumerate(refs):
            for key in ("apiVersion", "kind", "name", "uid"):
                if not isinstance(ref, dict) or not ref.get(key):
                    return _error(422, "Invalid", f"{kind} {name!r}: metadata.ownerReferences[{i}].{key}: Required value")
        if sum(1 for ref in refs if ref.get("controller")) > 1:
            return _error(422, "Invalid", f"{kind} {name!r}: metadata.ownerReferences: Only one reference can have Controller set to true")
        return None

    # -- pods ----------------------------------------------------------------

    async def _create_pod(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        ns = request.match_info["ns"]
        if (bad := self._validate_meta(body, "Pod")) is not None:
            return bad
        name = body["metadata"]["name"]
        spec = body.get("spec") or {}
        containers = spec.get("containers") or []
        if not containers or not all(c.get("name") and c.get("image") for c in containers):
            return _error(422, "Invalid", f"Pod {name!r}: spec.containers: every container needs a name and an image")
        for key in ("hostname", "subdomain"):
            if key in spec and (len(spec[key]) > 63 or not _DNS1123_LABEL.match(spec[key])):
                return _error(422, "Invalid", f"Pod {name!r}: spec.{key}: Invalid value: a lowercase RFC 1123 label")
        volumes = {v.get("name") for v in spec.get("volumes") or []}
        for c in containers:
            for m in c.get("volumeMounts") or []:
                where = f"Pod {name!r}: spec.containers[{c['name']}].volumeMounts[{m.get('name')}]"
                if m.get("name") not in volumes:
                    return _error(422, "Invalid", f"{where}.name: Not found")
                sub = str(m.get("subPath") or "")
                if sub.startswith("/") or ".." in sub.split("/"):
                    return _error(422, "Invalid", f"{where}.subPath: Invalid value: {sub!r}: must be a relative "
                                                  "path without '..'")
        if (ns, name) in self.pods:
            return _error(409, "AlreadyExists", f'pods "{name}" already exists')
        pod = copy.deepcopy(body)
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        pod["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        pod["status"] = {"phase": "Pending", "qosClass": "Burstable"}
        self._bump(pod)
        self.pods[(ns, name)] = pod
        self._emit("ADDED", ns, pod)
        return web.json_response(pod, status=201)

    async def _list_pods(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        ns = request.match_info["ns"]
        selector = _parse_selector(request.query.get("labelSelector", ""))
        if request.query.get("watch") in ("true", "1"):
            current = [p for (n, _), p in sorted(self.pods.items()) if n == ns and _matches(p, selector)]
            return await self._watch(request, _Watch(ns, selector), current)
        items = [p for (n, _), p in sorted(self.pods.items()) if n == ns and _matches(p, selector)]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, w: _Watch, current: list[dict[str, Any]]) -> web.StreamResponse:
        """Stream ``w``'s events: from ``resourceVersion`` on (history), else ``current`` as ADDED first."""
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(json.dumps(event).encode() + b"\n")

        since = request.query.get("resourceVersion", "")
        if since and int(since) < self.compacted_rv:
            await send({"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since} ({self.compacted_rv})")})
            await resp.write_eof()
            return resp
        if not since or since == "0":
            for p in current:
                w.queue.put_nowait(("event", {"type": "ADDED", "object": copy.deepcopy(p)}))
        else:
            for rv, etype, res, n, p in self._history:
                if rv > int(since) and res == w.resource and n == w.ns and _matches(p, w.selector):
                    w.queue.put_nowait(("event", {"type": etype, "object": p}))
        self._watches.append(w)
        timeout = float(request.query.get("timeoutSeconds", "0")) or None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    kind, payload = await w.queue.get()
                    if kind == "event":
                        await send(payload)
                    elif kind == "gone":
                        await send({"type": "ERROR", "object": _status(410, "Expired", "watch expired")})
                        break
                    elif kind == "abort":
                        # A dropped connection: no terminating chunk.
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    else:
                        break
        except TimeoutError:
            pass
        except ConnectionError:
            return resp
        finally:
            self._watches.remove(w)
        with contextlib.suppress(ConnectionError):  # the client went away first
            await resp.write_eof()
        return resp

    async def _get_pod(self, request: web.Request) -> web.Response:
        await self._record(request)
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.pods:
            return _error(404, "NotFound", f'pods "{key[1]}" not found')
        return web.json_response(self.pods[key])

    async def _delete_pod(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        ns, name = request.match_info["ns"], request.match_info["name"]
        pod = self.pods.pop((ns, name), None)
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found')
        grace = request.query.get("gracePeriodSeconds")
        if grace is None and isinstance(body, dict):
            grace = body.get("gracePeriodSeconds")
        pod["metadata"]["deletionTimestamp"] = _now()
        pod["metadata"]["deletionGracePeriodSeconds"] = int(grace) if grace is not None else 30
        self._bump(pod)
        self._emit("DELETED", ns, pod)
        return web.json_response(pod)

    async def _resize_pod(self, request: web.Request) -> web.Response:
        """``pods/{name}/resize``: a strategic merge patch of the containers' cpu and memory."""
        body = await self._record(request)
        ns, name = request.match_info["ns"], request.match_info["name"]
        if not self.resize_subresource:  # as an API server that has no such subresource answers
            return _error(404, "NotFound", "the server could not find the requested resource")
        if "pods/resize" in self.forbidden:
            return _error(403, "Forbidden", f'pods "{name}" is forbidden: User "system:serviceaccount:{ns}:pod-executor" '
                                            f'cannot patch resource "pods/resize" in API group "" in the namespace "{ns}"')
        pod = self.pods.get((ns, name))
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found')
        if request.content_type != STRATEGIC_MERGE:
            return _error(415, "UnsupportedMediaType", f"the fake takes only {STRATEGIC_MERGE}, not {request.content_type}")
        invalid = f'Pod "{name}" is invalid: '
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, dict) or set(body) != {"spec"} or set(spec) != {"containers"}:
            return _error(422, "Invalid", invalid + "spec: Forbidden: only containers' resources can be resized")
        stored = {c["name"]: c for c in pod["spec"]["containers"]}
        for i, c in enumerate(spec["containers"] or []):
            where = f"spec.containers[{i}]"
            if not isinstance(c, dict) or c.get("name") not in stored:
                return _error(422, "Invalid", invalid + f"{where}: Forbidden: containers cannot be added")
            res = c.get("resources") or {}
            if set(c) - {"name", "resources"} or not isinstance(res, dict) or set(res) - {"requests", "limits"} or any(
                    not isinstance(res[k] or {}, dict) or set(res[k] or {}) - {"cpu", "memory"} for k in res):
                return _error(422, "Invalid", invalid + f"{where}: Forbidden: only cpu and memory resources are mutable")
            old = stored[c["name"]].get("resources", {}).get("limits", {}).get("memory")
            new = (res.get("limits") or {}).get("memory", old)
            policy = {p.get("resourceName"): p.get("restartPolicy") for p in stored[c["name"]].get("resizePolicy") or []}
            if old and new and _bytes(new) < _bytes(old) and policy.get("memory") != "RestartContainer":
                return _error(422, "Invalid", invalid + f"{where}.resources.limits[memory]: Forbidden: memory limits "
                                                        "cannot be decreased unless resizePolicy is RestartContainer")

        def change(pod: dict[str, Any]) -> None:
            for c in spec["containers"] or []:
                resources = stored[c["name"]].setdefault("resources", {})
                _merge(resources, c.get("resources") or {})
                for st in pod["status"].get("containerStatuses") or []:
                    if self.kubelet_resizes and st["name"] == c["name"] and "running" in st.get("state", {}):
                        st["resources"] = copy.deepcopy(resources)

        self._update(ns, name, change)
        return web.json_response(pod)

    async def _pod_log(self, request: web.Request) -> web.Response:
        await self._record(request)
        ns, name = request.match_info["ns"], request.match_info["name"]
        if (ns, name) not in self.pods:
            return _error(404, "NotFound", f'pods "{name}" not found')
        container = request.query.get("container", "trainer")
        lines = self.logs.get((ns, name, container), "").splitlines(keepends=True)
        if "tailLines" in request.query:
            lines = lines[len(lines) - min(len(lines), int(request.query["tailLines"])):]
        return web.Response(text="".join(lines), content_type="text/plain")

    async def _list_all_pods(self, request: web.Request) -> web.Response:
        """``list_pod_for_all_namespaces``: label selector and ``status.phase!=X`` field selectors."""
        await self._record(request)
        if "pods/all-namespaces" in self.forbidden:
            return self._cluster_forbidden("pods")
        selector = _parse_selector(request.query.get("labelSelector", ""))
        not_phases: set[str] = set()
        for part in filter(None, (p.strip() for p in request.query.get("fieldSelector", "").split(","))):
            key, op, value = part.partition("!=")
            if key != "status.phase" or not op:
                return _error(400, "BadRequest", f"field selector {part!r} not supported by the fake")
            not_phases.add(value)
        items = [p for _, p in sorted(self.pods.items())
                 if _matches(p, selector) and p["status"].get("phase") not in not_phases]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    # -- apps: the executor's own Deployment ---------------------------------

    async def _get_apps(self, request: web.Request) -> web.Response:
        await self._record(request)
        resource, ns, name = request.match_info["resource"], request.match_info["ns"], request.match_info["name"]
        if resource in self.forbidden:
            return _error(403, "Forbidden", f'{resource}.apps "{name}" is forbidden: User '
                                            f'"system:serviceaccount:{ns}:pod-executor" cannot get resource '
                                            f'"{resource}" in API group "apps" in the namespace "{ns}"')
        obj = self.apps.get((resource, ns, name))
        if obj is None:
            return _error(404, "NotFound", f'{resource}.apps "{name}" not found')
        return web.json_response(obj)

    def run_executor(self, deployment: str = "pod-executor", ns: str = "") -> tuple[str, str]:
        """The executor's Deployment, its ReplicaSet and its pod, owned as a Deployment controller makes them.

        Returns (pod name, Deployment uid).
        """
        ns = ns or self.namespace

        def meta(name: str, owner: dict[str, Any] | None) -> dict[str, Any]:
            md: dict[str, Any] = {"name": name, "namespace": ns, "uid": str(uuid.uuid4()),
                                  "creationTimestamp": _now(), "labels": {"app.kubernetes.io/name": deployment}}
            if owner is not None:
                md["ownerReferences"] = [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                          "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
                                          "controller": True, "blockOwnerDeletion": True}]
            return md

        def go() -> tuple[str, str]:
            dep: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(deployment, None),
                   "spec": {"replicas": 1}}
            rs_name = f"{deployment}-7c9f8d6b5"
            rs: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": meta(rs_name, dep), "spec": {"replicas": 1}}
            pod_name = f"{rs_name}-x2k4q"
            pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta(pod_name, rs),
                   "spec": {"containers": [{"name": "pod-executor", "image": "pacer"}]}, "status": {"phase": "Running"}}
            for obj in (dep, rs, pod):
                self._bump(obj)
            self.apps[("deployments", ns, deployment)] = dep
            self.apps[("replicasets", ns, rs_name)] = rs
            self.pods[(ns, pod_name)] = pod
            return pod_name, str(dep["metadata"]["uid"])

        return self._run(go)

    # -- nodes ---------------------------------------------------------------

    def _cluster_forbidden(self, resource: str) -> web.Response:
        return _error(403, "Forbidden", f'{resource} is forbidden: User "system:serviceaccount:{self.namespace}:'
                                        f'pod-executor" cannot list resource "{resource}" in API group "" at the '
                                        "cluster scope")

    async def _list_nodes(self, request: web.Request) -> web.Response:
        await self._record(request)
        if "nodes" in self.forbidden:
            return self._cluster_forbidden("nodes")
        return web.json_response({"kind": "NodeList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)},
                                  "items": [n for _, n in sorted(self.nodes.items())]})

    def add_node(self, name: str, cpu: str, memory: str, *, ready: bool = True, unschedulable: bool = False,
                 taints: list[dict[str, str]] | None = None, hostname: str = "") -> None:
        """A node as a kubelet registers it (allocatable = capacity minus a small system reserve)."""
        def go() -> None:
            node: dict[str, Any] = {
                "kind": "Node", "apiVersion": "v1",
                "metadata": {
                    "name": name, "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                    "labels": {"kubernetes.io/hostname": hostname or name, "kubernetes.io/os": "linux",
                               "kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux"},
                    "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                },
                "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
                "status": {
                    "capacity": {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "102400Mi"},
                    "allocatable": {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "94371840Ki"},
                    "conditions": [
                        {"type": t, "status": "False", "reason": f"KubeletHasNo{t}",
                         "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}
                        for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
                    ] + [{"type": "Ready", "status": "True" if ready else "False",
                          "reason": "KubeletReady" if ready else "KubeletNotReady",
                          "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}],
                    "addresses": [{"type": "InternalIP", "address": "10.0.0.1"},
                                  {"type": "Hostname", "address": hostname or name}],
                    "nodeInfo": {"kubeletVersion": "v1.30.2", "containerRuntimeVersion": "containerd://1.7.18",
                                 "operatingSystem": "linux", "architecture": "amd64"},
                },
            }
            if unschedulable:
                node["spec"]["unschedulable"] = True
            if taints:
                node["spec"]["taints"] = taints
            self.rv += 1
            node["metadata"]["resourceVersion"] = str(self.rv)
            self.nodes[name] = node
        self._run(go)

    def add_foreign_pod(self, name: str, ns: str, node: str, cpu: str, memory: str, phase: str = "Running") -> None:
        """Another tenant's pod on ``node`` (not Pacer's: no Pacer labels)."""
        def go() -> None:
            pod = {"kind": "Pod", "apiVersion": "v1",
                   "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()),
                                "creationTimestamp": _now(), "labels": {"app": "other"}},
                   "spec": {"nodeName": node, "containers": [
                       {"name": "main", "image": "other", "resources": {"requests": {"cpu": cpu, "memory": memory},
                                                                        "limits": {"memory": memory}}}]},
                   "status": {"phase": phase}}
            self._bump(pod)
            self.pods[(ns, name)] = pod
        self._run(go)

    def _create_core(self, ns: str, body: Any, kind: str, store: dict[tuple[str, str], dict[str, Any]],
                     prepare: Callable[[dict[str, Any]], None] | None = None) -> web.Response:
        """POST of a core/v1 object of ``kind`` into ``store``: 422 for bad metadata, 409 for a taken name."""
        if (bad := self._validate_meta(body, kind)) is not None:
            return bad
        name = body["metadata"]["name"]
        if (ns, name) in store:
            return _error(409, "AlreadyExists", f'{kind.lower()}s "{name}" already exists')
        obj = copy.deepcopy(body)
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", kind)
        if prepare is not None:
            prepare(obj)
        obj["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        self._bump(obj)
        store[(ns, name)] = obj
        return web.json_response(obj, status=201)

    # -- services ------------------------------------------------------------

    async def _create_service(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        ns = request.match_info["ns"]
        return self._create_core(ns, body, "Service", self.services)

    async def _list_services(self, request: web.Request) -> web.Response:
        await self._record(request)
        ns = request.match_info["ns"]
        items = [s for (n, _), s in sorted(self.services.items()) if n == ns]
        return web.json_response({"kind": "ServiceList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _get_service(self, request: web.Request) -> web.Response:
        await self._record(request)
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.services:
            return _error(404, "NotFound", f'services "{key[1]}" not found')
        return web.json_response(self.services[key])

    async def _delete_service(self, request: web.Request) -> web.Response:
        await self._record(request)
        key = (request.match_info["ns"], request.match_info["name"])
        if key not in self.services:
            return _error(404, "NotFound", f'services "{key[1]}" not found')
        svc = self.services.pop(key)
        uid = svc["metadata"]["uid"]
        for skey in [k for k, s in self.secrets.items() if k[0] == key[0] and any(
                r.get("uid") == uid for r in s["metadata"].get("ownerReferences") or [])]:
            del self.secrets[skey]  # the garbage collector, at once: its owner is gone
        return web.json_response(svc)

    async def _create_secret(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        ns = request.match_info["ns"]
        if "secrets" in self.forbidden:
            return _error(403, "Forbidden", f'secrets is forbidden: User "system:serviceaccount:{ns}:pod-executor" '
                                            f'cannot create resource "secrets" in API group "" in the namespace "{ns}"')
        def encode(secret: dict[str, Any]) -> None:  # stringData is written into data, base64, as the API does
            data = dict(secret.get("data") or {})
            for k, v in (secret.pop("stringData", None) or {}).items():
                data[k] = base64.b64encode(str(v).encode()).decode()
            secret["data"] = data

        return self._create_core(ns, body, "Secret", self.secrets, encode)

    # -- custom resources ----------------------------------------------------

    def install_crd(self, crd: dict[str, Any]) -> None:
        """Serve the namespaced custom resource a CustomResourceDefinition manifest defines (its first version)."""
        spec = crd["spec"]
        assert spec.get("scope") == "Namespaced", "the fake serves namespaced custom resources only"
        version = spec["versions"][0]
        served = _Crd(spec["group"], version["name"], spec["names"]["plural"], spec["names"]["kind"],
                      version["schema"]["openAPIV3Schema"], "status" in (version.get("subresources") or {}))
        self._run(lambda: self.crds.__setitem__((served.group, served.version, served.plural), served))

    def install_volcano_podgroups(self) -> None:
        """Serve Volcano's PodGroups (what a cluster with Volcano installed has), checked by a minimal schema."""
        schema = {"type": "object", "properties": {"spec": {"type": "object", "required": ["minMember"], "properties": {
            "minMember": {"type": "integer", "minimum": 0}, "priorityClassName": {"type": "string"}}}}}
        self.install_crd({"spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
                                   "names": {"plural": "podgroups", "kind": "PodGroup"},
                                   "versions": [{"name": "v1beta1", "schema": {"openAPIV3Schema": schema},
                                                 "subresources": {"status": {}}}]}})

    def _crd(self, request: web.Request) -> _Crd | None:
        m = request.match_info
        return self.crds.get((m["group"], m["version"], m["plural"]))

    @staticmethod
    def _not_served(request: web.Request) -> web.Response:
        return _error(404, "NotFound", "the server could not find the requested resource")

    def _invalid(self, crd: _Crd, obj: dict[str, Any], old: dict[str, Any] | None = None) -> web.Response | None:
        """A 422 naming the first field the CRD's schema refuses, as the API server's validation would; on an
        update with :attr:`ratcheting`, a refused value the update left as it was passes."""
        from openapi_schema_validator import OAS30Validator

        errors = sorted(OAS30Validator(crd.schema).iter_errors(obj), key=lambda e: [str(p) for p in e.path])
        if old is not None and self.ratcheting:
            errors = [e for e in errors if _at(obj, list(e.path)) != _at(old, list(e.path))]
        error = next(iter(errors), None)
        if error is None:
            return None
        where = ".".join(str(p) for p in error.path) or "<root>"
        name = obj.get("metadata", {}).get("name", "")
        return _error(422, "Invalid", f'{crd.kind}.{crd.group} "{name}" is invalid: {where}: Invalid value: '
                                      f'{error.message}')

    def _store_custom(self, crd: _Crd, ns: str, obj: dict[str, Any], etype: str) -> None:
        self._bump(obj)
        self.custom[(crd.resource, ns, obj["metadata"]["name"])] = obj
        self._emit(etype, ns, obj, crd.resource)

    async def _create_custom(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        crd, ns = self._crd(request), request.match_info["ns"]
        if crd is None:
            return self._not_served(request)
        if (bad := self._validate_meta(body, crd.kind)) is not None:
            return bad
        name = body["metadata"]["name"]
        if (crd.resource, ns, name) in self.custom:
            return _error(409, "AlreadyExists", f'{crd.plural}.{crd.group} "{name}" already exists')
        obj = copy.deepcopy(body)
        if crd.status_subresource:
            obj.pop("status", None)  # written through .../status only
        obj["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if (bad := self._invalid(crd, obj)) is not None:
            return bad
        self._store_custom(crd, ns, obj, "ADDED")
        return web.json_response(obj, status=201)

    async def _list_custom(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        crd, ns = self._crd(request), request.match_info["ns"]
        if crd is None:
            return self._not_served(request)
        items = [o for (r, n, _), o in sorted(self.custom.items()) if r == crd.resource and n == ns]
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, _Watch(ns, {}, crd.resource), items)
        return web.json_response({"kind": f"{crd.kind}List", "apiVersion": f"{crd.group}/{crd.version}",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _get_custom(self, request: web.Request) -> web.Response:
        await self._record(request)
        crd, ns, name = self._crd(request), request.match_info["ns"], request.match_info["name"]
        if crd is None:
            return self._not_served(request)
        obj = self.custom.get((crd.resource, ns, name))
        if obj is None:
            return _error(404, "NotFound", f'{crd.plural}.{crd.group} "{name}" not found')
        return web.json_response(obj)

    async def _patch_custom(self, request: web.Request) -> web.Response:
        """A JSON merge patch of the object (``.../status``: of its status only), with the API server's rules:
        a ``metadata.resourceVersion`` in the patch must be the object's (else 409), the main resource
        ignores ``status`` and the status subresource everything but ``status``, a spec change bumps
        ``generation``, no finalizer may be added to an object being deleted, and an object being deleted
        whose last finalizer goes is deleted."""
        body = await self._record(request)
        crd, ns, name = self._crd(request), request.match_info["ns"], request.match_info["name"]
        if crd is None:
            return self._not_served(request)
        if request.content_type != MERGE_PATCH:
            return _error(415, "UnsupportedMediaType", f"the fake takes only {MERGE_PATCH}, not {request.content_type}")
        key = (crd.resource, ns, name)
        stored = self.custom.get(key)
        if stored is None:
            return _error(404, "NotFound", f'{crd.plural}.{crd.group} "{name}" not found')
        if not isinstance(body, dict):
            return _error(400, "BadRequest", "a merge patch is a JSON object")
        want_rv = (body.get("metadata") or {}).get("resourceVersion")
        if want_rv is not None and str(want_rv) != stored["metadata"]["resourceVersion"]:
            return _error(409, "Conflict", f'Operation cannot be fulfilled on {crd.plural}.{crd.group} "{name}": the '
                                           "object has been modified; please apply your changes to the latest "
                                           "version and try again")
        status_only = request.path.endswith("/status")
        patch = {"status": body.get("status")} if status_only else {k: v for k, v in body.items() if k != "status"}
        if status_only and "status" not in body:
            patch = {}
        obj = copy.deepcopy(stored)
        _merge(obj, patch)
        obj["metadata"].update({k: stored["metadata"][k] for k in
                                ("name", "namespace", "uid", "creationTimestamp", "generation", "resourceVersion")})
        obj["metadata"].pop("deletionTimestamp", None)  # set by a DELETE only
        if "deletionTimestamp" in stored["metadata"]:
            obj["metadata"]["deletionTimestamp"] = stored["metadata"]["deletionTimestamp"]
            if set(obj["metadata"].get("finalizers") or []) - set(stored["metadata"].get("finalizers") or []):
                return _error(422, "Invalid", f'{crd.kind}.{crd.group} "{name}" is invalid: metadata.finalizers: '
                                              "Forbidden: no new finalizers can be added if the object is being deleted")
        if obj.get("spec") != stored.get("spec"):
            obj["metadata"]["generation"] = stored["metadata"].get("generation", 1) + 1
        if (bad := self._invalid(crd, obj, stored)) is not None:
            return bad
        if obj == stored:  # a no-op patch: no new version, no event
            return web.json_response(obj)
        if "deletionTimestamp" in obj["metadata"] and not obj["metadata"].get("finalizers"):
            self._bump(obj)
            del self.custom[key]
            self._emit("DELETED", ns, obj, crd.resource)
            return web.json_response(obj)
        self._store_custom(crd, ns, obj, "MODIFIED")
        return web.json_response(obj)

    async def _delete_custom(self, request: web.Request) -> web.Response:
        """Gone at once without finalizers; with some, only marked (``deletionTimestamp``) until they are removed."""
        await self._record(request)
        crd, ns, name = self._crd(request), request.match_info["ns"], request.match_info["name"]
        if crd is None:
            return self._not_served(request)
        key = (crd.resource, ns, name)
        stored = self.custom.get(key)
        if stored is None:
            return _error(404, "NotFound", f'{crd.plural}.{crd.group} "{name}" not found')
        if not stored["metadata"].get("finalizers"):
            del self.custom[key]
            self._bump(stored)
            self._emit("DELETED", ns, stored, crd.resource)
            return web.json_response(stored)
        if "deletionTimestamp" not in stored["metadata"]:
            obj = copy.deepcopy(stored)
            obj["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
            self._store_custom(crd, ns, obj, "MODIFIED")
            stored = obj
        return web.json_response(stored)

    def custom_object(self, plural: str, name: str, ns: str = "", group: str = "") -> dict[str, Any] | None:
        """A copy of a stored custom object (None: there is none); ``group``: any, if only one serves ``plural``."""
        ns = ns or self.namespace

        def go() -> dict[str, Any] | None:
            for (res, n, nm), obj in self.custom.items():
                if n == ns and nm == name and res.split(".", 1)[0] == plural and (not group or res.endswith(group)):
                    return copy.deepcopy(obj)
            return None

        return self._run(go)

    def store_unchecked(self, plural: str, obj: dict[str, Any], ns: str = "") -> None:
        """Store (and announce) ``obj`` as it is, not checked against the CRD's schema: what an API server
        may still hold from before its CRD had a schema, or from an older one."""
        ns = ns or self.namespace

        def go() -> None:
            (crd,) = [c for c in self.crds.values() if c.plural == plural]
            stored = copy.deepcopy(obj)
            stored.setdefault("metadata", {}).update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(),
                                                     generation=1)
            self._store_custom(crd, ns, stored, "ADDED")

        self._run(go)

    # -- kubelet-like helpers for tests -------------------------------------

    def _update(self, ns: str, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        pod = self.pods[(ns, name)]
        change(pod)
        self._bump(pod)
        self._emit("MODIFIED", ns, pod)

    @staticmethod
    def _container_names(pod: dict[str, Any]) -> list[str]:
        return [c["name"] for c in pod["spec"]["containers"]]

    def set_running(self, name: str, ns: str = "", node: str = "node-1") -> None:
        """Scheduled on ``node``, every container running."""
        ns = ns or self.namespace
        def change(pod: dict[str, Any]) -> None:
            now = _now()
            pod["spec"]["nodeName"] = node
            statuses = [{"name": c["name"], "ready": True, "restartCount": 0, "image": "pacer", "imageID": "",
                         "state": {"running": {"startedAt": now}}} for c in pod["spec"]["containers"]]
            if self.resize_subresource:  # a 1.33 kubelet reports what each running container has
                for st, c in zip(statuses, pod["spec"]["containers"], strict=True):
                    st["resources"] = copy.deepcopy(c.get("resources") or {})
            pod["status"].update(phase="Running", hostIP="10.0.0.1", podIP="10.1.0.7", startTime=now,
                                 containerStatuses=statuses)
        self._run(self._update, ns, name, change)

    def terminate(self, name: str, exit_code: int, reason: str = "", ns: str = "", agent_alive: bool = False) -> None:
        """The trainer ended with ``exit_code`` (the agent with 0); phase Succeeded or Failed.

        With ``agent_alive`` the sidecar keeps running, so (restartPolicy
        Never) the pod stays Running with only the trainer terminated.
        """
        ns = ns or self.namespace
        def change(pod: dict[str, Any]) -> None:
            now = _now()
            started = pod["status"].get("startTime", now)
            statuses = []
            for c in self._container_names(pod):
                if agent_alive and c != "trainer":
                    statuses.append({"name": c, "ready": True, "restartCount": 0, "image": "pacer", "imageID": "",
                                     "state": {"running": {"startedAt": started}}})
                    continue
                code = exit_code if c == "trainer" else 0
                why = (reason or ("Completed" if code == 0 else "Error")) if c == "trainer" else "Completed"
                statuses.append({"name": c, "ready": False, "restartCount": 0, "image": "pacer", "imageID": "",
                                 "state": {"terminated": {"exitCode": code, "reason": why,
                                                          "startedAt": started, "finishedAt": now}}})
            phase = "Running" if agent_alive else "Succeeded" if exit_code == 0 else "Failed"
            pod["status"].update(phase=phase, containerStatuses=statuses)
        self._run(self._update, ns, name, change)

    def touch(self, name: str, ns: str = "") -> None:
        """A change the executor does not care about (a condition), as kubelets make often."""
        ns = ns or self.namespace
        def change(pod: dict[str, Any]) -> None:
            conditions = pod["status"].setdefault("conditions", [])
            conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": _now()})
        self._run(self._update, ns, name, change)

    def evict(self, name: str, ns: str = "") -> None:
        """The kubelet evicted the pod (node under memory pressure)."""
        ns = ns or self.namespace
        def change(pod: dict[str, Any]) -> None:
            now = _now()
            pod["status"].update(
                phase="Failed", reason="Evicted",
                message="The node was low on resource: memory.",
                containerStatuses=[
                    {"name": c, "ready": False, "restartCount": 0, "image": "pacer", "imageID": "",
                     "state": {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": now}}}
                    for c in self._container_names(pod)
                ],
            )
        self._run(self._update, ns, name, change)

    def image_pull_error(self, name: str, ns: str = "", reason: str = "ErrImagePull") -> None:
        """The image cannot be pulled: the pod stays Pending with its containers waiting."""
        ns = ns or self.namespace
        def change(pod: dict[str, Any]) -> None:
            pod["status"].update(
                phase="Pending",
                containerStatuses=[
                    {"name": c, "ready": False, "restartCount": 0, "image": "pacer", "imageID": "",
                     "state": {"waiting": {"reason": reason, "message": "pull access denied"}}}
                    for c in self._container_names(pod)
                ],
            )
        self._run(self._update, ns, name, change)

    def set_log(self, name: str, text: str, container: str = "trainer", ns: str = "") -> None:
        ns = ns or self.namespace
        self.logs[(ns, name, container)] = text

    # -- watch disruption ----------------------------------------------------

    def open_watches(self) -> int:
        return self._run(lambda: len(self._watches))

    def _signal_watches(self, kind: str) -> None:
        for w in list(self._watches):
            w.queue.put_nowait((kind, None))

    def end_watches(self) -> None:
        """End every open watch cleanly (as the API server does at ``timeoutSeconds``)."""
        self._run(self._signal_watches, "end")

    def drop_watches(self) -> None:
        """Drop every open watch connection mid-stream (no terminating chunk)."""
        self._run(self._signal_watches, "abort")

    def expire_watches(self) -> None:
        """Send ``410 Gone`` on every open watch and forget history up to now (etcd compaction)."""
        def go() -> None:
            # Another object changed after the compaction, so a fresh list
            # (at the new version) may watch again but an old version may not.
            self.rv += 1
            self.compacted_rv = self.rv
            self._history.clear()
            self._signal_watches("gone")
        self._run(go)
