"""One cluster round of the brain (DLRover-RM §4.3, Eq. 11-14): the ONE function the service and the simulator call.

The live brain (``BrainService.cluster_round``) and the autoscaling
simulator's cluster scaler (``PacerCluster.decide_all``) both hand a burst of
statistics windows to :func:`cluster_round` and apply what it returns; the
round itself is decided here and nowhere else.

Inputs
    ``ready``: the running jobs that have a window not yet fed to their
    :class:`~.autoscaler.JobAutoscaler` (a job without a plan in force is
    skipped); ``free``: what the cluster (or the operator's S) has left after
    everything that is held now, these jobs' plans included, per resource;
    it may be negative when the jobs hold more than S (S shrank, an OOM
    relaunch doubled memory); ``waiting``: autoscalers of jobs that wait to
    start, in the order they came (first come, first served); ``now``: the
    caller's clock, the time the windows were taken; ``namespace_free``:
    per namespace (a team) with a quota, what the quota has left after
    everything the namespace's jobs hold now (may be negative, like
    ``free``).  Every step below keeps a job's growth within its
    namespace's room as well as within the round's (issue 26: the brain's
    quota is per team); a namespace without an entry is bound by the
    round's total only.

The round, in this order (each step within what the previous ones left):

1. **Rules** (every :class:`~pacer.contracts.brain.BrainRule` but ``model``:
   sample-stage answers, optimize, OOM prevention, hot PS, idle PS,
   DLRover 2023 §4.2 and DLRover-RM §5.3):
   each job's rule decision is fitted to its plan plus what is left
   (:meth:`~.autoscaler.JobAutoscaler.fit_decision`), in ``ready`` order.
   They come first because they fix a job that is sampling or about to
   fail; a new job must not take the memory an OOM prevention needs.
2. **Admission**: each waiting job starts with its first plan (warm start
   or sample plan, :meth:`~.autoscaler.JobAutoscaler.first_plan`) if it
   fits what is left; the first one that does not fit stops the admission
   (the ones behind it wait too, so a large job is not overtaken forever).
   Before the model's growth, not after: DLRover-RM's pre-scaling stage
   wants a job "performing well upon submission rather than waiting", and
   running jobs that are already training should not starve the queue by
   growing into every free core.
3. **Model** (DLRover-RM Eq. 11-14): the remaining jobs' Pareto candidates
   share what is left plus what they hold by the weighted greedy selection
   (:func:`.cluster.select`); a job may decline its choice (``min_gain``,
   convergence), and since select() shared the room assuming every choice
   is taken, the others' growth is then taken only while it still fits,
   shrinking jobs first.

The round's total is ``held(ready) + max(free, 0)`` per resource: what the
round's jobs hold plus what is free.  When ``free`` is negative the round
may trade between its jobs and shrink them, never grow them (this was
``capacity.round_total`` in the service; the simulator passed
``free + held`` unguarded, which let :func:`.cluster.select` raise when an
OOM relaunch had pushed memory past the capacity).

Differences between the two former copies, resolved here:

* total: as above, the service's guard wins (the simulator's form raised);
* admission: the simulator admitted waiting jobs after the round, the
  service never did.  Now step 2 of the one round.  The live service
  passes no waiting jobs: it answers a job's first plan at submission
  (``pacer.rpc.brain.<job>.plan``) and the executor queues pods that do
  not fit, so there is no admission queue in the brain;
* clock: the service stepped each job at its own window's ``ts``, the
  simulator at ``now``; now one ``now`` per round (the service passes the
  newest window's ``ts``: a burst's windows are a fraction of a second
  apart, far below ``settle_s`` and ``adjust_interval_s``);
* duplicates: feeding a window once is the caller's business (the
  simulator may see the same window twice; the service keeps only new ones).

Output: :class:`RoundOutcome`; :meth:`RoundOutcome.plans` lists every new
plan in an order in which applying them one by one never exceeds the total.

Pure: no IO, no clock; the autoscalers are stepped (``propose`` feeds each
its window), so call it from one thread at a time per set of autoscalers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pacer.contracts.jobs import ResourcePlan
from pacer.contracts.monitor import JobStatistics

from .autoscaler import Decision, JobAutoscaler
from .cluster import DEFAULT_RHO, JobRequest, OverheadModel, Resources, plan_resources, select
from .pareto import Prices

__all__ = ["ReadyJob", "RoundOutcome", "cluster_round", "round_total"]


@dataclass(frozen=True, slots=True)
class ReadyJob:
    """A running job with a statistics window its autoscaler has not been fed yet."""

    auto: JobAutoscaler
    stats: JobStatistics


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What one round decided; jobs that keep their plan are absent."""

    rules: dict[str, Decision] = field(default_factory=dict)  # step 1, in ready order
    admitted: dict[str, ResourcePlan] = field(default_factory=dict)  # step 2, first come first served
    model: dict[str, Decision] = field(default_factory=dict)  # step 3, shrinking jobs first
    total: Resources = field(default_factory=Resources)  # what the round's jobs (and the admitted ones) may hold together
    left: Resources = field(default_factory=Resources)  # what is left of ``total`` once every plan here is applied

    @property
    def decisions(self) -> dict[str, Decision]:
        """The running jobs' new plans with why (rules, then the model's)."""
        return {**self.rules, **self.model}

    def plans(self) -> dict[str, ResourcePlan]:
        """Every new plan, in an order where applying them one at a time stays within ``total``."""
        out = {job: d.plan for job, d in self.rules.items()}
        out.update(self.admitted)
        out.update((job, d.plan) for job, d in self.model.items())
        return out


