"""The autoscaling simulator: hidden job model, runtime costs, baselines, cluster runs, scenarios, CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pacer.contracts.jobs import PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness
from pacer_services.brain.core.cluster import Resources, ScalingKind, ScalingRecord
from pacer_services.cli.main import main
from pacer_services.pod_executor.core import ExecutorPolicy
from pacer_services.simulator.autoscale import (
    PROFILES,
    ClusterJobView,
    JobSim,
    JobTruth,
    SharedCluster,
    SimConfig,
    SimJob,
    UserPlan,
    cpu_used,
    draw_truth,
    run_cluster,
    run_job,
    sim_job,
    throughput,
    time_to_fraction_of,
)
from pacer_services.simulator.autoscale.scalers import (
    EsScaler,
    FirstComeStatic,
    OptimusScaler,
    StaticScaler,
    oracle_plan,
)
from pacer_services.simulator.autoscale.scenario import parse
from pacer_services.simulator.fields import ScenarioError

REPO = Path(__file__).resolve().parents[2]
WD = PROFILES["wide_deep"].truth
XD = PROFILES["xdeepfm"].truth


def plan(w: int, p: int, cw: float, cp: float, wm: int = 16384, pm: int = 16384) -> ResourcePlan:
    return ResourcePlan(job="job", workers=w, ps=p, worker_cpu=cw, worker_memory_mb=wm, ps_cpu=cp,
                        ps_memory_mb=pm, source=PlanSource.USER)


class Scripted:
    """A scaler that applies given plans at given decision times and records what it saw."""

    name = "scripted"

    def __init__(self, first: ResourcePlan, at: dict[float, ResourcePlan] | None = None) -> None:
        self.first, self.at = first, at or {}
        self.stats: list[JobStatistics] = []
        self.records: list[tuple[float, ScalingRecord]] = []
        self.ooms: list[tuple[str, str]] = []

    def start(self, job: SimJob, now: float) -> ResourcePlan:
        return self.first

    def decide(self, job: SimJob, now: float, stats: JobStatistics) -> ResourcePlan | None:
        self.stats.append(stats)
        return self.at.get(now)

    def on_oom(self, job: SimJob, now: float, node: str, role: str, plan: ResourcePlan) -> ResourcePlan | None:
        self.ooms.append((node, role))
        return None

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        self.records.append((now, record))


# ------------------------------------------------------------------ the hidden truth


def test_cpu_beyond_par_w_does_not_speed_a_worker() -> None:
    at_par = throughput(XD, 8, 4, XD.par_w, 8)
    assert throughput(XD, 8, 4, XD.par_w + 8, 8) == pytest.approx(at_par)
    assert throughput(XD, 8, 4, XD.par_w - 4, 8) < at_par  # below par it does matter


def test_a_hot_ps_caps_throughput() -> None:
    cap = (min(8.0, WD.par_p) - WD.ovh_p) / (min(1.0, WD.skew / 2) * WD.u_ps)
    many = [float(throughput(WD, w, 2, 4, 8)) for w in (20, 40, 80)]
    assert max(many) == pytest.approx(cap) and many[1] == pytest.approx(many[2])
    # the same PS CPUs without skew would carry more
    assert throughput(replace(WD, skew=1.0), 80, 2, 4, 8) > cap * 1.3


def test_cpu_use_never_exceeds_the_allocation() -> None:
    for w, p, cw, cp in [(4, 2, 8, 8), (40, 1, 2, 1), (10, 8, 32, 32), (1, 1, 1, 1)]:
        pl = plan(w, p, cw, cp)
        worker, ps = cpu_used(WD, pl, w, float(throughput(WD, w, p, cw, cp)))
        assert worker <= cw and all(c <= cp for c in ps)
    sc = Scripted(plan(20, 1, 2, 2), {540.0: plan(30, 1, 2, 2)})
    run_job("wide_deep", sc, seed=3, samples_total=20_000_000)
    assert sc.stats
    for st in sc.stats:
        for n in st.nodes:
            alloc = 2.0 * 100.0
            assert n.cpu_percent <= alloc + 1e-9, n


def test_same_seed_same_run_other_seed_other_draws() -> None:
    a = run_job("xdeepfm", "es", seed=5, samples_total=10_000_000).to_dict()
    b = run_job("xdeepfm", "es", seed=5, samples_total=10_000_000).to_dict()
    c = run_job("xdeepfm", "es", seed=6, samples_total=10_000_000).to_dict()
    assert a == b
    assert a["jct_s"] != c["jct_s"]
    t5 = draw_truth(XD, np.random.default_rng([5, 0, 0]))
    t6 = draw_truth(XD, np.random.default_rng([6, 0, 0]))
    assert t5 != t6 and t5 != XD


# ------------------------------------------------------------------ runtime costs


def test_added_workers_join_ps_changes_migrate_and_new_worker_sizes_roll() -> None:
    """What the executor's plan_change does: start only the new workers, migrate PS beside training, resize
    workers a batch at a time (a quarter, the chief last)."""
    cfg = SimConfig(noise=0.0)
    a = plan(4, 2, 4, 8, pm=10**6)  # no OOM
    b = replace(a, workers=8)
    c = replace(b, ps=3)
    d = replace(c, worker_cpu=2)
    sc = Scripted(a, {180.0: b, 540.0: c, 1260.0: d})
    run = run_job("wide_deep", sc, seed=0, samples_total=200_000_000, config=cfg)
    tl = run.timeline
    restart = cfg.pending_s + cfg.init_s

    def psi_at(t: float) -> float:
        return float([psi for ts, psi, _ in tl if ts <= t][-1])

    assert psi_at(restart - 1) == 0.0 and psi_at(restart) > 0.0  # the first plan pays the start too
    assert psi_at(180 + restart - 10) == psi_at(170) > 0.0  # the old workers go on training
    assert psi_at(180 + restart) > psi_at(170) * 1.5  # the new ones join after pending + init
    # a PS change is a seamless migration: the new PS start while the job trains on the old ones ...
    assert psi_at(540 + restart - 10) == psi_at(530) > 0.0
    # ... then every worker restarts once from the chief's checkpoint, and the job trains on the new PS
    assert psi_at(540 + restart) == 0.0 and psi_at(540 + 2 * restart - 10) == 0.0
    assert psi_at(540 + 2 * restart) > 0.0
    # a new worker size: 8 workers replaced 2 at a time, the others train throughout
    before, after = psi_at(1250), psi_at(1260 + 4 * restart)
    during = [psi_at(1260 + k * restart + 10) for k in range(4)]
    assert after < before and all(0.0 < p < before for p in during), (before, during, after)
    assert sorted(set(during)) != [after]  # the job ran with both sizes for a while
    kinds = [(t, r.kind, r.pause_s) for t, r in sc.records]
    assert kinds == [(0.0, ScalingKind.PS, restart), (180.0, ScalingKind.WORKERS, restart),
                     (540.0, ScalingKind.PS, 2 * restart), (1260.0, ScalingKind.WORKERS, 4 * restart)]
    assert run.scalings == 3 and run.pause_s == 2 * restart  # the first start and the migration's restart


def test_more_memory_alone_grows_in_place_without_a_pause() -> None:
    """The executor's plan_change grows running nodes' memory in place: the job never stops, and the
    simulated nodes hold the new limit (an OOM then comes later or not at all)."""
    cfg = SimConfig(noise=0.0)
    a = plan(4, 2, 4, 8, pm=10**6)
    b = replace(a, ps_memory_mb=2 * 10**6, worker_memory_mb=a.worker_memory_mb * 2)
    sc = Scripted(a, {540.0: b})
    run = run_job("wide_deep", sc, seed=0, samples_total=200_000_000, config=cfg)
    restart = cfg.pending_s + cfg.init_s
    assert [(t, r.kind, r.pause_s) for t, r in sc.records] == [(0.0, ScalingKind.PS, restart),
                                                               (540.0, ScalingKind.MEMORY, 0.0)]
    psi = [p for t, p, _ in run.timeline if t >= restart]
    assert min(psi) > 0.0 and run.pause_s == restart  # only the first start paused the job
    truth = replace(WD, growth_mb_per_hour=20_000.0)
    job = sim_job("job", truth, 10**12, cfg)
    sim = JobSim(job, truth, cfg, np.random.default_rng(0))
    small = plan(8, 2, 4, 8, pm=8192)
    sim.apply(small, 0.0)
    sim.step(0.0, restart + 10.0)
    rec = sim.apply(replace(small, ps_memory_mb=4 * 8192), restart + 10.0)
    assert rec is not None and rec.kind is ScalingKind.MEMORY and rec.pause_s == 0.0
    assert all(n.spec.memory_mb == 4 * 8192 for name, n in sim.nodes(restart + 10.0).items() if name.startswith("ps-"))
    assert sim.migration is None


def test_oom_loses_progress_since_the_checkpoint_and_doubles_memory() -> None:
    truth = replace(WD, growth_mb_per_hour=20_000.0)
    cfg = SimConfig(noise=0.0, checkpoint_s=600.0)
    job = sim_job("job", truth, 10**12, cfg)
    sim = JobSim(job, truth, cfg, np.random.default_rng(0))
    first = plan(8, 2, 4, 8, pm=8192)
    sim.apply(first, 0.0)
    now = 0.0
    while sim.oom_node(now) is None:
        sim.step(now, 10.0)
        now += 10.0
    assert now > 600.0
    ckpt_samples, before = sim.ckpt[0], sim.done
    assert before > ckpt_samples > 0
    sim.oom(now)
    assert sim.done == ckpt_samples and sim.oom_failures == 1

    sc = Scripted(first)
    run = run_job(truth, sc, seed=0, samples_total=30_000_000, config=cfg, draw=False)
    assert run.oom_failures >= 1 and sc.ooms[0] == ("ps-0", "ps") and not run.failed
    assert run.final_plan is not None and run.final_plan.ps_memory_mb == 8192 * 2**run.oom_failures
    no_oom = run_job(truth, Scripted(plan(8, 2, 4, 8, pm=10**6)), seed=0, samples_total=30_000_000,
                     config=cfg, draw=False)
    assert run.jct_s is not None and no_oom.jct_s is not None
    assert run.jct_s > no_oom.jct_s + run.oom_failures * cfg.restart_s  # lost work on top of the pauses


def test_the_executor_core_caps_oom_relaunches_and_fails_the_job_past_its_budget() -> None:
    """on_exit: memory x2 up to the executor's cap, at most relaunch_budget relaunches of a node."""
    truth = replace(WD, growth_mb_per_hour=20_000.0)
    cfg = SimConfig(noise=0.0, checkpoint_s=600.0)
    sc = Scripted(plan(8, 2, 4, 8, pm=8192))
    run = run_job(truth, sc, seed=0, samples_total=100_000_000, config=cfg, draw=False)
    policy = ExecutorPolicy()
    assert run.oom_failures == policy.relaunch_budget + 1 and run.jct_s is None
    assert "budget" in run.failed and run.to_dict()["failed"] == run.failed
    assert run.final_plan is not None
    assert run.final_plan.ps_memory_mb == min(policy.max_memory_mb, 8192 * 2**policy.relaunch_budget)


