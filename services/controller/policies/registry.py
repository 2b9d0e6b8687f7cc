"""Built-in policy names -> decide functions (the names of ``pacer.subjects.POLICY_BUILTINS``).

The controller's policy service answers ``pacer.policy.<name>.decide`` for
each name here by calling the function; the cluster simulator calls the very
same functions.  They read no clock: the serving shell fills
``PolicyDecision.decision_ms``.
"""

from __future__ import annotations

from collections.abc import Callable

from pacer.contracts.policy import PolicyDecision, PolicyRequest

from . import adaptive, antdt_dd, antdt_nd, baselines

BUILTINS: dict[str, Callable[[PolicyRequest], PolicyDecision]] = {
    antdt_nd.NAME: antdt_nd.decide,
    antdt_dd.NAME: antdt_dd.decide,
    adaptive.NAME: adaptive.decide,
    baselines.LB_BSP: baselines.lb_bsp,
    baselines.BACKUP_WORKERS: baselines.backup_workers,
    baselines.NONE: baselines.none,
}

#: What the controller falls back to when a decision is unusable.
FALLBACK = baselines.NONE


def get(name: str) -> Callable[[PolicyRequest], PolicyDecision] | None:
    """The built-in decide function called ``name``, or None for a custom (external) policy."""
    return BUILTINS.get(name)
