"""Control-plane scale: N simulated nodes in M jobs against the real services (issue 25).

The services run as in a deployment: one process each (or two instances of
each with ``--two-instances``), on a real nats-server with TLS and per-role
permissions, every job's nodes connecting as that job's own agent user
through the auth callout.  The nodes are simulated (``bench/scale_sim.py``:
asyncio, no TensorFlow) but publish what real agents publish, at the real
cadence, through the agent's own window rule, and read shards with the real
``ShardClient``.  A few jobs get a straggler (one worker turns
``slow_factor`` times slower partway through), so the monitor, the
controller and the ``backup-workers`` policy act on them.

Windows are shortened as in the straggler tests (statistics every 1 s,
L_trans 6 s, L_per 12 s, a decision every 2 s; AntDT's are minutes), so that
"straggler -> action" measures the control plane, not the window length.

Measured, per N (each on a fresh stack):

* ``report_to_stats_p50_s`` / ``_p99_s``: a worker's metrics report published
  -> the first statistics event of its job that includes it (its
  ``samples_total``) is received;
* ``straggler_to_action_p99_s``: the straggler's onset -> the job's primary
  agent receives the controller's global action;
* ``lease_grants_total``: shard requests that granted shards over the whole run, in or out of the window;
* ``lease_p50_ms`` / ``lease_p99_ms``: shard requests that granted shards;
* ``cpu_s_per_1k_reports``: each service process's CPU seconds (children
  included) per 1,000 node reports (heartbeats + metrics) in the measured
  window; ``rss_mb`` per process; the same for ``nats-server``;
* ``nats_msgs_per_s`` (in + out, from the server's ``/varz``) and
  ``jetstream_mb_per_hour`` (growth of the streams' bytes).

Usage: python bench/bench_scale.py [--sizes 1000,5000,10000,20000] [--jobs-per-1k 20]
       [--measure-s 60] [--two-instances-at 10000] [--quick]
The last line of output is one JSON object (keys kept stable over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_sim
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode, encode
from pacer.contracts.agent import AgentMetrics
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics
from pacer.contracts.policy import ControllerDecision
from pacer.contracts.shards import DatasetSpec
from pacer.embedded import http_json
from pacer.jobs.spec import parse_job_spec
from pacer.shards.client import ShardAdmin
from pacer_services.cli.stack import Stack

SERVICES = ["auth", "shard", "monitor", "controller", "policies"]
ENV = {
    "PACER_MONITOR_INTERVAL_S": "1", "PACER_MONITOR_WINDOW_SHORT_S": "6", "PACER_MONITOR_WINDOW_LONG_S": "12",
    "PACER_CONTROLLER_EVERY_S": "2", "PACER_LOG_LEVEL": "WARNING",
}
REPORT_SLO_S = 2.0
ACTION_SLO_S = 10.0
BATCH = 512
BPT_S = 0.2  # a Wide&Deep step of 512 on a worker pod
BATCHES_PER_SHARD = 100  # AntDT's shard


def job_name(i: int) -> str:
    return f"scale-{i:04d}"


def spec_text(job: str) -> str:
    return (f"name: {job}\nmodel: wide_deep\ndataset: {{path: /data/{job}.rec}}\nbatch_size: {BATCH}\nmode: bsp\n"
            "policies: {straggler: backup-workers}\n")


def layout(nodes: int, jobs: int, stragglers: int, onset_s: float, seed: int) -> list[scale_sim.SimJob]:
    """``jobs`` jobs sharing ``nodes`` nodes (a PS per 10 workers, at least one); ``stragglers`` of them
    get one worker that turns 4x slower ``onset_s`` (spread over 10 s) into the run."""
    per = nodes // jobs
    out = []
    for j in range(jobs):
        ps = max(1, per // 11)
        sj = scale_sim.SimJob(job=job_name(j), workers=per - ps, ps=ps, batch_size=BATCH, bpt_s=BPT_S,
                              batches_per_shard=BATCHES_PER_SHARD)
        if j % max(1, jobs // max(1, stragglers)) == 0 and sum(1 for s in out if s.straggler) < stragglers:
            sj.straggler = f"worker-{1 + (j + seed) % max(1, sj.workers - 1)}"
            sj.onset = onset_s + 10.0 * (j / jobs)
        out.append(sj)
    return out


async def register(bus: Bus, sjobs: list[scale_sim.SimJob], run_s: float) -> None:
    """What the job service and executor would have done: a running record and a registered dataset."""
    kv = await bus.kv(subjects.JOB_BUCKET, "Pacer jobs: one JobRecord per job")
    admin = ShardAdmin(bus, timeout=30.0)
    now = time.time()
    sem = asyncio.Semaphore(32)

    async def one(sj: scale_sim.SimJob) -> None:
        sj.submitted_at = now  # the simulated agents' tokens name this incarnation (the auth callout checks it)
        shards = sj.workers * (int(run_s / (BPT_S * 0.9 * BATCHES_PER_SHARD)) + 6)
        rec = JobRecord(job=sj.job, spec=parse_job_spec(spec_text(sj.job)), state=JobState.RUNNING,
                        submitted_at=now, updated_at=now, started_at=now,
                        plan=ResourcePlan(job=sj.job, workers=sj.workers, ps=sj.ps, worker_cpu=4.0,
                                          worker_memory_mb=8192, ps_cpu=4.0, ps_memory_mb=8192,
                                          source=PlanSource.DEFAULT),
                        records=shards * BATCH * BATCHES_PER_SHARD)
        async with sem:
            await kv.put(sj.job, encode(rec))
            await admin.register(DatasetSpec(job=sj.job, dataset="d", records=rec.records, batch_size=BATCH,
                                             batches_per_shard=BATCHES_PER_SHARD))

    await asyncio.gather(*(one(sj) for sj in sjobs))


class Observer:
    """Every statistics event, as a dashboard gets it: per node, when each new samples_total was first seen."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        self.events = 0
        self.tapped: dict[tuple[str, str, int], float] = {}
        self.acted: dict[str, list[float]] = {}  # job -> times of decision rounds that executed an action

    async def on_stats(self, msg: Any) -> None:
        now = time.time()
        self.events += 1
        st = decode(JobStatistics, msg.data)
        for n in st.nodes:
            samples, times = self.seen.setdefault((st.job, n.node), ([], []))
            if not samples or n.samples_total > samples[-1]:
                samples.append(n.samples_total)
                times.append(now)

    async def on_decision(self, msg: Any) -> None:
        d = decode(ControllerDecision, msg.data)
        if d.executed:
            self.acted.setdefault(d.job, []).append(d.ts)

    def missing(self, reports: list[tuple[str, str, int, float]]) -> int:
        return sum(1 for r in reports if self.latency(*r) is None)

    async def on_metrics(self, msg: Any) -> None:
        """The tap on a few jobs' reports: when the bus delivered each (splits the generator's lag off)."""
        m = decode(AgentMetrics, msg.data)
        self.tapped[(m.job, m.node, m.samples_total)] = time.time()

    def latency(self, job: str, node: str, samples: int, ts: float) -> float | None:
        """Seconds from a report (``samples`` published at ``ts``) to the first statistics that include it."""
        got = self.seen.get((job, node))
        if not got:
            return None
        i = bisect_left(got[0], samples)
        return None if i == len(got[0]) else max(0.0, got[1][i] - ts)


