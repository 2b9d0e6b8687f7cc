"""The brain's cluster round (services/brain/core/round.py): rules, then admission, then Eq. 11-14, within the total."""

from __future__ import annotations

import math
from dataclasses import replace

from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer_services.brain.core.autoscaler import Decision, JobAutoscaler, Proposal, Rule, Stage
from pacer_services.brain.core.cluster import JobChoice, JobRequest, Resources, plan_resources
from pacer_services.brain.core.pareto import Candidate
from pacer_services.brain.core.round import ReadyJob, cluster_round, round_total

from .test_brain_autoscaler import CFG, Truth, spec, stats_of


def plan(job: str, workers: int, worker_cpu: float = 1.0, ps_memory_mb: int = 2048) -> ResourcePlan:
    return ResourcePlan(job, workers, 1, worker_cpu, 1024, 2.0, ps_memory_mb, PlanSource.BRAIN)


class Job:
    """What cluster_round asks of a JobAutoscaler, with a fixed proposal: a stand-in for the round's orchestration."""

    def __init__(self, now: ResourcePlan, *, rule: ResourcePlan | None = None,
                 candidates: list[Candidate] | None = None, namespace: str = "default") -> None:
        self.plan = now
        self.namespace = namespace
        self.rule, self.candidates = rule, candidates or []
        self.pauses: list[object] = []
        self.withdrawn: list[Decision] = []
        self.fed: list[float] = []

    def propose(self, now: float, stats: object) -> Proposal:
        self.fed.append(now)
        if self.rule is not None:
            return Proposal(Decision(self.rule, Stage.ADJUST, Rule.OOM))
        return Proposal(request=JobRequest(self.plan.job, self.candidates, 1e9, self.plan, 100.0))

    def fit_decision(self, d: Decision, room: Resources) -> Decision | None:
        if not plan_resources(d.plan).fits_in(room):
            self.withdrawn.append(d)
            return None
        return d

    def accept(self, choice: JobChoice, now: float) -> Decision | None:
        if choice.plan is None or choice.scored is None:
            return None
        return Decision(choice.plan, Stage.ADJUST, Rule.MODEL, choice.scored.candidate.throughput)

    def withdraw(self, d: Decision) -> None:
        self.withdrawn.append(d)


def ready(*jobs: Job) -> list[ReadyJob]:
    return [ReadyJob(j, None) for j in jobs]  # type: ignore[arg-type]


def waiting(name: str, max_cpu: float = 200.0) -> JobAutoscaler:
    return JobAutoscaler(spec(name, max_cpu=max_cpu), 512, CFG)


def test_the_total_is_what_the_jobs_hold_plus_what_is_free_never_less_than_they_hold() -> None:
    assert round_total(Resources(8.0, 100.0), Resources(6.0, 9700.0)) == Resources(14.0, 9800.0)
    assert round_total(Resources(8.0, 100.0), Resources(-6.0, math.inf)) == Resources(8.0, math.inf)


def test_rules_go_first_and_the_model_shares_only_what_they_leave() -> None:
    """Two 5-CPU jobs and 3 CPUs free: the OOM rule's 2 extra CPUs come first, so the model's growth by
    3 CPUs (listed first, and a far better deal) no longer fits; without the rule it would."""
    oom = Job(plan("a", 3), rule=plan("a", 5))  # +2 CPUs
    grow = Job(plan("b", 3), candidates=[Candidate(plan("b", 6), 8.0, 200.0)])  # +3 CPUs, much faster
    out = cluster_round(ready(grow, oom), Resources(3.0, math.inf), 7.0)
    assert list(out.rules) == ["a"] and out.model == {}
    assert oom.fed == grow.fed == [7.0]  # every ready job is fed its window once, at the round's now
    assert out.left == Resources(1.0, math.inf)
    alone = cluster_round(ready(Job(plan("b", 3), candidates=[Candidate(plan("b", 6), 8.0, 200.0)])),
                          Resources(3.0, math.inf), 7.0)
    assert [d.plan for d in alone.model.values()] == [plan("b", 6)] and alone.left == Resources(0.0, math.inf)


