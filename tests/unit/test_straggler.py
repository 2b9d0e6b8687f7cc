"""Straggler injection patterns (AntDT §VII-A4) are deterministic and shaped as specified."""

from __future__ import annotations

import pytest
from pacer.trainer.straggler import StragglerSpec


def test_persistent_delays_every_step_by_sleep_times_intensity() -> None:
    s = StragglerSpec(kind="persistent", sleep_s=4.0, intensity=0.5)
    assert {s.delay(t) for t in (0.0, 17.3, 1e6)} == {2.0}


def test_none_never_delays() -> None:
    assert StragglerSpec().delay(123.0) == 0.0


def test_transient_is_on_only_in_the_first_part_of_selected_periods() -> None:
    s = StragglerSpec(kind="transient", sleep_s=1.0, period_s=1800, on_s=900, probability=0.3, seed=3)
    periods = [s.active(k * 1800 + 1) for k in range(2000)]
    share = sum(periods) / len(periods)
    assert 0.25 < share < 0.35  # probability 0.3 per period
    for k, on in enumerate(periods[:50]):
        assert s.active(k * 1800 + 899) is on  # within on_s: same as the period's start
        assert not s.active(k * 1800 + 901)  # after on_s: off
    again = StragglerSpec(kind="transient", sleep_s=1.0, period_s=1800, on_s=900, probability=0.3, seed=3)
    assert [again.active(k * 1800 + 1) for k in range(2000)] == periods  # deterministic per seed


def test_json_round_trip_and_validation() -> None:
    s = StragglerSpec(kind="transient", sleep_s=0.2, intensity=0.8, seed=9)
    assert StragglerSpec.from_json(s.to_json()) == s
    with pytest.raises(ValueError, match="kind"):
        StragglerSpec(kind="sometimes")