def varz(stack: Stack) -> dict[str, Any]:
    _, data = http_json(f"http://127.0.0.1:{stack.nats.monitor_port}/varz", timeout=5.0)  # type: ignore[union-attr]
    return data


def processes(stack: Stack) -> dict[str, psutil.Process]:
    out = {key: psutil.Process(p.pid) for key, p in stack.procs.items()}
    nats = stack.nats.proc  # type: ignore[union-attr]
    if nats is not None:
        out["nats-server"] = psutil.Process(nats.pid)
    return out


def usage(p: psutil.Process) -> tuple[float, int]:
    """CPU seconds and RSS bytes of a process and its children (the policy service decides in worker
    processes); a child gone meanwhile counts nothing."""
    cpu, rss = 0.0, 0
    for q in [p, *p.children(recursive=True)]:
        try:
            t, m = q.cpu_times(), q.memory_info()
        except psutil.Error:
            continue
        cpu, rss = cpu + t.user + t.system, rss + m.rss
    return cpu, rss


def cpu_s(p: psutil.Process) -> float:
    return usage(p)[0]


def rss_mb(p: psutil.Process) -> float:
    return round(usage(p)[1] / 2**20, 1)


async def stream_bytes(bus: Bus) -> dict[str, int]:
    out = {}
    for name in (subjects.EVENTS_STREAM, subjects.SHARD_LOG_STREAM):
        info = await bus.js.stream_info(name)
        out[name] = int(info.state.bytes)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


