"""Every built-in straggler policy keeps its promises on generated scenarios of every class (issue 22).

The scenarios come from :mod:`pacer_services.simulator.stragglers.generate`
(the same generator ``make bench-stragglers`` runs many more of), drawn here
through hypothesis so that a failure shrinks to a small scenario.  Each
policy runs in the simulator over the services' own cores (controller,
monitor, shard service, executor) and is checked against ``none`` on the
same scenario: no record dropped (a backup worker's discarded gradients are
trained again), no batch above a device's cap or below the floor, every
record trained, never more than 5 % slower than doing nothing.

Bounded: a few dozen generated scenarios of up to 64 workers (derandomized:
the same ones every run, so CI never meets a new one by chance), plus one of
1,000 workers; the benchmark runs more, and larger.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pacer_services.simulator.stragglers import run
from pacer_services.simulator.stragglers.generate import (
    SeededDraw,
    applicable,
    check,
    draw_scenario,
)
from pacer_services.simulator.stragglers.scenario import Scenario

pytestmark = pytest.mark.timeout(900)


class HypothesisDraw:
    """The generator's :class:`~pacer_services.simulator.stragglers.generate.Draw` over ``st.data()``."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def real(self, lo: float, hi: float) -> float:
        return self.data.draw(st.floats(lo, hi, allow_nan=False, allow_infinity=False))

    def choice(self, options: tuple[Any, ...]) -> Any:
        return self.data.draw(st.sampled_from(options))

    def flip(self, p: float) -> bool:
        return self.data.draw(st.booleans())


def problems_of(sc: Scenario) -> dict[str, list[str]]:
    none = run(sc, "none", ideal=False)
    out = {}
    for method in applicable(sc):
        v = check(sc, run(sc, method, ideal=False), none)
        if v.problems():
            out[method] = v.problems()
    # none itself: every record trained, nothing dropped
    assert none.records_done == sc.job.records * sc.job.epochs and none.records_dropped == 0
    return out


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          database=None)
@given(st.data())
def test_every_builtin_policy_keeps_its_promises(data: st.DataObject) -> None:
    sc = draw_scenario(HypothesisDraw(data), seed=data.draw(st.integers(0, 1000)), max_workers=64)
    assert not (bad := problems_of(sc)), (sc, bad)


def test_a_thousand_workers() -> None:
    seed = next(s for s in range(1000) if draw_scenario(SeededDraw(s), s).cluster.workers >= 900)
    sc = draw_scenario(SeededDraw(seed), seed)
    assert not (bad := problems_of(sc)), (sc.name, bad)
