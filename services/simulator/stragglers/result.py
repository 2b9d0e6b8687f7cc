"""What one simulated run of the straggler simulator produced (the ``pacer sim`` JSON line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Result:
    """What one simulated run produced."""

    scenario: str
    method: str
    seed: int
    mode: str
    jct_s: float
    ideal_jct_s: float | None
    actions: dict[str, int]
    steps: int  # BSP: global steps; ASP: worker steps summed
    restarts: int
    shards_total: int
    shards_done: int
    records_done: int
    records_duplicated: int  # the shard core's count: re-granted records
    records_recomputed: int  # consumed since the last progress report when a worker died
    records_dropped: int  # BSP records whose gradients a backup-worker step discarded and nobody trained again
    decisions: int
    refused: int  # actions the controller refused (cool-down, busy cluster, inconsistent batch sizes)
    events: int
    wall_s: float
    records_reserved: int = 0  # records served again because their gradients were discarded (the shard core's)
    cap_violations: int = 0  # workers an executed ADJUST_BS set above their device's cap (an OOM on a device)
    floor_violations: int = 0  # ... below the batch floor
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "method": self.method,
            "seed": self.seed,
            "mode": self.mode,
            "jct_s": round(self.jct_s, 3),
            "ideal_jct_s": None if self.ideal_jct_s is None else round(self.ideal_jct_s, 3),
            "slowdown": None if not self.ideal_jct_s else round(self.jct_s / self.ideal_jct_s, 4),
            "actions": dict(sorted(self.actions.items())),
            "steps": self.steps,
            "restarts": self.restarts,
            "shards_total": self.shards_total,
            "shards_done": self.shards_done,
            "records_done": self.records_done,
            "records_duplicated": self.records_duplicated,
            "records_recomputed": self.records_recomputed,
            "records_dropped": self.records_dropped,
            "records_reserved": self.records_reserved,
            "cap_violations": self.cap_violations,
            "floor_violations": self.floor_violations,
            "decisions": self.decisions,
            "refused": self.refused,
            "events": self.events,
        }
