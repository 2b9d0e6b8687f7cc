"""The description of one TensorFlow PS cluster on this machine.

The ClusterSpec fixes the worker slots, so the maximum worker count is
declared up front and unused slots stay idle (docs/design.md, measured facts);
elasticity within that maximum needs no new ClusterSpec.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from pacer.embedded import free_port


@dataclass(frozen=True, slots=True)
class ClusterDesc:
    ps: tuple[str, ...]
    workers: tuple[str, ...]  # every slot, used or not

    @classmethod
    def local(cls, num_ps: int, max_workers: int) -> ClusterDesc:
        ports: list[int] = []
        while len(ports) < num_ps + max_workers:  # distinct: a port picked twice is bound by neither yet
            if (port := free_port()) not in ports:
                ports.append(port)
        addrs = tuple(f"127.0.0.1:{p}" for p in ports)
        return cls(addrs[:num_ps], addrs[num_ps:])

    def as_tf(self) -> dict[str, list[str]]:
        return {"ps": list(self.ps), "worker": list(self.workers)}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ClusterDesc:
        d = json.loads(text)
        return cls(tuple(d["ps"]), tuple(d["workers"]))
