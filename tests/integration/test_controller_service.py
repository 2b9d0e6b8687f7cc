"""The controller service over a real nats-server, with the built-in policies as a real policy service.

The job's agents and the pod-executor are test doubles answering their real
subjects with real contract messages (they only record what they were asked);
whole TensorFlow jobs under the controller run in ``test_stragglers_e2e.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import InProcess, eventually
from nats.aio.msg import Msg
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.agent import ActionKind, ActionResult, GlobalAction
from pacer.contracts.executor import CommandKind, CommandResult, ExecutorCommand
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StragglerKind
from pacer.contracts.policy import ControllerDecision, PolicyAction, PolicyDecision, PolicyRequest
from pacer.embedded import EmbeddedNats
from pacer.jobs.spec import parse_job_spec
from pacer.policy import serve_policies
from pacer_services.controller.app import ControllerService, ControllerServiceConfig
from pacer_services.controller.core import ControllerConfig
from pacer_services.policy_service.app import PolicyService

pytestmark = pytest.mark.timeout(60)


def node(name: str, bpt: float, role: str = "worker", kind: StragglerKind = StragglerKind.NONE) -> NodeStats:
    return NodeStats(node=name, role=role, bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=256 / bpt,
                     samples_total=1000, cpu_percent=90.0, rss_bytes=1 << 28, last_seen=time.time(),
                     state=Liveness.RUNNING, pending_s=1.0, restarts=0, slowdown_short=bpt / 0.1,
                     slowdown_long=bpt / 0.1, straggler=kind)


def stats(job: str, nodes: list[NodeStats], busy: bool = False) -> JobStatistics:
    return JobStatistics(job=job, ts=time.time(), window_short_s=300.0, window_long_s=600.0,
                         throughput_samples_per_s=1000.0, nodes=nodes, cluster_busy=busy)


@dataclass
class Doubles:
    """The agents' primary and the executor of every job: record and acknowledge."""

    bus: Bus
    global_actions: list[GlobalAction] = field(default_factory=list)
    commands: list[ExecutorCommand] = field(default_factory=list)
    decisions: list[ControllerDecision] = field(default_factory=list)

    async def start(self) -> None:
        async def agent(msg: Msg) -> None:
            ga = decode(GlobalAction, msg.data)
            self.global_actions.append(ga)
            await self.bus.respond(msg, ActionResult(ga.action_id, True, 42, ["worker-0", "worker-1"],
                                                     job=ga.job, kind=ga.kind))

        async def executor(msg: Msg) -> None:
            cmd = decode(ExecutorCommand, msg.data)
            self.commands.append(cmd)
            await self.bus.respond(msg, CommandResult(cmd.job, cmd.node, cmd.command_id, True, "pod"))

        async def decision(msg: Msg) -> None:
            self.decisions.append(decode(ControllerDecision, msg.data))

        await self.bus.nc.subscribe("pacer.rpc.agent.*.global_action", cb=agent)
        await self.bus.nc.subscribe("pacer.rpc.executor.*.command", cb=executor)
        await self.bus.nc.subscribe("pacer.events.controller.*.decision", cb=decision)
        await self.bus.nc.flush()

    async def wait(self, check: Callable[[], Any], within: float = 15.0) -> Any:
        return await eventually(check, within, lambda: f"decisions so far: {self.decisions}")


async def add_job(bus: Bus, job: str, policy: str, mode: str = "bsp") -> None:
    spec = parse_job_spec(f"name: {job}\nmodel: wide_deep\ndataset:\n  path: /d.rec\nbatch_size: 512\n"
                          f"mode: {mode}\npolicies: {{straggler: {policy}}}\n")
    plan = ResourcePlan(job, 2, 2, 1.0, 2048, 1.0, 2048, PlanSource.DEFAULT)
    kv = await bus.kv(subjects.JOB_BUCKET)
    await kv.put(job, encode(JobRecord(job, spec, JobState.RUNNING, time.time(), plan=plan)))


@pytest.fixture
async def env(nats_server: EmbeddedNats, bus: Bus) -> AsyncIterator[Doubles]:
    cfg = ControllerServiceConfig(decide_every_s=0.0, policy_timeout_s=1.0,
                                  # the mechanics of a round: scripted policies on flat statistics, which the
                                  # never-worse guard would refuse as noise-chasing (its own tests: test_controller_core)
                                  core=ControllerConfig(cooldown_s=3600.0, max_restarts_per_window=5, guard=False))
    ctl = InProcess(nats_server.url, lambda b: ControllerService(b, cfg))
    pol = InProcess(nats_server.url, PolicyService)
    await pol.start()
    await ctl.start()
    d = Doubles(bus)
    await d.start()
    yield d
    await ctl.stop()
    await pol.stop()


