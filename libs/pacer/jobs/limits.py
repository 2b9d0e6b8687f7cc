"""A plan clamped to a job's ``limits``: the one clamp that the default plan and every brain plan go through.

:func:`clamp` takes a plan whose user-given fields (``user``) are already in
place and returns it within :class:`~pacer.contracts.jobs.ResourceLimits`,
with a note per change, by these rules (the job spec's documented ones,
:mod:`pacer.jobs.spec`):

1. Counts the user did not give: workers are at least ``min_workers`` (one
   more than ``backup_workers``), then at most ``max_workers``; PS at most
   ``max_ps``.  A count limit never clamps below one: a PS job cannot run
   without a worker or without a PS.  (The default plan used to clamp PS to
   ``max_ps`` as given and the brain to ``max(max_ps, 1)``; validation
   rejects limits below one, so the two differed only for limits built in
   code, where a plan without a PS would have gone to the executor.  One
   rule now, the brain's, tested in ``tests/unit/test_brain_limits.py``.)
2. Fewer workers than ``min_workers`` (the user's own count): an error.
3. Total CPU above ``max_cpu``, then total memory above ``max_memory_mb``:
   non-user workers go (down to ``min_workers``), then non-user PS (down to
   one), then the non-user per-node amounts scale down (CPU in tenths, to
   at least ``min_cpu``; memory in MiB, to at least ``min_memory_mb``).
4. Still above a limit (the user's own values need more): an error naming
   the limit.

Whatever the limits, a count the user did not give is at most
:data:`MAX_NODES_PER_ROLE`: node indexes end up in pod hostnames, whose
length bounds the job's name (:mod:`pacer.jobs.spec`).

User values are never changed.  Errors are :class:`LimitsError` (a
:class:`~pacer.errors.ValidationError`); :mod:`pacer.jobs.spec` reports
them as a :class:`~pacer.jobs.spec.JobSpecError`.

Pure: no IO, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from pacer.contracts.common import Role
from pacer.contracts.jobs import ResourceLimits, ResourcePlan
from pacer.errors import ValidationError

__all__ = ["MAX_NODES_PER_ROLE", "MIN_CPU", "MIN_MEMORY_MB", "Clamped", "LimitsError", "clamp"]

MAX_NODES_PER_ROLE = 10_000  # worker and PS indexes 0..9999 (the job-name length rule counts on it)

MIN_CPU = 0.1  # floor when scaling CPU the user did not give down to fit max_cpu
MIN_MEMORY_MB = 128  # floor when scaling memory the user did not give down to fit max_memory_mb


class LimitsError(ValidationError):
    """The user's own resources leave no way to fit the plan within the limits (names the limit)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Clamped:
    """A plan within its limits, and one note per change made to get it there."""

    plan: ResourcePlan
    notes: tuple[str, ...] = ()


