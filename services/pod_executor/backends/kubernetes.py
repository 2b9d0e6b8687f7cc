"""The Kubernetes backend of the pod-executor (official ``kubernetes`` client).

One :class:`~pacer.contracts.executor.PodSpec` becomes one Pod: the trainer
container plus the agent sidecar, sharing an ``emptyDir`` (``{pod_dir}``) and
a process namespace (the agent reads the trainer's ``/proc``).  Each job gets
a headless Service named after it, so slot ``<job>-<node>`` has the stable
DNS name ``<job>-<node>.<job>.<namespace>.svc`` that the TF ClusterSpec uses.

Owner references (on by default, :func:`from_env`): every pod and Service
carries an ownerReference to the executor's own Deployment, found from the
executor's pod (``PACER_EXECUTOR_POD``) -> its ReplicaSet -> that
ReplicaSet's Deployment (:func:`find_owner`), so uninstalling Pacer lets
Kubernetes' garbage collector remove what the executor created.  The
reference is neither ``controller`` nor ``blockOwnerDeletion``: the executor,
not the Deployment, manages these objects, and deleting the Deployment must
not wait for training pods.  If the lookup fails (no RBAC, not in a cluster)
the backend logs it once, counts it in
``pacer_executor_owner_lookup_failures_total{reason}`` and runs without.

Bus credentials in a Secret: a PodSpec's ``PACER_NATS_PASSWORD`` (the job's
agent token, :func:`pacer_services.pod_executor.launch.pod_credentials`) is
never a literal value in the pod: the backend creates a Secret
``<job>-agent-<hash>`` holding it (key ``password``, immutable) before the pod,
and the pod's env takes it through ``valueFrom.secretKeyRef``.  The name
hashes the token, and a token is the same for every pod a job starts within
half its lifetime (:func:`pacer.authjwt.token_expiry`), so the pods of a job
share one Secret, a relaunch later gets a fresh one, and a create that finds
the Secret (409) found the very same content.  Each Secret is owned
(ownerReference) by the job's headless Service, so deleting the Service when
the job is torn down (:meth:`KubernetesBackend.release`) makes the garbage
collector delete the job's Secrets: the executor needs ``create`` on secrets
and nothing else (no get, list, delete).

Checkpoints, one directory per job: with ``checkpoint_root`` (the
executor's ``PACER_CHECKPOINT_ROOT``), a template's volume mounted at exactly
that path (the worker template's ``pacer-checkpoints`` PVC) is mounted with
``subPath: <job>`` at ``<root>/<job>``, in every container that mounts that
volume (:func:`scope_checkpoints`).  The chief writes and a relaunched chief
restores there (``launch.worker_config``), and no pod sees another job's
directory: the rest of the volume is not in its filesystem at all.

A PodSpec's ``machine`` (the brain's Dike placement) becomes a *preferred*
node affinity on ``kubernetes.io/hostname``; with ``cluster_machines``
(``PACER_CLUSTER_MACHINES=1``, which the kustomize component
``deploy/components/cluster-placement`` sets beside the ClusterRole it needs),
:meth:`KubernetesBackend.machines` reports the ready, schedulable nodes with
what is free on each.  Without it the backend never lists anything outside
its namespace: the machines are unknown (``[]``) and the brain places nothing.

Gang scheduling and priorities (a job's ``scheduling`` section, carried by
every PodSpec of the job; docs/kubernetes.md): ``priority_class`` becomes
the pod's ``spec.priorityClassName``.  Gang ``kueue`` (Kueue's plain-pod
integration) labels every pod with the job's LocalQueue
(``kueue.x-k8s.io/queue-name``) and a pod group named after the job
(``kueue.x-k8s.io/pod-group-name``), annotated with the group's size
(``kueue.x-k8s.io/pod-group-total-count``: the plan's PS plus workers when
the pod is created), so Kueue admits the job whole and gates its pods until
then.  Gang ``volcano`` sets ``spec.schedulerName: volcano`` and the
annotation ``scheduling.k8s.io/group-name: <job>``, and the backend creates
the job's PodGroup (``scheduling.volcano.sh/v1beta1``, ``minMember`` = the
gang's size, the priority class) before the job's first pod, owned by the
job's Service as its Secrets are; the executor needs ``create`` and
``patch`` on ``podgroups`` and nothing else.  A later plan of another size
patches ``minMember`` when its first pod is created (a merge patch of
``spec.minMember``; also when the group existed already, from another
instance or run).

In-place memory resize (:meth:`KubernetesBackend.resize`): Kubernetes >= 1.33,
where in-place pod vertical scaling is on by default (1.32 with its
``InPlacePodVerticalScaling`` feature gate).  A strategic merge PATCH of the
pod's ``resize`` subresource sets the trainer container's memory request and
limit; the agent sidecar is not touched.  The trainer container declares
``resizePolicy`` memory ``NotRequired`` (unless its template sets a policy),
so the kubelet raises the limit without restarting the container.  The call
returns once the API server accepted the new spec; the kubelet applies it
later (or leaves it pending while the node has no room), and
:func:`pod_status` reports the memory the container has once the kubelet
says so (``status.containerStatuses[].resources``).  Errors: no such pod ->
``NotFound``; the API refuses -> ``Conflict`` with the API's reason (a 404 on
the subresource of a pod that exists: a server before 1.33; 403: no RBAC for
``pods/resize``; 422: an invalid resize, e.g. a lower memory limit, which
1.33 refuses under ``NotRequired``; any other 4xx): the caller's cue to
migrate the pod instead; connection errors, 429 and 5xx -> ``Unavailable``.

Concurrency: the client is blocking, so every call runs in a thread
(``asyncio.to_thread``); a watch runs in a daemon thread of its own that
feeds an ``asyncio.Queue`` and is stopped (its socket shut down) when the
consuming generator is closed or cancelled.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import copy
import datetime as dt
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import kubernetes.config as _k8s_config
import kubernetes.watch as k8s_watch
import yaml
from kubernetes.client import ApiException
from pacer.contracts.executor import MachineInfo, PodPhase, PodSpec, PodStatus
from pacer.errors import Conflict, NotFound, Unavailable
from pacer.metrics import REGISTRY
from pacer.trainer.cluster import ClusterDesc
from prometheus_client import Counter

log = logging.getLogger(__name__)

POD_DIR = "/var/run/pacer"  # where the emptyDir shared by trainer and agent is mounted
TF_PORT = 2222  # every slot has its own DNS name, so all can use one port
PART_OF = "app.kubernetes.io/part-of"
L_JOB, L_NODE, L_ROLE, L_INDEX, L_GEN = (
    "pacer.io/job", "pacer.io/node", "pacer.io/role", "pacer.io/index", "pacer.io/generation",
)
AGENT_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
HOSTNAME = "kubernetes.io/hostname"  # the well-known node label that placement's node affinity matches
PLACEMENT_WEIGHT = 100  # the largest weight of a preferred scheduling term
_LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"  # pods that still hold their requests
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# A pending trainer waiting for one of these will never start: report it as
# exited with that reason, which core.classify() maps to CONFIG_ERROR.
_DEAD_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "InvalidImageName"})
DELETED_REASON = "Deleted"
_SIGTERM = 15
# The trainer's memory limit is raised in place (resize) without restarting it.
TRAINER_RESIZE_POLICY = [{"resourceName": "memory", "restartPolicy": "NotRequired"}]
_STRATEGIC_MERGE = "application/strategic-merge-patch+json"
_Statuses = list[PodStatus]  # `list` is a method name of the backend
_Json = list[dict[str, Any]]  # objects of an API list, as plain JSON
_Item = tuple[str, Any] | str | BaseException  # a watch event, the last version (clean end) or the error
_Watch: Any = k8s_watch.Watch  # type: ignore[attr-defined,unused-ignore]  # untyped in the client
k8s_config: Any = _k8s_config  # untyped too

PASSWORD_ENV = "PACER_NATS_PASSWORD"  # never a literal in a pod: a secretKeyRef to the job's Secret
SECRET_KEY = "password"
# Gang scheduling (a PodSpec's gang): Kueue's plain-pod integration admits a pod group whole ...
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"  # label: the LocalQueue
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"  # label: the group (the job)
KUEUE_TOTAL = "kueue.x-k8s.io/pod-group-total-count"  # annotation: pods of the group
# ... Volcano schedules the pods of one PodGroup (minMember of them at once).
VOLCANO_SCHEDULER = "volcano"
VOLCANO_GROUP = "scheduling.k8s.io/group-name"  # annotation: the PodGroup of the pod
PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "scheduling.volcano.sh", "v1beta1", "podgroups"
CLUSTER_MACHINES = "PACER_CLUSTER_MACHINES"  # "1": list nodes and all pods for the machine report
OWNER_REFERENCES = "PACER_OWNER_REFERENCES"  # "0" (or false/no/off): no ownerReferences at all
OWNER_LOOKUP_FAILURES = Counter(
    "pacer_executor_owner_lookup_failures",
    "Times the pod-executor could not find its own Deployment, so its pods and Services carry no ownerReference",
    ["reason"], registry=REGISTRY)


class OwnerLookupError(Exception):
    """The executor's Deployment could not be found; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KubernetesBackend:
    """Pods on a Kubernetes cluster through ``CoreV1Api``.

    This backend is tested only against an in-process fake of the Kubernetes
    REST endpoints it uses (``tests/fake_k8s.py``), because no API server can
    run on the development machine (docs/design.md); it has not been run against a
    real cluster.

    ``api_client`` is owned by the caller (``close`` does not close it).
    ``owner`` is an ownerReference (``apiVersion``, ``kind``, ``name``,
    ``uid``) put on every pod and Service, so deleting that object
    garbage-collects them.  With ``owner_pod`` (the executor's own pod)
    instead, that owner is the pod's Deployment, looked up before the first
    pod is created (:func:`find_owner`); a failed lookup is logged once,
    counted, and the backend goes on without owner references.  ``template`` is a Pod manifest (e.g.
    ``deploy/base/pod-templates/worker.yaml`` loaded as a dict), or a dict
    of them by role (``{"worker": ..., "ps": ...}``), whose metadata,
    pod-level spec and ``trainer``/``agent`` container settings (security
    context, extra env and mounts) are kept; everything the PodSpec says
    (command, image, resources, labels, port) replaces its values, the
    template's ``args`` and ``ports`` are dropped (the PodSpec's argv is the
    whole command line) and other containers are not used.

    Pods that disappear (deleted by us or by anyone) keep their last status,
    as ``exited``, in memory until :meth:`forget`, as the Backend contract
    asks; those records do not survive a restart of the executor.  A pod
    deleted before its trainer ended is reported as exited with reason
    ``"Deleted"`` and ``signal=15`` (the kubelet's SIGTERM), so classify()
    calls it KILLED (retryable) unless the executor deleted it itself.
    """

    name = "kubernetes"
    reserves_capacity = True

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        image: str,
        owner: dict[str, Any] | None = None,
        service_account: str = "",
        template: dict[str, Any] | None = None,
        *,
        owner_pod: str = "",
        watch_timeout_s: int = 300,
        retry_s: float = 1.0,
        machines_every_s: float = 30.0,
        checkpoint_root: str = "",
        cluster_machines: bool = False,
    ) -> None:
        if owner is not None and not {"apiVersion", "kind", "name", "uid"} <= owner.keys():
            raise ValueError("owner needs apiVersion, kind, name and uid")
        self.api = k8s.CoreV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)  # Volcano PodGroups
        self._api_client = api_client  # the owner lookup reads through AppsV1Api too
        self.namespace = namespace
        self.image = image
        self.owner = owner
        self.owner_pod = owner_pod if owner is None else ""  # "" once looked up (or never to look up)
        self.owner_error = ""  # why there is no owner, when the lookup failed
        self._owner_lock = asyncio.Lock()
        self.service_account = service_account
        self.template = template or {}
        # "": no checkpoints, the templates' mounts stay as they are; else the root each job's pods see only
        # their own directory of (scope_checkpoints).
        self.checkpoint_root = checkpoint_root.rstrip("/") if checkpoint_root.strip("/") else ""
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self._services: dict[str, str] = {}  # jobs whose headless Service exists -> its uid ("": unknown)
        self._secrets: dict[str, str] = {}  # credential Secrets created (or found) by this instance -> job
        self._podgroups: dict[str, int] = {}  # job -> the minMember this instance gave its Volcano PodGroup
        self._gone: dict[str, PodStatus] = {}  # pods deleted from the API, until forget()
        self._watches: set[Any] = set()  # open kubernetes.watch.Watch objects
        self._closed = False
        self.machines_every_s = machines_every_s
        # List nodes and every namespace's pods (the machine report): needs a ClusterRole, so off unless asked.
        self.cluster_machines = cluster_machines
        self._machines: builtins.list[MachineInfo] | None = None  # the last node listing, reused for machines_every_s
        self._machines_at = 0.0

    # -- the Backend protocol ------------------------------------------------

    async def create(self, pod: PodSpec) -> None:
        if self.owner_pod:
            await self._find_owner()
        if pod.job not in self._services:
            await self._ensure_service(pod.job)
        if pod.env.get(PASSWORD_ENV):
            await self._ensure_secret(pod)
        if pod.gang == VOLCANO_SCHEDULER and self._podgroups.get(pod.job) != pod.gang_size:
            await self._ensure_podgroup(pod)
        try:
            body: Any = self.pod_manifest(pod)  # the client takes plain dicts too
            await asyncio.to_thread(self.api.create_namespaced_pod, self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                raise Conflict(f"pod {pod.name} exists") from e
            raise _unavailable("create pod " + pod.name, e) from e
        except Exception as e:
            raise _unavailable("create pod " + pod.name, e) from e
        self._gone.pop(pod.name, None)

    async def delete(self, name: str, grace_s: float = 10.0) -> None:
        try:
            obj = await asyncio.to_thread(
                self.api.delete_namespaced_pod, name, self.namespace, grace_period_seconds=max(0, round(grace_s)),
            )
        except ApiException as e:
            if e.status == 404:
                return
            raise _unavailable("delete pod " + name, e) from e
        except Exception as e:
            raise _unavailable("delete pod " + name, e) from e
        if isinstance(obj, k8s.V1Pod) and _is_pacer(obj):
            self._gone[name] = deleted(pod_status(obj))

    async def resize(self, name: str, memory_mb: int) -> None:
        """Set the trainer container's memory request and limit to ``memory_mb`` MiB, in place.

        A strategic merge PATCH of ``pods/{name}/resize`` (Kubernetes >= 1.33);
        returns once the API server accepted it, before the kubelet applied
        it.  Raises ``NotFound`` (no such pod), ``Conflict`` (the API refuses:
        a server before 1.33, no RBAC, an invalid resize; the API's reason is
        in the message) or ``Unavailable`` (connection errors, 429, 5xx).
        """
        if memory_mb < 1:
            raise ValueError(f"memory_mb must be positive, not {memory_mb}")
        mem = f"{memory_mb}Mi"
        body: Any = {"spec": {"containers": [
            {"name": "trainer", "resources": {"requests": {"memory": mem}, "limits": {"memory": mem}}},
        ]}}
        try:
            await asyncio.to_thread(
                self.api.patch_namespaced_pod_resize, name, self.namespace, body, _content_type=_STRATEGIC_MERGE,
            )
        except ApiException as e:
            if e.status == 404:
                if not await self._exists(name):
                    raise NotFound(f"kubernetes: resize pod {name}: no such pod") from e
                raise Conflict(f"kubernetes: resize pod {name}: the API server has no pods/resize "
                               f"(Kubernetes before 1.33?): {_api_reason(e)}") from e
            if e.status is not None and 400 <= e.status < 500 and e.status != 429:
                raise Conflict(f"kubernetes: resize pod {name} refused: {_api_reason(e)}") from e
            raise _unavailable("resize pod " + name, e) from e
        except Exception as e:
            raise _unavailable("resize pod " + name, e) from e

    async def list(self, job: str | None = None) -> list[PodStatus]:
        pods, _ = await self._list(job)
        return self._with_gone(pods, job)

    async def watch(self) -> AsyncIterator[PodStatus]:
        """List, then watch from the list's resourceVersion; re-list after a 410 or an error.

        Only statuses that differ from the last one yielded for the pod are
        yielded, so a re-list after a reconnect repeats nothing.  A clean end
        of the stream (``timeoutSeconds``) resumes from the last version seen.
        """
        last: dict[str, PodStatus] = {}
        rv: str | None = None
        while not self._closed:
            if rv is None:
                try:
                    pods, rv = await self._list(None)
                except Unavailable as e:
                    log.warning("kubernetes list failed, retrying: %s", e.message)
                    await asyncio.sleep(self.retry_s)
                    continue
                live = {s.name for s in pods}
                for s in self._with_gone(pods, None):
                    if last.get(s.name) != s:
                        last[s.name] = s
                        yield s
                for name in [n for n in last if n not in live and n not in self._gone]:
                    if last[name].phase is PodPhase.EXITED:
                        del last[name]  # forgotten (or deleted after it exited: nothing new)
                    else:  # deleted while we were not watching
                        self._gone[name] = last[name] = deleted(last[name])
                        yield last[name]
            async with contextlib.aclosing(self._stream(rv)) as stream:
                async for item in stream:
                    if isinstance(item, str):  # clean end: resume from the last version seen
                        rv = item
                        break
                    if isinstance(item, BaseException):
                        if isinstance(item, ApiException) and item.status == 410:
                            log.info("kubernetes watch expired (410), re-listing")
                        else:
                            log.warning("kubernetes watch failed, re-listing: %r", item)
                            await asyncio.sleep(self.retry_s)
                        rv = None
                        break
                    etype, obj = item
                    if not _is_pacer(obj):
                        continue
                    s = pod_status(obj)
                    if etype == "DELETED":
                        s = deleted(s)
                        self._gone[s.name] = s
                    if last.get(s.name) != s:
                        last[s.name] = s
                        yield s

    async def logs(self, name: str, tail: int = 200, container: str = "trainer") -> str:
        try:
            text = await asyncio.to_thread(
                self.api.read_namespaced_pod_log, name, self.namespace, container=container, tail_lines=tail,
            )
        except ApiException as e:
            if e.status == 404:
                return ""  # as the local backend: a pod that is gone has no logs
            raise _unavailable("logs of " + name, e) from e
        except Exception as e:
            raise _unavailable("logs of " + name, e) from e
        return str(text or "")

    async def forget(self, name: str) -> None:
        self._gone.pop(name, None)
        await self.delete(name, 0)
        self._gone.pop(name, None)

    def cluster(self, job: str, num_ps: int, max_workers: int) -> ClusterDesc:
        def addr(node: str) -> str:
            return f"{job}-{node}.{job}.{self.namespace}.svc:{TF_PORT}"

        return ClusterDesc(
            tuple(addr(f"ps-{i}") for i in range(num_ps)),
            tuple(addr(f"worker-{i}") for i in range(max_workers)),
        )

    def pod_port(self, cluster: ClusterDesc, role: str, index: int) -> int:
        return TF_PORT

    async def release(self, job: str) -> None:
        """Delete the job's headless Service (a 404 is fine: it is gone already)."""
        try:
            await asyncio.to_thread(self.api.delete_namespaced_service, job, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise _unavailable("delete service " + job, e) from e
        except Exception as e:
            raise _unavailable("delete service " + job, e) from e
        self._services.pop(job, None)
        # Its Secrets and PodGroup go with it (the garbage collector: they are owned by the Service).
        for name in [n for n, j in self._secrets.items() if j == job]:
            del self._secrets[name]
        self._podgroups.pop(job, None)

    def capacity(self) -> tuple[float, int]:
        """Unknown here (a blocking call could not list nodes): :meth:`machines` tells, asynchronously."""
        return 0.0, 0

    async def machines(self) -> builtins.list[MachineInfo]:
        """Ready, schedulable nodes with allocatable minus the requests of every live pod on them.

        Allocatable alone would be cheaper (one node list), but it makes a
        full node look empty, and a placement onto it one the scheduler
        cannot follow.  So this is the scheduler's own arithmetic:
        allocatable minus the requests of the pods that are not Succeeded or
        Failed, of every namespace.  That costs a cluster-wide pod list, so
        the result is reused for ``machines_every_s`` and both lists are
        read as raw JSON (the client's model objects are the expensive part).
        A node counts if its Ready condition is True, it is not cordoned and
        the pod templates tolerate its NoSchedule/NoExecute taints (a node
        selector or affinity in the templates is not looked at).  Only with
        ``cluster_machines``, which needs RBAC to list nodes and pods
        cluster-wide (the component ``deploy/components/cluster-placement``);
        without it ``[]`` at once, no call made.  On any error (a 403: the
        setting without the ClusterRole) the machines are unknown (``[]``)
        until the next try, ``machines_every_s`` later.
        """
        if not self.cluster_machines:
            return []
        now = time.monotonic()
        if self._machines is not None and now - self._machines_at < self.machines_every_s:
            return self._machines
        try:
            nodes, pods = await asyncio.to_thread(self._nodes_and_pods)
            out = machines_of(nodes, pods, self.namespace, self._tolerations())
        except Exception as e:  # unknown until the next try; never the executor's problem
            if self._machines != []:
                if isinstance(e, ApiException) and e.status == 403:
                    log.warning("kubernetes: no RBAC to list nodes and every namespace's pods (%s), machines "
                                "unknown, so the brain places nothing: grant the ClusterRole of "
                                "deploy/components/cluster-placement, or unset PACER_CLUSTER_MACHINES",
                                _api_reason(e))
                else:
                    log.warning("kubernetes: listing nodes and pods failed, machines unknown: %r", e)
            out = []
        self._machines, self._machines_at = out, now
        return out

    async def close(self) -> None:
        """Stop the watches (their generators end); the caller closes ``api_client``."""
        self._closed = True
        for w in list(self._watches):
            w.stop()

    # -- manifests -----------------------------------------------------------

    def pod_manifest(self, pod: PodSpec) -> dict[str, Any]:
        """The Pod body for one PodSpec (a plain dict in API field names)."""
        tpl = copy.deepcopy(self.template.get(pod.role, {}) if "spec" not in self.template else self.template)
        meta: dict[str, Any] = tpl.get("metadata") or {}
        spec: dict[str, Any] = tpl.get("spec") or {}
        labels = dict(meta.get("labels") or {})
        labels.update(_labels(pod))
        metadata: dict[str, Any] = {"name": pod.name, "labels": labels}
        annotations = dict(meta.get("annotations") or {})
        if pod.gang == "kueue":  # one pod group per job, admitted whole from the job's LocalQueue
            labels.update({KUEUE_QUEUE: pod.queue, KUEUE_GROUP: pod.job})
            annotations[KUEUE_TOTAL] = str(pod.gang_size)
        elif pod.gang == VOLCANO_SCHEDULER:
            annotations[VOLCANO_GROUP] = pod.job
        if annotations:
            metadata["annotations"] = annotations
        if self.owner is not None:
            metadata["ownerReferences"] = [dict(self.owner)]
        mount = {"name": "pod-dir", "mountPath": POD_DIR}
        env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name(pod.job, v), "key": SECRET_KEY}}}
               if k == PASSWORD_ENV and v else {"name": k, "value": _pod_dir(v)} for k, v in pod.env.items()]
        by_name = {c.get("name"): c for c in spec.get("containers") or []}

        def container(name: str, argv: list[str], resources: dict[str, Any], image: str = "") -> dict[str, Any]:
            c: dict[str, Any] = by_name.get(name, {})
            c.pop("args", None)  # the PodSpec's argv is the whole command line
            kept_env = [e for e in c.get("env") or [] if e.get("name") not in pod.env]
            c.update(
                name=name, image=image or self.image, command=[_pod_dir(a) for a in argv],
                env=kept_env + env, resources=resources,
                volumeMounts=[m for m in c.get("volumeMounts") or [] if m.get("name") != "pod-dir"] + [mount],
            )
            c.pop("ports", None)
            return c

        cpu = f"{max(1, round(pod.cpu * 1000))}m"
        mem = f"{pod.memory_mb}Mi"
        trainer = container("trainer", pod.command, {"requests": {"cpu": cpu, "memory": mem},
                                                     "limits": {"cpu": cpu, "memory": mem}}, pod.image)
        if pod.port > 0:
            trainer["ports"] = [{"name": "tf-grpc", "containerPort": pod.port}]
        if not trainer.get("resizePolicy"):  # a template's own policy wins
            trainer["resizePolicy"] = copy.deepcopy(TRAINER_RESIZE_POLICY)
        containers = [trainer]
        if pod.agent:
            containers.append(container("agent", pod.agent, copy.deepcopy(AGENT_RESOURCES)))
        if self.checkpoint_root:
            scope_checkpoints(containers, self.checkpoint_root, pod.job)
        volumes = [v for v in spec.get("volumes") or [] if v.get("name") != "pod-dir"]
        spec.update(
            restartPolicy="Never", hostname=f"{pod.job}-{pod.node}", subdomain=pod.job,
            shareProcessNamespace=True, containers=containers,
            volumes=[*volumes, {"name": "pod-dir", "emptyDir": {}}],
        )
        if self.service_account:
            spec["serviceAccountName"] = self.service_account
        if pod.priority_class:
            spec["priorityClassName"] = pod.priority_class
        if pod.gang == VOLCANO_SCHEDULER:
            spec["schedulerName"] = VOLCANO_SCHEDULER
        if pod.machine:
            _prefer_machine(spec, pod.machine)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}

    def _job_object_metadata(self, job: str, name: str) -> dict[str, Any]:
        """Metadata of an object that lives as long as ``job``'s pods (its Secrets, its PodGroup): owned by
        the job's Service when its uid is known, so the teardown's delete of the Service lets the garbage
        collector delete it; else by the executor's owner (if any)."""
        metadata: dict[str, Any] = {"name": name, "labels": {PART_OF: "pacer", L_JOB: job}}
        uid = self._services.get(job, "")
        if uid:
            metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Service", "name": job, "uid": uid,
                                            "controller": False, "blockOwnerDeletion": False}]
        elif self.owner is not None:
            metadata["ownerReferences"] = [dict(self.owner)]
        return metadata

    def secret_manifest(self, pod: PodSpec) -> dict[str, Any]:
        """The Secret holding the bus password of ``pod`` (shared by the job's pods of that token), owned by
        the job's Service when its uid is known, else by the executor's owner (if any)."""
        password = pod.env[PASSWORD_ENV]
        metadata = self._job_object_metadata(pod.job, secret_name(pod.job, password))
        return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "immutable": True,
                "stringData": {SECRET_KEY: password}}

    def podgroup_manifest(self, pod: PodSpec) -> dict[str, Any]:
        """The Volcano PodGroup of ``pod``'s job: its pods are scheduled once ``minMember`` of them fit.

        Owned like the job's Secrets: by the job's Service when its uid is known (deleting the Service at
        teardown lets the garbage collector delete the group), else by the executor's owner (if any).
        """
        metadata = self._job_object_metadata(pod.job, pod.job)
        spec: dict[str, Any] = {"minMember": pod.gang_size}
        if pod.priority_class:
            spec["priorityClassName"] = pod.priority_class
        return {"apiVersion": f"{PODGROUP_GROUP}/{PODGROUP_VERSION}", "kind": "PodGroup", "metadata": metadata,
                "spec": spec}

    def service_manifest(self, job: str) -> dict[str, Any]:
        """The headless Service that gives each slot of ``job`` its DNS name."""
        metadata: dict[str, Any] = {"name": job, "labels": {PART_OF: "pacer", L_JOB: job}}
        if self.owner is not None:
            metadata["ownerReferences"] = [dict(self.owner)]
        return {
            "apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {
                "clusterIP": "None",
                "selector": {PART_OF: "pacer", L_JOB: job},
                # TF servers must resolve each other before any readiness.
                "publishNotReadyAddresses": True,
                "ports": [{"name": "tf-grpc", "port": TF_PORT, "targetPort": TF_PORT}],
            },
        }

    # -- helpers -------------------------------------------------------------

    async def _find_owner(self) -> None:
        """Look the executor's Deployment up once; on failure log, count and go on without an owner."""
        async with self._owner_lock:
            if not self.owner_pod:
                return  # another create looked it up meanwhile
            pod, self.owner_pod = self.owner_pod, ""
            try:
                self.owner = await asyncio.to_thread(find_owner, self._api_client, self.namespace, pod)
            except OwnerLookupError as e:
                owner_lookup_failed(e)
                self.owner_error = str(e)
            else:
                log.info("kubernetes: pods and Services are owned by Deployment %s (uid %s)",
                         self.owner["name"], self.owner["uid"])

    async def _exists(self, name: str) -> bool:
        """Whether the API server has pod ``name`` (Unavailable if it cannot tell)."""
        try:
            await asyncio.to_thread(self.api.read_namespaced_pod, name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return False
            raise _unavailable("get pod " + name, e) from e
        except Exception as e:
            raise _unavailable("get pod " + name, e) from e
        return True

    async def _ensure_service(self, job: str) -> None:
        try:
            body: Any = self.service_manifest(job)
            obj = await asyncio.to_thread(self.api.create_namespaced_service, self.namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise _unavailable("create service " + job, e) from e
            try:  # there already (another instance, or before a restart): its uid owns the job's Secrets
                obj = await asyncio.to_thread(self.api.read_namespaced_service, job, self.namespace)
            except Exception as e2:
                raise _unavailable("get service " + job, e2) from e2
        except Exception as e:
            raise _unavailable("create service " + job, e) from e
        self._services[job] = str(getattr(getattr(obj, "metadata", None), "uid", None) or "")

    async def _ensure_secret(self, pod: PodSpec) -> None:
        """Create the Secret of ``pod``'s password unless this instance did (a 409: the same content exists)."""
        body: Any = self.secret_manifest(pod)
        name = body["metadata"]["name"]
        if name in self._secrets:
            return
        try:
            await asyncio.to_thread(self.api.create_namespaced_secret, self.namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise _unavailable("create secret " + name, e) from e
        except Exception as e:
            raise _unavailable("create secret " + name, e) from e
        self._secrets[name] = pod.job

    async def _ensure_podgroup(self, pod: PodSpec) -> None:
        """Create the job's PodGroup before its first pod, or give it the pod's ``minMember`` (a plan of
        another size; a group another instance or run created, a 409)."""
        exists = pod.job in self._podgroups
        if not exists:
            body: Any = self.podgroup_manifest(pod)
            try:
                await asyncio.to_thread(self.custom.create_namespaced_custom_object, PODGROUP_GROUP,
                                        PODGROUP_VERSION, self.namespace, PODGROUP_PLURAL, body)
            except ApiException as e:
                if e.status != 409:
                    raise _unavailable("create podgroup " + pod.job, e) from e
                exists = True
            except Exception as e:
                raise _unavailable("create podgroup " + pod.job, e) from e
        if exists:
            patch: Any = {"spec": {"minMember": pod.gang_size}}
            try:
                await asyncio.to_thread(self.custom.patch_namespaced_custom_object, PODGROUP_GROUP,
                                        PODGROUP_VERSION, self.namespace, PODGROUP_PLURAL, pod.job, patch)
            except Exception as e:
                raise _unavailable("patch podgroup " + pod.job, e) from e
        self._podgroups[pod.job] = pod.gang_size

    def _nodes_and_pods(self) -> tuple[_Json, _Json]:
        """Every node and every live pod of the cluster, as plain JSON (blocking: run in a thread)."""
        def items(resp: Any) -> _Json:
            try:
                return list(json.loads(resp.data).get("items") or [])
            finally:
                resp.release_conn()

        nodes = items(self.api.list_node(_preload_content=False))
        pods = items(self.api.list_pod_for_all_namespaces(field_selector=_LIVE_PODS, _preload_content=False))
        return nodes, pods

    def _tolerations(self) -> builtins.list[_Json]:
        """The tolerations of each role's pod template (one list per template; none: one empty list)."""
        templates = [self.template] if "spec" in self.template else list(self.template.values())
        return [list((t.get("spec") or {}).get("tolerations") or []) for t in templates] or [[]]

    async def _list(self, job: str | None) -> tuple[_Statuses, str]:
        try:
            result: Any = await asyncio.to_thread(self.api.list_namespaced_pod, self.namespace, label_selector=_selector(job))
        except ApiException as e:
            raise _unavailable("list pods", e) from e
        except Exception as e:
            raise _unavailable("list pods", e) from e
        pods = [pod_status(p) for p in result.items if _is_pacer(p)]
        return pods, str(result.metadata.resource_version or "")

    def _with_gone(self, pods: _Statuses, job: str | None) -> _Statuses:
        live = {s.name for s in pods}
        gone = [s for n, s in self._gone.items() if n not in live and (job is None or s.job == job)]
        return sorted([*pods, *gone], key=lambda s: s.name)

    async def _stream(self, rv: str) -> AsyncGenerator[_Item, None]:
        """One watch request from ``rv``: events, then the last version (clean end) or the error."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        w = _Watch()
        closed = threading.Event()

        def put(item: _Item) -> None:
            if not closed.is_set():
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the loop is gone
                    closed.set()

        def run() -> None:
            last = rv
            try:
                for event in w.stream(
                    self.api.list_namespaced_pod, self.namespace, label_selector=_selector(None),
                    resource_version=rv, timeout_seconds=self.watch_timeout_s, allow_watch_bookmarks=True,
                ):
                    if closed.is_set():
                        return
                    last = w.resource_version or last
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        put((event["type"], event["object"]))
                put(str(last))
            except BaseException as e:  # delivered to the consumer, which re-lists
                put(e)

        self._watches.add(w)
        thread = threading.Thread(target=run, name="pacer-k8s-watch", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                yield item
                if not isinstance(item, tuple):
                    return
        finally:
            closed.set()
            w.stop()
            self._watches.discard(w)


def owner_lookup_failed(e: OwnerLookupError) -> None:
    log.warning("kubernetes: training pods and Services get no ownerReference, so uninstalling Pacer will "
                "not garbage-collect them: %s", e)
    OWNER_LOOKUP_FAILURES.labels(e.reason).inc()


def find_owner(api_client: Any, namespace: str, pod_name: str) -> dict[str, Any]:
    """The ownerReference to the Deployment that runs pod ``pod_name`` (blocking: run in a thread).

    Pod -> its controlling ReplicaSet -> that ReplicaSet's controlling
    Deployment, each read back so that the uid is the live object's (an
    ownerReference to a uid that does not exist would make the garbage
    collector delete the dependents at once).  Needs ``get`` on pods,
    ``apps`` replicasets and deployments; raises :class:`OwnerLookupError`.
    """
    core, apps = k8s.CoreV1Api(api_client), k8s.AppsV1Api(api_client)

    def get(kind: str, read: Callable[..., Any], name: str) -> dict[str, Any]:
        try:
            resp = read(name, namespace, _preload_content=False)
            try:
                obj: dict[str, Any] = json.loads(resp.data)
            finally:
                resp.release_conn()
        except ApiException as e:
            reason = {403: "forbidden", 404: "not_found"}.get(e.status or 0, "api_error")
            raise OwnerLookupError(reason, f"get {kind} {namespace}/{name}: {e.status} {e.reason}") from e
        except Exception as e:
            raise OwnerLookupError("api_error", f"get {kind} {namespace}/{name}: {e!r}") from e
        return obj

    def controller(obj: dict[str, Any], what: str, kind: str) -> dict[str, Any]:
        refs = (obj.get("metadata") or {}).get("ownerReferences") or []
        ref = next((r for r in refs if r.get("controller") and r.get("kind") == kind), None)
        if ref is None or not ref.get("name") or not ref.get("uid"):
            raise OwnerLookupError("no_owner", f"{what} is not controlled by a {kind}")
        return dict(ref)

    pod = get("pod", core.read_namespaced_pod, pod_name)
    rs_ref = controller(pod, f"pod {namespace}/{pod_name}", "ReplicaSet")
    rs = get("replicaset", apps.read_namespaced_replica_set, rs_ref["name"])
    dep_ref = controller(rs, f"replicaset {namespace}/{rs_ref['name']}", "Deployment")
    dep = get("deployment", apps.read_namespaced_deployment, dep_ref["name"])
    md = dep.get("metadata") or {}
    if md.get("uid") != dep_ref["uid"]:
        raise OwnerLookupError("no_owner", f"deployment {namespace}/{dep_ref['name']} has another uid than "
                                           "its replicaset's owner reference (replaced?)")
    if md.get("deletionTimestamp"):
        raise OwnerLookupError("no_owner", f"deployment {namespace}/{dep_ref['name']} is being deleted")
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep_ref["name"], "uid": md["uid"],
            "controller": False, "blockOwnerDeletion": False}


def from_env(environ: Mapping[str, str] | None = None, checkpoint_root: str | None = None) -> KubernetesBackend:
    """The backend as the pod-executor's Deployment configures it (``PACER_EXECUTOR_BACKEND=kubernetes``).

    * ``PACER_KUBE_HOST``: an API server URL without auth (``kubectl proxy``,
      tests); otherwise the in-cluster service account, else ``~/.kube/config``.
    * ``PACER_NAMESPACE``: where pods go (default: the service account's
      namespace, else ``default``).
    * ``PACER_TRAINER_IMAGE`` (default ``pacer:0.1.0``),
      ``PACER_TRAINER_SERVICE_ACCOUNT`` (default: the namespace's default).
    * ``PACER_CHECKPOINT_ROOT`` (or ``checkpoint_root``, the executor's
      setting, which wins): the templates' volume mounted there is narrowed
      to each job's own directory (:func:`scope_checkpoints`).
    * ``PACER_CLUSTER_MACHINES=1`` (or true/yes/on): report the cluster's
      machines (:meth:`KubernetesBackend.machines`; needs the ClusterRole of
      ``deploy/components/cluster-placement``); default off.
    * ``PACER_POD_TEMPLATES``: a directory with ``worker.yaml`` and
      ``ps.yaml`` (default ``/etc/pacer/pod-templates``; missing files: no template).
    * Owner references: by default every pod and Service is owned by the
      executor's Deployment, looked up from ``PACER_EXECUTOR_POD`` (the
      executor's pod name, from the downward API) in ``PACER_NAMESPACE``;
      ``PACER_OWNER`` (an ownerReference as JSON) names another owner;
      ``PACER_OWNER_REFERENCES=0`` turns owner references off.
    """
    env = os.environ if environ is None else environ
    if env.get("PACER_KUBE_HOST"):
        api = k8s.ApiClient(k8s.Configuration(host=env["PACER_KUBE_HOST"]))
    else:
        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()
        api = k8s.ApiClient()
    namespace = env.get("PACER_NAMESPACE", "")
    sa_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if not namespace and sa_ns.exists():
        namespace = sa_ns.read_text().strip()
    templates: dict[str, Any] = {}
    tdir = Path(env.get("PACER_POD_TEMPLATES", "/etc/pacer/pod-templates"))
    for role in ("worker", "ps"):
        if (tdir / f"{role}.yaml").exists():
            templates[role] = yaml.safe_load((tdir / f"{role}.yaml").read_text())
    namespace = namespace or "default"
    owner: dict[str, Any] | None = None
    owner_pod = ""
    if env.get(OWNER_REFERENCES, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("kubernetes: owner references off (%s)", OWNER_REFERENCES)
    elif env.get("PACER_OWNER"):
        owner = json.loads(env["PACER_OWNER"])
    elif not env.get("PACER_EXECUTOR_POD"):
        owner_lookup_failed(OwnerLookupError("no_pod_name", "PACER_EXECUTOR_POD (the executor's pod name) is unset"))
    elif sa_ns.exists() and sa_ns.read_text().strip() != namespace:
        # An ownerReference cannot cross namespaces: the collector would take the owner for gone.
        owner_lookup_failed(OwnerLookupError(
            "other_namespace", f"the executor runs in {sa_ns.read_text().strip()!r}, its pods go to {namespace!r}"))
    else:
        owner_pod = env["PACER_EXECUTOR_POD"]
    return KubernetesBackend(
        api, namespace, env.get("PACER_TRAINER_IMAGE", "pacer-tf:0.1.0"), owner=owner, owner_pod=owner_pod,
        service_account=env.get("PACER_TRAINER_SERVICE_ACCOUNT", ""), template=templates,
        checkpoint_root=env.get("PACER_CHECKPOINT_ROOT", "") if checkpoint_root is None else checkpoint_root,
        cluster_machines=env.get(CLUSTER_MACHINES, "").strip().lower() in ("1", "true", "yes", "on"),
    )


# -- conversion (pure) -------------------------------------------------------


def _labels(pod: PodSpec) -> dict[str, str]:
    return {
        PART_OF: "pacer", L_JOB: pod.job, L_NODE: pod.node, L_ROLE: pod.role,
        L_INDEX: str(pod.index), L_GEN: str(pod.generation),
    }


def scope_checkpoints(containers: list[dict[str, Any]], root: str, job: str) -> None:
    """Mount only job ``job``'s directory of the checkpoint volume, at ``<root>/<job>`` (in place).

    The checkpoint volume is the one a container mounts at exactly ``root``.
    Each mount of it, in any container and at any path ``P``, becomes
    ``subPath: <job>`` (after the mount's own ``subPath``/``subPathExpr``, if
    the template has one) at ``P/<job>``; so the chief's
    ``<root>/<job>`` is the same path as before, and nothing else of the volume
    is visible.  The kubelet creates the directory on the first mount.  A job
    name is one NATS subject token (letters, digits, ``-``, ``_``): never
    ``..`` nor a ``/``, so it cannot name a directory outside its own.
    """
    root = root.rstrip("/")
    names = {m.get("name") for c in containers for m in c.get("volumeMounts") or []
             if str(m.get("mountPath") or "").rstrip("/") == root}
    for c in containers:
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in names:
                continue
            if m.get("subPathExpr"):
                m["subPathExpr"] = f"{str(m['subPathExpr']).rstrip('/')}/{job}"
            else:
                m["subPath"] = f"{str(m.get('subPath') or '').strip('/')}/{job}".lstrip("/")
            m["mountPath"] = f"{str(m['mountPath']).rstrip('/')}/{job}"


def _prefer_machine(spec: dict[str, Any], machine: str) -> None:
    """Soft node affinity to ``machine`` (the placement's choice), added to the template's own affinity.

    Preferred, not required: if the machine filled up between the placement
    and the pod's creation (other tenants, a relaunch), the scheduler puts
    the pod elsewhere instead of leaving it pending forever.  A name that is
    no valid label value could not be matched and would make the API server
    reject the pod, so it is dropped.
    """
    if len(machine) > 63 or not _LABEL_VALUE.match(machine):
        log.warning("placement names %r, not a valid node hostname: no node affinity", machine)
        return
    affinity = spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    node_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append({
        "weight": PLACEMENT_WEIGHT,
        "preference": {"matchExpressions": [{"key": HOSTNAME, "operator": "In", "values": [machine]}]},
    })


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    """Kubernetes' toleration matching: effect (empty: any), key (empty with Exists: any), value."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _usable(node: dict[str, Any], tolerations: list[list[dict[str, Any]]]) -> bool:
    """Ready, not cordoned, and every pod template tolerates its scheduling taints."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return False
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not all(
                _tolerates(tols, taint) for tols in tolerations):
            return False
    return True


def _requests(pod: dict[str, Any]) -> tuple[float, float]:
    """A pod's (CPUs, bytes) as the scheduler counts them: its containers' requests summed, at least
    any one init container's, plus the pod overhead.  A container without requests counts its limits
    (the API server defaults requests to limits)."""
    spec = pod.get("spec") or {}

    def one(c: dict[str, Any]) -> tuple[float, float]:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        return (_quantity(req.get("cpu", lim.get("cpu"))), _quantity(req.get("memory", lim.get("memory"))))

    main = [one(c) for c in spec.get("containers") or []]
    cpu, mem = sum(c for c, _ in main), sum(m for _, m in main)
    for c, m in (one(c) for c in spec.get("initContainers") or []):
        cpu, mem = max(cpu, c), max(mem, m)
    overhead = spec.get("overhead") or {}
    return cpu + _quantity(overhead.get("cpu")), mem + _quantity(overhead.get("memory"))


def machines_of(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], namespace: str,
                tolerations: list[list[dict[str, Any]]]) -> list[MachineInfo]:
    """Usable nodes (:func:`_usable`) with allocatable minus the requests of the live pods on them, and
    what each Pacer job of ``namespace`` holds there (its pods' requests, sidecars included)."""
    used: dict[str, list[float]] = {}
    held: dict[str, dict[str, list[float]]] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if not node or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue  # not scheduled yet, or ended: it holds nothing
        cpu, mem = _requests(p)
        u = used.setdefault(node, [0.0, 0.0])
        u[0] += cpu
        u[1] += mem
        md = p.get("metadata") or {}
        labels = md.get("labels") or {}
        if md.get("namespace") == namespace and labels.get(PART_OF) == "pacer" and labels.get(L_JOB):
            h = held.setdefault(node, {}).setdefault(labels[L_JOB], [0.0, 0.0])
            h[0] += cpu
            h[1] += mem
    out = []
    for n in nodes:
        md = n.get("metadata") or {}
        name = md.get("name") or ""
        if not name or not _usable(n, tolerations):
            continue
        alloc = (n.get("status") or {}).get("allocatable") or {}
        cpu, mem = _quantity(alloc.get("cpu")), _quantity(alloc.get("memory"))
        u_cpu, u_mem = used.get(name, [0.0, 0.0])
        jobs = held.get(name, {})
        out.append(MachineInfo(
            name=(md.get("labels") or {}).get(HOSTNAME) or name,  # what the affinity matches
            cpu=cpu, memory_mb=int(mem // 2**20),
            free_cpu=round(max(0.0, cpu - u_cpu), 3), free_memory_mb=int(max(0.0, mem - u_mem) // 2**20),
            held_cpu={j: round(v[0], 3) for j, v in sorted(jobs.items())},
            held_memory_mb={j: int(v[1] // 2**20) for j, v in sorted(jobs.items())}))
    return sorted(out, key=lambda m: m.name)


def secret_name(job: str, password: str) -> str:
    """The Secret of one password of job ``job``'s pods: ``<job>-agent-<12 hex of its SHA-256>``."""
    return f"{job}-agent-{hashlib.sha256(password.encode()).hexdigest()[:12]}"


def _selector(job: str | None) -> str:
    return f"{PART_OF}=pacer" + (f",{L_JOB}={job}" if job else "")


def _pod_dir(text: str) -> str:
    return text.replace("{pod_dir}", POD_DIR)


def _is_pacer(pod: Any) -> bool:
    labels = getattr(getattr(pod, "metadata", None), "labels", None) or {}
    return bool(labels.get(L_JOB)) and labels.get(PART_OF) == "pacer"


def _ts(value: Any) -> float:
    return value.timestamp() if isinstance(value, dt.datetime) else 0.0


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _quantity(text: Any) -> float:
    """A Kubernetes quantity (``1500m``, ``2``, ``4Gi``) as a number; 0 if absent or unknown."""
    m = _QUANTITY.match(str(text or ""))
    if not m or m.group(2) not in _SUFFIX:
        return 0.0
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def pod_status(pod: Any) -> PodStatus:
    """A ``V1Pod`` -> what the executor needs (the trainer container decides)."""
    md, spec, st = pod.metadata, pod.spec, pod.status
    labels = md.labels or {}
    phase_name = (st.phase if st else None) or "Pending"
    phase = {"Running": PodPhase.RUNNING, "Succeeded": PodPhase.EXITED,
             "Failed": PodPhase.EXITED}.get(phase_name, PodPhase.PENDING)
    trainer = next((c for c in (st.container_statuses or []) if c.name == "trainer"), None) if st else None
    started = finished = 0.0
    exit_code: int | None = None
    signal: int | None = None
    reason = ""
    state = trainer.state if trainer else None
    if state is not None and state.running is not None:
        started = _ts(state.running.started_at)
    if state is not None and state.terminated is not None:
        # The pod stays Running while the agent sidecar lives: the trainer's
        # end is the pod's end for the executor.
        term = state.terminated
        phase = PodPhase.EXITED
        exit_code, signal = term.exit_code, term.signal
        reason = term.reason or ""
        started = _ts(term.started_at) or started
        finished = _ts(term.finished_at)
    if (state is not None and state.waiting is not None and phase is PodPhase.PENDING
            and state.waiting.reason in _DEAD_WAITING):
        phase, reason = PodPhase.EXITED, state.waiting.reason
    if st is not None and st.reason and phase_name == "Failed":
        reason = st.reason  # Evicted, DeadlineExceeded, NodeLost, ...: the pod's reason wins
    cpu = mem = 0.0
    for c in spec.containers or [] if spec else []:
        if c.name == "trainer" and c.resources is not None:
            limits = c.resources.limits or c.resources.requests or {}
            cpu, mem = _quantity(limits.get("cpu")), _quantity(limits.get("memory"))
    actual = trainer.resources if trainer is not None else None  # k8s >= 1.33: what the kubelet applied
    if actual is not None and (actual.limits or {}).get("memory"):
        mem = _quantity(actual.limits["memory"])
    try:
        generation = int(labels.get(L_GEN, "0"))
    except ValueError:
        generation = 0
    job = labels.get(L_JOB, "")
    return PodStatus(
        name=md.name, job=job,
        node=labels.get(L_NODE, ""), role=labels.get(L_ROLE, ""), generation=generation,
        phase=phase, created_at=_ts(md.creation_timestamp), started_at=started, finished_at=finished,
        exit_code=exit_code, signal=signal, reason=reason, oom=reason == "OOMKilled",
        cpu=cpu, memory_mb=round(mem / 2**20), host=(spec.node_name if spec else None) or "",
    )


def deleted(status: PodStatus, now: Callable[[], float] = time.time) -> PodStatus:
    """The last status of a pod that is gone from the API server."""
    if status.phase is PodPhase.EXITED:
        return status
    return replace(status, phase=PodPhase.EXITED, reason=DELETED_REASON, signal=_SIGTERM, finished_at=now())


def _api_reason(e: ApiException) -> str:
    """``<status> <reason>: <message>`` of the API's Status in an error response (else the HTTP reason)."""
    try:
        st = json.loads(e.body or "")
    except (TypeError, ValueError):
        st = None
    if not isinstance(st, dict):
        return f"{e.status} {e.reason}"
    reason, message = st.get("reason") or e.reason, st.get("message")
    return f"{e.status} {reason}: {message}" if message else f"{e.status} {reason}"


def _unavailable(what: str, e: BaseException) -> Unavailable:
    if isinstance(e, ApiException):
        return Unavailable(f"kubernetes: {what}: {e.status} {e.reason}", temporary=True)
    return Unavailable(f"kubernetes: {what}: {e!r}", temporary=True)