async def publish(bus: Bus, st: JobStatistics) -> None:
    await bus.publish(subjects.monitor_statistics(st.job), st)


async def test_antdt_nd_restarts_a_persistent_worker_straggler_once_per_cooldown(env: Doubles, bus: Bus) -> None:
    await add_job(bus, "j1", "antdt-nd")
    nodes = [node("worker-0", 0.1), node("worker-1", 0.5, kind=StragglerKind.PERSISTENT),
             node("ps-0", 0.1, "ps"), node("ps-1", 0.1, "ps")]
    await publish(bus, stats("j1", nodes))
    d = await env.wait(lambda: [x for x in env.decisions if x.job == "j1"])
    assert any(a.kind is ActionKind.KILL_RESTART and a.node == "worker-1" for a in d[0].executed)
    assert d[0].decision_ms > 0  # timed by the policy service that served the pure policy
    cmd = await env.wait(lambda: [c for c in env.commands if c.job == "j1"])
    assert cmd[0].node == "worker-1" and cmd[0].kind is CommandKind.RESTART and cmd[0].command_id
    await publish(bus, stats("j1", nodes))  # the same straggler again: within the cool-down
    d = await env.wait(lambda: [x for x in env.decisions if x.job == "j1"][1:])
    assert not any(a.kind is ActionKind.KILL_RESTART for a in d[0].executed)
    assert len([c for c in env.commands if c.job == "j1"]) == 1


async def test_cluster_busy_blocks_kill_restart_and_a_slow_ps_is_migrated(env: Doubles, bus: Bus) -> None:
    await add_job(bus, "j2", "antdt-nd")
    slow_worker = [node("worker-0", 0.1), node("worker-1", 0.5, kind=StragglerKind.PERSISTENT),
                   node("ps-0", 0.1, "ps")]
    await publish(bus, stats("j2", slow_worker, busy=True))
    d = await env.wait(lambda: [x for x in env.decisions if x.job == "j2"])
    assert not any(a.kind is ActionKind.KILL_RESTART for a in d[0].executed)
    assert not [c for c in env.commands if c.job == "j2"]
    await add_job(bus, "j3", "antdt-nd")
    slow_ps = [node("worker-0", 0.1), node("worker-1", 0.1), node("ps-0", 0.1, "ps"),
               node("ps-1", 0.6, "ps", kind=StragglerKind.PERSISTENT)]
    await publish(bus, stats("j3", slow_ps))
    cmd = await env.wait(lambda: [c for c in env.commands if c.job == "j3"])
    assert cmd[0].node == "ps-1" and cmd[0].kind is CommandKind.MIGRATE  # a fresh pod, state kept


async def test_transient_straggler_gets_adjust_bs_through_the_primary_agent(env: Doubles, bus: Bus) -> None:
    await add_job(bus, "j4", "antdt-nd")
    nodes = [node("worker-0", 0.1), node("worker-1", 0.3, kind=StragglerKind.TRANSIENT), node("ps-0", 0.1, "ps")]
    await publish(bus, stats("j4", nodes))
    ga = await env.wait(lambda: [g for g in env.global_actions if g.job == "j4"])
    sizes = ga[0].payload["batch_sizes"]
    assert ga[0].kind is ActionKind.ADJUST_BS and sum(sizes.values()) == 512
    assert sizes["worker-1"] < sizes["worker-0"]


async def test_a_custom_policy_service_receives_the_window_and_its_actions_run(env: Doubles, bus: Bus) -> None:
    # decide runs in a worker process of the policy (pacer.policy): what it saw comes back in its reason.
    def decide(req: PolicyRequest) -> PolicyDecision:
        return PolicyDecision(req.job, "halve-lr", [PolicyAction(ActionKind.ADJUST_LR, payload={"scale": 0.5},
                                                                 reason="custom")],
                              reason=f"always halve (saw {req.stats.job}, B={req.global_batch}, {req.mode})")

    subs = await serve_policies(bus, {"halve-lr": decide})
    await add_job(bus, "j5", "halve-lr")
    await publish(bus, stats("j5", [node("worker-0", 0.1), node("worker-1", 0.1)]))
    ga = await env.wait(lambda: [g for g in env.global_actions if g.job == "j5"])
    assert ga[0].kind is ActionKind.ADJUST_LR and ga[0].payload == {"scale": 0.5}
    d = await env.wait(lambda: [x for x in env.decisions if x.job == "j5"])
    assert d[0].policy == "halve-lr" and not d[0].fallback
    assert d[0].reason == "always halve (saw j5, B=512, bsp)"
    await subs.close()


