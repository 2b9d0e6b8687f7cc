"""What a plan change makes the executor do: starts, stops, rolling replacement, PS migration.

:func:`plan_change` is the one decision behind the live executor's
``apply_plan`` and behind the simulators' cost of a re-plan: scale-up fills
the lowest free slots, scale-down stops the highest, workers of another
size are replaced a batch at a time (:mod:`.resize`, DLRover-RM §5.1), and a
change of the PS set or size is a seamless migration (:mod:`.migration`,
DLRover-RM §5.2) rather than a restart of the job.  A change that only
raises a role's memory (the brain's OOM prevention, DLRover-RM §5.3, asks
for little else) grows the running nodes' limits in place
(``ExecutorPolicy.memory_in_place``): neither a migration nor a
replacement, so no pause at all.  Pure: no IO, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pacer.contracts.common import Role
from pacer_services.pod_executor.core.model import (
    DEFAULT_POLICY,
    ExecutorPolicy,
    Node,
    NodeSpec,
    Plan,
)
from pacer_services.pod_executor.core.resize import resize_rounds, resize_targets


@dataclass(frozen=True, slots=True)
class Reconcile:
    start: tuple[NodeSpec, ...]
    stop: tuple[str, ...]  # node names


def reconcile(plan: Plan, nodes: Mapping[str, Node]) -> Reconcile:
    """Starts and stops that make the live nodes match the plan.

    Scale-up fills the lowest free slots; scale-down stops the highest slots
    first (their shards go back through the node-death event).  A finished
    node keeps its slot (it is not started again) and is not stopped.
    Resources of running nodes are not changed here: that is a replacement
    or a migration (:func:`plan_change`).
    """
    start: list[NodeSpec] = []
    stop: list[str] = []
    for role, want, template in ((Role.WORKER, plan.workers, plan.worker), (Role.PS, plan.ps, plan.ps_spec)):
        held = sorted((n for n in nodes.values() if n.spec.role == role and n.holds_slot),
                      key=lambda n: n.spec.index)
        have = {n.spec.index for n in held}
        missing = [i for i in range(want) if i not in have]
        start.extend(replace(template, role=role.value, index=i) for i in missing)
        stop.extend(n.name for n in held if n.spec.index >= want and n.live)
    return Reconcile(tuple(start), tuple(stop))


@dataclass(frozen=True, slots=True)
class PlanChange:
    """What the executor does to move a job from one plan to the next."""

    start: tuple[NodeSpec, ...]  # nodes created (scale-up; every node for a job's first plan)
    stop: tuple[str, ...]  # node names stopped (scale-down)
    # worker slots replaced with the new size, batch by batch, as the rolling replacement does them
    # (highest slot first, chief last); empty when a migration restarts every worker anyway
    resize_batches: tuple[tuple[int, ...], ...]
    # PS count or size changes: seamless migration (new PS start beside the old, then every
    # worker restarts once from the chief's checkpoint, with its new size)
    migrate_ps: bool
    resize: tuple[NodeSpec, ...] = ()  # the workers due a replacement, each with the size it gets
    ps_deferred: bool = False  # the PS change waits: a migration is already under way
    # running nodes whose memory limit grows in place (same CPU, more memory): no restart, no pause
    grow: tuple[NodeSpec, ...] = ()


def _grows(before: NodeSpec, after: NodeSpec) -> bool:
    """Only the memory changes, and it grows: a limit the running node can be given in place."""
    return bool(after.cpu == before.cpu and after.memory_mb > before.memory_mb)


def _ps_changed(before: Plan, after: Plan) -> bool:
    return after.ps != before.ps or (after.ps_spec.cpu, after.ps_spec.memory_mb) != (
        before.ps_spec.cpu, before.ps_spec.memory_mb)


def plan_change(before: Plan, after: Plan, nodes: Mapping[str, Node],
                policy: ExecutorPolicy = DEFAULT_POLICY, *, migrating: bool = False) -> PlanChange:
    """The starts, stops, worker replacements and PS migration that take ``nodes`` from ``before`` to ``after``.

    ``nodes`` are the job's nodes as the executor tracks them (empty for a
    job's first plan: every node of ``after`` starts).  ``after.workers`` is
    already clamped to the job's TF worker slots.  The PS set changes only by
    a migration: ``start`` and ``stop`` keep ``before.ps`` PS (started with
    ``after``'s PS size where a slot is free) and ``migrate_ps`` says a
    migration to ``after.ps`` x ``after.ps_spec`` follows; with ``migrating``
    (one is under way) the PS change waits (``ps_deferred``).  The workers
    that stay and differ from ``after.worker`` are replaced in
    ``resize_batches`` (:func:`.resize.resize_rounds`), unless a migration
    restarts every worker anyway: then each takes its new size there.
    With ``policy.memory_in_place``, nodes whose only change is more memory
    are in ``grow`` instead (the PS too: then there is no migration).
    """
    first = not nodes
    # More memory for the same PS (count and CPU): their limits grow in place, not a migration.  Not
    # while one is under way: its new PS are starting with the old size (the change waits for it).
    ps_grow = (policy.memory_in_place and not first and not migrating and after.ps == before.ps
               and _grows(before.ps_spec, after.ps_spec))
    ps_change = not first and _ps_changed(before, after) and not ps_grow
    migrate = ps_change and not migrating
    ps_count = after.ps if first else before.ps
    diff = reconcile(Plan(after.workers, ps_count, after.worker, after.ps_spec), nodes)
    if migrating:
        # The migration owns the PS set until it ends (its new PS are starting beside the old ones):
        # a plan arriving meanwhile must neither stop them nor start others (found in the brain's e2e
        # test: an OOM plan during an optimize migration stopped the new PS; the workers then moved
        # onto a cluster with dead PS and the job stalled).
        diff = Reconcile(tuple(s for s in diff.start if s.role != Role.PS),
                         tuple(n for n in diff.stop if not n.startswith(f"{Role.PS.value}-")))
    stopped = set(diff.stop)
    staying = [n for n in nodes.values() if n.spec.role == Role.WORKER and n.live and n.name not in stopped]
    resize = resize_targets(after.worker, staying)
    grow: list[NodeSpec] = []
    if policy.memory_in_place and not migrate:
        current = {n.spec.index: n.spec for n in staying}
        grow = [t for t in resize if _grows(current[t.index], t)]
        resize = tuple(t for t in resize if t not in grow)
    if ps_grow:
        grow.extend(replace(n.spec, memory_mb=after.ps_spec.memory_mb) for n in sorted(
            nodes.values(), key=lambda n: n.spec.index)
            if n.spec.role == Role.PS and n.live and n.spec.memory_mb < after.ps_spec.memory_mb)
    workers = len(staying) + sum(1 for s in diff.start if s.role == Role.WORKER)
    batches = () if migrate else resize_rounds((s.index for s in resize), workers, policy)
    return PlanChange(diff.start, diff.stop, batches, migrate, resize, ps_deferred=ps_change and migrating,
                      grow=tuple(grow))
