"""The built-in straggler policies as a service: ``python -m pacer_services.policy_service.main``.

Each built-in (``antdt-nd``, ``antdt-dd``, ``lb-bsp``, ``backup-workers``,
``none``) answers ``pacer.policy.<name>.decide`` exactly as a user's policy
would (:mod:`pacer.policy`); the controller cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.subscription import Subscription
from pacer.bus import Bus
from pacer.policy import serve_policies
from pacer.runtime import RuntimeConfig
from pacer.telemetry import Counters
from pacer_services.controller.policies.registry import BUILTINS


class PolicyService:
    name = "policies"

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.counters = Counters(self.name)
        self.subs: list[Subscription] = []

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self.subs = await serve_policies(self.bus, BUILTINS, self.counters)

    async def drain(self) -> None:
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def create(bus: Bus, rc: RuntimeConfig) -> PolicyService:
    """App factory."""
    return PolicyService(bus)
