"""How much the brain's autoscaled jobs may hold together: the total of DLRover-RM's cluster stage.

DLRover-RM §4.3 shares one amount S among running jobs (Eq. 13: the chosen
plans together within S).  In the service S comes from one of two places,
per resource:

* the operator (``PACER_BRAIN_CLUSTER_CPU`` / ``PACER_BRAIN_CLUSTER_MEMORY_MB``):
  S is that, whatever the cluster says;
* the pod executor's :class:`~pacer.contracts.executor.ClusterStatus`, where
  pods' requests reserve capacity (Kubernetes): S is what is free plus what
  the autoscaled jobs hold now, since their own pods are among the used.
  Where nothing is reserved (the local backend shares one machine, free is
  the whole machine) the status says nothing about S.

Without a CPU amount from either, S is unknown and each job is planned
within its own quota, as before.  A round over some of the jobs gets S
minus what the others hold (:func:`round_total`).

:func:`within_total` re-checks a round's outcome against S before anything
is published, and :func:`status_problem` rejects a ClusterStatus whose
numbers no planner should use.  Pure: no IO, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pacer.contracts.executor import ClusterStatus
from pacer.contracts.jobs import ResourcePlan

from .cluster import Resources, plan_resources

__all__ = ["cluster_capacity", "round_total", "status_problem", "within_total"]


def status_problem(status: ClusterStatus) -> str:
    """Why ``status`` is unusable (``""``: it is fine): negative or non-finite amounts, repeated machines."""
    amounts = [("total_cpu", status.total_cpu), ("free_cpu", status.free_cpu),
               ("total_memory_mb", status.total_memory_mb), ("free_memory_mb", status.free_memory_mb)]
    for m in status.machines:
        amounts += [(f"machines[{m.name}].cpu", m.cpu), (f"machines[{m.name}].memory_mb", m.memory_mb),
                    (f"machines[{m.name}].free_cpu", m.free_cpu),
                    (f"machines[{m.name}].free_memory_mb", m.free_memory_mb)]
        amounts += [(f"machines[{m.name}].held_cpu[{j}]", v) for j, v in m.held_cpu.items()]
        amounts += [(f"machines[{m.name}].held_memory_mb[{j}]", v) for j, v in m.held_memory_mb.items()]
    for name, value in amounts:
        if not math.isfinite(value) or value < 0:
            return f"{name}: {value!r} is not a finite amount >= 0"
    names = [m.name for m in status.machines]
    if len(set(names)) != len(names) or "" in names:
        return "machines: names must be unique and non-empty"
    return ""


def cluster_capacity(status: ClusterStatus | None, held: Resources, *, cpu: float | None = None,
                     memory_mb: float | None = None) -> Resources | None:
    """S of DLRover-RM Eq. 13 for all autoscaled jobs together, or None when the CPUs are unknown.

    ``held`` is what those jobs' plans in force hold (their pods are part of
    the status's used capacity); ``cpu`` / ``memory_mb`` are the operator's
    amounts, which win.  Memory unknown: unbounded (the jobs' own quotas
    still bound it).
    """
    reserved = status is not None and status.reserves_capacity and status.total_cpu > 0
    if cpu is None and not reserved:
        return None
    if cpu is None:
        assert status is not None
        cpu = status.free_cpu + held.cpu
    if memory_mb is None:
        memory_mb = (status.free_memory_mb + held.memory_mb
                     if reserved and status is not None and status.total_memory_mb > 0 else math.inf)
    return Resources(cpu, memory_mb)


def round_total(capacity: Resources, in_round: Resources, others: Resources) -> Resources:
    """What the jobs of one round may hold together: S minus what the other jobs hold.

    Never less than what the round's jobs hold already: when S has shrunk
    under them (the operator lowered it, other tenants grew), the round can
    still move resources between them and shrink them, but not grow them.
    """
    left = capacity - others
    return Resources(max(left.cpu, in_round.cpu), max(left.memory_mb, in_round.memory_mb))


def within_total(decided: Mapping[str, ResourcePlan], current: Mapping[str, ResourcePlan],
                 total: Resources) -> tuple[dict[str, ResourcePlan], list[str]]:
    """The decided plans that keep the round's jobs within ``total``, and the jobs whose plan is held back.

    A guard, not a second selection: plans that shrink or keep a job's
    resources always pass; growing ones pass in order of the least extra
    CPU while the sum of every job's plan (decided, else current) stays
    within ``total``.  It only ever holds back a plan when the selection
    itself broke Eq. 13 (e.g. a job declined the smaller plan that made
    room for another's growth).
    """
    held = Resources()
    for plan in current.values():
        held = held + plan_resources(plan)
    kept: dict[str, ResourcePlan] = {}
    dropped: list[str] = []

    def extra(job: str) -> Resources:
        return plan_resources(decided[job]) - plan_resources(current.get(job))

    for job in sorted(decided, key=lambda j: (extra(j).cpu, extra(j).memory_mb, j)):
        e = extra(job)
        if (e.cpu <= 1e-9 and e.memory_mb <= 1e-9) or (held + e).fits_in(total):
            kept[job] = decided[job]
            held = held + e
        else:
            dropped.append(job)
    return kept, dropped
