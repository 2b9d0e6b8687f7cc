"""The built-in straggler policies as a service: ``python -m pacer_services.policy_service.main``.

Each built-in (``antdt-nd``, ``antdt-dd``, ``lb-bsp``, ``backup-workers``,
``none``, ``pacer-adaptive``) answers ``pacer.policy.<name>.decide`` exactly
as a user's policy would (:mod:`pacer.policy`); the controller cannot tell
them apart.  Each decides in worker processes of its own, bounded in time
and memory (``PACER_POLICY_*``), so one bad request cannot stall the others.
"""

from __future__ import annotations

import asyncio

from pacer.bus import Bus
from pacer.policy import DecisionLimits, PolicyServer, serve_policies
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.controller.policies.registry import BUILTINS


class PolicyService:
    name = "policies"

    def __init__(self, bus: Bus, limits: DecisionLimits | None = None) -> None:
        self.bus = bus
        self.counters = Counters(self.name)
        self.limits = limits or DecisionLimits.from_env()
        self.server: PolicyServer | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self.server = await serve_policies(self.bus, BUILTINS, self.counters, self.limits)

    async def drain(self) -> None:
        if self.server is not None:
            await self.server.close()


async def create(bus: Bus, rc: RuntimeConfig) -> PolicyService:
    """App factory."""
    return PolicyService(bus)
