"""The monitor service: events in, per-job statistics out (AntDT section V-D).

Inputs come from the ``PACER_EVENTS`` stream (filters in
:func:`pacer.subjects.monitor_inputs`): agent metrics, node events and the
shard service's progress events; and, on a plain subscription, the agents'
heartbeats, which are live only (:data:`pacer.subjects.LIVE_EVENTS`: never
stored, so neither replayed nor acked; the next one, a second later,
replaces a lost one).  Each is decoded by a thin handler and folded into
the pure :class:`MonitorCore`.  Outputs:

* ``pacer.events.monitor.<job>.statistics``: a :class:`JobStatistics` every
  ``interval_s`` for every job with data in the last long window L_per;
* ``pacer.rpc.monitor.<job>.stats``: :class:`StatsQuery` -> :class:`JobStatistics`
  (``not_found`` error reply for a job the monitor knows nothing about);
* ``pacer.svc.monitor.health`` (the runtime), ``pacer.deadletter.monitor``.

Time
----
``now`` comes from the injected ``clock``, which must be *wall* time (unix
seconds): agent metrics carry wall timestamps.  An event that waited in the
stream (published while the monitor was down, or replayed) is observed at
the time the stream stored it (``min(clock(), stored)``), so a backlog lands
in the past, where it was, and a node silent since then does not look alive.

Restart: the windows are rebuilt, not persisted
-----------------------------------------------
The core's state is in memory only.  On start the monitor (1) binds its
durable pull consumer (created with ``DeliverPolicy.NEW`` on first use), then
(2) replays the stream from ``now - L_per`` with a fresh ephemeral consumer
(``DeliverPolicy.BY_START_TIME``): exactly what the windows can hold, and
(3) only then answers queries and consumes the durable consumer, acking
without re-applying what the replay already applied (stream sequence <= the
last replayed one).  Statistics after a restart therefore match those before
it, as long as the stream still retains the window (it keeps 7 days).
Heartbeats are not replayed (they are not stored): a node's liveness comes
from its replayed metrics until its next heartbeat, a second later.

Concurrency contract
--------------------
One consumer loop applies events in stream order (so a node's ``died`` and
its late metrics are seen in the order they were stored); the core is
synchronous and never awaited in the middle of an update, so queries and the
publish loop, which run on the same event loop, always see a consistent
state.  Acks are explicit: ack after applying; a message that can never be
applied is terminated, dead-lettered (header ``Pacer-Error``) and counted;
nothing in a message can stop the loop.

Several instances (issue 13)
----------------------------
Every instance consumes *every* input event with a durable consumer of its
own (``monitor-<instance>``, deleted by the server after ``inactive_s``
without its instance), so every instance holds every job's windows: a hot
standby.  Per-job durable consumers bound by an owner were the alternative;
they would make a new owner replay the window before it could answer, and
the windows are a small pure fold of a stream that every instance can read,
so replicating the fold is cheaper and makes a hand-over instant.  What must
not happen twice is the output: each job is owned by one instance
(:class:`pacer.ownership.Ownership`, lease ``monitor.<job>``, competed for
as soon as an event names the job), and only the owner publishes the job's
statistics.  Nothing is persisted: the windows are rebuilt from the stream
(above).  A ``stats`` request that reaches a non-owner is forwarded to the
owner (which answers the client directly); when no owner can be found the
receiver answers itself, which is correct since it holds the same windows.

Cluster information (AntDT V-D "third party"): the pod-executor publishes
its backend's queue and capacity on ``pacer.events.cluster._cluster.status``
(:class:`~pacer.contracts.executor.ClusterStatus`); the core derives
``cluster_busy`` of every job's statistics from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from pacer import metrics, subjects
from pacer.bus import Bus
from pacer.consumer import dead_letter
from pacer.errors import PacerError
from pacer.lease import Lease
from pacer.owned.router import Router
from pacer.ownership import DEFAULT_TTL_S, Ownership
from pacer.runtime import RuntimeConfig, guard
from pacer.telemetry import Counters
from pacer_services.monitor import handlers
from pacer_services.monitor.core import MonitorConfig, MonitorCore
from pacer_services.monitor.effects import EventFeed, publish_statistics

log = logging.getLogger("pacer.monitor")


@dataclass
class MonitorServiceConfig:
    interval_s: float = 10.0  # how often JobStatistics are published
    durable: str = "monitor"  # the durable consumer on PACER_EVENTS is <durable>-<instance>
    inactive_s: float = 300.0  # the server deletes a gone instance's consumer after this long
    instance: str | None = None  # None: PACER_INSTANCE, else monitor-<random>
    lease_ttl_s: float = DEFAULT_TTL_S
    replay: bool = True  # rebuild the windows from the stream on start
    fetch_batch: int = 256
    fetch_timeout_s: float = 0.5  # also bounds how long a drain waits for the loop
    ack_wait_s: float = 30.0
    # A job silent for this long is forgotten (None: 2 x (L_per + heartbeat timeout)).
    forget_after_s: float | None = None
    core: MonitorConfig = field(default_factory=MonitorConfig)

    @classmethod
    def from_env(cls) -> MonitorServiceConfig:
        """``PACER_MONITOR_INTERVAL_S``, ``PACER_MONITOR_WINDOW_SHORT_S`` / ``_LONG_S``, ``_SLOWNESS_RATIO``,
        ``_PS_LATENCY_FLOOR_S``, ``_WINDOW_SHORT_MIN_S`` (unset: the fixed short window), ``_WINDOW_SHORT_REL_ERROR``."""
        env = os.environ
        base = MonitorConfig()
        min_s = env.get("PACER_MONITOR_WINDOW_SHORT_MIN_S", "")
        core = MonitorConfig(
            window_short_s=float(env.get("PACER_MONITOR_WINDOW_SHORT_S", base.window_short_s)),
            window_long_s=float(env.get("PACER_MONITOR_WINDOW_LONG_S", base.window_long_s)),
            slowness_ratio=float(env.get("PACER_MONITOR_SLOWNESS_RATIO", base.slowness_ratio)),
            ps_latency_floor_s=float(env.get("PACER_MONITOR_PS_LATENCY_FLOOR_S", base.ps_latency_floor_s)),
            window_short_min_s=float(min_s) if min_s and float(min_s) > 0 else None,
            window_short_rel_error=float(env.get("PACER_MONITOR_WINDOW_SHORT_REL_ERROR",
                                                 base.window_short_rel_error)),
        )
        return cls(interval_s=float(env.get("PACER_MONITOR_INTERVAL_S", cls.interval_s)), core=core,
                   lease_ttl_s=float(env.get("PACER_LEASE_TTL_S", DEFAULT_TTL_S)))


class MonitorService:
    name = subjects.MONITOR_SERVICE

    def __init__(
        self,
        bus: Bus,
        cfg: MonitorServiceConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.cfg = cfg or MonitorServiceConfig()
        self.clock = clock
        self.core = MonitorCore(self.cfg.core)
        self.counters = Counters(self.name)
        self.own = Ownership(bus, self.name, self._acquired, self._lost, instance=self.cfg.instance,
                             ttl_s=self.cfg.lease_ttl_s)
        self.feed = EventFeed(bus.js, f"{self.cfg.durable}-{self.own.instance}")
        self.events = handlers.build_events(self.core)
        self.rpc = handlers.build_rpc(self)
        # Any instance may answer (every one folds every event): a request is passed to the owner only so
        # that the freshest windows answer; a job nobody has data of is not_found, from here.
        self.router = Router(bus, self.own, self.counters, self.rpc, local_ok=True, unknown=self._unknown)
        self.last_data: dict[str, float] = {}  # job -> monitor time of its newest event
        self.replayed_upto = 0  # stream sequence: durable deliveries up to it were applied by the replay
        self._replay_bad: set[int] = set()  # ... except these, which the durable consumer dead-letters
        self._durable: JetStreamContext.PullSubscription | None = None
        self._rpc_sub: Subscription | None = None
        self._live_subs: list[Subscription] = []
        self._draining = False
        self._consumer_idle = asyncio.Event()

    # ================================================================ lifecycle
    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.ensure_streams()
        await self.own.start(tg, on_forwarded=self.router.on_forwarded)
        self._durable = await self._open_durable()  # before the replay: no gap
        if self.cfg.replay:
            await self._replay()
        self._rpc_sub = await self.bus.nc.subscribe(
            subjects.rpc_wildcard(self.name), queue="monitor", cb=self.router.on_rpc
        )
        # After the replay: a heartbeat is newer than anything the stream held.  No queue group: every
        # instance folds every event.
        self._live_subs = [await self.bus.nc.subscribe(f, cb=self._on_live) for f in subjects.LIVE_EVENTS]
        await self.bus.nc.flush()  # ready means answering: the server has our subscription
        tg.create_task(guard("events", self._events_loop), name="pacer:monitor:events")
        tg.create_task(guard("publish", self._publish_loop), name="pacer:monitor:publish")

    async def drain(self) -> None:
        self._draining = True
        for sub in [self._rpc_sub, *self._live_subs]:
            if sub is not None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        await self._consumer_idle.wait()  # the batch in hand is applied and acked
        await self.own.close()  # the other instances take the jobs over at once

    async def _open_durable(self) -> JetStreamContext.PullSubscription:
        since = self.clock() - self.core.cfg.window_long_s if self.cfg.replay else None
        sub: JetStreamContext.PullSubscription = await self.feed.open_durable(
            self.cfg.ack_wait_s, since=since, inactive_s=self.cfg.inactive_s)
        return sub

    # ================================================================ ownership
    async def _acquired(self, job: str, lease: Lease) -> None:
        """Nothing to load: this instance's windows are as full as the last owner's."""
        self.counters.inc("jobs_acquired")

    async def _lost(self, job: str) -> None:
        self.counters.inc("jobs_lost")  # publish_once checks ownership at every interval
        # /metrics shows the jobs this instance publishes: an old owner's last gauges would stay
        # frozen (a straggler alert that never clears) beside the new owner's.
        metrics.JOBS.forget(job)

    # ================================================================ events
    def _now_of(self, m: Msg) -> float:
        now = self.clock()
        with contextlib.suppress(Exception):  # no metadata: a plain (non-JetStream) message
            now = min(now, m.metadata.timestamp.timestamp())
        return now

    def _apply(self, m: Msg) -> None:
        """Decode one event into the core; raises PacerError if it can never be applied."""
        domain, job, kind = handlers.parse_event(m.subject)
        handler = self.events.get((domain, kind)) or self.events.get((domain, handlers.ANY_KIND))
        if handler is None:  # a newer publisher's kind under one of our filters
            self.counters.inc("events_ignored")
            return
        now = self._now_of(m)
        handler(job, m.data, now)
        if job != subjects.CLUSTER_SCOPE:
            self.last_data[job] = max(self.last_data.get(job, 0.0), now)
            if job in self.core.jobs:
                self.own.want(job)
        self.counters.inc("events", domain=domain)

    async def _replay(self) -> None:
        since = self.clock() - self.core.cfg.window_long_s
        n = 0
        t0 = time.perf_counter()
        try:
            async for m in self.feed.replay(since, batch=self.cfg.fetch_batch):
                seq = m.metadata.sequence.stream
                self.replayed_upto = max(self.replayed_upto, seq)
                try:
                    self._apply(m)
                    n += 1
                except Exception:
                    self._replay_bad.add(seq)  # the durable consumer refuses it, if it has not yet
        except Exception:  # start with whatever came through: the windows fill up again
            self.counters.inc("replay_failures")
            log.exception("replay failed; the windows start partly empty")
        self.counters.inc("events_replayed", n)
        log.info(
            "monitor windows rebuilt",
            extra={"fields": {"events": n, "jobs": len(self.core.jobs), "s": round(time.perf_counter() - t0, 3)}},
        )

    async def _events_loop(self) -> None:
        """The durable consumer: apply, ack; a bad message is terminated and dead-lettered."""
        try:
            if self._durable is None:  # restarted by guard after a crash
                self._durable = await self._open_durable()
            while not self._draining:
                self._consumer_idle.clear()
                try:
                    msgs = await self._durable.fetch(self.cfg.fetch_batch, timeout=self.cfg.fetch_timeout_s)
                except TimeoutError:  # nats-py raises plain asyncio.TimeoutError here too
                    msgs = []
                for m in msgs:
                    await self._on_event(m)
                self._consumer_idle.set()
        finally:
            self._consumer_idle.set()
            # nats-py's fetch leaves stale status messages that would hold up
            # the connection's drain; the durable consumer keeps our position.
            sub, self._durable = self._durable, None
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        await asyncio.Event().wait()  # drained: park until the runtime cancels us

    async def _on_live(self, m: Msg) -> None:
        """A live event (a heartbeat): applied as it comes; a bad one is counted, there is nothing to ack."""
        try:
            self._apply(m)
        except PacerError as exc:
            self.counters.inc("bad_events", code=exc.code)
            log.warning("live event refused", extra={"fields": {"subject": m.subject, "error": exc.message}})
        except Exception:  # callback boundary: a core bug must not stop the subscription
            self.counters.inc("internal_errors", op="live_event")
            log.exception("live event failed")

    async def _on_event(self, m: Msg) -> None:
        seq = m.metadata.sequence.stream
        if seq <= self.replayed_upto and seq not in self._replay_bad:
            self.counters.inc("events_already_replayed")
            await m.ack()
            return
        try:
            self._apply(m)
        except PacerError as exc:  # permanent: a retry cannot fix it
            self.counters.inc("bad_events", code=exc.code)
            log.warning("event refused", extra={"fields": {"subject": m.subject, "error": exc.message}})
            await self._refuse(m, exc.message)
            return
        except Exception as exc:  # loop boundary: a core bug must not stop the monitor
            self.counters.inc("internal_errors", op="event")
            log.exception("event failed")
            await self._refuse(m, f"internal error: {type(exc).__name__}: {exc}")
            return
        await m.ack()

    async def _refuse(self, m: Msg, why: str) -> None:
        self._replay_bad.discard(m.metadata.sequence.stream)
        await dead_letter(self.bus, self.name, m, why)
        await m.term()

    # ================================================================ outputs
    def forget_after_s(self) -> float:
        c = self.core.cfg
        return self.cfg.forget_after_s or 2 * (c.window_long_s + c.heartbeat_timeout_s)

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.publish_once()

    async def publish_once(self) -> int:
        """Publish the statistics of every job we own with data in the long window; forget long-silent jobs."""
        now = self.clock()
        sent = 0
        for job in sorted(self.core.jobs):
            age = now - self.last_data.get(job, now)
            if age > self.forget_after_s():
                self.core.forget(job)
                metrics.JOBS.forget(job)
                self.last_data.pop(job, None)
                self.counters.inc("jobs_forgotten")
                await self.own.drop(job)
                continue
            if age > self.core.cfg.window_long_s or not self.own.owns(job):
                continue
            try:
                stats = self.core.statistics(job, now)
                metrics.JOBS.set(stats)  # what /metrics shows: the same numbers as the event
                await publish_statistics(self.bus, stats)
                sent += 1
            except Exception:  # one job's statistics must not stop the others'
                self.counters.inc("internal_errors", op="publish")
                log.exception("statistics not published", extra={"fields": {"job": job}})
        self.counters.inc("statistics_published", sent)
        return sent

    async def _unknown(self, job: str, op: str) -> bool:
        return job not in self.core.jobs


async def create(bus: Bus, cfg: RuntimeConfig) -> MonitorService:
    """App factory: the only place that builds a MonitorService from configuration."""
    return MonitorService(bus, MonitorServiceConfig.from_env())
