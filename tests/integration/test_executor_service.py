"""The pod-executor service over a real nats-server and the real local backend.

The pods run small stand-in programs instead of TensorFlow (the executor's
``pod_builder``): each waits until the test writes its exit code into a
control file, so every exit the executor must handle can be produced on
purpose and fast.  Whole TensorFlow jobs run in ``test_jobs_e2e.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import InProcess, eventually
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode, encode
from pacer.contracts.executor import (
    ClusterStatus,
    CommandKind,
    CommandResult,
    ExecutorCommand,
    ExecutorEvent,
    ExecutorJob,
    ExecutorStatus,
    JobQuery,
    LogsQuery,
    LogsReply,
    NodeIntent,
    PodSpec,
)
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.nodes import NodeEvent
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, NotFound, ValidationError
from pacer.jobs.spec import parse_job_spec
from pacer_services.pod_executor import launch
from pacer_services.pod_executor.app import ExecutorConfig, ExecutorService
from pacer_services.pod_executor.backends.local import LocalBackend
from pacer_services.pod_executor.core import ExecutorPolicy

pytestmark = pytest.mark.timeout(90)

JOB = "exjob"
# Waits for its control file, prints a result line like the chief's, exits with the code in the file.
STANDIN = (
    "import os, sys, time\n"
    "p = sys.argv[1]\n"
    "while not os.path.exists(p): time.sleep(0.05)\n"
    "code = int(open(p).read().strip() or 0)\n"
    "print('{\"node\": \"%s\", \"auc\": 0.75}' % sys.argv[2], flush=True)\n"
    "sys.exit(code)\n"
)


class GatedBackend:
    """The local backend, except that stopping a pod of ``job`` waits at a gate: a job whose backend hangs."""

    def __init__(self, inner: LocalBackend, job: str) -> None:
        self.inner, self.job = inner, job
        self.name, self.reserves_capacity = inner.name, inner.reserves_capacity
        self.gate = asyncio.Event()
        self.gate.set()

    async def delete(self, name: str, grace_s: float = 10.0) -> None:
        if name.startswith(f"{self.job}-"):
            await self.gate.wait()
        await self.inner.delete(name, grace_s)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


class RefusingBackend:
    """The local backend on a cluster that cannot resize pods in place (Kubernetes before 1.33)."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.name, self.reserves_capacity = inner.name, inner.reserves_capacity
        self.refused = 0

    async def resize(self, name: str, memory_mb: int) -> None:
        self.refused += 1
        raise Conflict(f"pod {name}: the server could not find the requested resource (pods/resize)")

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


class Harness:
    def __init__(self, url: str, root: Path, ctrl: Path) -> None:
        self.url, self.root, self.ctrl = url, root, ctrl
        self.cfg = ExecutorConfig(root=root, reconcile_s=0.1, cluster_every_s=0.2, delete_grace_s=2.0,
                                  durable="executor-test", policy=ExecutorPolicy(relaunch_budget=2),
                                  orphan_grace_s=1.0)
        self.proc: InProcess[ExecutorService] | None = None
        self.gated: GatedBackend | None = None  # set: the executor's backend hangs on this job's stops
        self.refusing: RefusingBackend | None = None  # set (any value): pods cannot grow in place

    def build(self, rec: JobRecord, plan: ResourcePlan, cluster: Any, role: str, index: int, generation: int,
              cpu: float, memory_mb: int, port: int, cfg: launch.LaunchConfig, restore: bool = False) -> PodSpec:
        node = f"{role}-{index}"
        name = launch.pod_name(rec.job, node, generation)
        return PodSpec(name=name, job=rec.job, node=node, role=role, index=index, generation=generation, cpu=cpu,
                       memory_mb=memory_mb, command=["python", "-c", STANDIN, str(self.ctrl / name), node])

    async def start(self) -> ExecutorService:
        def backend() -> Any:
            local = LocalBackend(self.root, poll_s=0.05)
            if self.gated is not None:
                self.gated = GatedBackend(local, self.gated.job)
                return self.gated
            if self.refusing is not None:
                self.refusing = RefusingBackend(local)
                return self.refusing
            return local

        self.proc = InProcess(self.url, lambda b: ExecutorService(b, backend(), self.cfg, pod_builder=self.build))
        return await self.proc.start()

    async def stop(self) -> None:
        assert self.proc is not None
        await self.proc.stop()

    def exit(self, node: str, generation: int, code: int) -> None:
        (self.ctrl / launch.pod_name(JOB, node, generation)).write_text(str(code))