# ------------------------------------------------------------------ baselines


@pytest.mark.parametrize("name", ["wide_deep", "xdeepfm"])
def test_the_oracle_beats_random_feasible_plans(name: str) -> None:
    truth = draw_truth(PROFILES[name].truth, np.random.default_rng(1))
    best = oracle_plan(truth, 200.0, 32.0, samples_total=50_000_000)
    assert best.workers * best.worker_cpu + best.ps * best.ps_cpu <= 200.0
    assert max(best.worker_cpu, best.ps_cpu) <= 32.0
    top = float(throughput(truth, best.workers, best.ps, best.worker_cpu, best.ps_cpu))
    rng = np.random.default_rng(7)
    n = 0
    while n < 2000:
        cw, cp = rng.integers(1, 33, size=2)
        p = int(rng.integers(1, 60))
        wmax = (200 - p * cp) // cw
        if wmax < 1:
            continue
        w = int(rng.integers(1, wmax + 1))
        assert throughput(truth, w, p, float(cw), float(cp)) <= top * (1 + 1e-9)
        n += 1
    # not trivial: neither one PS nor the whole quota in workers
    assert best.ps > 1 and best.workers * best.worker_cpu < 200


def hot_ps_job() -> JobTruth:
    """One tiny PS that saturates at once: more workers cannot help, another PS does."""
    return replace(WD, skew=1.0, u_ps=0.004, par_p=2.0)


