"""The executor's IO: what applies the core's decisions to the KV record, the backend and the bus.

:class:`Effects` owns every write the executor makes: the job's KV record
(compare-and-set against the revision it last read or wrote: never a blind
put), pods (create, delete), node and executor events, and the requests a
PS migration makes (the chief's checkpoint, the shard restore).
:meth:`Effects.apply` runs a list of :mod:`.core.effects` in order; the
first that fails ends the list and its error goes to the caller (the next
reconcile pass decides again from what is saved).

The record's changes themselves are the core's (:mod:`.core.record`: a
node's state changes only through its ``move``, which checks the transition
table); this module only applies what they ask for.

Called only from the job's own worker (:class:`pacer.owned.queues.JobQueues`): nothing here is
shared between jobs except the pod cache, which is keyed by pod name.

Two instances (:mod:`pacer.ownership`): every write and every pod action
first asks ``may_act(job)`` (does this instance own the job now?) and stops
with :class:`NotOwner` if not.  A pod action that no save precedes checks
first that the record is still at the revision this instance last wrote
(:meth:`Effects.check`): a new owner rewrites the record when it takes the
job over, so a stale owner's save or check is refused
(:class:`~pacer.errors.StaleRevision`) before it touches a pod.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

import nats.js.errors
from nats.js.kv import KeyValue
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode, encode
from pacer.contracts.agent import ActionKind, ActionResult, NodeCommand
from pacer.contracts.executor import (
    ExecutorEvent,
    ExecutorEventKind,
    ExecutorJob,
    MigrationPhase,
    NodePhase,
    NodeRecord,
    PodPhase,
    PodSpec,
    PodStatus,
)
from pacer.contracts.jobs import JobRecord
from pacer.contracts.nodes import NodeEvent
from pacer.errors import Conflict, NotFound, PacerError, StaleRevision, Unavailable
from pacer.shards.client import ShardAdmin
from pacer.subjects import NodeEventKind
from pacer.telemetry import Counters
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor import launch
from pacer_services.pod_executor.backends import Backend
from pacer_services.pod_executor.core import effects as fx
from pacer_services.pod_executor.core.record import move, node_event_of, normalise, restart_node

log = logging.getLogger("pacer.executor")

PodBuilder = Callable[..., PodSpec]
_WRONG_LAST_SEQUENCE = (10071, 10164)  # a refused compare-and-set (10164: nats-server 2.12+, e.g. a cluster)


class NotOwner(Unavailable):
    """This instance does not own the job (any more): its work stops; the client or the event retries
    and reaches the owner."""


class Effects:
    def __init__(self, bus: Bus, backend: Backend, counters: Counters, clock: Callable[[], float],
                 pod_builder: PodBuilder, launch_cfg: launch.LaunchConfig, delete_grace_s: float) -> None:
        self.bus, self.backend, self.counters, self.clock = bus, backend, counters, clock
        self.pod_builder, self.launch, self.delete_grace_s = pod_builder, launch_cfg, delete_grace_s
        self.kv: KeyValue | None = None
        self.jobs_kv: KeyValue | None = None
        self.revisions: dict[str, int] = {}  # job -> KV revision of its record as last read or written
        self.records: dict[str, JobRecord] = {}  # the job service's records, read from KV
        self.pods: dict[str, PodStatus] = {}  # newest status of every pod we know
        self.stops_sent: set[str] = set()  # pods this executor (not a crashed predecessor) asked to stop
        self.may_act: Callable[[str], bool] = lambda job: True  # this instance owns the job now
        self.fail_job: Callable[[ExecutorJob, str], Awaitable[None]] | None = None  # the service's FailJob

    def guard(self, job: str) -> None:
        """Refuse to write or act for a job this instance does not own (:class:`NotOwner`)."""
        if not self.may_act(job):
            self.counters.inc("not_owner")
            raise NotOwner(f"job {job!r}: this executor instance does not own it (any more); retry")

    async def check(self, ej: ExecutorJob) -> None:
        """Before a pod action no save precedes: the record must still be at the revision we last wrote
        (a new owner rewrote it when it took the job over: :class:`StaleRevision`, counted as ``fenced``)."""
        self.guard(ej.job)
        got = await self._last(ej.job)
        now = got[1] if got is not None else None
        if now != self.revisions.get(ej.job):
            self.counters.inc("fenced")
            raise StaleRevision(f"{ej.job}: the record moved on (revision {now}, ours "
                                f"{self.revisions.get(ej.job)}): another instance owns the job")

    async def _last(self, job: str) -> tuple[bytes, int] | None:
        """The record's bytes and revision, read from the bucket stream's leader (a replica may lag behind
        the other instance's write); None when absent or deleted."""
        stream, subject = f"KV_{subjects.EXECUTOR_BUCKET}", f"$KV.{subjects.EXECUTOR_BUCKET}.{job}"
        try:
            msg = await self.bus.js.get_last_msg(stream, subject, direct=False)
        except nats.js.errors.NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or msg.seq is None:
            return None
        return msg.data or b"", msg.seq

    async def mark(self, job: str) -> ExecutorJob | None:
        """Take the job's record over: read it and write it back unchanged at the revision read, so that
        a previous owner's next compare-and-set (and :meth:`check`) is refused.  None: no record."""
        for _ in range(5):
            ej = await self.reread(job)
            if ej is None:
                return None
            try:
                await self._cas(ej)
                return ej
            except StaleRevision:
                continue  # the previous owner wrote after our read: read again
        raise Unavailable(f"executor record of {job!r} keeps moving under its new owner")

    async def _cas(self, ej: ExecutorJob) -> None:
        assert self.kv is not None
        try:
            self.revisions[ej.job] = await Bus.kv_update(self.kv, ej.job, encode(ej), self.revisions.get(ej.job))
        except nats.js.errors.APIError as exc:
            if exc.err_code not in _WRONG_LAST_SEQUENCE:
                raise
            raise StaleRevision(f"{ej.job}: written by someone else (error {exc.err_code})") from exc

    # ------------------------------------------------------------ KV
    async def load(self) -> dict[str, ExecutorJob]:
        """Every record of the bucket, with the revision each was read at."""
        assert self.kv is not None
        out: dict[str, ExecutorJob] = {}
        for key in (await self.bus.kv_items(subjects.EXECUTOR_BUCKET)):
            got = await self.reread(key)
            if got is not None:
                out[key] = got
        return out

    async def reread(self, job: str, track: bool = True) -> ExecutorJob | None:
        """The job's record as KV has it now (and, ``track``: its revision becomes the base of our next
        compare-and-set); None when absent or unreadable."""
        got = await self._last(job)
        if got is None:  # absent or deleted: nothing to adopt
            if track:
                self.revisions.pop(job, None)
            return None
        data, revision = got
        if track:
            self.revisions[job] = revision
        try:
            ej = decode(ExecutorJob, data)
        except PacerError:
            self.counters.inc("bad_records")
            log.error("unreadable executor record %s; ignored", job)
            return None
        normalise(ej)
        return ej

    async def save(self, ej: ExecutorJob) -> None:
        """Write the record if KV still has the revision we last saw (compare-and-set).

        Raises :class:`~pacer.errors.StaleRevision` when another writer got there
        first (a second executor, an operator): counted and logged loudly; the
        caller's work stops there and the service re-reads the record.
        """
        self.guard(ej.job)
        try:
            await self._cas(ej)
        except StaleRevision:
            self.counters.inc("kv_conflicts")
            log.error("executor record of %s was written by someone else; re-reading it", ej.job)
            raise

    async def record(self, job: str) -> JobRecord:
        """The job service's record of ``job`` (cached; it never changes what the pods run)."""
        rec = self.records.get(job)
        if rec is None:
            assert self.jobs_kv is not None
            rec = await Bus.kv_get(self.jobs_kv, job, JobRecord)
            if rec is None:
                raise NotFound(f"job {job!r}: no job record (submit it through the job service)")
            self.records[job] = rec
        return rec

    # ------------------------------------------------------------ events
    async def node_event(self, job: str, n: NodeRecord, kind: str, *, reason: str = "", pod: str = "",
                         exit_code: int | None = None, pending_s: float = 0.0, relaunch: bool = False,
                         detail: str = "", result: dict[str, object] | None = None,
                         generation: int | None = None) -> None:
        gen = n.generation if generation is None else generation
        ev = NodeEvent(job=job, node=n.node, kind=kind, ts=self.clock(), reason=reason, role=n.role,
                       pod=pod or launch.pod_name(job, n.node, gen), generation=gen,
                       exit_code=exit_code, pending_s=pending_s, restarts=n.restarts + n.requested_restarts,
                       cpu=n.cpu, memory_mb=n.memory_mb, relaunch=relaunch, detail=detail,
                       result=dict(result or {}))
        await self.bus.publish_durable(subjects.node_event(job, kind), ev)
        self.counters.inc("node_events", kind=kind)

    async def publish_node_event(self, job: str, role: str, e: fx.PublishNodeEvent) -> None:
        """A node event as the core described it (:func:`.core.record.apply_exit`)."""
        ev = node_event_of(job, role, e, self.clock(), launch.pod_name(job, e.node, e.generation))
        await self.bus.publish_durable(subjects.node_event(job, e.kind), ev)
        self.counters.inc("node_events", kind=e.kind)

    async def executor_event(self, job: ExecutorJob, kind: ExecutorEventKind, reason: str = "",
                             overhead_s: float = 0.0, started: list[str] | None = None,
                             stopped: list[str] | None = None) -> None:
        ev = ExecutorEvent(job.job, kind, self.clock(), reason, job.plan, overhead_s, started or [], stopped or [])
        await self.bus.publish_durable(subjects.executor_event(job.job, kind.value), ev)

    # ------------------------------------------------------------ pods
    def current(self, ej: ExecutorJob, n: NodeRecord) -> PodStatus | None:
        return self.pods.get(launch.pod_name(ej.job, n.node, n.generation))

    def cluster_of(self, ej: ExecutorJob, n: NodeRecord) -> ClusterDesc:
        """During a migration the new PS pods belong to the next cluster; the workers move last."""
        if ej.migration is not MigrationPhase.NONE and n.role == "ps":
            return ClusterDesc.from_json(ej.next_cluster)
        return ClusterDesc.from_json(ej.cluster)

    async def create(self, ej: ExecutorJob, n: NodeRecord) -> None:
        rec = await self.record(ej.job)
        cluster = self.cluster_of(ej, n)
        spec = self.pod_builder(rec, ej.plan, cluster, n.role, n.index, n.generation, n.cpu, n.memory_mb,
                                self.backend.pod_port(cluster, n.role, n.index), self.launch, restore=n.restore)
        n.created_at, n.running_at = self.clock(), 0.0
        await self.save(ej)  # the intent, fenced: a stale owner stops here
        try:
            await self.backend.create(spec)
        except Conflict:
            self.counters.inc("pods_existed")
            pass  # made before a crash, or by the previous owner: one pod per (node, generation)
        self.pods.setdefault(spec.name, PodStatus(spec.name, ej.job, n.node, n.role, n.generation,
                                                  PodPhase.PENDING, n.created_at, cpu=n.cpu,
                                                  memory_mb=n.memory_mb))
        self.counters.inc("pods_created", role=n.role)
        await self.node_event(ej.job, n, NodeEventKind.CREATED, pod=spec.name)

    async def delete(self, ej: ExecutorJob, n: NodeRecord) -> None:
        st = self.current(ej, n)
        if st is None or st.phase is PodPhase.EXITED:
            return
        if st.name not in n.deleting:
            n.deleting.append(st.name)
            await self.save(ej)
        else:
            await self.check(ej)
        await self.backend.delete(st.name, self.delete_grace_s)
        self.stops_sent.add(st.name)
        self.counters.inc("pods_deleted")

    async def grow(self, ej: ExecutorJob, n: NodeRecord, memory_mb: int) -> None:
        """Raise the node's memory to ``memory_mb`` in place (its running pod's limit, fenced by
        :meth:`check`); a node without a live pod just gets it in its record, for its next pod.
        The backend's refusal (:class:`~pacer.errors.Conflict`, ``NotFound``) propagates."""
        st = self.current(ej, n)
        if st is not None and st.phase is not PodPhase.EXITED:
            await self.check(ej)
            await self.backend.resize(st.name, memory_mb)
            self.pods[st.name] = replace(st, memory_mb=memory_mb)
        n.memory_mb = memory_mb
        self.counters.inc("memory_grown", role=n.role)

    async def delete_pod(self, ej: ExecutorJob, name: str) -> None:
        """Stop a pod the record names by name only (a migration's retired PS), fenced by :meth:`check`."""
        await self.check(ej)
        await self.backend.delete(name, self.delete_grace_s)

    # ------------------------------------------------------------ a decision's effects
    async def apply(self, ej: ExecutorJob, effects: tuple[fx.Effect, ...]) -> None:
        """Apply ``effects`` in order; the first that fails raises (the rest waits for the next pass)."""
        nodes = {n.node: n for n in ej.nodes}
        for e in effects:
            self.guard(ej.job)  # lost the job in the middle of a decision: the rest waits for its owner
            match e:
                case fx.SaveRecord():
                    await self.save(ej)
                case fx.CreatePod(node=node):
                    n = nodes[node]
                    await self.create(ej, n)
                    n.restore = False  # only the first pod after a checkpoint restores it
                case fx.DeletePod(node=node):
                    await self.delete(ej, nodes[node])
                case fx.DeletePods(pods=pods):
                    for pod in pods:
                        await self.delete_pod(ej, pod)
                    ej.retiring = [p for p in ej.retiring if p not in pods]  # stopped: no longer to retire
                case fx.SetIntent(nodes=names, intent=intent):
                    for name in names:
                        move(nodes[name], NodePhase.STOPPING, intent)
                case fx.EnterPhase(phase=phase):
                    ej.migration = phase
                case fx.RequestCheckpoint(node=node):
                    # the chief checkpoints shard state + model, then exits (75)
                    await self.bus.request(
                        subjects.agent_command(ej.job, node),
                        NodeCommand(ej.job, node, ActionKind.KILL_RESTART, "PS migration",
                                    payload={"checkpoint": True}),
                        ActionResult, timeout=5.0, retry=NO_RETRY)
                case fx.RestoreShards(checkpoint=ckpt):
                    rec = await self.record(ej.job)
                    await ShardAdmin(self.bus, timeout=10.0).restore(ej.job, rec.spec.dataset.name, ckpt)
                case fx.SwitchCluster():
                    ej.cluster, ej.next_cluster, ej.migration = ej.next_cluster, "", MigrationPhase.NONE
                    ej.migration_stop_first = False
                    ej.plan_at, ej.applied = ej.migration_at, False
                    ej.retiring = []
                case fx.RestartNodes(nodes=names, restore=restore):
                    for name in names:
                        restart_node(nodes[name], restore=name in restore)
                case fx.PublishNodeEvent():
                    await self.publish_node_event(ej.job, nodes[e.node].role, e)
                case fx.FailJob(reason=reason):
                    assert self.fail_job is not None, "the service sets Effects.fail_job"
                    await self.fail_job(ej, reason)