class Events:
    """Every event of the job, as the executor published it."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []

    async def on(self, m: Msg) -> None:
        domain, kind = m.subject.split(".")[2], m.subject.split(".")[4]
        cls = {"node": NodeEvent, "executor": ExecutorEvent, "cluster": ClusterStatus}.get(domain)
        if cls is not None:
            self.items.append((f"{domain}.{kind}", decode(cls, m.data)))

    def of(self, key: str) -> list[Any]:
        return [e for k, e in self.items if k == key]

    async def wait(self, check: Callable[[], Any], within: float = 30.0) -> Any:
        return await eventually(check, within, lambda: f"events: {[k for k, _ in self.items]}")


@pytest.fixture
async def env(nats_server: EmbeddedNats, bus: Bus, tmp_path: Path) -> AsyncIterator[tuple[Harness, Events, Bus]]:
    ctrl = tmp_path / "ctrl"
    ctrl.mkdir()
    h = Harness(nats_server.url, tmp_path / "pods", ctrl)
    ev = Events()
    sub = await bus.nc.subscribe("pacer.events.>", cb=ev.on)
    spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    rec = JobRecord(JOB, spec, JobState.PLANNING, time.time(), data_path="/data/train.rec", records=1000)
    kv = await bus.kv(subjects.JOB_BUCKET)
    await kv.put(JOB, encode(rec))
    await h.start()
    yield h, ev, bus
    await sub.unsubscribe()
    await h.stop()
    for d in (tmp_path / "pods").glob("*/*"):  # let every stand-in a failing test left running end
        (ctrl / d.name).write_text("0")


def plan(workers: int = 2, ps: int = 1) -> ResourcePlan:
    return ResourcePlan(JOB, workers, ps, 0.5, 256, 0.5, 256, PlanSource.USER)


async def status(bus: Bus) -> ExecutorStatus:
    return await bus.request(subjects.executor_rpc(JOB, subjects.ExecutorOp.STATUS), JobQuery(JOB), ExecutorStatus,
                             retry=NO_RETRY)


async def publish_plan(bus: Bus, p: ResourcePlan) -> None:
    await bus.publish_durable(subjects.job_event(JOB, subjects.JobEventKind.PLAN), p)


def running(ev: Events, node: str, generation: int) -> Callable[[], bool]:
    return lambda: any(e.node == node and e.generation == generation for e in ev.of("node.running"))


async def test_plan_starts_nodes_and_a_finished_job_is_torn_down(env: tuple[Harness, Events, Bus]) -> None:
    h, ev, bus = env
    shm = Path("/dev/shm") / f"pacer-flash-{JOB}-chief.A"  # what a chief's flash checkpoint leaves in RAM
    shm.write_bytes(b"x" * 1024)
    await publish_plan(bus, plan())
    applied = await ev.wait(lambda: ev.of("executor.applied"))
    assert sorted(applied[0].started) == ["ps-0", "worker-0", "worker-1"] and applied[0].overhead_s >= 0
    created = {e.node: e for e in ev.of("node.created")}
    assert created["worker-0"].cpu == 0.5 and created["worker-0"].memory_mb == 256
    st = await status(bus)
    assert {n.node: n.phase.value for n in st.nodes} == {"ps-0": "running", "worker-0": "running",
                                                           "worker-1": "running"}
    assert all(e.pending_s >= 0 for e in ev.of("node.running"))
    h.exit("worker-0", 0, 0)
    h.exit("worker-1", 0, 0)
    await ev.wait(lambda: ev.of("executor.torn_down"))
    fin = {e.node: e for e in ev.of("node.finished")}
    assert fin["worker-0"].result == {"node": "worker-0", "auc": 0.75}  # the chief's result line
    ps_end = [e for e in ev.of("node.died") if e.node == "ps-0"]
    assert ps_end and not ps_end[0].relaunch  # stopped by the executor, not relaunched
    cs = await ev.wait(lambda: ev.of("cluster.status"))
    assert cs[-1].backend == "local" and cs[-1].total_cpu >= 1
    assert not shm.exists()  # released with the job: shared memory is RAM


async def test_exits_are_classified_relaunched_or_fail_the_job(env: tuple[Harness, Events, Bus]) -> None:
    h, ev, bus = env
    await publish_plan(bus, plan())
    await ev.wait(lambda: ev.of("executor.applied"))
    h.exit("worker-1", 0, 75)  # KILL_RESTART asked by the trainer: relaunched, no budget spent
    await ev.wait(running(ev, "worker-1", 1))
    died = [e for e in ev.of("node.died") if e.node == "worker-1"]
    assert died[0].reason == "restart_requested" and died[0].relaunch
    h.exit("worker-1", 1, 137)  # killed (128 + 9): retryable, budget 1/2
    await ev.wait(running(ev, "worker-1", 2))
    st = {n.node: n for n in (await status(bus)).nodes}
    assert (st["worker-1"].restarts, st["worker-1"].requested_restarts, st["worker-1"].generation) == (1, 1, 2)
    h.exit("worker-0", 0, 2)  # a configuration error: unretryable, the job fails
    failed = await ev.wait(lambda: ev.of("executor.failed"))
    assert "config_error" in failed[0].reason and "worker-0" in failed[0].reason
    await ev.wait(lambda: ev.of("executor.torn_down"))
    assert (await status(bus)).state == "torn_down"


async def test_relaunch_budget_spent_fails_the_job(env: tuple[Harness, Events, Bus]) -> None:
    h, ev, bus = env
    await publish_plan(bus, plan(workers=1))
    await ev.wait(lambda: ev.of("executor.applied"))
    for gen in range(2):
        h.exit("worker-0", gen, 137)
        await ev.wait(running(ev, "worker-0", gen + 1))
    h.exit("worker-0", 2, 137)
    failed = await ev.wait(lambda: ev.of("executor.failed"))
    assert "budget" in failed[0].reason


async def test_restart_command_scale_down_and_up(env: tuple[Harness, Events, Bus]) -> None:
    _h, ev, bus = env
    await publish_plan(bus, plan())
    await ev.wait(lambda: ev.of("executor.applied"))
    cmd = ExecutorCommand(JOB, "worker-1", CommandKind.RESTART, "persistent straggler", command_id="c1")
    subject = subjects.executor_rpc(JOB, subjects.ExecutorOp.COMMAND)
    res = await bus.request(subject, cmd, CommandResult, retry=NO_RETRY)
    assert res.done and res.pod == launch.pod_name(JOB, "worker-1", 1)
    await ev.wait(running(ev, "worker-1", 1))
    died = [e for e in ev.of("node.died") if e.node == "worker-1"]
    assert died[0].reason == "restart_requested" and died[0].relaunch  # the shard service requeues its shards
    again = await bus.request(subject, cmd, CommandResult, retry=NO_RETRY)  # same id: not done twice
    assert again.detail == "already done" and again.pod == res.pod
    await asyncio.sleep(0.5)
    assert len([e for e in ev.of("node.created") if e.node == "worker-1"]) == 2

    await publish_plan(bus, plan(workers=1))  # scale down: the highest slot goes
    gone = await ev.wait(lambda: [e for e in ev.of("node.died") if e.node == "worker-1" and e.generation == 1])
    assert not gone[0].relaunch
    await publish_plan(bus, plan(workers=2))  # and back up: a fresh pod in the slot
    await ev.wait(running(ev, "worker-1", 2))
    with pytest.raises(NotFound):
        await bus.request(subject, ExecutorCommand(JOB, "worker-9", CommandKind.RESTART), CommandResult,
                          retry=NO_RETRY)


async def test_exit_while_the_executor_is_down_is_handled_after_restart(env: tuple[Harness, Events, Bus]) -> None:
    h, ev, bus = env
    await publish_plan(bus, plan())
    await ev.wait(lambda: ev.of("executor.applied"))
    await h.stop()  # pods keep running: they are supervisor processes of their own
    h.exit("worker-1", 0, 75)
    await asyncio.sleep(1.0)
    await h.start()  # a new executor: reloads its KV record, adopts the pods
    await ev.wait(running(ev, "worker-1", 1))
    st = {n.node: n for n in (await status(bus)).nodes}
    assert st["worker-0"].generation == 0 and st["worker-0"].phase.value == "running"  # adopted, not restarted
    assert st["worker-1"].requested_restarts == 1
    assert len(ev.of("executor.applied")) == 1


async def test_bad_input_is_refused_and_counted(env: tuple[Harness, Events, Bus]) -> None:
    h, ev, bus = env
    await bus.js.publish(subjects.job_event(JOB, subjects.JobEventKind.PLAN), b"\xc1 not msgpack")
    await publish_plan(bus, ResourcePlan(JOB, 0, 1, 0.5, 256, 0.5, 256, PlanSource.USER))  # 0 workers
    await bus.publish_durable(subjects.job_event("nojob", subjects.JobEventKind.PLAN),
                              ResourcePlan("nojob", 1, 1, 1.0, 512, 1.0, 512, PlanSource.USER))
    assert h.proc is not None and h.proc.svc is not None
    counters = h.proc.svc.counters
    await ev.wait(lambda: counters.snapshot().get("bad_events", 0) >= 3)
    with pytest.raises(NotFound):
        await status(bus)  # nothing was started for any of them
    with pytest.raises(ValidationError, match="tail"):
        await publish_plan(bus, plan())
        await ev.wait(lambda: ev.of("executor.applied"))
        await bus.request(subjects.executor_rpc(JOB, subjects.ExecutorOp.LOGS), LogsQuery(JOB, "worker-0", 0),
                          LogsReply, retry=NO_RETRY)
    logs = await bus.request(subjects.executor_rpc(JOB, subjects.ExecutorOp.LOGS), LogsQuery(JOB, "worker-0", 10),
                             LogsReply, retry=NO_RETRY)
    assert logs.pod == launch.pod_name(JOB, "worker-0", 0)


async def test_a_pod_of_no_known_job_is_deleted_only_after_a_grace(env: tuple[Harness, Events, Bus]) -> None:
    h, ev, _bus = env
    backend = LocalBackend(h.root)
    ghost = PodSpec(name="ghost-worker-0-g0", job="ghost", node="worker-0", role="worker", index=0, generation=0,
                    cpu=0.5, memory_mb=128, command=["python", "-c", "import time; time.sleep(60)"])
    await backend.create(ghost)
    assert h.proc is not None and h.proc.svc is not None
    svc = h.proc.svc
    await ev.wait(lambda: "ghost-worker-0-g0" in svc.orphans)
    assert any(p.name == "ghost-worker-0-g0" and p.phase.value != "exited" for p in await backend.list("ghost"))
    await ev.wait(lambda: all(p.phase.value == "exited" for p in svc.pods.values() if p.job == "ghost"))
    assert "ghost-worker-0-g0" not in svc.orphans


def down_at_once(ev: Events, generation: int) -> int:
    """The most workers that were down together while they were replaced by pods of ``generation``."""
    down = most = 0
    for key, e in ev.items:
        if key == "node.died" and e.role == "worker" and e.generation == generation - 1:
            down += 1
        elif key == "node.running" and e.role == "worker" and e.generation == generation:
            down -= 1
        most = max(most, down)
    return most


async def test_new_worker_memory_replaces_the_running_workers_a_batch_at_a_time(
        env: tuple[Harness, Events, Bus]) -> None:
    """A plan with more worker memory, where pods cannot grow in place: every running worker is replaced
    by a pod with the new memory, two of the four at a time (fraction 0.5), highest slot first; the PS
    stays; ``applied`` once the last one runs."""
    h, ev, bus = env
    h.cfg.policy = ExecutorPolicy(relaunch_budget=2, resize_fraction=0.5, memory_in_place=False)
    await publish_plan(bus, plan(workers=4))
    await ev.wait(lambda: ev.of("executor.applied"))
    t0 = time.time()
    await publish_plan(bus, replace(plan(workers=4), worker_memory_mb=384))
    applied = await ev.wait(lambda: ev.of("executor.applied")[1:])
    workers = [f"worker-{i}" for i in range(4)]
    for w in workers:
        assert running(ev, w, 1)(), f"{w} was not replaced"
    created = {e.node: e.memory_mb for e in ev.of("node.created") if e.generation == 1}
    assert created == dict.fromkeys(workers, 384)
    died = [e for e in ev.of("node.died") if e.role == "worker"]
    assert [e.generation for e in died] == [0] * 4 and all(e.reason == "resized" and e.relaunch for e in died)
    assert {e.node for e in died[:2]} == {"worker-3", "worker-2"} and "worker-0" in {e.node for e in died[2:]}
    assert down_at_once(ev, 1) == 2  # two at a time: the other two kept training
    assert not [e for e in ev.of("node.died") if e.node == "ps-0"]  # the PS stays
    st = {n.node: n for n in (await status(bus)).nodes}
    assert (st["ps-0"].generation, st["ps-0"].memory_mb, st["ps-0"].phase.value) == (0, 256, "running")
    for w in workers:
        assert (st[w].memory_mb, st[w].generation, st[w].requested_restarts, st[w].restarts) == (384, 1, 1, 0)
    live = [p for p in await LocalBackend(h.root).list(JOB) if p.phase.value != "exited"]
    assert sorted((p.node, p.memory_mb) for p in live) == [("ps-0", 256)] + [(w, 384) for w in workers]
    # applied once the whole plan is in force: after every replacement runs, with the time that took
    last_running = max(i for i, (k, e) in enumerate(ev.items) if k == "node.running" and e.generation == 1)
    assert ev.items.index(("executor.applied", applied[0])) > last_running
    assert 0 < applied[0].overhead_s <= time.time() - t0 + 1.0
    assert applied[0].plan.worker_memory_mb == 384


async def test_more_memory_alone_grows_the_running_pods_in_place(env: tuple[Harness, Events, Bus]) -> None:
    """A plan that only raises the PS's and the workers' memory (what OOM prevention asks for): no pod
    stops, no migration; the running pods report the new limit and ``applied`` follows at once."""
    h, ev, bus = env
    await publish_plan(bus, plan(workers=2))
    await ev.wait(lambda: ev.of("executor.applied"))
    await publish_plan(bus, replace(plan(workers=2), worker_memory_mb=384, ps_memory_mb=512))
    applied = await ev.wait(lambda: ev.of("executor.applied")[1:])
    assert applied[0].plan.ps_memory_mb == 512 and applied[0].overhead_s < 30.0
    assert not ev.of("node.died")  # nothing stopped (a migration would retire ps-0 and restart the workers)
    assert [e.generation for e in ev.of("node.created")] == [0, 0, 0]
    live = {p.node: p for p in await LocalBackend(h.root).list(JOB) if p.phase.value != "exited"}
    assert {n: (p.generation, p.memory_mb) for n, p in live.items()} == {
        "ps-0": (0, 512), "worker-0": (0, 384), "worker-1": (0, 384)}
    st = {n.node: n for n in (await status(bus)).nodes}
    assert {n: (x.generation, x.memory_mb) for n, x in st.items()} == {
        "ps-0": (0, 512), "worker-0": (0, 384), "worker-1": (0, 384)}
    assert h.proc is not None and h.proc.svc is not None
    counts = h.proc.svc.counters.snapshot()
    assert sum(v for k, v in counts.items() if k.startswith("memory_grown")) == 3, counts


async def test_a_cluster_that_cannot_grow_pods_gets_the_plan_by_replacement(
        env: tuple[Harness, Events, Bus]) -> None:
    """The backend refuses the in-place resize: the refusal is counted and the workers' new memory comes
    the way it did before, by the rolling replacement (a new pod with 384 MiB each)."""
    h, ev, bus = env
    await h.stop()
    h.refusing = RefusingBackend(LocalBackend(h.root))
    await h.start()
    await publish_plan(bus, plan(workers=2))
    await ev.wait(lambda: ev.of("executor.applied"))
    await publish_plan(bus, replace(plan(workers=2), worker_memory_mb=384))
    await ev.wait(lambda: ev.of("executor.applied")[1:])
    created = {(e.node, e.generation): e.memory_mb for e in ev.of("node.created")}
    assert created[("worker-0", 1)] == created[("worker-1", 1)] == 384 and ("ps-0", 1) not in created
    assert h.refusing is not None and h.refusing.refused >= 1
    assert h.proc is not None and h.proc.svc is not None
    assert h.proc.svc.counters.snapshot().get("memory_grow_refused", 0) >= 1


async def test_a_replacement_decided_before_a_crash_is_carried_out_after_restart(
        env: tuple[Harness, Events, Bus]) -> None:
    """The executor saved a replacement's intent (worker-1 resize, worker-0 queued) and died before it stopped
    any pod: the next executor adopts the pods, stops worker-1, relaunches it with the new memory, then
    worker-0, and only then says the plan is applied."""
    h, ev, bus = env
    await publish_plan(bus, plan(workers=2))
    await ev.wait(lambda: ev.of("executor.applied"))
    await h.stop()
    kv = await bus.kv(subjects.EXECUTOR_BUCKET)
    ej = decode(ExecutorJob, (await kv.get(JOB)).value or b"")
    ej.plan, ej.applied = replace(ej.plan, worker_memory_mb=384), False
    for n in ej.nodes:
        if n.role == "worker":
            n.resize_cpu, n.resize_memory_mb = 0.5, 384
            n.intent = NodeIntent.RESIZE if n.node == "worker-1" else NodeIntent.NONE
    await kv.put(JOB, encode(ej))
    await h.start()
    await ev.wait(lambda: ev.of("executor.applied")[1:])
    died = [(e.node, e.generation, e.reason) for e in ev.of("node.died")]
    assert died == [("worker-1", 0, "resized"), ("worker-0", 0, "resized")]  # one at a time (2 x 0.25 -> 1)
    created = [(e.node, e.generation, e.memory_mb) for e in ev.of("node.created")][-2:]
    assert created == [("worker-1", 1, 384), ("worker-0", 1, 384)]
    st = {n.node: n for n in (await status(bus)).nodes}
    assert st["ps-0"].generation == 0 and st["ps-0"].phase.value == "running"
    assert st["worker-1"].memory_mb == st["worker-0"].memory_mb == 384


async def test_a_record_written_behind_the_executors_back_is_re_read_not_overwritten(
        env: tuple[Harness, Events, Bus]) -> None:
    """Record writes are compare-and-set: a write that lost is counted, the record read again and the work
    decided again from it, so what another writer saved survives (a blind put would have erased it)."""
    h, ev, bus = env
    await publish_plan(bus, plan())
    await ev.wait(lambda: ev.of("executor.applied"))
    kv = await bus.kv(subjects.EXECUTOR_BUCKET)
    ej = decode(ExecutorJob, (await kv.get(JOB)).value or b"")
    ej.reason, ej.commands = "noted by an operator", ["op-1"]
    await kv.put(JOB, encode(ej))  # someone else: the executor's revision is stale now
    cmd = ExecutorCommand(JOB, "worker-1", CommandKind.RESTART, "straggler", command_id="c2")
    res = await bus.request(subjects.executor_rpc(JOB, subjects.ExecutorOp.COMMAND), cmd, CommandResult,
                            retry=NO_RETRY)
    assert res.done and res.pod == launch.pod_name(JOB, "worker-1", 1)
    await ev.wait(running(ev, "worker-1", 1))
    assert h.proc is not None and h.proc.svc is not None
    assert h.proc.svc.counters.snapshot().get("kv_conflicts") == 1
    final = decode(ExecutorJob, (await kv.get(JOB)).value or b"")
    assert final.reason == "noted by an operator" and final.commands == ["op-1", "c2"]
    assert {n.node: n.generation for n in final.nodes}["worker-1"] == 1


async def test_a_job_whose_backend_hangs_holds_up_no_other_job(env: tuple[Harness, Events, Bus]) -> None:
    """One worker per job, no lock across jobs: while stopping a pod of ``slowjob`` hangs, ``exjob``'s
    command is carried out and both jobs answer their status; ``slowjob``'s command finishes once the
    backend does."""
    h, ev, bus = env
    await h.stop()
    h.gated = GatedBackend(LocalBackend(h.root), "slowjob")
    await h.start()
    spec = parse_job_spec("name: slowjob\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n")
    rec = JobRecord("slowjob", spec, JobState.PLANNING, time.time(), data_path="/data/train.rec", records=1000)
    await (await bus.kv(subjects.JOB_BUCKET)).put("slowjob", encode(rec))
    await publish_plan(bus, plan())
    await bus.publish_durable(subjects.job_event("slowjob", subjects.JobEventKind.PLAN),
                              replace(plan(), job="slowjob"))
    await ev.wait(lambda: {e.job for e in ev.of("executor.applied")} == {JOB, "slowjob"})
    gated = h.gated
    assert gated is not None
    gated.gate.clear()

    def restart(job: str) -> Any:
        return bus.request(subjects.executor_rpc(job, subjects.ExecutorOp.COMMAND),
                           ExecutorCommand(job, "worker-1", CommandKind.RESTART, "straggler"), CommandResult,
                           timeout=30.0, retry=NO_RETRY)

    slow = asyncio.ensure_future(restart("slowjob"))
    await asyncio.sleep(0.5)  # its worker now waits in the backend
    t0 = time.monotonic()
    res = await restart(JOB)
    await ev.wait(lambda: [e for e in ev.of("node.running") if (e.job, e.node, e.generation) == (JOB, "worker-1", 1)])
    assert res.done and time.monotonic() - t0 < 5.0
    st = await bus.request(subjects.executor_rpc("slowjob", subjects.ExecutorOp.STATUS), JobQuery("slowjob"),
                           ExecutorStatus, retry=NO_RETRY)
    assert st.state == "running" and not slow.done()
    gated.gate.set()
    assert (await slow).done
    await ev.wait(lambda: [e for e in ev.of("node.running")
                           if (e.job, e.node, e.generation) == ("slowjob", "worker-1", 1)])


async def test_a_stop_command_removes_the_node_for_good_and_a_later_command_is_refused(
        env: tuple[Harness, Events, Bus]) -> None:
    _h, ev, bus = env
    await publish_plan(bus, plan(workers=3))
    await ev.wait(lambda: ev.of("executor.applied"))
    subject = subjects.executor_rpc(JOB, subjects.ExecutorOp.COMMAND)
    res = await bus.request(subject, ExecutorCommand(JOB, "worker-2", CommandKind.STOP, "slow", command_id="s1"),
                            CommandResult, retry=NO_RETRY)
    assert res.done and res.detail == "stopping"
    died = await ev.wait(lambda: [e for e in ev.of("node.died") if e.node == "worker-2"])
    assert not died[0].relaunch  # its shards go back; no pod follows
    with pytest.raises(Conflict, match="removed"):
        await bus.request(subject, ExecutorCommand(JOB, "worker-2", CommandKind.RESTART), CommandResult,
                          retry=NO_RETRY)
    await asyncio.sleep(0.5)
    assert not [e for e in ev.of("node.created") if e.node == "worker-2" and e.generation > 0]
    st = {n.node: n for n in (await status(bus)).nodes}
    assert st["worker-2"].phase.value == "exited" and st["worker-1"].phase.value == "running"