async def _until(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.5)
    return True


async def run_size(nodes: int, jobs: int, args: argparse.Namespace, two: bool,
                   until_acted_s: float = 0.0) -> dict[str, Any]:
    """One measured run on a fresh stack.  ``until_acted_s`` > 0 (the correctness test): the nodes run on
    past the measured window until every straggler's job had an action executed (at most that long), and
    the result waits (as long again at most) until the statistics include every report checked."""
    run_s = args.warmup_s + args.measure_s
    stragglers = max(1, jobs // 10)
    sjobs = layout(nodes, jobs, stragglers, onset_s=args.warmup_s + 5.0, seed=nodes)
    instances = {s: 2 for s in SERVICES if s != "auth"} if two else {}
    with tempfile.TemporaryDirectory(prefix="pacer-scale-") as tmp:
        stack = Stack(data_dir=Path(tmp), services=list(SERVICES), env=dict(ENV), instances=instances,
                      nats_monitoring=True)
        stack.start()
        try:
            bus = await Bus.connect(stack.url, name="bench-scale")
            obs = Observer()
            sub = await bus.nc.subscribe(subjects.events_of(subjects.MONITOR_SERVICE, kind="statistics"),
                                         cb=obs.on_stats)
            await bus.nc.subscribe(subjects.events_of(subjects.CONTROLLER_SERVICE, kind="decision"),
                                   cb=obs.on_decision)
            for sj in sjobs[::10]:
                await bus.nc.subscribe(subjects.agent_metrics(sj.job), cb=obs.on_metrics)
            await register(bus, sjobs, run_s + 2 * until_acted_s)  # nobody runs out of data
            procs = max(1, min(args.procs, jobs))
            start_at = time.time() + 3.0 + nodes / 4000  # every process connected first
            plans = [scale_sim.Plan(url=stack.bare_url, agent_secret=stack._agent_secret,
                                    ca=str(stack.ca_file or ""), jobs=sjobs[i::procs], start_at=start_at,
                                    stop_at=start_at + run_s, seed=i,
                                    stop_file=str(Path(tmp) / "stop") if until_acted_s else "")
                     for i in range(procs)]
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            workers = [ctx.Process(target=scale_sim.main, args=(p, q)) for p in plans]
            for w in workers:
                w.start()
            ps = processes(stack)
            sims = [psutil.Process(w.pid) for w in workers]
            await asyncio.sleep(max(0.0, start_at + args.warmup_s - time.time()))
            t_a, v_a, b_a = time.time(), varz(stack), await stream_bytes(bus)
            cpu_a = {k: cpu_s(p) for k, p in ps.items()}
            sim_a = sum(cpu_s(p) for p in sims)
            await asyncio.sleep(max(0.0, start_at + run_s - time.time()))
            t_b, v_b, b_b = time.time(), varz(stack), await stream_bytes(bus)
            cpu_b = {k: cpu_s(p) for k, p in ps.items()}
            sim_b = sum(cpu_s(p) for p in sims)
            rss = {k: rss_mb(p) for k, p in ps.items()}
            if until_acted_s:
                onsets = {sj.job: start_at + sj.onset for sj in sjobs if sj.straggler}
                await _until(lambda: all(any(t >= on for t in obs.acted.get(j, [])) for j, on in onsets.items()),
                             until_acted_s)
                (Path(tmp) / "stop").touch()
            results = [await asyncio.to_thread(q.get, True, 120 + nodes / 50) for _ in workers]
            for w in workers:
                w.join(30)
            in_window = [r for res in results for r in res["reports"] if t_a <= r[3] < t_b - 3.0]
            # the statistics of the last reports: a test waits for them all, a measurement 2 s
            await _until(lambda: not obs.missing(in_window), until_acted_s or 2.0)
            await sub.unsubscribe()
            await bus.close()
        finally:
            stack.stop()
    window = t_b - t_a
    lat = [obs.latency(*r) for r in in_window]
    missing = sum(1 for x in lat if x is None)
    to_bus = [obs.tapped[r[:3]] - r[3] for r in in_window if r[:3] in obs.tapped]
    lat_ok = [x for x in lat if x is not None]
    node_reports = sum(r for res in results for r in res["published"].values())
    rate_reports = node_reports / run_s  # every node reports steadily from start to stop
    per_1k = max(1e-9, rate_reports * window / 1000)
    onsets = {j: t for res in results for j, t in res["onsets"].items()}
    actions: dict[str, list[float]] = {}
    for res in results:
        for job, t, _kind in res["actions"]:
            actions.setdefault(job, []).append(t)
    to_action = []
    unacted = []
    for job, t_on in onsets.items():
        after = [t for t in actions.get(job, []) if t >= t_on]
        if after:
            to_action.append(min(after) - t_on)
        else:
            unacted.append(job)
    grants = [t[0] for res in results for t in res["lease_timings"] if t[2] > 0 and t_a <= t[3] < t_b]
    out = {
        "nodes": nodes, "jobs": jobs, "instances": 2 if two else 1,
        "report_to_stats_p50_s": round(pct(lat_ok, 0.5), 3),
        "report_to_stats_p99_s": round(pct(lat_ok, 0.99), 3),
        "report_to_bus_p99_s": round(pct(to_bus, 0.99), 3),
        "reports_checked": len(in_window), "reports_missing": missing,
        "straggler_to_action_p99_s": round(pct(to_action, 0.99), 2) if not unacted else float("inf"),
        "stragglers": len(onsets), "stragglers_unacted": len(unacted),
        "lease_p50_ms": round(1000 * pct(grants, 0.5), 2), "lease_p99_ms": round(1000 * pct(grants, 0.99), 2),
        "lease_grants_total": sum(1 for res in results for t in res["lease_timings"] if t[2] > 0),
        "node_reports_per_s": round(rate_reports, 1),
        "cpu_s_per_1k_reports": {k: round((cpu_b[k] - cpu_a[k]) / per_1k, 4) for k in cpu_a},
        "cpu_cores": {k: round((cpu_b[k] - cpu_a[k]) / window, 3) for k in cpu_a},
        "sim_cpu_cores": round((sim_b - sim_a) / window, 3),  # the simulated nodes: not the control plane
        "rss_mb": rss,
        "nats_msgs_per_s": round((v_b["in_msgs"] + v_b["out_msgs"] - v_a["in_msgs"] - v_a["out_msgs"]) / window),
        "jetstream_mb_per_hour": round(sum(b_b[k] - b_a[k] for k in b_a) / window * 3600 / 2**20, 1),
        "jetstream_mb_per_hour_by_stream": {k: round((b_b[k] - b_a[k]) / window * 3600 / 2**20, 1) for k in b_a},
        "statistics_events": obs.events,
        "sim_errors": [e for res in results for e in res["errors"]][:5],
    }
    out["within_slo"] = (out["report_to_stats_p99_s"] < REPORT_SLO_S and not missing
                         and out["straggler_to_action_p99_s"] < ACTION_SLO_S)
    return out


def plot(curve: list[dict[str, Any]], two: dict[str, Any] | None, path: Path) -> str:
    """The curve: p99 latencies and each process's CPU (cores) against the nodes; the two-instance run marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    xs = [r["nodes"] for r in curve]
    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("report_to_stats_p99_s", "report -> statistics p99"),
                       ("straggler_to_action_p99_s", "straggler -> action p99")):
        lat.plot(xs, [r[key] for r in curve], marker="o", label=label)
        if two:
            lat.plot([two["nodes"]], [two[key]], marker="s", linestyle="", label=f"{label}, two instances")
    lat.axhline(REPORT_SLO_S, color="grey", linestyle=":", linewidth=1)
    lat.axhline(ACTION_SLO_S, color="grey", linestyle="--", linewidth=1)
    lat.set_xlabel("simulated nodes (20 jobs per 1,000)")
    lat.set_ylabel("seconds")
    lat.set_yscale("log")
    lat.legend(fontsize=7)
    for proc in sorted({k for r in curve for k in r["cpu_cores"]}):
        ys = [r["cpu_cores"].get(proc, 0.0) for r in curve]
        if max(ys) >= 0.02:
            cpu.plot(xs, ys, marker="o", label=proc)
    cpu.plot(xs, [r.get("sim_cpu_cores", 0.0) for r in curve], marker="x", linestyle="--", color="grey",
             label="simulated nodes (the load, same machine)")
    cpu.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    cpu.set_xlabel("simulated nodes")
    cpu.set_ylabel("CPU (cores) during the measured window")
    cpu.legend(fontsize=7)
    fig.suptitle("Pacer control plane on one 2-core machine (make bench-scale)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


HEADLINE = ("nodes", "jobs", "report_to_stats_p99_s", "straggler_to_action_p99_s", "lease_p99_ms",
            "cpu_s_per_1k_reports", "rss_mb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,5000,10000,20000")
    ap.add_argument("--jobs-per-1k", type=int, default=20)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--measure-s", type=float, default=60.0)
    ap.add_argument("--procs", type=int, default=2, help="simulating processes")
    ap.add_argument("--two-instances-at", type=int, default=10000, help="0: skip the two-instance run")
    ap.add_argument("--quick", action="store_true", help="1,000 and 2,000 nodes, short windows")
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parent / "plots" / "scale-curve.png"),
                    help="where the curve's PNG goes ('': none)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.warmup_s, args.measure_s, args.two_instances_at = "1000,2000", 15.0, 30.0, 2000
    sizes = [int(s) for s in args.sizes.split(",") if s]
    curve = []
    for n in sizes:
        r = asyncio.run(run_size(n, max(1, n * args.jobs_per_1k // 1000), args, two=False))
        print(json.dumps(r), flush=True)
        curve.append(r)
    two = None
    if args.two_instances_at:
        n = args.two_instances_at
        two = asyncio.run(run_size(n, max(1, n * args.jobs_per_1k // 1000), args, two=True))
        print(json.dumps(two), flush=True)
    head = next((r for r in curve if r["nodes"] == 10000), curve[-1])
    ok = [r["nodes"] for r in curve if r["within_slo"]]
    summary = {k: head[k] for k in HEADLINE}
    summary |= {"max_nodes_within_slo": max(ok) if ok else 0,
                "curve": [{k: r[k] for k in (*HEADLINE, "report_to_stats_p50_s", "lease_p50_ms", "cpu_cores",
                                             "nats_msgs_per_s", "jetstream_mb_per_hour", "reports_missing", "sim_cpu_cores",
                                             "stragglers_unacted", "within_slo")} for r in curve],
                "two_instances": {k: two[k] for k in (*HEADLINE, "cpu_cores", "within_slo")} if two else None}
    summary["plot"] = plot(curve, two, Path(args.plot)) if args.plot else ""
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