def test_es_stops_when_the_step_efficiency_falls_below_0_3() -> None:
    up = UserPlan(workers=4, worker_cpu=4, ps=1, ps_cpu=2, ps_memory_mb=10**6)
    es = EsScaler(up)
    run = run_job(hot_ps_job(), es, seed=0, samples_total=30_000_000, config=SimConfig(noise=0.02), draw=False)
    assert es.efficiencies and es.efficiencies[-1] < 0.3
    assert run.final_plan is not None and run.final_plan.workers == 4 and run.final_plan.ps == 1
    assert run.scalings == 2  # one step of +4 and its undo, then nothing
    # a job that scales: ES keeps adding
    es2 = EsScaler()
    run2 = run_job(XD, es2, seed=0, samples_total=40_000_000, draw=False)
    assert run2.final_plan is not None and run2.final_plan.workers >= 12 and es2.efficiencies[0] >= 0.3


def test_optimus_adds_ps_when_the_ps_is_the_bottleneck() -> None:
    up = UserPlan(workers=4, worker_cpu=4, ps=1, ps_cpu=2, ps_memory_mb=10**6)
    opt = OptimusScaler(up)
    run = run_job(hot_ps_job(), opt, seed=0, samples_total=30_000_000, config=SimConfig(noise=0.02), draw=False)
    assert run.final_plan is not None and run.final_plan.ps >= 3
    assert run.final_plan.worker_cpu == 4 and run.final_plan.ps_cpu == 2  # pod sizes never change


