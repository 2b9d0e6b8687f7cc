"""Brain benchmark: zero-configuration jobs against ES, Optimus and the oracle, in the autoscaling simulator.

``make bench-brain`` runs ``python bench/bench_brain.py``.  Markdown tables go
to stdout, progress to stderr, PNG plots to ``--out`` (default
``bench/out/brain/``), and the last stdout line is one JSON object with
``jct_vs_oracle_pct``, ``jct_gain_vs_es_pct``, ``jct_gain_vs_optimus_pct``,
``time_to_95pct_oracle_throughput_s``, ``warm_start_error_pct``,
``oom_failures``, ``cluster_mean_jct_gain_pct`` and the details behind them.

Setup (DLRover-RM §6, ``pacer_services.simulator.autoscale``): a 200-CPU
quota per job, at most 32 CPU per pod, decisions every 3 min, a pod starts in
20 s and initialises in 100 s.  Jobs are Wide&Deep-like (embedding/PS bound,
a hot PS, embeddings that grow) and xDeepFM-like (compute bound); each
job's true parameters are drawn around its profile from the seed and every
measurement carries 5 % noise.  No scaler sees the truth but the oracle.

1. Single jobs, ``--seeds`` per profile: Pacer (the brain's
   :class:`JobAutoscaler`, cold start: sample -> optimize -> adjust), ES
   (+4 workers while the scaling efficiency exceeds 0.3), Optimus (+1 PS or
   worker by marginal gain of its fitted model), a static user plan (4 x 8
   CPU workers, 2 x 8 CPU PS) and the oracle (the best static plan by
   exhaustive search over the true model, from t = 0).
   ``jct_vs_oracle_pct`` = mean of (JCT_pacer / JCT_oracle - 1) x 100;
   ``jct_gain_vs_es_pct`` = mean of (1 - JCT_pacer / JCT_es) x 100 (shorter
   JCT, as the paper reports it); the same for Optimus;
   ``time_to_95pct_oracle_throughput_s`` = mean time from submission until
   the job's true throughput first reaches 95 % of the oracle plan's.
2. Warm start (DLRover-RM Alg. 1): ``--history`` finished Pacer jobs of the
   same profile (other seeds) form the config DB; a new job's warm-start
   plan is run.  ``warm_start_error_pct`` = mean |throughput of the
   warm-start plan - oracle throughput| / oracle throughput x 100 (both
   true, noiseless), and the time to 95 % is compared with the cold start.
   ``jct_vs_oracle_pct_warm`` is the JCT over the oracle's of those
   warm-started jobs: a job whose family the config DB knows, Pacer's
   production path (DLRover-RM's Fig. 7 comparison with well-tuned plans is
   made with DLRover as deployed).  ``jct_vs_oracle_pct`` is the cold start
   of section 1: no history at all.
3. OOM (DLRover-RM §5.3): a Wide&Deep job whose embeddings grow 3x faster
   than the profile's, Pacer with and without OOM prediction.
   ``oom_failures`` = {"pacer": n, "no_prediction": n}, and the same after
   the sample stage (where the sample stage's own doubling rule, DLRover
   2023 §4.2, is replaced by prediction).
4. Cluster (DLRover-RM §4.3, Eq. 11-14): ``--cluster-jobs`` jobs arriving
   over time (Poisson) sharing one quota; Pacer's cluster-level selection
   against first-come static user plans.  ``cluster_mean_jct_gain_pct`` =
   (1 - mean JCT_pacer / mean JCT_static) x 100.

5. Off the model's structure: the same single jobs with the simulator's
   ``form="off-model"`` truth (smooth parallelism saturation, a sync cost
   in (w/p)^1.4, a soft PS capacity: :mod:`pacer_services.simulator.autoscale`),
   where the brain's calibrated model is wrong by construction; ``off_model``
   in the JSON.  Not a target: a check that the margins do not depend on
   the simulator sharing the model's assumptions.

Targets (issue 6, the papers' margins; issue 15: for each profile): within
3 % of the oracle from a cold start and 2 % warm; at least 17.7 % shorter
JCT than ES and 28.5 % than Optimus; no OOM failure where prediction applies.
``*_by_profile`` keys give each profile's mean; ``oracle_gain_vs_*_by_profile``
is the oracle's own lead over ES / Optimus, the most any scaler could gain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pacer_services.brain.core.history import JobFeatures, JobHistory
from pacer_services.brain.core.warmstart import warm_start
from pacer_services.simulator.autoscale import (
    CLUSTER_SCALERS,
    PROFILES,
    JobRun,
    ScalerContext,
    SharedCluster,
    SimConfig,
    draw_truth,
    rngs,
    run_cluster,
    run_job,
    sim_job,
    throughput,
    time_to_fraction_of,
)
from pacer_services.simulator.autoscale.scalers import PacerScaler, autoscale_config, oracle_plan

SCALERS = ("oracle", "pacer", "es", "optimus", "static")
TARGET_ORACLE_PCT = 3.0
TARGET_WARM_PCT = 2.0  # issue 15: warm starts within 2 %
TARGET_ES_PCT = 17.7
TARGET_OPTIMUS_PCT = 28.5


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def peak(run: JobRun) -> float:
    return max((psi for _, psi, _ in run.timeline), default=0.0)


def single_jobs(seeds: int, cfg: SimConfig, form: str = "dlrover") -> tuple[list[dict[str, Any]], dict[str, JobRun]]:
    rows: list[dict[str, Any]] = []
    examples: dict[str, JobRun] = {}
    for prof in PROFILES:
        nominal = replace(PROFILES[prof].truth, form=form)
        for seed in range(seeds):
            runs: dict[str, JobRun] = {}
            for sc in SCALERS:
                t = time.perf_counter()
                runs[sc] = run = run_job(nominal, sc, seed=seed, config=cfg, samples_total=PROFILES[prof].samples_total)
                say(f"  {prof} seed {seed} {sc}: JCT {(run.jct_s or 0.0) / 3600:.2f} h "
                    f"({time.perf_counter() - t:.1f} s)")
            o = runs["oracle"]
            assert o.jct_s is not None
            t95 = time_to_fraction_of(runs["pacer"].timeline, peak(o), 0.95)
            final = runs["pacer"].timeline[-1][1]
            rows.append({
                "profile": prof, "seed": seed,
                **{f"jct_{sc}_h": None if r.jct_s is None else round(r.jct_s / 3600, 3) for sc, r in runs.items()},
                "pacer_vs_oracle_pct": _pct(runs["pacer"].jct_s, o.jct_s),
                "gain_vs_es_pct": _gain(runs["pacer"].jct_s, runs["es"].jct_s),
                "gain_vs_optimus_pct": _gain(runs["pacer"].jct_s, runs["optimus"].jct_s),
                # the most any plan could gain: the oracle's own lead (a bound on the two above)
                "oracle_gain_vs_es_pct": _gain(o.jct_s, runs["es"].jct_s),
                "oracle_gain_vs_optimus_pct": _gain(o.jct_s, runs["optimus"].jct_s),
                "time_to_95pct_s": t95,
                # convergence: until the throughput first reaches 95 % of what the job ends with
                "time_to_95pct_of_final_s": time_to_fraction_of(runs["pacer"].timeline, final, 0.95),
                "pacer_final_vs_oracle_throughput": round(runs["pacer"].timeline[-1][1] / peak(o), 3),
                "pacer_scalings": runs["pacer"].scalings, "pacer_oom": runs["pacer"].oom_failures,
                "pacer_cpu_util": round(runs["pacer"].cpu_core_hours_used / runs["pacer"].cpu_core_hours_allocated, 3),
                "oracle_cpu_util": round(o.cpu_core_hours_used / o.cpu_core_hours_allocated, 3),
            })
            if seed == 0:
                for sc, r in runs.items():
                    examples[f"{prof}/{sc}"] = r
    return rows, examples


def _pct(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((a / b - 1.0) * 100.0, 2)


def _gain(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((1.0 - a / b) * 100.0, 2)


def _mean(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return round(statistics.fmean(v), 2) if v else None


def by_profile(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    """The mean of ``key`` over each profile's rows (issue 15: every target holds per profile)."""
    return {prof: _mean([r[key] for r in rows if r["profile"] == prof]) for prof in PROFILES}


