"""The executor's reconcile pass and orphan reaping: what makes the backend match the records again.

Every ``reconcile_s`` each job the instance owns gets a pass in its own
worker: :func:`observe` reads the record and the pods as they are,
:func:`.core.reconcile_pass` decides (pods a record names but the backend
lacks are created again, a stop a crash swallowed is sent again, ``applied``
is published once every node of the plan runs, a migration or a rolling
replacement is stepped on, a finished job is torn down), and
:func:`reconcile` acts; what fails is observed again on the next pass.
Pods of no known job are deleted after ``orphan_grace_s`` (:func:`reap_orphans`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pacer.contracts.executor import ExecutorEventKind, ExecutorJob, NodePhase, PodPhase
from pacer.contracts.executor import ExecutorJobState as JS
from pacer.errors import PacerError
from pacer_services.pod_executor import core, moves
from pacer_services.pod_executor.core import record
from pacer_services.pod_executor.core.record import move

if TYPE_CHECKING:
    from pacer_services.pod_executor.app import ExecutorService

log = logging.getLogger("pacer.executor")


async def reap_orphans(svc: ExecutorService) -> None:
    """Delete pods of no known job once they stayed unknown for ``orphan_grace_s``.

    With two instances only the owner of the pod's job reaps it (it claimed the job when the watch
    showed the pod): the record, read again from KV just before, must still lack the pod's node
    (a pod is only ever created after the record naming it was saved).  A delete is idempotent anyway.
    """
    now = svc.clock()
    for name, since in list(svc.orphans.items()):
        st = svc.pods.get(name)
        known = st is not None and any(n.node == st.node for n in getattr(svc.jobs.get(st.job), "nodes", []))
        if st is None or st.phase is PodPhase.EXITED or known or not svc.own.owns(st.job):
            svc.orphans.pop(name, None)
        elif now - since >= svc.cfg.orphan_grace_s:
            svc.orphans.pop(name, None)
            try:
                rec = await svc.io.reread(st.job, track=False)
                if (rec is not None and any(n.node == st.node for n in rec.nodes)) or not svc.own.owns(st.job):
                    continue
                log.warning("deleting pod %s: it belongs to no known job", name)
                await svc.backend.delete(name, svc.cfg.delete_grace_s)
            except PacerError as exc:  # tried again once the watch reports it again
                svc.counters.inc("errors", code=exc.code, op="orphan")
                log.warning("orphan pod %s not deleted: %s", name, exc.message)


def observe(svc: ExecutorService, ej: ExecutorJob) -> core.JobView:
    """The first phase of a reconcile pass: the record and the pods as they are now."""
    nodes = []
    for n in ej.nodes:
        st = svc.io.current(ej, n)
        nodes.append(core.NodeView(
            n.node, n.role, n.state, n.intent, st.phase if st is not None else None,
            exit_handled=n.handled >= n.generation, resize_due=bool(n.resize_memory_mb),
            running_at=n.running_at, stop_sent=st is not None and st.name in svc.io.stops_sent,
            stopping=st is not None and st.name in n.deleting))
    left = any(p.phase is not PodPhase.EXITED for p in svc.pods.values() if p.job == ej.job)
    return core.JobView(ej.state, ej.migration, ej.applied, ej.plan_at, ej.completing_since, tuple(nodes), left)

async def reconcile(svc: ExecutorService, ej: ExecutorJob) -> None:
    """Observe, let :func:`.core.reconcile_pass` decide, act; what fails is observed again next pass."""
    p = core.reconcile_pass(observe(svc, ej), svc.clock(), svc.cfg.completion_grace_s)
    nodes = {n.node: n for n in ej.nodes}
    started = [n.node for n in ej.nodes if record.live(n)]
    for name in p.recreate:
        n = nodes[name]
        svc.counters.inc("pods_recreated")
        if n.resize_memory_mb:  # a replacement was due: the new pod is it
            n.cpu, n.memory_mb, n.resize_cpu, n.resize_memory_mb = n.resize_cpu, n.resize_memory_mb, 0.0, 0
        move(n, NodePhase.PENDING)
        await svc.io.create(ej, n)
    for name in p.restop:
        svc.counters.inc("stops_resent")
        await svc.io.delete(ej, nodes[name])
    if p.applied_overhead is not None:
        ej.applied, ej.state = True, JS.RUNNING
        await svc.io.save(ej)
        await svc.io.executor_event(ej, ExecutorEventKind.APPLIED, ej.reason, p.applied_overhead,
                                     started=started)
    if p.migrate:
        await moves.migrate_step(svc, ej)
    if p.resize:
        await moves.resize_step(svc, ej)
    if p.teardown:
        await svc._teardown(ej, p.teardown)
    for name in p.redelete:  # a delete may have been lost in a crash
        await svc.io.delete(ej, nodes[name])
    if p.torn_down:
        await svc.io.check(ej)
        try:
            await svc.backend.release(ej.job)
        except PacerError as exc:  # leftovers cost memory, not correctness: say so, go on
            svc.counters.inc("errors", code=exc.code, op="release")
            log.warning("resources of %s not released: %s", ej.job, exc.message)
        ej.state = JS.TORN_DOWN
        await svc.io.save(ej)
        await svc.io.executor_event(ej, ExecutorEventKind.TORN_DOWN, ej.reason)
        svc.records.pop(ej.job, None)