def test_a_waiting_job_is_admitted_only_when_its_first_plan_fits_first_come_first_served() -> None:
    small, big, after = waiting("small", max_cpu=8.0), waiting("big"), waiting("after", max_cpu=8.0)
    need_small = plan_resources(small.first_plan())
    need_big = plan_resources(big.first_plan())
    assert need_big.cpu > need_small.cpu
    free = Resources(need_small.cpu * 2 + 0.5, math.inf)  # room for both small ones, not for the big one
    assert not need_big.fits_in(free - need_small)
    out = cluster_round([], free, 0.0, waiting=[small, big, after])
    assert list(out.admitted) == ["small"]  # "after" would fit, but waits behind "big"
    assert out.admitted["small"] == small.first_plan()
    assert cluster_round([], free - need_small - need_small, 0.0, waiting=[small]).admitted == {}


def test_admission_comes_after_the_rules_and_before_the_model() -> None:
    w = waiting("new", max_cpu=8.0)
    need = plan_resources(w.first_plan())
    oom = Job(plan("a", 3), rule=plan("a", 5))  # +2 CPUs
    grow = Job(plan("b", 3), candidates=[Candidate(plan("b", 6), 8.0, 200.0)])  # +3 CPUs
    # room for the rule and the new job, not for the model's growth as well
    out = cluster_round(ready(oom, grow), Resources(2.0 + need.cpu + 1.0, math.inf), 0.0, waiting=[w])
    assert list(out.plans()) == ["a", "new"] and out.model == {}
    # not even room for the new job once the rule took its 2 CPUs: it waits, and the model may grow
    out = cluster_round(ready(Job(plan("a", 3), rule=plan("a", 5)),
                              Job(plan("b", 3), candidates=[Candidate(plan("b", 6), 8.0, 200.0)])),
                        Resources(need.cpu + 1.0, math.inf), 0.0, waiting=[waiting("new", max_cpu=8.0)])
    assert out.admitted == {} and list(out.plans()) == ["a", "b"]


def test_when_the_jobs_hold_more_than_there_is_they_may_shrink_but_not_grow() -> None:
    grow = Job(plan("b", 4), candidates=[Candidate(plan("b", 6), 8.0, 200.0)])
    out = cluster_round(ready(grow), Resources(-3.0, -100.0), 0.0)  # an OOM relaunch overshot memory
    assert out.model == {} and out.total == plan_resources(plan("b", 4))
    shrink = Job(plan("b", 4), candidates=[Candidate(plan("b", 2), 1.0, 150.0)])  # cheaper and faster
    out = cluster_round(ready(shrink), Resources(-3.0, -100.0), 0.0)
    assert [d.plan for d in out.model.values()] == [plan("b", 2)]


def test_a_round_never_exceeds_its_total_over_a_run_with_arrivals() -> None:
    """Real autoscalers, as the simulator drives them: two running jobs of up to 30 CPUs, three of up to 16
    waiting, 80 CPUs; every plan applied in the round's order keeps the cluster within its capacity."""
    cap = Resources(80.0, math.inf)
    truths = {"a": Truth(), "b": Truth(a_grad=0.03, par_w=24, u=0.0004), "c": Truth(u=0.004),
              "d": Truth(), "e": Truth(u=0.004)}
    autos = {n: JobAutoscaler(spec(n, max_cpu=30.0 if n in "ab" else 16.0), t.m, replace(CFG, seed=i))
             for i, (n, t) in enumerate(truths.items())}
    running = ["a", "b"]
    for n in running:
        autos[n].applied(autos[n].first_plan(), 0.0)
    queue = ["c", "d", "e"]
    t, admitted = 0.0, []
    while t < 2 * 3600:
        t += 60.0
        held = sum((plan_resources(autos[n].plan) for n in running), Resources())
        out = cluster_round([ReadyJob(autos[n], stats_of(truths[n], autos[n].plan, t)) for n in running
                             if autos[n].plan is not None], cap - held, t, waiting=[autos[n] for n in queue])
        for n, p in out.plans().items():  # applied one by one, in order: never above the capacity
            before = autos[n].plan
            held = held - plan_resources(before) + plan_resources(p)
            assert held.fits_in(cap), (t, n, held)
            autos[n].applied(p, t)
            if n in queue:
                queue.remove(n)
                running.append(n)
                admitted.append(n)
    assert admitted and admitted == ["c", "d", "e"][:len(admitted)]  # first come, first served