def warm_starts(history: int, tests: int, cfg: SimConfig) -> dict[str, Any]:
    """Alg. 1 from Pacer's own finished jobs; error of the warm plan's true throughput vs the oracle's."""
    out: dict[str, Any] = {"rows": []}
    for prof in PROFILES:
        db: list[JobHistory] = []
        for seed in range(100, 100 + history):
            sc = PacerScaler(autoscale_config(cfg, seed=seed))
            r = run_job(prof, sc, seed=seed, config=cfg, name=f"hist-{seed}")
            assert r.final_plan is not None and r.jct_s is not None
            spec = sc.autoscaler.spec
            feats = replace(JobFeatures.from_spec(spec), dataset="criteo")
            db.append(JobHistory(job=f"hist-{seed}", features=feats, plans=(r.final_plan,),
                                 throughput=r.timeline[-1][1], finished_at=float(seed),
                                 coefficients=sc.autoscaler.learnt(),
                                 calibration=sc.autoscaler.learnt_calibration()))
        for seed in range(200, 200 + tests):
            truth = draw_truth(PROFILES[prof].truth, rngs(seed, 0)[0], cfg.sigma)
            probe = PacerScaler(autoscale_config(cfg))
            job = sim_job("new", truth, PROFILES[prof].samples_total, cfg)
            spec = replace(job.spec, dataset=replace(job.spec.dataset, path="sim://criteo"))
            ws = warm_start(spec, db)
            assert not ws.cold, "the config DB should hold similar jobs"
            plan = replace(ws.plan, worker_cpu=min(ws.plan.worker_cpu, cfg.max_pod_cpu),
                           ps_cpu=min(ws.plan.ps_cpu, cfg.max_pod_cpu))
            best = oracle_plan(truth, cfg.quota_cpu, cfg.max_pod_cpu)
            psi_best = float(throughput(truth, best.workers, best.ps, best.worker_cpu, best.ps_cpu))
            psi_warm = float(throughput(truth, plan.workers, plan.ps, plan.worker_cpu, plan.ps_cpu))
            warm = run_job(truth, PacerScaler(autoscale_config(cfg), warm=plan, prior=ws.coefficients,
                                              prior_calibration=ws.calibration), seed=seed,
                           config=cfg,
                           samples_total=PROFILES[prof].samples_total, draw=False)
            cold = run_job(truth, probe, seed=seed, config=cfg, samples_total=PROFILES[prof].samples_total,
                           draw=False)
            oracle = run_job(truth, "oracle", seed=seed, config=cfg, samples_total=PROFILES[prof].samples_total,
                             draw=False)
            row = {
                "profile": prof, "seed": seed,
                "warm_plan": f"{plan.workers}w x {plan.worker_cpu:g} + {plan.ps}ps x {plan.ps_cpu:g}",
                "error_pct": round(abs(psi_warm - psi_best) / psi_best * 100.0, 2),
                "predicted_error_pct": round(abs(ws.predicted_throughput - psi_best) / psi_best * 100.0, 2),
                "warm_time_to_95pct_s": time_to_fraction_of(warm.timeline, peak(oracle), 0.95),
                "cold_time_to_95pct_s": time_to_fraction_of(cold.timeline, peak(oracle), 0.95),
                "warm_time_to_95pct_of_final_s": time_to_fraction_of(warm.timeline, warm.timeline[-1][1], 0.95),
                "cold_time_to_95pct_of_final_s": time_to_fraction_of(cold.timeline, cold.timeline[-1][1], 0.95),
                "warm_jct_h": round((warm.jct_s or 0) / 3600, 3), "cold_jct_h": round((cold.jct_s or 0) / 3600, 3),
                "oracle_jct_h": round((oracle.jct_s or 0) / 3600, 3),
            }
            out["rows"].append(row)
            say(f"  warm start {prof} seed {seed}: {row}")
    rows = out["rows"]
    for r in rows:
        r["warm_vs_oracle_pct"] = round((r["warm_jct_h"] / r["oracle_jct_h"] - 1) * 100, 2)
        r["cold_vs_oracle_pct"] = round((r["cold_jct_h"] / r["oracle_jct_h"] - 1) * 100, 2)
    out["warm_jct_vs_oracle_pct_by_profile"] = by_profile(rows, "warm_vs_oracle_pct")
    out["cold_jct_vs_oracle_pct_by_profile"] = by_profile(rows, "cold_vs_oracle_pct")
    out["warm_start_error_pct"] = _mean([r["error_pct"] for r in rows])
    out["warm_jct_vs_oracle_pct"] = _mean([(r["warm_jct_h"] / r["oracle_jct_h"] - 1) * 100 for r in rows])
    out["cold_jct_vs_oracle_pct"] = _mean([(r["cold_jct_h"] / r["oracle_jct_h"] - 1) * 100 for r in rows])
    out["warm_time_to_95pct_of_final_s"] = _mean([r["warm_time_to_95pct_of_final_s"] for r in rows])
    out["cold_time_to_95pct_of_final_s"] = _mean([r["cold_time_to_95pct_of_final_s"] for r in rows])
    return out


