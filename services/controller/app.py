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
   comes back fresh); KILL_RESTART of a PS as the policy chose in the
   payload's ``migration``: ``seamless`` (also when it does not say) is a
   ``migrate`` to a fresh pod with the same resources (DLRover-RM §5.2),
   ``restart`` the executor's stop-and-restart (checkpoint, stop, a new PS,
   restore; AntDT §V-E2); a bare PS restart would lose its variables;
5. the core records what was done (``ControllerCore.applied``: cool-downs,
   the job's setup) and the round is published as
   ``pacer.events.controller.<job>.decision`` with every executed, refused
   and failed action and its reason.

This module is the IO shell: the same core drives the cluster simulator
(``pacer_services.simulator.stragglers``).

Several instances (issue 13)
----------------------------
Every instance hears every job's statistics (a plain subscription, no queue
group and no consumer: statistics are periodic snapshots, a lost one is
replaced by the next) and acts only on the jobs it owns (:class:`pacer.ownership.Ownership`, lease
``controller.<job>``, claimed on the first statistics of a running job).
The job's state (:mod:`pacer_services.controller.state`: setup, cool-downs,
re-send flag, last round) lives in KV beside the lease
(``state.controller.<job>`` of ``pacer-leases``), written only through the
lease (fenced): a new owner loads it and continues the cool-downs.  Before a
KILL_RESTART is carried out, the restart is written there first as an
intention: a stale owner's intention is refused by the server (and the
restart not executed), and if the owner dies after its intention was
stored, the next owner counts the node as restarted (cool-down) whether or
not the command went out: a KILL_RESTART is executed at most once per
decision across a hand-over.  Losing the lease cancels the job's round in
flight.
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
from pacer.lease import Lease, LeaseLost
from pacer.ownership import DEFAULT_TTL_S, Ownership
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.controller.core import (
    DEFAULT_MIGRATION,
    ControllerConfig,
    ControllerCore,
    JobSetup,
    round_due,
)
from pacer_services.controller.state import decode_state, encode_state, restore, snapshot

log = logging.getLogger("pacer.controller")


@dataclass
class ControllerServiceConfig:
    decide_every_s: float = 300.0  # AntDT §VII-A: the monitor aggregates and actions are taken every 5 min
    policy_timeout_s: float = 5.0
    action_timeout_s: float = 30.0  # a global action's two phases, or an executor command
    core: ControllerConfig = field(default_factory=ControllerConfig)
    lease_ttl_s: float = DEFAULT_TTL_S  # a dead owner's jobs are taken over about this long after
    sweep_every_s: float = 30.0  # how often owned jobs that no longer run are given up
    instance: str | None = None  # None: PACER_INSTANCE, else controller-<random>

    @classmethod
    def from_env(cls) -> ControllerServiceConfig:
        """``PACER_CONTROLLER_EVERY_S``, ``PACER_CONTROLLER_COOLDOWN_S``, ``PACER_POLICY_TIMEOUT_S``,
        ``PACER_LEASE_TTL_S`` (``PACER_INSTANCE`` names the instance)."""
        env = os.environ
        return cls(decide_every_s=float(env.get("PACER_CONTROLLER_EVERY_S", cls.decide_every_s)),
                   policy_timeout_s=float(env.get("PACER_POLICY_TIMEOUT_S", cls.policy_timeout_s)),
                   core=ControllerConfig(cooldown_s=float(env.get("PACER_CONTROLLER_COOLDOWN_S", "600")),
                                         guard=env.get("PACER_CONTROLLER_GUARD", "1") != "0"),
                   lease_ttl_s=float(env.get("PACER_LEASE_TTL_S", DEFAULT_TTL_S)))


