"""Straggler injection patterns (AntDT §VII-A4) are deterministic and shaped as specified.

:class:`Pattern` is the one generator of the real trainer and the simulator:
these tests pin its shape, its determinism and its wire form.
"""

from __future__ import annotations

import json
import math

import pytest
from pacer.trainer.straggler import Pattern, PatternKind, StragglerSpec


def test_persistent_delays_every_step_by_sleep_times_intensity() -> None:
    s = StragglerSpec(kind=PatternKind.PERSISTENT, sleep_s=4.0, intensity=0.5)
    assert {s.delay(t) for t in (0.0, 17.3, 1e6)} == {2.0}
    assert s.on("worker-1").at(5.0) == (2.0, math.inf)


def test_none_never_delays() -> None:
    assert StragglerSpec().delay(123.0) == 0.0
    assert StragglerSpec(kind=PatternKind.NONE, sleep_s=5.0).on("worker-0").at(9.0) == (0.0, math.inf)


def test_transient_is_on_only_in_the_first_part_of_selected_periods() -> None:
    s = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=1.0, period_s=1800, on_s=900, probability=0.3, seed=3)
    periods = [s.active(k * 1800 + 1) for k in range(2000)]
    share = sum(periods) / len(periods)
    assert 0.25 < share < 0.35  # probability 0.3 per period
    for k, on in enumerate(periods[:50]):
        assert s.active(k * 1800 + 899) is on  # within on_s: same as the period's start
        assert not s.active(k * 1800 + 901)  # after on_s: off
    again = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=1.0, period_s=1800, on_s=900, probability=0.3, seed=3)
    assert [again.active(k * 1800 + 1) for k in range(2000)] == periods  # deterministic per seed


def test_pattern_is_piecewise_constant_and_says_when_it_changes() -> None:
    spec = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=2.0, intensity=0.5, start_s=100.0,
                         period_s=60.0, on_s=20.0, probability=0.5, seed=7)
    p = Pattern(spec, "worker-2")
    assert p.at(50.0) == (0.0, 100.0)  # before start_s
    for k in range(40):
        begin = 100.0 + 60.0 * k
        d, nxt = p.at(begin + 5.0)
        assert nxt == begin + 20.0 and d == (1.0 if p.slow_period(k) else 0.0)
        assert p.at(begin + 19.9)[0] == d  # constant until the change it announced
        assert p.at(begin + 20.0) == (0.0, begin + 60.0)  # off for the rest of the period
        assert p.delay_at(begin + 30.0) == 0.0 and p.next_change(begin + 30.0) == begin + 60.0
    assert 5 < sum(p.slow_period(k) for k in range(40)) < 35


def test_draws_are_per_node_and_seed_and_do_not_depend_on_the_order_of_questions() -> None:
    spec = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=1.0, period_s=10, on_s=5, probability=0.5, seed=1)
    a, b = spec.on("worker-0"), spec.on("worker-1")
    forward = [a.slow_period(k) for k in range(200)]
    assert [a.slow_period(k) for k in reversed(range(200))][::-1] == forward
    assert forward != [b.slow_period(k) for k in range(200)]  # two nodes of one run draw independently
    other_seed = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=1.0, period_s=10, on_s=5, probability=0.5, seed=2)
    assert forward != [other_seed.on("worker-0").slow_period(k) for k in range(200)]


def test_json_round_trip_and_validation() -> None:
    s = StragglerSpec(kind=PatternKind.TRANSIENT, sleep_s=0.2, intensity=0.8, seed=9, start_s=3.0)
    assert StragglerSpec.from_json(s.to_json()) == s
    assert json.loads(s.to_json())["kind"] == "transient"
    # The JSON written before start_s existed still reads (wire-compatible), kinds given as strings.
    old = StragglerSpec.from_json('{"kind": "persistent", "sleep_s": 0.5}')
    assert old.kind is PatternKind.PERSISTENT and old.start_s == 0.0 and old.delay(1.0) == 0.5
    with pytest.raises(ValueError, match="kind"):
        StragglerSpec.from_json('{"kind": "sometimes"}')
    with pytest.raises(ValueError, match="period_s"):
        StragglerSpec(kind=PatternKind.TRANSIENT, period_s=0.0)