def round_total(held: Resources, free: Resources) -> Resources:
    """What a round's jobs may hold together: what they hold plus what is free, never less than they hold.

    ``free`` below zero (the cluster or the operator's S shrank under the
    jobs, an OOM relaunch doubled memory): the jobs may trade and shrink,
    not grow.
    """
    return Resources(held.cpu + max(free.cpu, 0.0), held.memory_mb + max(free.memory_mb, 0.0))


def cluster_round(ready: Sequence[ReadyJob], free: Resources, now: float, *,
                  waiting: Sequence[JobAutoscaler] = (), prices: Prices | None = None,
                  rho: float = DEFAULT_RHO, namespace_free: Mapping[str, Resources] | None = None) -> RoundOutcome:
    """One DLRover-RM §4.3 round: rules, then admission, then the weighted greedy choice (module docstring).

    Each ready job's window is fed to its autoscaler (``propose``), so every
    ready job is stepped exactly once.  A decision the round cannot carry
    out is withdrawn from its autoscaler, which decides again next time.
    """
    jobs = [r for r in ready if r.auto.plan is not None]
    held = Resources()
    for r in jobs:
        held = held + plan_resources(r.auto.plan)
    total = round_total(held, free)
    left = total - held
    # what each namespace with a quota may still add; below zero it may trade and shrink, not grow
    ns_left = {ns: Resources(max(f.cpu, 0.0), max(f.memory_mb, 0.0)) for ns, f in (namespace_free or {}).items()}

    def room(a: JobAutoscaler) -> Resources:
        """What ``a``'s job may add: the round's room, and its namespace's when it has a quota."""
        own = ns_left.get(a.namespace)
        return left if own is None else Resources(min(left.cpu, own.cpu), min(left.memory_mb, own.memory_mb))

    def take(a: JobAutoscaler, extra: Resources) -> None:
        nonlocal left
        left = left - extra
        if a.namespace in ns_left:
            ns_left[a.namespace] = ns_left[a.namespace] - extra

    # 1. rules, fitted to what each job may hold now (its plan plus what is left)
    rules: dict[str, Decision] = {}
    requests: list[tuple[JobAutoscaler, JobRequest]] = []
    for r in jobs:
        a = r.auto
        prop = a.propose(now, r.stats)
        if prop is None or a.plan is None:
            continue
        if prop.decision is not None:
            d = a.fit_decision(prop.decision, room(a) + plan_resources(a.plan))
            if d is not None:
                rules[a.plan.job] = d
                take(a, plan_resources(d.plan) - plan_resources(a.plan))
        elif prop.request is not None:
            requests.append((a, prop.request))

    # 2. admission, first come first served
    admitted: dict[str, ResourcePlan] = {}
    for w in waiting:
        if w.plan is not None:
            continue
        first = w.first_plan()
        need = plan_resources(first)
        if not need.fits_in(room(w)):
            break  # the ones behind it wait too
        admitted[first.job] = first
        take(w, need)

    # 3. the model's candidates: Eq. 11-14 over what is left plus what these jobs hold
    model: dict[str, Decision] = {}
    if requests:
        pool = left
        for _, req in requests:
            pool = pool + plan_resources(req.current)
        choice = select([req for _, req in requests], pool, prices=prices, rho=rho,
                        overhead=OverheadModel.from_history([p for a, _ in requests for p in a.pauses]),
                        group_of={req.job: a.namespace for a, req in requests}, group_room=ns_left)
        accepted: list[tuple[JobAutoscaler, Decision]] = []
        for (a, _), c in zip(requests, choice.choices, strict=True):
            d = a.accept(c, now)
            if d is not None:
                accepted.append((a, d))
        # select() shared the room assuming every choice is taken; a job that declined keeps what it
        # holds, so the others' growth is taken only while it still fits, shrinking jobs first.
        accepted.sort(key=lambda ad: (plan_resources(ad[1].plan) - plan_resources(ad[0].plan)).cpu)
        for a, d in accepted:
            extra = plan_resources(d.plan) - plan_resources(a.plan)
            if extra.fits_in(room(a)):
                model[d.plan.job] = d
                take(a, extra)
            else:
                a.withdraw(d)
    return RoundOutcome(rules=rules, admitted=admitted, model=model, total=total, left=left)
