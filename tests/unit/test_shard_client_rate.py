"""The rate a shard client reports with its lease requests (``LeaseRequest.rate``, DatasetSpec.tail_split)."""
from __future__ import annotations

import pytest
from pacer.shards.client import RATE_EVERY_S, ShardClient


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_rate_is_records_trained_over_time_averaged_with_the_last() -> None:
    clock = Clock()
    c = ShardClient(None, "j", "d", "w0", clock=clock)  # type: ignore[arg-type]  # no request is sent: no bus
    assert c._measure_rate() == 0.0  # nothing measured yet: "not known"
    c.trained(500)
    clock.t += RATE_EVERY_S / 2
    assert c._measure_rate() == 0.0  # not over RATE_EVERY_S yet
    clock.t += RATE_EVERY_S / 2
    assert c._measure_rate() == pytest.approx(500 / RATE_EVERY_S)
    c.trained(100)
    clock.t += RATE_EVERY_S
    assert c._measure_rate() == pytest.approx((500 / RATE_EVERY_S + 100 / RATE_EVERY_S) / 2)
    for _ in range(30):  # idle (no data): decays towards 0, which the service reads as "the mean"
        clock.t += RATE_EVERY_S
        c._measure_rate()
    assert c.rate < 1e-3