def clamp(plan: ResourcePlan, limits: ResourceLimits | None, *, user: Collection[str] = (),
          min_workers: int = 1, min_cpu: float = MIN_CPU, min_memory_mb: int = MIN_MEMORY_MB) -> Clamped:
    """``plan`` within ``limits`` without changing the fields in ``user`` (module docstring).

    ``user`` names the :class:`ResourcePlan` fields the user gave
    (``workers``, ``ps``, ``worker_cpu``, ...).  Raises :class:`LimitsError`.
    """
    lim = limits or ResourceLimits()
    given = frozenset(user)
    notes: list[str] = []
    if "workers" not in given and plan.workers < min_workers:
        plan = replace(plan, workers=min_workers)
    if lim.max_workers is not None and plan.workers > lim.max_workers and "workers" not in given:
        plan = replace(plan, workers=max(lim.max_workers, 1))
        notes.append(f"workers clamped to limits.max_workers={lim.max_workers}")
    if lim.max_ps is not None and plan.ps > lim.max_ps and "ps" not in given:
        plan = replace(plan, ps=max(lim.max_ps, 1))
        notes.append(f"ps clamped to limits.max_ps={lim.max_ps}")
    if plan.workers > MAX_NODES_PER_ROLE and "workers" not in given:
        plan = replace(plan, workers=MAX_NODES_PER_ROLE)
        notes.append(f"workers clamped to {MAX_NODES_PER_ROLE}, the most a job's pod names allow")
    if plan.ps > MAX_NODES_PER_ROLE and "ps" not in given:
        plan = replace(plan, ps=MAX_NODES_PER_ROLE)
        notes.append(f"ps clamped to {MAX_NODES_PER_ROLE}, the most a job's pod names allow")
    if plan.workers < min_workers:
        raise LimitsError([f"backup_workers: must be < the plan's {plan.workers} workers, got {min_workers - 1}"])
    if lim.max_cpu is not None:
        plan = _fit(plan, lim.max_cpu, "cpu", given, min_workers, min_cpu, notes)
    if lim.max_memory_mb is not None:
        plan = _fit(plan, lim.max_memory_mb, "memory_mb", given, min_workers, min_memory_mb, notes)
    return Clamped(plan, tuple(notes))


def _total(plan: ResourcePlan, unit: str) -> float:
    return float(plan.workers * getattr(plan, f"worker_{unit}") + plan.ps * getattr(plan, f"ps_{unit}"))


def _count(plan: ResourcePlan, role: Role) -> int:
    return plan.workers if role is Role.WORKER else plan.ps


def _fit(plan: ResourcePlan, limit: float, unit: str, user: frozenset[str], min_workers: int,
         floor: float, notes: list[str]) -> ResourcePlan:
    """Shrink what the user did not give until the job's total ``unit`` is within ``limit``."""
    if _total(plan, unit) <= limit:
        return plan
    limit_name = "max_cpu" if unit == "cpu" else "max_memory_mb"
    before = (plan.workers, plan.ps)
    steps: list[Callable[[ResourcePlan], ResourcePlan | None]] = []
    if "workers" not in user:
        steps.append(lambda p: replace(p, workers=p.workers - 1) if p.workers > min_workers else None)
    if "ps" not in user:
        steps.append(lambda p: replace(p, ps=p.ps - 1) if p.ps > 1 else None)
    for step in steps:
        while _total(plan, unit) > limit:
            nxt = step(plan)
            if nxt is None:
                break
            plan = nxt
    if (plan.workers, plan.ps) != before:
        notes.append(f"workers/ps reduced to {plan.workers}/{plan.ps} to fit limits.{limit_name}={limit:g}")
    if _total(plan, unit) > limit:
        # Scale the per-node amounts the user did not give into what the user's amounts leave over.
        roles = [r for r in (Role.WORKER, Role.PS) if f"{r.value}_{unit}" not in user]
        fixed = sum(_count(plan, r) * getattr(plan, f"{r.value}_{unit}") for r in (Role.WORKER, Role.PS)
                    if r not in roles)
        scalable = sum(_count(plan, r) * getattr(plan, f"{r.value}_{unit}") for r in roles)
        room = limit - fixed
        if roles and room > 0:
            factor = room / scalable
            for r in roles:
                cur = getattr(plan, f"{r.value}_{unit}")
                if unit == "cpu":
                    new: float | int = max(floor, math.floor(cur * factor * 10) / 10)
                else:
                    new = max(int(floor), int(cur * factor))
                change: dict[str, Any] = {f"{r.value}_{unit}": new}
                plan = replace(plan, **change)
            notes.append(f"{'/'.join(f'{r.value}_{unit}' for r in roles)} scaled down to fit "
                         f"limits.{limit_name}={limit:g}")
    if _total(plan, unit) > limit + 1e-9:
        raise LimitsError([
            f"limits.{limit_name}: {limit:g} is below the {_total(plan, unit):g} the plan needs "
            f"({plan.workers} workers, {plan.ps} PS) with the resources given"
        ])
    return plan