@dataclass
class JobControl:
    """The owner's bookkeeping of one job; the job's setup and cool-downs live in its core (and in KV)."""

    core: ControllerCore
    last: float = 0.0  # when the last round ran
    busy: bool = False  # a round is in flight
    task: asyncio.Task[None] | None = None  # the round in flight


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
        self.own = Ownership(bus, self.name, self._acquired, self._lost, instance=self.cfg.instance,
                             ttl_s=self.cfg.lease_ttl_s)

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        await self.bus.ensure_streams()
        self._kv = await self.bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
        await self.own.start(tg)
        # No queue group: every instance hears every job, the owner acts.
        self._sub = await self.bus.nc.subscribe(subjects.events_of(subjects.MONITOR_SERVICE, kind="statistics"),
                                                cb=tracing.traced("consume controller.statistics", self._on_statistics))
        await self.bus.nc.flush()
        tg.create_task(self._sweep_loop(), name="pacer:controller:sweep")

    async def drain(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        if self._tasks:
            await asyncio.wait(self._tasks)
        await self.own.close()  # hand the jobs over at once

    # ================================================================ ownership
    async def _acquired(self, job: str, lease: Lease) -> None:
        """We own ``job`` now: its core from the record, then its state from KV (the last owner's)."""
        rec = await self._record(job)
        if rec is None:
            raise PacerError(f"no record of job {job!r}")
        core = ControllerCore(rec.job, JobSetup.of_record(rec), self.cfg.core, policy=rec.spec.policies.straggler)
        ctl = JobControl(core)
        data = await self.own.get_state(job)
        if data:
            try:
                st = decode_state(data)
                restore(core, st)
                ctl.last = st.last
            except ValueError:
                self.counters.inc("bad_state")
                log.warning("unreadable controller state, starting from the record", extra={"fields": {"job": job}})
        self.jobs[job] = ctl
        self.counters.inc("jobs_acquired")

    async def _lost(self, job: str) -> None:
        """Someone else owns ``job`` (or we stop): drop its core, cancel its round in flight."""
        ctl = self.jobs.pop(job, None)
        if ctl is not None and ctl.task is not None and ctl.task is not asyncio.current_task():
            ctl.task.cancel()
        self.counters.inc("jobs_lost")

    async def _forget(self, job: str) -> None:
        """``job`` no longer runs: its state goes, the lease is given up."""
        self.jobs.pop(job, None)
        if self.own.owns(job):
            await self.own.delete_state(job)
        await self.own.drop(job)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_every_s)
            for job in list(self.own.jobs):
                with contextlib.suppress(Exception):
                    rec = await self._record(job)
                    if rec is None or rec.state is not JobState.RUNNING:
                        await self._forget(job)

    # ================================================================ statistics in
    async def _on_statistics(self, msg: Msg) -> None:
        try:
            stats = decode(JobStatistics, msg.data)
        except PacerError:
            self.counters.inc("bad_events")
            return
        ctl = self.jobs.get(stats.job)
        if ctl is not None and (ctl.busy or not round_due(ctl.last, self.clock(), self.cfg.decide_every_s, stats)):
            return
        st = self.own.jobs.get(stats.job)
        if ctl is None and st is not None and st.attempted.is_set() and not self.own.owns(stats.job):
            return  # another instance owns the job; our lease loop keeps watching it
        assert self._tg is not None
        task = self._tg.create_task(self._round(stats), name=f"pacer:controller:{stats.job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, job: str) -> JobRecord | None:
        assert self._kv is not None
        return await Bus.kv_get(self._kv, job, JobRecord)

    async def _round(self, stats: JobStatistics) -> None:
        """One decision round for one job; every failure ends in a counted, published reason."""
        try:
            rec = await self._record(stats.job)
        except PacerError:
            self.counters.inc("errors", op="record")
            return
        if rec is None or rec.state is not JobState.RUNNING:
            await self._forget(stats.job)  # not (or no longer) running: nothing to control
            return
        if not self.own.owns(rec.job) and not await self.own.claim(rec.job):
            return  # another instance owns it
        ctl = self.jobs.get(rec.job)
        if ctl is None or ctl.busy or not round_due(ctl.last, self.clock(), self.cfg.decide_every_s, stats):
            return
        ctl.busy, ctl.last, ctl.task = True, self.clock(), asyncio.current_task()
        t0 = time.perf_counter()
        try:
            await self._decide(rec, ctl, stats, t0)
        except asyncio.CancelledError:
            self.counters.inc("rounds_cancelled")  # the lease was lost: the new owner goes on
        except Exception:  # the round's boundary: the next window tries again
            self.counters.inc("internal_errors", op="round")
            log.exception("decision round failed", extra={"fields": {"job": stats.job}})
        finally:
            ctl.busy, ctl.task = False, None

    async def _decide(self, rec: JobRecord, ctl: JobControl, stats: JobStatistics, t0: float) -> None:
        """IO around the core's round: ask the policy, carry the planned actions out, publish the outcome."""
        now = self.clock()
        req = ctl.core.request(stats, now)
        rnd = ctl.core.round(req, await self._ask(ctl.core.policy, req), now)
        planned = [(a.node, now) for a in rnd.execute if a.kind is ActionKind.KILL_RESTART]
        if planned and not await self._save(rec.job, ctl, planned):
            return  # no recorded intention, no restart: the next round (or owner) decides again
        errors = []
        for action in rnd.execute:
            if not self.own.owns(rec.job):
                errors.append("lease lost: not executed by this instance")
                continue
            errors.append(await self._execute(rec, stats, action))
        out = ctl.core.applied(rnd, errors, now, round_ms=(time.perf_counter() - t0) * 1e3)
        await self._save(rec.job, ctl)
        for action in out.executed:
            self.counters.inc("actions", kind=action.kind.value)
        for failed in out.failed:
            self.counters.inc("actions_failed", kind=failed.kind)
        if out.fallback:
            self.counters.inc("fallbacks")
        await self.bus.publish_durable(subjects.controller_decision(rec.job), out)
        self.counters.inc("rounds")

    async def _save(self, job: str, ctl: JobControl, planned: list[tuple[str, float]] | None = None) -> bool:
        """Write the job's state through our lease (with ``planned`` restarts as an intention); whether stored."""
        try:
            await self.own.put_state(job, encode_state(snapshot(ctl.core, ctl.last, planned or ())))
            return True
        except LeaseLost:
            self.counters.inc("fenced")
            log.warning("state write refused: the job has another owner", extra={"fields": {"job": job}})
        except (nats.errors.Error, TimeoutError, nats.js.errors.Error) as exc:
            self.counters.inc("errors", op="state")
            log.warning("state not stored: %s", exc, extra={"fields": {"job": job}})
        return False

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

    def _command_id(self, job: str) -> str:
        return f"{job}-{self.own.instance}-c{next(self._ids)}-{int(self.clock())}"

    async def _execute(self, rec: JobRecord, stats: JobStatistics, action: PolicyAction) -> str:
        """Carry one reviewed action out; returns an error text, or "" when done."""
        job = rec.job
        try:
            if action.kind in GLOBAL_KINDS:
                ga = GlobalAction(job, self._command_id(job), action.kind,
                                  dict(action.payload), action.reason)
                res = await self.bus.request(subjects.agent_global_action(job), ga, ActionResult,
                                             timeout=self.cfg.action_timeout_s, retry=NO_RETRY)
                return "" if res.applied else f"not applied: {res.detail}"
            if action.kind is ActionKind.KILL_RESTART:
                role = next((n.role for n in stats.nodes if n.node == action.node), "")
                # A PS: the policy's choice (AntDT §V-E2 time cost vs gain) of a stop-and-restart
                # (RESTART) or a seamless migration (MIGRATE; also when the policy does not say).
                how = action.payload.get("migration", DEFAULT_MIGRATION)
                kind = CommandKind.MIGRATE if role == Role.PS and how == "seamless" else CommandKind.RESTART
                cmd = ExecutorCommand(job, action.node, kind, action.reason or "KILL_RESTART",
                                      command_id=self._command_id(job))
                out = await self.bus.request(subjects.executor_rpc(job, subjects.ExecutorOp.COMMAND), cmd,
                                             CommandResult, timeout=self.cfg.action_timeout_s, retry=NO_RETRY)
                return "" if out.done else f"not done: {out.detail}"
            return f"unsupported action {action.kind.value}"
        except PacerError as exc:
            return f"{exc.code}: {exc.message}"


async def create(bus: Bus, rc: RuntimeConfig) -> ControllerService:
    """App factory: the only place that builds a ControllerService from configuration."""
    return ControllerService(bus, ControllerServiceConfig.from_env())
