"""What the shard client sends for records whose gradients were discarded (``ShardClient.discarded``)."""
from __future__ import annotations

from typing import Any

import pytest
from pacer.contracts.shards import (
    LeaseReply,
    LeaseRequest,
    Rejected,
    ShardLease,
    ShardProgress,
    ShardRange,
)
from pacer.errors import Unavailable

SHARD = ShardLease(shard=4, epoch=0, start=100, end=200, offset=100, seed=1)


class Bus:
    """Answers lease requests with ``replies`` in turn (an exception is raised), keeping what was sent."""

    def __init__(self, *replies: LeaseReply | Exception) -> None:
        self.replies = list(replies)
        self.sent: list[LeaseRequest] = []

    async def request(self, subject: str, msg: LeaseRequest, reply: type[Any], timeout: float, retry: Any) -> Any:
        self.sent.append(msg)
        r = self.replies.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


def reply(*rejected: Rejected, shards: list[ShardLease] | None = None) -> LeaseReply:
    return LeaseReply(shards=shards or [], lease_s=30.0, finished=False, rejected=list(rejected))


async def test_ranges_merge_raise_progress_and_go_before_done() -> None:
    from pacer.shards.client import ShardClient

    bus = Bus(reply(shards=[SHARD]), reply(), reply())
    c = ShardClient(bus, "j", "d", "w0", prefetch=1)  # type: ignore[arg-type]
    assert (await c._sync(1)).shards == [SHARD]  # now held
    c.discarded(SHARD, 0, 10)
    c.discarded(SHARD, 10, 20)  # the next batch: one range
    c.discarded(SHARD, 30, 40)
    c.discarded(SHARD, 50, 50)  # empty: nothing
    c.progress(SHARD, 35)  # behind the last discard: the discard raises it
    await c._sync(0)
    sent = bus.sent[-1]
    assert sent.discarded == [ShardRange(4, 0, 20), ShardRange(4, 30, 40)]
    assert sent.progress == [ShardProgress(4, 40)], "a discard must lie within the reported progress"
    assert c.records_discarded == 30
    c.discarded(SHARD, 40, 100)
    c.done(SHARD)
    await c._sync(0)
    sent = bus.sent[-1]
    assert sent.done == [4] and sent.discarded == [ShardRange(4, 40, 100)] and sent.progress == []


async def test_a_request_that_failed_sends_them_again_and_a_landed_retry_is_no_problem() -> None:
    from pacer.shards.client import ShardClient

    bus = Bus(reply(shards=[SHARD]), Unavailable("down"), reply(Rejected(4, "discard_repeated")),
              reply(Rejected(4, "discard_not_consumed")))
    c = ShardClient(bus, "j", "d", "w0", prefetch=1)  # type: ignore[arg-type]
    await c._sync(1)
    c.discarded(SHARD, 0, 10)
    with pytest.raises(Unavailable):
        await c._sync(0)
    c.discarded(SHARD, 20, 30)
    await c._sync(0)
    assert bus.sent[-1].discarded == [ShardRange(4, 0, 10), ShardRange(4, 20, 30)]
    assert c.rejected == 0  # what a retried request that did land gets back
    c.discarded(SHARD, 30, 40)
    await c._sync(0)
    assert c.rejected == 1
