"""Placement of a job's PS and workers onto machines (Dike §3.3, cost model Eq. 1-6).

Dike minimises the communication cost of workers downloading parameters::

    cost = sum_k sum_j Mem_j * Conn_jk * Cost_in + Mem_j * (1 - Conn_jk) * Cost_out   (Dike Eq. 1)

over workers k and PS j, where ``Mem_j`` is the parameter traffic of PS j
per worker and ``Conn_jk = 1`` iff PS j and worker k share a machine,
subject to the machines' capacities per resource (Eq. 2, here CPU and
memory), binary placement variables (Eq. 3, 4) and every task on exactly
one machine (Eq. 5, 6).  Dike calls it bin packing, NP-hard, and makes it
tractable by pruning (§3.2-3.3); we use its pruning and one consequence of
its cost model:

* Workers are identical (Dike §3.2, first pruning rule: "workers need to be
  of same resources assignment"), so a worker placement is only a count
  per machine.
* Given where the PS are, Eq. 1 is
  ``W * Cost_out * sum_j Mem_j - (Cost_out - Cost_in) * sum_i n_i * L_i``
  with ``n_i`` workers and ``L_i`` PS traffic on machine i.  With
  ``Cost_in <= Cost_out`` the best workers placement fills machines in
  decreasing ``L_i`` up to their remaining capacity: exact, because every
  worker weighs 1 and a worker on machine i is worth ``L_i``.
* PS placements are searched depth-first, largest traffic first, trying
  only one of several machines of the same capacity in the same state
  (same resources used, same PS traffic; the usual bin-packing symmetry
  break, which makes identical empty machines count once), cut by an upper
  bound on what the workers can still save.  The search is exact unless it visits more than
  ``max_nodes`` PS placements, in which case the best found is returned
  with ``exact=False`` (Dike itself settles for an approximation at scale:
  §4.2 reports at least 95% of the optimum at 20 instances).

Output: node name -> machine name; the pod executor turns it into node
affinity.  :func:`place_plan` is what the brain service calls: a plan and
the machines the executor reports (:func:`machines_for` adds back what the
job's own pods hold) in, the plan with its placement (or, when none fits,
without one and a reason that says why) out.  Pure: no IO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pacer.contracts.executor import MachineInfo
from pacer.contracts.jobs import ResourcePlan

__all__ = [
    "Machine",
    "Placement",
    "PlacementError",
    "PlacementInfeasible",
    "Task",
    "TaskRole",
    "after_placement",
    "cost_of",
    "machines_for",
    "place",
    "place_plan",
    "tasks_from_plan",
]


class PlacementError(ValueError):
    """Base error of placement."""


class PlacementInfeasible(PlacementError):
    """The tasks do not fit on the machines (Dike Eq. 2 cannot hold); the message says what is short."""


@dataclass(frozen=True, slots=True)
class Machine:
    """A bin B_i of Dike Eq. 2: the CPUs and memory it can still give."""

    name: str
    cpu: float
    memory_mb: float


class TaskRole:
    PS = "ps"
    WORKER = "worker"


@dataclass(frozen=True, slots=True)
class Task:
    """A PS or worker with its requirements R_jr / R_kr (Dike Eq. 2).

    ``traffic`` is Mem_j of Dike Eq. 1 for a PS (what each worker exchanges
    with it per step, any unit); ignored for workers.
    """

    name: str
    role: str  # TaskRole.PS or TaskRole.WORKER
    cpu: float
    memory_mb: float
    traffic: float = 0.0


def tasks_from_plan(plan: ResourcePlan, ps_traffic: Sequence[float] | None = None) -> list[Task]:
    """The tasks of a plan, named as the pod executor names nodes (``ps-<i>``, ``worker-<i>``).

    ``ps_traffic[j]`` is Mem_j; by default the PS share the model evenly, so
    each gets its memory as traffic (Dike §3.1: parameter count drives both
    memory and network traffic).
    """
    traffic = list(ps_traffic) if ps_traffic is not None else [float(plan.ps_memory_mb)] * plan.ps
    if len(traffic) != plan.ps:
        raise PlacementError(f"{len(traffic)} traffic values for {plan.ps} PS")
    ps = [
        Task(f"ps-{j}", TaskRole.PS, plan.ps_cpu, float(plan.ps_memory_mb), traffic[j])
        for j in range(plan.ps)
    ]
    workers = [
        Task(f"worker-{k}", TaskRole.WORKER, plan.worker_cpu, float(plan.worker_memory_mb))
        for k in range(plan.workers)
    ]
    return ps + workers


@dataclass(frozen=True, slots=True)
class Placement:
    """Node -> machine, with its Dike Eq. 1 cost and the traffic that crosses machines."""

    assignment: dict[str, str]
    cost: float  # Dike Eq. 1
    cross_traffic: float  # sum over (worker, PS) pairs on different machines of Mem_j
    exact: bool  # True: the search proved no placement has a lower cost
    explored: int  # PS placements visited


def cost_of(
    assignment: dict[str, str], tasks: Sequence[Task], cost_in: float = 0.0, cost_out: float = 1.0
) -> tuple[float, float]:
    """Dike Eq. 1 for a full assignment, and the cross-machine traffic: ``(cost, cross_traffic)``."""
    ps = [t for t in tasks if t.role == TaskRole.PS]
    workers = [t for t in tasks if t.role == TaskRole.WORKER]
    cost = cross = 0.0
    for k in workers:
        for j in ps:
            if assignment[j.name] == assignment[k.name]:  # Conn_jk = 1
                cost += j.traffic * cost_in
            else:
                cost += j.traffic * cost_out
                cross += j.traffic
    return cost, cross


def _check_fits_at_all(tasks: Sequence[Task], machines: Sequence[Machine]) -> None:
    need_cpu = sum(t.cpu for t in tasks)
    need_mem = sum(t.memory_mb for t in tasks)
    have_cpu = sum(m.cpu for m in machines)
    have_mem = sum(m.memory_mb for m in machines)
    if need_cpu > have_cpu + 1e-9:
        raise PlacementInfeasible(f"the tasks need {need_cpu:g} CPUs, the machines have {have_cpu:g}")
    if need_mem > have_mem + 1e-9:
        raise PlacementInfeasible(f"the tasks need {need_mem:g} MiB, the machines have {have_mem:g}")
    for t in tasks:
        if not any(t.cpu <= m.cpu + 1e-9 and t.memory_mb <= m.memory_mb + 1e-9 for m in machines):
            raise PlacementInfeasible(
                f"{t.name} ({t.cpu:g} CPUs, {t.memory_mb:g} MiB) fits on no single machine"
            )


def _fill(load: Sequence[float], caps: Sequence[int], workers: int) -> tuple[float, list[int], int]:
    """Workers onto machines in decreasing PS traffic L_i up to capacity: the best given the PS.

    Exact (module docstring): every worker weighs 1 and is worth the L_i of its machine.
    Returns ``(sum_i n_i L_i, n_i, workers left over)``.
    """
    counts = [0] * len(load)
    left = workers
    value = 0.0
    for i in sorted(range(len(load)), key=lambda i: (-load[i], i)):
        take = min(left, caps[i])
        counts[i] = take
        value += take * load[i]
        left -= take
    return value, counts, left


def place(
    tasks: Sequence[Task],
    machines: Sequence[Machine],
    *,
    cost_in: float = 0.0,
    cost_out: float = 1.0,
    max_nodes: int = 20_000,
) -> Placement:
    """Place every task on one machine within capacity at the least Dike Eq. 1 cost.

    ``cost_in`` / ``cost_out`` are Dike's weights of traffic within and
    across machines (``0 <= cost_in <= cost_out``).  Workers must be
    identical (Dike's pruning rule).  Raises :class:`PlacementInfeasible`
    with the reason when no placement exists.
    """
    if not (0.0 <= cost_in <= cost_out):
        raise PlacementError(f"need 0 <= cost_in <= cost_out, got {cost_in}, {cost_out}")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise PlacementError("task names must be unique")
    if len({m.name for m in machines}) != len(machines):
        raise PlacementError("machine names must be unique")
    ps = sorted((t for t in tasks if t.role == TaskRole.PS), key=lambda t: (-t.traffic, t.name))
    workers = [t for t in tasks if t.role == TaskRole.WORKER]
    if len(ps) + len(workers) != len(tasks):
        raise PlacementError(f"unknown roles in {[t.role for t in tasks]}")
    if len({(w.cpu, w.memory_mb) for w in workers}) > 1:
        raise PlacementError("workers must have identical resources (Dike §3.2)")
    if not machines:
        raise PlacementInfeasible("no machines")
    _check_fits_at_all(tasks, machines)

    n = len(machines)
    n_workers = len(workers)
    w_cpu = workers[0].cpu if workers else 0.0
    w_mem = workers[0].memory_mb if workers else 0.0
    total_traffic = sum(j.traffic for j in ps)
    saving_per_unit = cost_out - cost_in
    free_cpu = [m.cpu for m in machines]
    free_mem = [m.memory_mb for m in machines]
    load = [0.0] * n  # L_i: PS traffic hosted on machine i
    hosts: list[int] = [-1] * len(ps)

    best_value = -math.inf  # sum_i n_i * L_i, maximised
    best: tuple[list[int], list[int]] | None = None
    explored = 0
    exhausted = False

    def worker_capacity(i: int) -> int:
        by_cpu = math.floor(free_cpu[i] / w_cpu + 1e-9) if w_cpu > 0 else n_workers
        by_mem = math.floor(free_mem[i] / w_mem + 1e-9) if w_mem > 0 else n_workers
        return max(0, min(by_cpu, by_mem, n_workers))

    def place_workers() -> tuple[float, list[int]] | None:
        value, counts, left = _fill(load, [worker_capacity(i) for i in range(n)], n_workers)
        return None if left > 0 else (value, counts)

    def search(idx: int) -> None:
        nonlocal best_value, best, explored, exhausted
        if exhausted:
            return
        if idx == len(ps):
            explored += 1
            if explored > max_nodes:
                exhausted = True
            got = place_workers()
            if got is not None and got[0] > best_value + 1e-12:
                best_value, best = got[0], (list(hosts), got[1])
            return
        # Bound: capacities only shrink as PS are added, so the best worker fill with today's
        # loads and capacities, plus the remaining PS traffic times the most workers any
        # machine can still take, is at least the value of every completion.
        if best is not None:
            caps = [worker_capacity(i) for i in range(n)]
            remaining = sum(j.traffic for j in ps[idx:])
            bound = _fill(load, caps, n_workers)[0] + remaining * min(n_workers, max(caps))
            if bound <= best_value + 1e-12:
                return
        task = ps[idx]
        seen: set[tuple[float, float, float, float, float]] = set()
        # Most promising first (where traffic already is, then room for workers), so that a
        # good incumbent is found early and the bound cuts more.
        for i in sorted(range(n), key=lambda i: (-load[i], -worker_capacity(i), i)):
            if task.cpu > free_cpu[i] + 1e-9 or task.memory_mb > free_mem[i] + 1e-9:
                continue
            # Machines of the same capacity holding the same (capacity used, PS traffic) are
            # interchangeable for the rest of the search: try one of them.
            key = (machines[i].cpu, machines[i].memory_mb, free_cpu[i], free_mem[i], load[i])
            if key in seen:
                continue
            seen.add(key)
            free_cpu[i] -= task.cpu
            free_mem[i] -= task.memory_mb
            load[i] += task.traffic
            hosts[idx] = i
            search(idx + 1)
            free_cpu[i] += task.cpu
            free_mem[i] += task.memory_mb
            load[i] -= task.traffic
            hosts[idx] = -1

    search(0)
    if best is None:
        raise PlacementInfeasible(
            f"{len(ps)} PS and {n_workers} workers fit in total but cannot be packed onto "
            f"{n} machines within their CPU and memory (Dike Eq. 2)"
        )
    ps_hosts, counts = best
    assignment = {ps[j].name: machines[ps_hosts[j]].name for j in range(len(ps))}
    slots = [machines[i].name for i in range(n) for _ in range(counts[i])]
    for k, w in enumerate(sorted(workers, key=lambda t: t.name)):
        assignment[w.name] = slots[k]
    cost = n_workers * cost_out * total_traffic - saving_per_unit * best_value  # Dike Eq. 1
    cross = n_workers * total_traffic - best_value
    return Placement(
        assignment=assignment, cost=cost, cross_traffic=cross, exact=not exhausted, explored=explored,
    )


def machines_for(job: str, machines: Sequence[MachineInfo]) -> list[Machine]:
    """The bins B_i of Dike Eq. 2 for (re-)placing ``job``: what each machine has free, plus what the
    job's own live pods hold there (a re-plan replaces them, so their share is the job's to use)."""
    return [Machine(m.name, m.free_cpu + m.held_cpu.get(job, 0.0),
                    float(m.free_memory_mb + m.held_memory_mb.get(job, 0))) for m in machines]


def place_plan(plan: ResourcePlan, machines: Sequence[Machine], *, ps_traffic: Sequence[float] | None = None,
               cost_in: float = 0.0, cost_out: float = 1.0, max_nodes: int = 20_000) -> ResourcePlan:
    """``plan`` with its Dike placement over ``machines`` (Eq. 1-6 by :func:`place`), replacing any it had.

    With fewer than two machines there is nothing to choose: no placement.
    When the nodes cannot be packed (Dike Eq. 2 fails), the plan goes out
    without a placement and its reason says why: a placement is a
    preference, so a plan is never held back for the lack of one (the
    scheduler may still find room as other pods end).
    """
    bare = replace(plan, placement={}) if plan.placement else plan
    if len(machines) < 2 or plan.workers + plan.ps == 0:
        return bare
    tasks = tasks_from_plan(plan, ps_traffic)
    try:
        p = place(tasks, machines, cost_in=cost_in, cost_out=cost_out, max_nodes=max_nodes)
    except PlacementError as exc:
        return _with_reason(bare, f"no placement: {exc}", {})
    used = len(set(p.assignment.values()))
    total = plan.workers * sum(t.traffic for t in tasks if t.role == TaskRole.PS)
    share = f", {p.cross_traffic / total:.0%} of PS traffic across machines" if total > 0 else ""
    return _with_reason(bare, f"placed on {used} of {len(machines)} machines (Dike{share})", p.assignment)


def _with_reason(plan: ResourcePlan, note: str, placement: dict[str, str]) -> ResourcePlan:
    return replace(plan, reason=f"{plan.reason}; {note}" if plan.reason else note, placement=dict(placement))


def after_placement(machines: Sequence[MachineInfo], plan: ResourcePlan) -> list[MachineInfo]:
    """The machines once ``plan``'s placement is in force: its job holds what the placement puts on each.

    So that the next job placed before the executor's next report does not
    count on the same free capacity.  A plan without placement changes nothing.
    """
    if not plan.placement:
        return list(machines)
    cpu: dict[str, float] = {}
    mem: dict[str, int] = {}
    for t in tasks_from_plan(plan):
        host = plan.placement.get(t.name)
        if host is not None:
            cpu[host] = cpu.get(host, 0.0) + t.cpu
            mem[host] = mem.get(host, 0) + int(t.memory_mb)
    out = []
    for m in machines:
        had_cpu, had_mem = m.held_cpu.get(plan.job, 0.0), m.held_memory_mb.get(plan.job, 0)
        now_cpu, now_mem = cpu.get(m.name, 0.0), mem.get(m.name, 0)
        out.append(replace(
            m, free_cpu=max(0.0, m.free_cpu + had_cpu - now_cpu), free_memory_mb=max(0, m.free_memory_mb + had_mem - now_mem),
            held_cpu={**m.held_cpu, plan.job: now_cpu}, held_memory_mb={**m.held_memory_mb, plan.job: now_mem}))
    return out
