"""The straggler policies a simulated job can run: the controller's built-ins, by name.

A policy is any ``decide(PolicyRequest) -> PolicyDecision``; the built-in
ones are the very functions that the live policy service serves
(:mod:`pacer_services.controller.policies.registry`).
"""

from __future__ import annotations

from collections.abc import Callable

from pacer.contracts.policy import PolicyDecision, PolicyRequest
from pacer.errors import PacerError
from pacer_services.controller.policies import registry

Policy = Callable[[PolicyRequest], PolicyDecision]


def none_policy(req: PolicyRequest) -> PolicyDecision:
    """The dummy policy: never acts (AntDT's NONE)."""
    return PolicyDecision(job=req.job, policy="none", actions=[], reason="no mitigation")


def resolve_policy(method: str) -> Policy:
    """A built-in policy by name (``none``, ``antdt-nd``, ``antdt-dd``, ``lb-bsp``, ``backup-workers``, ...)."""
    found: Policy | None = registry.BUILTINS.get(method)
    if found is not None:
        return found
    if method == "none":
        return none_policy
    known = sorted({"none", *registry.BUILTINS})
    raise PacerError(f"method: unknown policy {method!r} (known: {', '.join(known)})", code="invalid")