def test_baselines_respect_the_quota() -> None:
    for scaler in ("es", "optimus"):
        run = run_job("xdeepfm", scaler, seed=2, samples_total=60_000_000)
        assert run.final_plan is not None and run.rejected == 0
        assert run.final_plan.workers * run.final_plan.worker_cpu + run.final_plan.ps * run.final_plan.ps_cpu <= 200


def test_time_to_fraction_of() -> None:
    tl = [(0.0, 0.0, "a"), (120.0, 50.0, "a"), (300.0, 96.0, "b")]
    assert time_to_fraction_of(tl, 100.0) == 300.0
    assert time_to_fraction_of(tl, 100.0, fraction=0.5) == 120.0
    assert time_to_fraction_of(tl, 1000.0) is None


# ------------------------------------------------------------------ clusters


class Watching:
    """Wraps a cluster scaler; records the free resources at every call."""

    def __init__(self, inner: FirstComeStatic | Greedy) -> None:
        self.inner, self.name = inner, inner.name
        self.free: list[Resources] = []
        self.pending_seen = 0

    def decide_all(self, now: float, jobs: Sequence[ClusterJobView], free: Resources) -> dict[str, ResourcePlan]:
        self.free.append(free)
        self.pending_seen = max(self.pending_seen, sum(v.plan is None for v in jobs))
        return self.inner.decide_all(now, jobs, free)

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        self.inner.on_applied(job, now, record)


class Greedy:
    """Gives every pending job the whole per-job quota, fit or not."""

    name = "greedy"

    def decide_all(self, now: float, jobs: Sequence[ClusterJobView], free: Resources) -> dict[str, ResourcePlan]:
        return {v.job.name: replace(plan(19, 2, 8, 24), job=v.job.name) for v in jobs if v.plan is None}

    def on_applied(self, job: SimJob, now: float, record: ScalingRecord) -> None:
        return None


SMALL = SharedCluster(cpu=100.0, memory_mb=10**7, jobs=5, arrival_mean_s=1.0, size_min=0.02, size_max=0.04)


def test_first_come_static_never_exceeds_the_quota_and_queues_the_rest() -> None:
    w = Watching(FirstComeStatic())
    res = run_cluster(SMALL, w, seed=0)
    assert all(f.cpu >= -1e-9 for f in w.free)
    assert res.unfinished == 0 and res.rejected == 0
    assert w.pending_seen >= 3  # 48-CPU user plans: two fit in 100 CPUs, the others wait
    started = sorted(r.started_s or 0.0 for r in res.jobs)
    assert started[1] < 60.0 and started[2] > 600.0
    assert 0.0 < res.cpu_used_util <= res.cpu_allocated_util <= 1.0


def test_a_cluster_run_rejects_over_quota_returns_and_counts_them() -> None:
    w = Watching(Greedy())
    res = run_cluster(replace(SMALL, cpu=450.0, jobs=3), w, seed=0)
    assert res.rejected >= 1
    assert all(f.cpu >= -1e-9 for f in w.free)
    assert res.unfinished == 0


# ------------------------------------------------------------------ scenarios and the CLI


