"""The operator: PacerJob resources in, Pacer jobs out, their state written back (docs/kubernetes.md).

For every PacerJob in the namespaces it is given (``PACER_OPERATOR_NAMESPACES``),
one reconcile at a time per resource (:class:`pacer.owned.queues.JobQueues`),
different resources in parallel, in two phases: observe (the object as the
watch last delivered it, the job's record from the job service: ``get``),
then act:

* being deleted (``deletionTimestamp``) and holding the finalizer
  :data:`pacer.k8s_crd.FINALIZER`: the job is stopped (``stop``) unless it
  has ended or does not exist, then the finalizer is removed and the API
  server deletes the object;
* no job yet: the spec is checked by the job service's own parser
  (:func:`.core.check_spec`).  Invalid: status ``Invalid`` with a ``Valid``
  condition listing every problem with its field path, counted
  (``invalid_specs``), nothing submitted.  Valid: the finalizer is added
  first (a compare-and-set on the object's resourceVersion), then the spec
  is submitted (``submit``) as the Pacer job :func:`.core.job_name`.  A
  refusal of the job service (its ``invalid``: the dataset, its columns) is
  ``Valid=False, Rejected``; a temporary error is retried with a growing
  delay, the status saying so (``Pending``);
* the job exists: the status is the job's (phase, plan, progress,
  conditions), written only when it differs from the stored one.

Where the job's state comes from: its record, read with ``get`` (the job
service's answer, never a copy of it).  When to read it again: on every
watch event of the resource, on every ``pacer.events.job.<job>.*`` event
(a plain subscription: a state change, a new plan; the events are only a
cue, so a missed one costs nothing), and every ``resync_s`` for each
resource whose job has not ended (that is how progress is refreshed: the
shard counts change too often to be events of their own).

Restarts: on start each namespace is listed and every resource reconciled;
the job's name is a function of the resource (namespace, name, uid), so a
job submitted before the restart is found by ``get`` and not submitted
again, and its status resumes.  A submission whose reply was lost (a
timeout; the job service went on) answers the retry with ``conflict``: the
operator then reads the job and carries on with it.

Bad input never stops the operator: an object without a name or uid is
counted (``malformed_resources``) and skipped; any spec, of any type, is
checked and answered with a condition; an error of one reconcile is counted
and retried later, for that resource only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.contracts.jobs import JobRecord
from pacer.errors import Conflict, NotFound, PacerError, ValidationError
from pacer.jobs.client import JobClient
from pacer.jobs.lifecycle import TERMINAL
from pacer.k8s_crd import FINALIZER
from pacer.owned.queues import JobQueues
from pacer.runtime import RuntimeConfig, guard
from pacer.telemetry import Counters
from pacer_services.operator import core
from pacer_services.operator.kube import KubeClient, KubeConfig, KubeError, own_namespace

log = logging.getLogger("pacer.operator")


@dataclass
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # empty: the pod's own namespace
    kube: KubeConfig | None = None  # None: from the environment (KubeConfig.from_env)
    resync_s: float = 15.0  # how often a job that has not ended is read again (progress)
    watch_timeout_s: float = 300.0  # a watch is re-opened after this long (the server ends it)
    retry_s: float = 1.0  # first delay after a failed reconcile; doubled up to max_retry_s
    max_retry_s: float = 60.0
    rpc_timeout_s: float = 10.0

    @classmethod
    def from_env(cls) -> OperatorConfig:
        """``PACER_OPERATOR_NAMESPACES`` (comma-separated; unset or empty: the pod's namespace),
        ``PACER_OPERATOR_RESYNC_S``, ``PACER_OPERATOR_WATCH_TIMEOUT_S``; the API server: ``PACER_KUBE_HOST``
        or the in-cluster service account (:meth:`.kube.KubeConfig.from_env`)."""
        env = os.environ
        names = tuple(n.strip() for n in env.get("PACER_OPERATOR_NAMESPACES", "").split(",") if n.strip())
        return cls(namespaces=names or (own_namespace(),), kube=KubeConfig.from_env(),
                   resync_s=float(env.get("PACER_OPERATOR_RESYNC_S", "15")),
                   watch_timeout_s=float(env.get("PACER_OPERATOR_WATCH_TIMEOUT_S", "300")))


@dataclass
class Tracked:
    """One PacerJob as the operator holds it: the object the watch last delivered and its retry state."""

    res: core.Resource
    queued: bool = False  # a reconcile is queued and has not started: another trigger adds nothing
    failures: int = 0  # reconciles failed in a row (the retry delay grows with them)
    retry: asyncio.TimerHandle | None = field(default=None, repr=False)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class OperatorService:
    name = subjects.OPERATOR_SERVICE

    def __init__(self, bus: Bus, cfg: OperatorConfig, clock: Callable[[], str] = _now) -> None:
        self.bus = bus
        self.cfg = cfg
        self.clock = clock
        self.counters = Counters(self.name)
        self.jobs = JobClient(bus, timeout=cfg.rpc_timeout_s, retry=RetryPolicy(attempts=3))
        self.tracked: dict[str, Tracked] = {}  # "<ns>/<name>" -> the resource
        self.by_job: dict[str, str] = {}  # Pacer job -> its resource's key (job events name the job)
        self.kube: KubeClient | None = None
        self.queues: JobQueues | None = None
        self._sub: Subscription | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._stopping = False

    # ================================================================ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        self.kube = KubeClient(self.cfg.kube or KubeConfig.from_env())
        self.queues = JobQueues(lambda coro, name: tg.create_task(coro, name=name), self.counters,
                                name="operator", idle_s=5.0)
        self._sub = await self.bus.nc.subscribe(subjects.events_of("job"), cb=self._on_job_event)
        await self.bus.nc.flush()
        for ns in self.cfg.namespaces:
            tg.create_task(guard(f"watch {ns}", functools.partial(self._watch, ns)), name=f"pacer:operator:watch:{ns}")
        tg.create_task(guard("resync", self._resync_loop), name="pacer:operator:resync")
        log.info("operator watching", extra={"fields": {"namespaces": list(self.cfg.namespaces)}})

    async def drain(self) -> None:
        self._stopping = True
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        for t in self.tracked.values():
            if t.retry is not None:
                t.retry.cancel()
        if self.queues is not None:
            await self.queues.join(timeout=5.0)
        if self.kube is not None:
            await self.kube.close()

    # ================================================================ observe: the watch
    async def _watch(self, ns: str) -> None:
        """List the namespace, then follow its changes; list again when the watch cannot continue."""
        assert self.kube is not None
        while True:
            try:
                items, rv = await self.kube.list(ns)
            except KubeError as exc:
                self.counters.inc("kube_errors", op="list")
                log.warning("cannot list PacerJobs", extra={"fields": {"namespace": ns, "error": exc.message}})
                await asyncio.sleep(self.cfg.retry_s * 5)
                continue
            self.counters.inc("lists")
            listed = set()
            for obj in items:
                if (key := self._observe(obj)) is not None:
                    listed.add(key)
            for key in [k for k, t in self.tracked.items() if t.res.namespace == ns and k not in listed]:
                self._forget(key)  # deleted while nobody watched
            try:
                while True:  # a watch the server ended in time continues from where it was
                    opened = asyncio.get_running_loop().time()
                    async for ev in self.kube.watch(ns, rv, self.cfg.watch_timeout_s):
                        obj = ev.get("object")
                        meta = obj.get("metadata") if isinstance(obj, dict) else None
                        if isinstance(meta, dict) and meta.get("resourceVersion"):
                            rv = str(meta["resourceVersion"])
                        if ev.get("type") == "BOOKMARK":
                            continue
                        if ev.get("type") == "DELETED":
                            with contextlib.suppress(core.Malformed):
                                self._forget(core.read_resource(obj).key)
                            continue
                        self._observe(obj)
                    if asyncio.get_running_loop().time() - opened < 1.0:  # ended at once: no busy loop
                        await asyncio.sleep(self.cfg.retry_s)
            except KubeError as exc:  # 410 Expired, a dropped connection...: list again
                self.counters.inc("watch_restarts", reason=exc.reason or "error")
                log.info("watch ended; listing again", extra={"fields": {"namespace": ns, "error": exc.message}})
                if exc.status != 410:
                    await asyncio.sleep(self.cfg.retry_s)

    def _observe(self, obj: Any) -> str | None:
        """Take in an object from the API server and reconcile it; its key, or None when it is malformed."""
        try:
            res = core.read_resource(obj)
        except core.Malformed as exc:
            self.counters.inc("malformed_resources")
            log.warning("PacerJob without identity skipped", extra={"fields": {"problem": str(exc)}})
            return None
        t = self.tracked.get(res.key)
        if t is not None and t.res.uid != res.uid:  # deleted and created again under its name
            self._forget(res.key)
            t = None
        key: str = res.key
        if t is None:
            t = self.tracked[key] = Tracked(res)
            self.counters.inc("resources_seen")
        elif _same_but_status(t.res, res):  # its status changed (mostly: this operator wrote it): nothing to do
            t.res = res
            return key
        t.res = res
        self.by_job[res.job] = key
        self.trigger(key)
        return key

    def _forget(self, key: str) -> None:
        t = self.tracked.pop(key, None)
        if t is None:
            return
        if t.retry is not None:
            t.retry.cancel()
        if self.by_job.get(t.res.job) == key:
            del self.by_job[t.res.job]

    async def _on_job_event(self, msg: Msg) -> None:
        parts = msg.subject.split(".")  # pacer.events.job.<job>.<kind>: only a cue to read the record again
        key = self.by_job.get(parts[3]) if len(parts) == 5 else None
        if key is not None:
            self.trigger(key)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.resync_s)
            for key, t in list(self.tracked.items()):
                if core.needs_polling(t.res):
                    self.trigger(key)

    # ================================================================ act: one resource at a time
    def trigger(self, key: str) -> None:
        """Reconcile ``key`` soon (once, however often it is asked before the reconcile starts)."""
        t = self.tracked.get(key)
        if t is None or t.queued or self._stopping or self.queues is None:
            return
        t.queued = True
        self.queues.post(key, lambda: self._run(key), what="reconcile")

    async def _run(self, key: str) -> None:
        t = self.tracked.get(key)
        if t is None:
            return
        t.queued = False
        self.counters.inc("reconciles")
        try:
            await self.reconcile(t.res)
        except (PacerError, nats.errors.Error, TimeoutError) as exc:  # the loop boundary of one resource
            code = exc.code if isinstance(exc, PacerError) else type(exc).__name__
            self.counters.inc("reconcile_errors", code=code)
            log.warning("reconcile failed; retrying", extra={"fields": {"resource": key, "error": str(exc)}})
            self._retry_later(t)
        except Exception:  # a bug: counted and logged, and this resource tried again; the others go on
            self.counters.inc("internal_errors", op="reconcile")
            log.exception("reconcile crashed; retrying", extra={"fields": {"resource": key}})
            self._retry_later(t)
        else:
            t.failures = 0

    def _retry_later(self, t: Tracked) -> None:
        t.failures += 1
        delay = min(self.cfg.max_retry_s, self.cfg.retry_s * 2 ** (t.failures - 1))
        if t.retry is not None:
            t.retry.cancel()
        t.retry = asyncio.get_running_loop().call_later(delay, self.trigger, t.res.key)

    async def reconcile(self, res: core.Resource) -> None:
        """One resource: observe its job, then act (module docstring).  Raises what should be retried."""
        job = res.job
        if res.deleting:
            await self._finalize(res, job)
            return
        rec = await self._read(job)
        if rec is None:
            checked = await asyncio.to_thread(core.check_spec, res)  # up to 256 KiB of spec: off the loop
            if not checked.valid:
                if await self._write_status(res, core.invalid_status(res, checked.problems, self.clock())):
                    self.counters.inc("invalid_specs")
                    log.info("invalid PacerJob spec", extra={"fields": {"resource": res.key,
                                                                         "problems": list(checked.problems)}})
                return
            if not res.has_finalizer:
                res = await self._add_finalizer(res)
            rec = await self._submit(res, job, checked.text)
            if rec is None:
                return
        elif not res.has_finalizer and rec.state not in TERMINAL:  # someone removed it: deleting must stop the job
            res = await self._add_finalizer(res)
        await self._write_status(res, core.job_status(res, rec, self.clock()))

    async def _read(self, job: str) -> JobRecord | None:
        try:
            return await self.jobs.get(job)
        except NotFound:
            return None

    async def _submit(self, res: core.Resource, job: str, text: str) -> JobRecord | None:
        """The job's record once submitted (or found submitted); None when the job service refused it."""
        try:
            rec = await self.jobs.submit(job, text, res.namespace)  # the team is the resource's namespace
        except ValidationError as exc:  # the job service's own checks (its dataset): as final as a bad spec
            problems = exc.message.splitlines()
            if await self._write_status(res, core.invalid_status(res, problems, self.clock(), reason="Rejected")):
                self.counters.inc("rejected")
            return None
        except Conflict:  # submitted already (a retry after a lost reply), or being submitted right now
            found = await self._read(job)
            if found is None:
                await self._write_status(res, core.pending_status(res, "the job service is still taking the "
                                                                       "submission; checking again", self.clock()))
                raise
            self.counters.inc("adopted")
            return found
        except PacerError as exc:
            if exc.temporary:
                await self._write_status(res, core.pending_status(res, exc.message, self.clock()))
            raise
        self.counters.inc("submitted")
        log.info("PacerJob submitted", extra={"fields": {"resource": res.key, "job": job}})
        return rec

    async def _finalize(self, res: core.Resource, job: str) -> None:
        """The resource is being deleted: stop its job, then let it go."""
        if not res.has_finalizer:
            return
        rec = await self._read(job)
        if rec is not None and rec.state not in TERMINAL:
            try:
                await self.jobs.stop(job, f"PacerJob {res.key} deleted")
            except Conflict:  # it ended meanwhile: nothing left to stop
                pass
            self.counters.inc("stopped")
            log.info("job stopped: its PacerJob is deleted", extra={"fields": {"resource": res.key, "job": job}})
        await self._remove_finalizer(res)

    # ================================================================ effects on the API server
    async def _write_status(self, res: core.Resource, desired: dict[str, Any]) -> bool:
        """Write ``desired`` unless the stored status already says it; whether it was written."""
        patch = core.status_changes(res, desired)
        if patch is None:
            return False
        assert self.kube is not None
        try:
            await self.kube.patch_status(res.namespace, res.name, patch)
        except KubeError as exc:
            if exc.status == 404:  # gone meanwhile: its DELETED event follows
                return False
            if exc.status == 422:  # the object as stored fails its CRD's schema (an older one's spec): until it
                # changes, no status can be written (Kubernetes < 1.30 validates the whole object on a status
                # write; 1.30's ratcheting lets unchanged fields pass).  Its next change is reconciled anew.
                self.counters.inc("status_refused")
                log.warning("the API server refuses this PacerJob's status",
                            extra={"fields": {"resource": res.key, "error": exc.message}})
                return False
            self.counters.inc("kube_errors", op="patch_status")
            raise
        self.counters.inc("status_writes")
        t = self.tracked.get(res.key)
        if t is not None and t.res.uid == res.uid:  # what the next reconcile compares with, before the watch says
            t.res = dataclasses.replace(t.res, status=desired)
        return True

    async def _add_finalizer(self, res: core.Resource) -> core.Resource:
        """Hold the object until its job is stopped, added before the job exists (a compare-and-set on the
        object's version: a 409 means the object changed, and the next reconcile sees the new one)."""
        assert self.kube is not None
        patch = {"metadata": {"finalizers": [*res.finalizers, FINALIZER], "resourceVersion": res.resource_version}}
        try:
            obj = await self.kube.patch(res.namespace, res.name, patch)
        except KubeError:
            self.counters.inc("kube_errors", op="add_finalizer")
            raise
        self.counters.inc("finalizers_added")
        return core.read_resource(obj)

    async def _remove_finalizer(self, res: core.Resource) -> None:
        assert self.kube is not None
        patch = {"metadata": {"finalizers": [f for f in res.finalizers if f != FINALIZER],
                              "resourceVersion": res.resource_version}}
        try:
            await self.kube.patch(res.namespace, res.name, patch)
        except KubeError as exc:
            if exc.status == 404:
                return
            self.counters.inc("kube_errors", op="remove_finalizer")
            raise
        self.counters.inc("finalizers_removed")


def _same_but_status(old: core.Resource, new: core.Resource) -> bool:
    """Whether ``new`` differs from ``old`` in its status (and version) alone."""
    return (old.uid, old.generation, old.deleting, old.finalizers, old.spec) == \
        (new.uid, new.generation, new.deleting, new.finalizers, new.spec)


async def create(bus: Bus, rc: RuntimeConfig) -> OperatorService:
    """App factory: the only place that builds the operator from configuration."""
    return OperatorService(bus, OperatorConfig.from_env())
