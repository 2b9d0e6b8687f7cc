"""The controller service: statistics in, a policy's decision out, actions carried out (AntDT §V-E).

For every running job, on the monitor's statistics
(``pacer.events.monitor.<job>.statistics``), at most once per
``decide_every_s`` (AntDT: every 5 minutes):

1. the pure :class:`~pacer_services.controller.core.ControllerCore` builds a
   :class:`~pacer.contracts.policy.PolicyRequest` (the window, the job's
   batch sizes, the nodes in KILL_RESTART cool-down);
2. the job's policy service answers on ``pacer.policy.<name>.decide``
   (``spec.policies.straggler``; the built-ins are services too);
3. the core plans the round (``ControllerCore.round``): it reviews the
   decision (AntDT §V-E2, time cost vs gain): KILL_RESTART only when the
   cluster is not busy, not twice for one node within the cool-down, at most
   one per window; batch sizes must cover the live workers and sum to B; a
   malformed or missing reply -> ``none`` for this round (``fallback``);
   and it puts first a re-send of the batch sizes to a relaunched worker;
4. this service carries the planned actions out: global actions (ADJUST_BS, ADJUST_LR,
   BACKUP_WORKERS) through the job's primary agent, which applies them in one
   iteration on every worker; KILL_RESTART of a worker through the
   pod-executor's ``restart`` (the node's shards go back at once, the pod
   comes back fresh); KILL_RESTART of a PS through a seamless ``migrate`` to a
   fresh pod with the same resources (DLRover-RM §5.2: a bare PS restart
   would lose its variables);
5. the core records what was done (``ControllerCore.applied``: cool-downs,
   the job's setup) and the round is published as
   ``pacer.events.controller.<job>.decision`` with every executed, refused
   and failed action and its reason.

This module is the IO shell: the same core drives the cluster simulator
(``pacer_services.simulator.stragglers``).  State (cool-downs, current batch
sizes) is in memory, in each job's core: after a restart the
controller starts from the job's spec (batch sizes B/n) and an empty
cool-down; the executor's relaunch budget still bounds restarts.  Run one
instance (statistics arrive in a queue group, so a second instance would
only share the load, with separate cool-downs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pacer import subjects, tracing
from pacer.bus import NO_RETRY, Bus
from pacer.codec import decode
from pacer.contracts.agent import GLOBAL_KINDS, ActionKind, ActionResult, GlobalAction
from pacer.contracts.common import Role
from pacer.contracts.executor import CommandKind, CommandResult, ExecutorCommand
from pacer.contracts.jobs import JobRecord, JobState
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
from pacer.errors import PacerError
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.controller.core import ControllerConfig, ControllerCore, JobSetup

log = logging.getLogger("pacer.controller")


@dataclass
class ControllerServiceConfig:
    decide_every_s: float = 300.0  # AntDT §VII-A: the monitor aggregates and actions are taken every 5 min
    policy_timeout_s: float = 5.0
    action_timeout_s: float = 30.0  # a global action's two phases, or an executor command
    core: ControllerConfig = field(default_factory=ControllerConfig)

    @classmethod
    def from_env(cls) -> ControllerServiceConfig:
        """``PACER_CONTROLLER_EVERY_S``, ``PACER_CONTROLLER_COOLDOWN_S``, ``PACER_POLICY_TIMEOUT_S``."""
        env = os.environ
        return cls(decide_every_s=float(env.get("PACER_CONTROLLER_EVERY_S", cls.decide_every_s)),
                   policy_timeout_s=float(env.get("PACER_POLICY_TIMEOUT_S", cls.policy_timeout_s)),
                   core=ControllerConfig(cooldown_s=float(env.get("PACER_CONTROLLER_COOLDOWN_S", "600"))))


@dataclass
class JobControl:
    """The service's bookkeeping of one job; the job's setup and cool-downs live in its core."""

    core: ControllerCore
    last: float = 0.0  # when the last round ran
    busy: bool = False  # a round is in flight


class ControllerService:
    name = subjects.CONTROLLER_SERVICE

    def __init__(self, bus: Bus, cfg: ControllerServiceConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.bus = bus
        self.cfg = cfg or ControllerServiceConfig()
        self.clock = clock
        self.counters = Counters(self.name)
        self.jobs: dict[str, JobControl] = {}
        self._ids = itertools.count(1)
        self._kv: KeyValue | None = None
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        await self.bus.ensure_streams()
        self._kv = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
        self._sub = await self.bus.nc.subscribe(subjects.events_of(subjects.MONITOR_SERVICE, kind="statistics"),
                                                queue=self.name,
                                                cb=tracing.traced("consume controller.statistics", self._on_statistics))
        await self.bus.nc.flush()

    async def drain(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        if self._tasks:
            await asyncio.wait(self._tasks)

    # ================================================================ statistics in
    async def _on_statistics(self, msg: Msg) -> None:
        try:
            stats = decode(JobStatistics, msg.data)
        except PacerError:
            self.counters.inc("bad_events")
            return
        ctl = self.jobs.get(stats.job)
        if ctl is not None and (ctl.busy or self.clock() - ctl.last < self.cfg.decide_every_s):
            return
        assert self._tg is not None
        task = self._tg.create_task(self._round(stats), name=f"pacer:controller:{stats.job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, job: str) -> JobRecord | None:
        assert self._kv is not None
        return await Bus.kv_get(self._kv, job, JobRecord)

    def _control(self, rec: JobRecord) -> JobControl:
        ctl = self.jobs.get(rec.job)
        if ctl is None:
            core = ControllerCore(rec.job, JobSetup.of_record(rec), self.cfg.core, policy=rec.spec.policies.straggler)
            ctl = self.jobs[rec.job] = JobControl(core)
        return ctl

    async def _round(self, stats: JobStatistics) -> None:
        """One decision round for one job; every failure ends in a counted, published reason."""
        try:
            rec = await self._record(stats.job)
        except PacerError:
            self.counters.inc("errors", op="record")
            return
        if rec is None or rec.state is not JobState.RUNNING:
            self.jobs.pop(stats.job, None)  # not (or no longer) running: nothing to control
            return
        ctl = self._control(rec)
        if ctl.busy:
            return
        ctl.busy, ctl.last = True, self.clock()
        t0 = time.perf_counter()
        try:
            await self._decide(rec, ctl, stats, t0)
        except Exception:  # the round's boundary: the next window tries again
            self.counters.inc("internal_errors", op="round")
            log.exception("decision round failed", extra={"fields": {"job": stats.job}})
        finally:
            ctl.busy = False

    async def _decide(self, rec: JobRecord, ctl: JobControl, stats: JobStatistics, t0: float) -> None:
        """IO around the core's round: ask the policy, carry the planned actions out, publish the outcome."""
        now = self.clock()
        req = ctl.core.request(stats, now)
        rnd = ctl.core.round(req, await self._ask(ctl.core.policy, req), now)
        errors = [await self._execute(rec, stats, action) for action in rnd.execute]
        out = ctl.core.applied(rnd, errors, now, round_ms=(time.perf_counter() - t0) * 1e3)
        for action in out.executed:
            self.counters.inc("actions", kind=action.kind.value)
        for failed in out.failed:
            self.counters.inc("actions_failed", kind=failed.kind)
        if out.fallback:
            self.counters.inc("fallbacks")
        await self.bus.publish_durable(subjects.controller_decision(rec.job), out)
        self.counters.inc("rounds")

    async def _ask(self, policy: str, req: PolicyRequest) -> PolicyDecision | str:
        """The policy's decision, or why there is none usable."""
        try:
            decision = await self.bus.request(subjects.policy_decide(policy), req, PolicyDecision,
                                              timeout=self.cfg.policy_timeout_s, retry=NO_RETRY)
        except PacerError as exc:
            self.counters.inc("policy_errors", code=exc.code)
            return f"{exc.code}: {exc.message}"
        if decision.job != req.job:
            return f"the reply names job {decision.job!r}, not {req.job!r}"
        return decision

    async def _execute(self, rec: JobRecord, stats: JobStatistics, action: PolicyAction) -> str:
        """Carry one reviewed action out; returns an error text, or "" when done."""
        job = rec.job
        try:
            if action.kind in GLOBAL_KINDS:
                ga = GlobalAction(job, f"{job}-c{next(self._ids)}-{int(self.clock())}", action.kind,
                                  dict(action.payload), action.reason)
                res = await self.bus.request(subjects.agent_global_action(job), ga, ActionResult,
                                             timeout=self.cfg.action_timeout_s, retry=NO_RETRY)
                return "" if res.applied else f"not applied: {res.detail}"
            if action.kind is ActionKind.KILL_RESTART:
                role = next((n.role for n in stats.nodes if n.node == action.node), "")
                kind = CommandKind.MIGRATE if role == Role.PS else CommandKind.RESTART
                cmd = ExecutorCommand(job, action.node, kind, action.reason or "KILL_RESTART",
                                      command_id=f"{job}-c{next(self._ids)}-{int(self.clock())}")
                out = await self.bus.request(subjects.executor_rpc(job, subjects.ExecutorOp.COMMAND), cmd,
                                             CommandResult, timeout=self.cfg.action_timeout_s, retry=NO_RETRY)
                return "" if out.done else f"not done: {out.detail}"
            return f"unsupported action {action.kind.value}"
        except PacerError as exc:
            return f"{exc.code}: {exc.message}"


async def create(bus: Bus, rc: RuntimeConfig) -> ControllerService:
    """App factory: the only place that builds a ControllerService from configuration."""
    return ControllerService(bus, ControllerServiceConfig.from_env())