@pytest.mark.parametrize(("raw", "field"), [
    ({"autoscale": {"quota_cpu": -1}}, "autoscale.quota_cpu"),
    ({"autoscale": {"profile": "dcn"}}, "autoscale.profile"),
    ({"autoscale": {"speed": 3}}, "autoscale.speed"),
    ({"autoscale": {"truth": {"skew": 0.5}}}, "autoscale.truth.skew"),
    ({"autoscale": {"user_plan": {"workers": 0}}}, "autoscale.user_plan.workers"),
    ({"autoscale": {"cluster": {"mix": {"bert": 1.0}}}}, "autoscale.cluster.mix.bert"),
    ({"autoscale": {"cluster": {"jobs": 0}}}, "autoscale.cluster.jobs"),
    ({"autoscale": {"scaler": "magic"}}, "autoscale.scaler"),
    ({"autoscale": []}, "autoscale"),
    ({"autoscale": {"truth": {"form": "linear"}}}, "autoscale.truth.form"),
])
def test_scenario_errors_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ScenarioError) as e:
        parse(raw)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_the_off_model_truth_departs_from_the_models_structure_where_it_should() -> None:
    """Smooth saturation, a sync cost in (w/p)^1.4 equal to the linear one at w/p = 4, a soft PS cap."""
    off = replace(WD, form="off-model")
    assert parse({"autoscale": {"truth": {"form": "off-model"}}}).truth.form == "off-model"
    # far below the parallelism the two forms agree; at it the smooth one gives less than min(C, par)
    assert float(throughput(off, 4, 16, 1.0, 2.0)) == pytest.approx(float(throughput(WD, 4, 16, 1.0, 2.0)), rel=0.05)
    assert float(throughput(off, 4, 16, WD.par_w, 2.0)) < float(throughput(WD, 4, 16, WD.par_w, 2.0))
    # sync: more workers per PS cost more than linearly
    few, many = (float(throughput(t, 64, 4, 4.0, 8.0)) for t in (WD, off))
    assert many < few
    # the PS capacity is approached smoothly: never above the hard cap, and below it near the cap
    w, p, cw, cp = 60, 2, 4.0, 2.0
    assert float(throughput(off, w, p, cw, cp)) < float(throughput(WD, w, p, cw, cp))
    assert float(throughput(off, 0, 2, 4.0, 2.0)) == 0.0


def test_unknown_scaler_lists_the_known_ones() -> None:
    with pytest.raises(ScenarioError, match=r"known: .*es.*optimus.*oracle.*static"):
        parse({"autoscale": {"scaler": "magic"}})


def test_examples_parse() -> None:
    import yaml

    for f in ("autoscale-wide-deep", "autoscale-xdeepfm", "autoscale-cluster"):
        sc = parse(yaml.safe_load((REPO / f"examples/sim/{f}.yaml").read_text()))
        assert sc.name == f
    assert StaticScaler(lambda j: plan(1, 1, 1, 1)).decide(sim_job("j", WD, 1, SimConfig()), 0.0,
                                                           JobStatistics(job="j", ts=0.0, window_short_s=1.0,
                                                                         window_long_s=1.0,
                                                                         throughput_samples_per_s=0.0)) is None


def test_pacer_sim_runs_an_autoscale_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", str(REPO / "examples/sim/autoscale-wide-deep.yaml"), "--scaler", "es", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 1
    out = json.loads(lines[0])
    assert out["scaler"] == "es" and out["jct_s"] > out["oracle_jct_s"] > 0
    assert out["jct_vs_oracle_pct"] > 0 and out["final_plan"]["ps"] == 2


def test_pacer_sim_unknown_scaler_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", str(REPO / "examples/sim/autoscale-xdeepfm.yaml"), "--scaler", "nope"])
    assert rc == 2 and "--scaler" in capsys.readouterr().err


def test_scalers_see_the_monitor_cores_statistics_of_what_the_executor_did() -> None:
    """The statistics are MonitorCore's, fed agent reports and the executor's node events."""
    cfg = SimConfig(noise=0.0)
    a = plan(8, 2, 4, 8, pm=10**6)
    sc = Scripted(a, {360.0: replace(a, workers=4), 720.0: replace(a, workers=4, ps=3)})
    run_job("wide_deep", sc, seed=0, samples_total=100_000_000, config=cfg)
    by_ts = {st.ts: st for st in sc.stats}

    def states(ts: float, role: str) -> list[Liveness]:
        return [n.state for n in by_ts[ts].nodes if n.role == role]

    first = by_ts[180.0]
    assert first.window_short_s < cfg.adjust_interval_s and first.pending_nodes == 0
    assert states(180.0, "worker") == [Liveness.RUNNING] * 8 and first.throughput_samples_per_s > 0
    assert first.shards is not None and 0 < first.shards.records_done < first.shards.records_total
    # scaled down: the stopped workers are dead to the monitor, the others train on
    assert states(540.0, "worker").count(Liveness.DEAD) == 4 and states(540.0, "worker").count(Liveness.RUNNING) == 4
    # the PS migration: the new PS run beside the old until the switch (720 + 120), then every worker restarts
    assert by_ts[900.0].pending_nodes == 0 and by_ts[900.0].throughput_samples_per_s == 0.0  # trainers starting
    after = by_ts[1080.0]
    assert states(1080.0, "ps") == [Liveness.RUNNING] * 3 and after.throughput_samples_per_s > 0
    assert {n.restarts for n in after.nodes if n.role == "worker" and n.state is Liveness.RUNNING} == {1}
