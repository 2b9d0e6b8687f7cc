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
within its own quota, as before.  A round over some of the jobs gets what
they hold plus what is free, S minus everything held
(:func:`.round.round_total`).

A round's decisions stay within its total by construction
(:func:`.round.cluster_round`); :func:`status_problem` rejects a
ClusterStatus whose numbers no planner should use.  Pure: no IO, no clock.
"""

from __future__ import annotations

import math

from pacer.contracts.executor import ClusterStatus

from .cluster import Resources

__all__ = ["cluster_capacity", "status_problem"]


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
