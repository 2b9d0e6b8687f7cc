"""The executor's requests (``pacer.rpc.executor.<job>.<op>``): decode, check, act through the job's worker, reply.

``command`` (a node's STOP / RESTART / MIGRATE; a PS moves by migration),
``status``, ``logs`` and ``teardown``.  A command and a teardown run in the
job's own worker (:class:`pacer.owned.queues.JobQueues`), like every change of its record; the
record's changes are the core's (:func:`.core.record.node_command`).  Which
instance answers is the router's (:mod:`pacer.owned.router`): these run at
the job's owner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from pacer import subjects
from pacer.codec import decode
from pacer.contracts.common import Role
from pacer.contracts.executor import (
    CommandKind,
    CommandResult,
    ExecutorCommand,
    ExecutorJob,
    ExecutorStatus,
    JobQuery,
    LogsQuery,
    LogsReply,
    NodeInfo,
    NodeIntent,
    NodePhase,
    PodPhase,
)
from pacer.contracts.executor import ExecutorJobState as JS
from pacer.errors import Conflict, NotFound, ValidationError
from pacer.subjects import ExecutorOp
from pacer_services.pod_executor import launch, moves
from pacer_services.pod_executor.core import record

if TYPE_CHECKING:
    from pacer_services.pod_executor.app import ExecutorService


def check_job(job: str) -> None:
    """A job id that can name a lease and subjects (raises :class:`ValidationError`)."""
    subjects.executor_rpc(job, ExecutorOp.STATUS)


def same_job(job: str, body_job: str) -> None:
    if body_job != job:
        raise ValidationError(f"job: body names {body_job!r} but the subject is for {job!r}")


def status_of(svc: ExecutorService, ej: ExecutorJob) -> ExecutorStatus:
    """The job's nodes as the executor sees them now."""
    nodes = []
    now = svc.clock()
    for n in sorted(ej.nodes, key=lambda x: (x.role != Role.PS, x.index)):
        st = svc.io.current(ej, n)
        phase = st.phase if st else PodPhase.EXITED
        pending = (n.running_at or now) - n.created_at if n.created_at else 0.0
        nodes.append(NodeInfo(n.node, n.role, launch.pod_name(ej.job, n.node, n.generation), phase, n.cpu,
                              n.memory_mb, n.restarts, n.requested_restarts, n.generation,
                              max(0.0, pending), n.last_reason))
    return ExecutorStatus(ej.job, ej.state.value, ej.plan, nodes, svc.backend.name, ej.reason)


async def command(svc: ExecutorService, job: str, cmd: ExecutorCommand) -> CommandResult:
    """One node command, in the job's worker; a repeated ``command_id`` is answered, not done again."""
    ej = svc._job(job)
    n = next((x for x in ej.nodes if x.node == cmd.node), None)
    if n is None:
        raise NotFound(f"job {job!r} has no node {cmd.node!r}; nodes: {[x.node for x in ej.nodes]}")
    if cmd.command_id and cmd.command_id in ej.commands:
        return CommandResult(job, n.node, cmd.command_id, True, launch.pod_name(job, n.node, n.generation),
                             "already done")
    if not ej.state.active:
        raise Conflict(f"job {job!r} is {ej.state.value}: no node commands")
    if n.state in (NodePhase.REMOVED, NodePhase.FINISHED):
        raise Conflict(f"node {n.node} of job {job!r} is {n.state.value}")
    st = svc.io.current(ej, n)
    live = st is not None and st.phase is not PodPhase.EXITED
    if n.role == Role.PS and cmd.kind is not CommandKind.STOP:
        # A PS is never restarted alone (its workers would lose what it holds since the last
        # checkpoint): MIGRATE moves it seamlessly, RESTART stops training first (core.migration).
        ps = {x.index: (x.cpu, x.memory_mb) for x in ej.nodes
              if x.role == Role.PS and x.state is not NodePhase.REMOVED}
        ps[n.index] = (cmd.cpu if cmd.cpu is not None else n.cpu,
                       cmd.memory_mb if cmd.memory_mb is not None else n.memory_mb)
        stop_first = cmd.kind is CommandKind.RESTART
        await moves.start_migration(svc, ej, ps, f"{n.node} to {ps[n.index][0]:g} CPU / "
                                          f"{ps[n.index][1]} MiB: {cmd.reason}", stop_first=stop_first)
        if cmd.command_id:
            record.remember_command(ej, cmd)
            await svc.io.save(ej)
        return CommandResult(job, n.node, cmd.command_id, True, launch.pod_name(job, n.node, n.generation),
                             "stop-and-restart started" if stop_first else "migration started")
    await svc.io.apply(ej, record.node_command(ej, n, cmd, live_pod=live))
    svc.counters.inc("commands", kind=cmd.kind.value)
    detail = "stopping" if cmd.kind is CommandKind.STOP else f"{cmd.kind.value}: {cmd.reason}".strip(": ")
    # A restart is under way when the old pod is still stopping: its successor is the next generation.
    serving = n.generation + 1 if n.intent is NodeIntent.RESTART else n.generation
    return CommandResult(job, n.node, cmd.command_id, True, launch.pod_name(job, n.node, serving), detail)


def build(svc: ExecutorService) -> dict[str, Any]:
    """The op -> handler table of :func:`pacer.runtime.dispatch_rpc`."""

    async def rpc_command(job: str, msg: Msg) -> None:
        cmd = decode(ExecutorCommand, msg.data)
        same_job(job, cmd.job)
        res = await svc._in_job(job, lambda: command(svc, job, cmd), "command")
        await svc.bus.respond(msg, res)

    async def rpc_status(job: str, msg: Msg) -> None:
        q = decode(JobQuery, msg.data)
        same_job(job, q.job)
        await svc.bus.respond(msg, status_of(svc, svc._job(job)))

    async def rpc_logs(job: str, msg: Msg) -> None:
        q = decode(LogsQuery, msg.data)
        same_job(job, q.job)
        if not 1 <= q.tail <= 5000:
            raise ValidationError(f"tail: must be 1..5000, got {q.tail}")
        if q.container not in ("trainer", "agent"):
            raise ValidationError(f"container: must be trainer or agent, got {q.container!r}")
        ej = svc._job(job)
        n = next((x for x in ej.nodes if x.node == q.node), None)
        if n is None:
            raise NotFound(f"job {job!r} has no node {q.node!r}; nodes: {[x.node for x in ej.nodes]}")
        pod = launch.pod_name(job, n.node, n.generation)
        text = await svc.backend.logs(pod, q.tail, q.container)
        await svc.bus.respond(msg, LogsReply(job, n.node, pod, text))

    async def rpc_teardown(job: str, msg: Msg) -> None:
        q = decode(JobQuery, msg.data)
        same_job(job, q.job)

        async def teardown() -> ExecutorStatus:
            ej = svc._job(job)
            if ej.state is not JS.TORN_DOWN:
                await svc._teardown(ej, "teardown requested",
                                    state=JS.FAILED if ej.state is JS.FAILED else JS.TEARING_DOWN)
            return status_of(svc, ej)

        await svc.bus.respond(msg, await svc._in_job(job, teardown, "teardown"))

    return {ExecutorOp.COMMAND: rpc_command, ExecutorOp.STATUS: rpc_status, ExecutorOp.LOGS: rpc_logs,
            ExecutorOp.TEARDOWN: rpc_teardown}