# ------------------------------------------------------------------ teams' quotas (issue 26)


def test_a_teams_jobs_grow_within_its_quota_while_another_team_takes_the_rest() -> None:
    """Team A holds 6 of its 8 CPUs: its job's +3 does not fit, its job's +2 elsewhere in the round does; team B
    has no quota of its own and takes what the round has.  Without quotas every growth fits."""
    a1 = Job(plan("a1", 3), candidates=[Candidate(plan("a1", 6), 8.0, 200.0)], namespace="team-a")  # +3
    a2 = Job(plan("a2", 3), candidates=[Candidate(plan("a2", 5), 6.0, 180.0)], namespace="team-a")  # +2
    b = Job(plan("b", 3), candidates=[Candidate(plan("b", 6), 8.0, 200.0)], namespace="team-b")  # +3
    free = Resources(20.0, math.inf)
    out = cluster_round(ready(a1, a2, b), free, 0.0, namespace_free={"team-a": Resources(2.0, math.inf)})
    assert {job: d.plan for job, d in out.model.items()} == {"a2": plan("a2", 5), "b": plan("b", 6)}
    assert out.left == Resources(15.0, math.inf)
    free_for_all = cluster_round(ready(*(Job(j.plan, candidates=j.candidates, namespace=j.namespace)
                                         for j in (a1, a2, b))), free, 0.0)
    assert sorted(free_for_all.model) == ["a1", "a2", "b"]


def test_a_rule_and_an_admission_are_fitted_to_the_teams_room_too() -> None:
    oom = Job(plan("a", 3), rule=plan("a", 5), namespace="team-a")  # +2 CPUs, team A has 1 left
    out = cluster_round(ready(oom), Resources(10.0, math.inf), 0.0, namespace_free={"team-a": Resources(1.0, math.inf)})
    assert out.rules == {} and [d.plan for d in oom.withdrawn] == [plan("a", 5)]
    w = waiting("new", max_cpu=8.0)
    w.namespace = "team-a"
    need = plan_resources(w.first_plan())
    tight = {"team-a": Resources(need.cpu - 0.5, math.inf)}
    assert cluster_round([], Resources(100.0, math.inf), 0.0, waiting=[w], namespace_free=tight).admitted == {}
    roomy = {"team-a": Resources(need.cpu, math.inf), "team-b": Resources(0.0, math.inf)}
    assert list(cluster_round([], Resources(100.0, math.inf), 0.0, waiting=[w], namespace_free=roomy).admitted) == ["new"]


def test_a_team_over_its_quota_may_shrink_but_not_grow() -> None:
    grow = Job(plan("a", 4), candidates=[Candidate(plan("a", 6), 8.0, 200.0)], namespace="team-a")
    out = cluster_round(ready(grow), Resources(50.0, math.inf), 0.0,
                        namespace_free={"team-a": Resources(-2.0, math.inf)})  # the quota was lowered under it
    assert out.model == {}
    shrink = Job(plan("a", 4), candidates=[Candidate(plan("a", 2), 1.0, 150.0)], namespace="team-a")
    out = cluster_round(ready(shrink), Resources(50.0, math.inf), 0.0,
                        namespace_free={"team-a": Resources(-2.0, math.inf)})
    assert [d.plan for d in out.model.values()] == [plan("a", 2)]