def oom(cfg: SimConfig, seeds: int) -> dict[str, Any]:
    prof = PROFILES["wide_deep"]
    res: dict[str, Any] = {"pacer": 0, "no_prediction": 0, "pacer_after_sample": 0,
                           "no_prediction_after_sample": 0}
    for seed in range(seeds):
        truth = draw_truth(prof.truth, rngs(seed, 0)[0], cfg.sigma)
        truth = replace(truth, growth_mb_per_hour=truth.growth_mb_per_hour * 3)
        for key, pred in (("pacer", True), ("no_prediction", False)):
            sc = PacerScaler(autoscale_config(cfg, oom_prediction=pred))
            r = run_job(truth, sc, seed=seed, config=cfg, samples_total=prof.samples_total, draw=False)
            sampled = sum(1 for d in sc.autoscaler.decisions if d.rule == "sample-oom")
            res[key] += r.oom_failures
            res[f"{key}_after_sample"] += r.oom_failures - sampled
            res.setdefault(f"{key}_jct_h", []).append(round((r.jct_s or 0) / 3600, 3))
            say(f"  OOM scenario seed {seed} {key}: {r.oom_failures} OOMs ({sampled} while sampling), "
                f"JCT {(r.jct_s or 0) / 3600:.2f} h")
    return res