async def test_a_ps_restart_goes_to_the_executor_as_the_policy_chose_it(env: Doubles, bus: Bus) -> None:
    """``migration: restart`` is the executor's stop-and-restart, ``seamless`` its migration (AntDT §V-E2)."""
    for job, how, kind in (("j6", "restart", CommandKind.RESTART), ("j7", "seamless", CommandKind.MIGRATE)):
        def decide(req: PolicyRequest, how: str = how) -> PolicyDecision:
            return PolicyDecision(req.job, f"ps-{how}", [PolicyAction(
                ActionKind.KILL_RESTART, node="ps-1", payload={"migration": how}, reason="slow PS")])

        subs = await serve_policies(bus, {f"ps-{how}": decide})
        await add_job(bus, job, f"ps-{how}")
        await publish(bus, stats(job, [node("worker-0", 0.1), node("ps-0", 0.1, "ps"), node("ps-1", 0.4, "ps")]))
        cmd = await env.wait(lambda job=job: [c for c in env.commands if c.job == job])
        assert cmd[0].node == "ps-1" and cmd[0].kind is kind, how
        await subs.close()


async def test_malformed_or_missing_policy_replies_fall_back_to_none(env: Doubles, bus: Bus) -> None:
    async def garbage(msg: Msg) -> None:
        await bus.nc.publish(msg.reply, b"\x93not a decision")

    async def wrong_job(msg: Msg) -> None:
        await bus.respond(msg, PolicyDecision("someone-else", "x", [PolicyAction(ActionKind.ADJUST_LR)]))

    await bus.nc.subscribe(subjects.policy_decide("garbage"), cb=garbage)
    await bus.nc.subscribe(subjects.policy_decide("wrong-job"), cb=wrong_job)
    for job, policy in (("j6", "garbage"), ("j7", "wrong-job"), ("j8", "nobody-serves-this")):
        await add_job(bus, job, policy)
        await publish(bus, stats(job, [node("worker-0", 0.1), node("worker-1", 0.1)]))
    for job in ("j6", "j7", "j8"):
        d = await env.wait(lambda j=job: [x for x in env.decisions if x.job == j])
        assert d[0].fallback and not d[0].executed and "none" in d[0].reason, (job, d[0].reason)
    assert not [g for g in env.global_actions if g.job in ("j6", "j7", "j8")]


async def test_jobs_that_are_not_running_are_left_alone(env: Doubles, bus: Bus) -> None:
    await add_job(bus, "j9", "antdt-nd")
    kv = await bus.kv(subjects.JOB_BUCKET)
    rec = decode(JobRecord, (await kv.get("j9")).value)
    from dataclasses import replace

    await kv.put("j9", encode(replace(rec, state=JobState.COMPLETED)))
    await publish(bus, stats("j9", [node("worker-0", 0.1), node("worker-1", 0.5, kind=StragglerKind.PERSISTENT)]))
    await publish(bus, stats("nojob", [node("worker-0", 0.1)]))
    await bus.nc.publish(subjects.monitor_statistics("j9"), b"garbage")
    await asyncio.sleep(1.0)
    assert not [x for x in env.decisions if x.job in ("j9", "nojob")]
    assert not env.commands


async def test_batch_sizes_go_again_to_a_relaunched_worker_once_every_worker_runs(env: Doubles, bus: Bus) -> None:
    """The core's re-send (BSP): ADJUST_BS, then KILL_RESTART of worker-1, then the sizes again."""
    script = [
        [PolicyAction(ActionKind.ADJUST_BS, payload={"batch_sizes": {"worker-0": 384, "worker-1": 128}})],
        [PolicyAction(ActionKind.KILL_RESTART, node="worker-1", reason="slow")],
        [],
    ]

    def decide(req: PolicyRequest) -> PolicyDecision:  # in the policy's one worker process: the script runs down there
        return PolicyDecision(req.job, "scripted", script.pop(0) if script else [])

    subs = await serve_policies(bus, {"scripted": decide})
    await add_job(bus, "j10", "scripted")
    nodes = [node("worker-0", 0.1), node("worker-1", 0.1), node("ps-0", 0.1, "ps")]
    for rounds in (1, 2, 3):
        await publish(bus, stats("j10", nodes))
        await env.wait(lambda n=rounds: len([x for x in env.decisions if x.job == "j10"]) >= n or None)
    d = [x for x in env.decisions if x.job == "j10"]
    assert [a.kind for a in d[1].executed] == [ActionKind.KILL_RESTART]
    assert [a.kind for a in d[2].executed] == [ActionKind.ADJUST_BS] and "re-send" in d[2].executed[0].reason
    sent = [g for g in env.global_actions if g.job == "j10"]
    assert [g.payload["batch_sizes"] for g in sent] == [{"worker-0": 384, "worker-1": 128}] * 2
    await subs.close()
