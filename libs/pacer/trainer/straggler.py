"""Straggler injection for experiments (AntDT §VII-A4).

A straggling node sleeps ``sleep_s * intensity`` on every step while it is
*active*.  Sleeping costs no CPU, so a 2-core machine can emulate large speed
gaps.  Patterns:

* ``persistent``: always active (AntDT: a constant 4 s delay);
* ``transient``: time is cut into periods of ``period_s``; each period is
  active with probability ``probability`` (seeded per period, so a run is
  reproducible), and then only for its first ``on_s`` seconds (AntDT: a
  delay for 15 min every 30 min with probability 0.3).

Pure: the caller passes the elapsed time.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class StragglerSpec:
    kind: str = "none"  # none | persistent | transient
    sleep_s: float = 0.0
    intensity: float = 1.0
    period_s: float = 1800.0
    on_s: float = 900.0
    probability: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "persistent", "transient"):
            raise ValueError(f"straggler kind: {self.kind!r} is not none|persistent|transient")
        if self.sleep_s < 0 or self.intensity < 0:
            raise ValueError("straggler sleep_s and intensity must be >= 0")

    def active(self, elapsed_s: float) -> bool:
        if self.kind == "persistent":
            return True
        if self.kind == "transient":
            k = int(elapsed_s // self.period_s)
            on = random.Random(self.seed * 1_000_003 + k).random() < self.probability
            return on and (elapsed_s - k * self.period_s) < self.on_s
        return False

    def delay(self, elapsed_s: float) -> float:
        """Seconds to sleep on a step taken ``elapsed_s`` after the node started."""
        return self.sleep_s * self.intensity if self.active(elapsed_s) else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StragglerSpec:
        return cls(**json.loads(text)) if text else cls()