def cluster(jobs: int, cfg: SimConfig, seed: int) -> dict[str, Any]:
    spec = SharedCluster(jobs=jobs)
    out: dict[str, Any] = {}
    prof = PROFILES["wide_deep"]
    for name in ("pacer", "first-come-static"):
        t = time.perf_counter()
        ctx = ScalerContext(prof.truth, prof.samples_total, cfg)
        run = run_cluster(spec, CLUSTER_SCALERS[name](ctx), seed=seed, config=cfg)
        out[name] = {k: v for k, v in run.to_dict().items() if k != "jobs"}
        out[name]["wall_s"] = round(time.perf_counter() - t, 1)
        say(f"  cluster {name}: mean JCT {(run.mean_jct_s or 0) / 3600:.2f} h, makespan {run.makespan_s / 3600:.1f} h "
            f"({time.perf_counter() - t:.0f} s)")
    a, b = out["pacer"]["mean_jct_s"], out["first-come-static"]["mean_jct_s"]
    out["cluster_mean_jct_gain_pct"] = _gain(a, b)
    return out


def plots(examples: dict[str, JobRun], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plots")
        return []
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for prof in PROFILES:
        fig, ax = plt.subplots(figsize=(8, 4))
        for sc in SCALERS:
            r = examples.get(f"{prof}/{sc}")
            if r is None:
                continue
            end = (r.jct_s or r.timeline[-1][0]) / 3600
            xs, ys = [], []
            for i, (t, psi, _) in enumerate(r.timeline):
                nxt = r.timeline[i + 1][0] / 3600 if i + 1 < len(r.timeline) else end
                xs += [t / 3600, nxt]
                ys += [psi, psi]
            ax.plot(xs, ys, label=f"{sc} (JCT {end:.2f} h)")
        ax.set_xlabel("hours since submission")
        ax.set_ylabel("true throughput (samples/s)")
        ax.set_title(f"{prof}, seed 0: throughput over time")
        ax.legend()
        path = out / f"throughput_{prof}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(str(path))
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds per profile for single jobs (default 5)")
    ap.add_argument("--history", type=int, default=5, help="finished jobs in the config DB per profile (default 5)")
    # 8, not 3: one warm job's JCT moves by 10-20 points with the config DB, so three could not show a
    # change of a point or two (W&D warm was +4.9 % over 3 tests and +10.5 % over 8, 2026-11-27)
    ap.add_argument("--warm-tests", type=int, default=8, help="warm-started jobs per profile (default 8)")
    ap.add_argument("--oom-seeds", type=int, default=3)
    ap.add_argument("--cluster-jobs", type=int, default=50)
    ap.add_argument("--off-model-seeds", type=int, default=3, help="seeds per profile off the model's structure")
    ap.add_argument("--out", type=Path, default=Path("bench/out/brain"))
    args = ap.parse_args(argv)
    cfg = SimConfig()
    wall = time.perf_counter()

    say("1. single jobs")
    rows, examples = single_jobs(args.seeds, cfg)
    say("2. warm start")
    warm = warm_starts(args.history, args.warm_tests, cfg)
    say("3. OOM")
    ooms = oom(cfg, args.oom_seeds)
    say("4. cluster")
    clu = cluster(args.cluster_jobs, cfg, seed=0)
    say("5. off the model's structure")
    off_rows, _ = single_jobs(args.off_model_seeds, cfg, form="off-model")
    off: dict[str, Any] = {"jct_vs_oracle_pct": _mean([r["pacer_vs_oracle_pct"] for r in off_rows]),
           "jct_gain_vs_es_pct": _mean([r["gain_vs_es_pct"] for r in off_rows]),
           "jct_gain_vs_optimus_pct": _mean([r["gain_vs_optimus_pct"] for r in off_rows]),
           "jct_vs_oracle_pct_by_profile": by_profile(off_rows, "pacer_vs_oracle_pct"),
           "jct_gain_vs_es_pct_by_profile": by_profile(off_rows, "gain_vs_es_pct"),
           "jct_gain_vs_optimus_pct_by_profile": by_profile(off_rows, "gain_vs_optimus_pct"), "rows": off_rows}
    files = plots(examples, args.out)

    res: dict[str, Any] = {
        "jct_vs_oracle_pct": _mean([r["pacer_vs_oracle_pct"] for r in rows]),
        "jct_gain_vs_es_pct": _mean([r["gain_vs_es_pct"] for r in rows]),
        "jct_gain_vs_optimus_pct": _mean([r["gain_vs_optimus_pct"] for r in rows]),
        "jct_vs_oracle_pct_by_profile": by_profile(rows, "pacer_vs_oracle_pct"),
        "jct_vs_oracle_pct_warm_by_profile": warm["warm_jct_vs_oracle_pct_by_profile"],
        "jct_gain_vs_es_pct_by_profile": by_profile(rows, "gain_vs_es_pct"),
        "jct_gain_vs_optimus_pct_by_profile": by_profile(rows, "gain_vs_optimus_pct"),
        "oracle_gain_vs_es_pct_by_profile": by_profile(rows, "oracle_gain_vs_es_pct"),
        "oracle_gain_vs_optimus_pct_by_profile": by_profile(rows, "oracle_gain_vs_optimus_pct"),
        "scalings_by_profile": by_profile(rows, "pacer_scalings"),
        "time_to_95pct_oracle_throughput_s": _mean([r["time_to_95pct_s"] for r in rows]),
        "time_to_95pct_never": sum(1 for r in rows if r["time_to_95pct_s"] is None),
        "time_to_95pct_of_final_s": _mean([r["time_to_95pct_of_final_s"] for r in rows]),
        "warm_start_error_pct": warm["warm_start_error_pct"],
        "jct_vs_oracle_pct_warm": warm["warm_jct_vs_oracle_pct"],
        "oom_failures": {k: v for k, v in ooms.items() if not k.endswith("_jct_h")},
        "cluster_mean_jct_gain_pct": clu["cluster_mean_jct_gain_pct"],
        "targets": {"jct_vs_oracle_pct": TARGET_ORACLE_PCT, "jct_vs_oracle_pct_warm": TARGET_WARM_PCT,
                    "jct_gain_vs_es_pct": TARGET_ES_PCT,
                    "jct_gain_vs_optimus_pct": TARGET_OPTIMUS_PCT, "oom_failures_after_sample": 0},
        "single_jobs": rows, "warm_start": warm, "oom": ooms, "cluster": clu, "off_model": off, "plots": files,
        "setup": {"quota_cpu": cfg.quota_cpu, "max_pod_cpu": cfg.max_pod_cpu,
                  "adjust_interval_s": cfg.adjust_interval_s, "pending_s": cfg.pending_s, "init_s": cfg.init_s,
                  "noise": cfg.noise, "seeds": args.seeds, "warm_tests": args.warm_tests},
        "wall_s": 0.0,
    }

    print("## Single jobs (JCT, hours; DLRover-RM §6 setup)\n")
    print("| profile | seed | oracle | Pacer | ES | Optimus | static | Pacer vs oracle | vs ES | vs Optimus "
          "| to 95 % of oracle | Pacer final / oracle throughput |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t95 = "never" if r["time_to_95pct_s"] is None else f"{r['time_to_95pct_s'] / 60:.0f} min"
        print(f"| {r['profile']} | {r['seed']} | {r['jct_oracle_h']} | {r['jct_pacer_h']} | {r['jct_es_h']} | "
              f"{r['jct_optimus_h']} | {r['jct_static_h']} | {r['pacer_vs_oracle_pct']:+.1f} % | "
              f"{r['gain_vs_es_pct']:.1f} % shorter | {r['gain_vs_optimus_pct']:.1f} % shorter | {t95} | "
              f"{r['pacer_final_vs_oracle_throughput']:.2f} |")
    print("\n## Against the targets\n")
    print("| metric | Pacer | target |")
    print("|---|---|---|")
    print(f"| JCT over the oracle's, cold start (no history) | {res['jct_vs_oracle_pct']:+.1f} % | "
          f"within {TARGET_ORACLE_PCT} % |")
    print(f"| JCT over the oracle's, warm start (config DB of the family) | {res['jct_vs_oracle_pct_warm']:+.1f} % | "
          f"within {TARGET_WARM_PCT} % |")
    print(f"| JCT shorter than ES | {res['jct_gain_vs_es_pct']:.1f} % | >= {TARGET_ES_PCT} % |")
    print(f"| JCT shorter than Optimus | {res['jct_gain_vs_optimus_pct']:.1f} % | >= {TARGET_OPTIMUS_PCT} % |")
    print(f"| time to 95 % of the oracle's throughput | {res['time_to_95pct_oracle_throughput_s']} s "
          f"(never in {res['time_to_95pct_never']} of {len(rows)}) | - |")
    print(f"| time to 95 % of its own final throughput (convergence) | {res['time_to_95pct_of_final_s']} s | - |")
    print(f"| warm-start plan's throughput error vs the oracle | {res['warm_start_error_pct']} % | - |")
    print(f"| time to 95 % of the final throughput, warm vs cold start | {warm['warm_time_to_95pct_of_final_s']} s vs "
          f"{warm['cold_time_to_95pct_of_final_s']} s | - |")
    o = res["oom_failures"]
    print(f"| OOM failures, growing embeddings (after the sample stage) | Pacer {o['pacer']} ({o['pacer_after_sample']})"
          f", no prediction {o['no_prediction']} ({o['no_prediction_after_sample']}) | 0 after sampling |")
    print(f"| cluster mean JCT, {args.cluster_jobs} jobs, vs first-come static | "
          f"{res['cluster_mean_jct_gain_pct']:.1f} % shorter | - |")
    print("\n## Per profile (issue 15: each target for each profile)\n")
    print("| profile | cold vs oracle | warm vs oracle | shorter than ES | (oracle's own) | shorter than Optimus "
          "| (oracle's own) | off-model vs oracle | moves |")
    print("|---|---|---|---|---|---|---|---|---|")
    def pct(table: dict[str, float | None], prof: str, sign: str = "") -> str:
        v = table.get(prof)
        return "-" if v is None else f"{v:{sign}.1f} %"

    for prof in PROFILES:
        print(f"| {prof} | {pct(res['jct_vs_oracle_pct_by_profile'], prof, '+')} | "
              f"{pct(res['jct_vs_oracle_pct_warm_by_profile'], prof, '+')} | "
              f"{pct(res['jct_gain_vs_es_pct_by_profile'], prof)} | {pct(res['oracle_gain_vs_es_pct_by_profile'], prof)} | "
              f"{pct(res['jct_gain_vs_optimus_pct_by_profile'], prof)} | "
              f"{pct(res['oracle_gain_vs_optimus_pct_by_profile'], prof)} | "
              f"{pct(off['jct_vs_oracle_pct_by_profile'], prof, '+')} | {res['scalings_by_profile'][prof]} |")
    print("\n## Warm start (DLRover-RM Alg. 1)\n")
    print("| profile | seed | warm plan | plan error vs oracle | warm JCT | cold JCT | oracle JCT | "
          "warm / cold time to 95 % |")
    print("|---|---|---|---|---|---|---|---|")
    for r in warm["rows"]:
        w, c = r["warm_time_to_95pct_s"], r["cold_time_to_95pct_s"]
        print(f"| {r['profile']} | {r['seed']} | {r['warm_plan']} | {r['error_pct']} % | {r['warm_jct_h']} h | "
              f"{r['cold_jct_h']} h | {r['oracle_jct_h']} h | {w if w is not None else 'never'} / "
              f"{c if c is not None else 'never'} s |")
    print("\n## Off the model's structure (smooth saturation, sync in (w/p)^1.4, soft PS capacity)\n")
    print("| profile | seed | oracle | Pacer | ES | Optimus | Pacer vs oracle | vs ES | vs Optimus |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in off_rows:
        print(f"| {r['profile']} | {r['seed']} | {r['jct_oracle_h']} | {r['jct_pacer_h']} | {r['jct_es_h']} | "
              f"{r['jct_optimus_h']} | {r['pacer_vs_oracle_pct']:+.1f} % | {r['gain_vs_es_pct']:.1f} % shorter | "
              f"{r['gain_vs_optimus_pct']:.1f} % shorter |")
    print(f"| mean | | | | | | {off['jct_vs_oracle_pct']:+.1f} % | {off['jct_gain_vs_es_pct']:.1f} % | "
          f"{off['jct_gain_vs_optimus_pct']:.1f} % |")
    c = clu
    print("\n## Cluster (Eq. 11-14 selection vs first-come static)\n")
    print("| scaler | mean JCT (h) | makespan (h) | CPU allocated | CPU used | unfinished |")
    print("|---|---|---|---|---|---|")
    for name in ("pacer", "first-come-static"):
        d = c[name]
        print(f"| {name} | {(d['mean_jct_s'] or 0) / 3600:.2f} | {d['makespan_s'] / 3600:.1f} | "
              f"{d['cpu_allocated_util'] * 100:.0f} % | {d['cpu_used_util'] * 100:.0f} % | {d['unfinished']} |")
    res["wall_s"] = round(time.perf_counter() - wall, 1)
    print()
    print(json.dumps(res, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
