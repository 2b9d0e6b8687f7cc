"""IO of the monitor: its JetStream consumers, the dead-letter subject, the statistics events.

Two consumers of each monitor instance read the monitor's inputs from ``PACER_EVENTS`` (the filters
are :func:`pacer.subjects.monitor_inputs`):

* the instance's *durable* pull consumer (explicit acks, named after the
  instance: every instance sees every event) that the monitor lives on; it
  keeps the instance's position across restarts of the same instance name,
  so nothing published while it was down is missed;
* a short-lived *ephemeral* consumer, created once at start, that replays
  the stream from ``now - L_per`` (``DeliverPolicy.BY_START_TIME``, no acks)
  so that the sliding windows are full again before the first query is
  answered.  The durable consumer has usually acked part of that range
  already: that is why the replay is separate (an ack floor cannot be moved
  back), and why the service skips durable deliveries the replay has already
  applied (by stream sequence) instead of applying them twice.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import AsyncIterator

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pacer import subjects
from pacer.bus import Bus
from pacer.consumer import bind_durable
from pacer.contracts.monitor import JobStatistics

log = logging.getLogger("pacer.monitor")


class EventFeed:
    """The monitor's view of ``PACER_EVENTS``: one durable consumer and a replay."""

    def __init__(self, js: JetStreamContext, durable: str, filters: list[str] | None = None) -> None:
        self.js = js
        self.durable = durable
        self.filters = filters or subjects.monitor_inputs()

    async def open_durable(self, ack_wait_s: float = 30.0, since: float | None = None,
                           inactive_s: float | None = None) -> JetStreamContext.PullSubscription:
        """Bind to (creating on first use) the durable consumer.

        Created with ``DeliverPolicy.NEW`` (or, given ``since``, from unix
        time ``since``: a new instance's consumer starts at the window, whose
        events the service skips as already replayed): what came before is
        the replay's business, and a fresh monitor must not walk a week of
        history.  ``inactive_s``: the server deletes the consumer after so
        long without a client (an instance's own consumer, once the instance
        is gone for good).  Call this *before* :meth:`replay` so that no
        message falls between the two.
        """
        if since is None and inactive_s is None:
            return await bind_durable(self.js, self.durable, self.filters, DeliverPolicy.NEW, ack_wait_s)
        return await self.js.pull_subscribe(
            "",
            durable=self.durable,
            stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(
                durable_name=self.durable,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW if since is None else DeliverPolicy.BY_START_TIME,
                opt_start_time=None if since is None else datetime.datetime.fromtimestamp(since, datetime.UTC),
                ack_wait=ack_wait_s,
                max_deliver=-1,
                filter_subjects=list(self.filters),
                inactive_threshold=inactive_s,
            ),
        )

    async def replay(self, since: float, batch: int = 256, idle_s: float = 0.5) -> AsyncIterator[Msg]:
        """Yield every input event stored since unix time ``since`` up to the stream's current end."""
        info = await self.js.stream_info(subjects.EVENTS_STREAM)
        end = int(info.state.last_seq)
        if end == 0:
            return
        sub = await self.js.pull_subscribe(
            "",
            stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.BY_START_TIME,
                opt_start_time=datetime.datetime.fromtimestamp(since, datetime.UTC),
                filter_subjects=list(self.filters),
                inactive_threshold=30.0,  # the server drops it soon if we die mid-replay
                mem_storage=True,
            ),
        )
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch, timeout=idle_s)
                except TimeoutError:
                    return  # nothing (more) stored in the window
                for m in msgs:
                    yield m
                    md = m.metadata
                    if md.sequence.stream >= end or md.num_pending == 0:
                        return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def publish_statistics(bus: Bus, stats: JobStatistics) -> None:
    """Fire-and-forget: the next interval publishes fresher statistics anyway."""
    await bus.publish(subjects.monitor_statistics(stats.job), stats)
