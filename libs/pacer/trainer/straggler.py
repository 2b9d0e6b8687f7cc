"""Straggler injection for experiments (AntDT §VII-A4), one generator for real and simulated runs.

A straggling node sleeps T_delay = ``sleep_s * intensity`` (AntDT §VII-A4:
SleepDuration x Intensity) on every step while its pattern is *on*.
Sleeping costs no CPU, so a 2-core machine can emulate large speed gaps.
Patterns (``kind``):

* ``persistent``: on from ``start_s`` (AntDT: a constant 4 s delay);
* ``transient``: time from ``start_s`` is cut into periods of ``period_s``;
  period k is slow with probability ``probability`` (one draw per period,
  seeded by ``(seed, node, k)``, so a run is reproducible and two nodes of
  one run draw independently), and then only for its first ``on_s``
  seconds (AntDT: a delay for 15 min every 30 min with probability 0.3);
* ``none``: never.

A slow *server* cannot sleep per request (a TF PS runs no Python per
request), so a PS straggler is injected by ``cpu``: the node's pod gets at
most that many CPUs (the executor lowers the pod's CPU limit: on the local
backend the supervisor's SIGSTOP/SIGCONT quota, on Kubernetes the container's
CFS limit).  ``cpu`` works for workers too; it is a property of the pod, not
a pattern in time, so :class:`Pattern` ignores it.

:class:`StragglerSpec` is the blueprint, the JSON that travels
(``PACER_INJECT_STRAGGLERS``, the executor's launch config, the worker's
``--config``); :class:`Pattern` is that blueprint on one node, the only
code that turns time into a delay.  The real trainer asks it before every
step (``delay_at(seconds since the process started)``), the cluster
simulator asks it for piecewise-constant delays and the next time they may
change (``at(simulated seconds)``).  Pure: the caller passes the time.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from enum import Enum


class PatternKind(str, Enum):
    """How a straggler's delay varies; fixed for the lifetime of a :class:`StragglerSpec`."""

    NONE = "none"
    PERSISTENT = "persistent"
    TRANSIENT = "transient"


@dataclass(frozen=True, slots=True)
class StragglerSpec:
    """The wire form of an injected straggler (JSON; every field has a default, new ones too)."""

    kind: PatternKind = PatternKind.NONE  # JSON: "none" | "persistent" | "transient"
    sleep_s: float = 0.0  # SleepDuration
    intensity: float = 1.0  # Intensity
    period_s: float = 1800.0  # transient: period length
    on_s: float = 900.0  # transient: slow for the first on_s seconds of a selected period
    probability: float = 0.3  # transient: chance that a period is selected
    seed: int = 0
    start_s: float = 0.0  # the pattern begins this long after the clock's zero
    cpu: float = 0.0  # > 0: the pod's CPU limit is lowered to this many CPUs (a throttled PS or worker)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", PatternKind(self.kind))  # JSON and callers give the string
        except ValueError:
            raise ValueError(f"straggler kind: {self.kind!r} is not none|persistent|transient") from None
        if self.sleep_s < 0 or self.intensity < 0:
            raise ValueError("straggler sleep_s and intensity must be >= 0")
        if self.period_s <= 0 or self.on_s < 0 or self.start_s < 0:
            raise ValueError("straggler period_s must be > 0, on_s and start_s >= 0")
        if self.cpu < 0:
            raise ValueError("straggler cpu must be >= 0 (0: the pod keeps its planned CPU)")

    @property
    def delay_s(self) -> float:
        """AntDT §VII-A4: T_delay = SleepDuration x Intensity."""
        return self.sleep_s * self.intensity

    def on(self, node: str) -> Pattern:
        """This spec applied to ``node`` (whose name seeds the transient draws)."""
        return Pattern(self, node)

    def active(self, elapsed_s: float, node: str = "") -> bool:
        return self.on(node).delay_at(elapsed_s) > 0

    def delay(self, elapsed_s: float, node: str = "") -> float:
        """Seconds to sleep on a step taken ``elapsed_s`` after the clock's zero."""
        return self.on(node).delay_at(elapsed_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StragglerSpec:
        return cls(**json.loads(text)) if text else cls()


@dataclass(frozen=True, slots=True)
class Pattern:
    """d(t) of one node: piecewise constant, so :meth:`at` also says when it may next change."""

    spec: StragglerSpec
    node: str = ""  # seeds the draws with spec.seed; several patterns of one node need distinct names

    def slow_period(self, k: int) -> bool:
        """Whether transient period ``k`` (0 = the one starting at ``start_s``) is selected.

        One draw per (seed, node, period), each from its own generator: the answer does not
        depend on which periods were asked before (a string seed is hashed with sha512 by
        ``random.Random``, stable across runs and processes).
        """
        s = self.spec
        return random.Random(f"{s.seed}/{self.node}/{k}").random() < s.probability

    def at(self, t: float) -> tuple[float, float]:
        """(delay at ``t``, the next time at or after which the delay may differ)."""
        s = self.spec
        if s.kind is PatternKind.NONE or s.delay_s <= 0:
            return 0.0, math.inf
        if t < s.start_s:
            return 0.0, s.start_s
        if s.kind is PatternKind.PERSISTENT:
            return s.delay_s, math.inf
        k = int((t - s.start_s) // s.period_s)
        begin = s.start_s + k * s.period_s
        if t < begin + s.on_s:
            return (s.delay_s if self.slow_period(k) else 0.0), begin + s.on_s
        return 0.0, begin + s.period_s

    def delay_at(self, t: float) -> float:
        """Seconds of delay for a step taken at ``t``."""
        return self.at(t)[0]

    def next_change(self, t: float) -> float:
        """The next time (> ``t`` unless the delay never changes: inf) at which the delay may differ."""
        return self.at(t)[1]
