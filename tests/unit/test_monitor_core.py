"""Monitor core: windows, AntDT-ND straggler classes, node states, cluster busy.

Every test injects ``now``; nothing reads a clock.
"""

from __future__ import annotations

import pytest
from pacer.codec import decode, encode
from pacer.contracts.agent import AgentMetrics, Heartbeat
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StatsQuery, StragglerKind
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.shards import DatasetMode, DatasetStatus
from pacer.errors import NotFound, ValidationError
from pacer_services.monitor.core import MonitorConfig, MonitorCore

JOB = "job1"
T0 = 1_000_000.0
STEP_EVERY = 10.0  # one report every 10 s of monitor time
K = 10  # steps per report


def metrics(node: str, ts: float, bpt: float, role: str = "worker", batch: int = 100, **kw: object) -> AgentMetrics:
    base: dict[str, object] = dict(
        job=JOB,
        node=node,
        role=role,
        ts=ts,
        local_step=0,
        iteration=0,
        bpt_s=bpt,
        batch_size=batch,
        samples_per_s=batch / bpt,
        samples_total=0,
        cpu_percent=100.0,
        rss_bytes=1 << 20,
        last_action_seq=0,
        last_action_iteration=-1,
        primary=False,
        steps=K,
    )
    base.update(kw)
    return AgentMetrics(**base)  # type: ignore[arg-type]


def feed(core: MonitorCore, node: str, start: float, end: float, bpt: float, role: str = "worker") -> None:
    """One report every STEP_EVERY seconds over [start, end)."""
    t = start
    while t < end:
        core.observe_metrics(metrics(node, t, bpt, role), t)
        t += STEP_EVERY


def by_node(st: JobStatistics) -> dict[str, NodeStats]:
    return {n.node: n for n in st.nodes}


def cluster_of(peers: int = 3, role: str = "worker", until: float = T0 + 600) -> MonitorCore:
    core = MonitorCore()
    for i in range(peers):
        feed(core, f"{role}-{i}", T0, until, 1.0, role)
    return core


# ------------------------------------------------------------------ windows


def test_windows_evict_old_samples_with_injected_now() -> None:
    core = MonitorCore()
    feed(core, "w0", T0, T0 + 600, 1.0)
    node = core.jobs[JOB].nodes["w0"]
    assert len(node.samples) == 60
    # 100 s later (and a heartbeat so the node stays alive): the first 100 s left the long window.
    core.observe_heartbeat(Heartbeat(JOB, "w0", "worker", T0 + 700, "h-1", False, True), T0 + 700)
    assert len(node.samples) == 50
    assert node.samples[0].t >= T0 + 700 - 600
    # statistics() evicts too; after a long silence nothing is left.
    core.statistics(JOB, T0 + 2000)
    assert len(node.samples) == 0


def test_short_and_long_means_and_bounded_memory() -> None:
    cfg = MonitorConfig(window_short_s=100, window_long_s=200, max_samples=15)
    core = MonitorCore(cfg)
    feed(core, "w0", T0, T0 + 100, 2.0)
    feed(core, "w0", T0 + 100, T0 + 200, 1.0)
    node = core.jobs[JOB].nodes["w0"]
    assert len(node.samples) == 15  # capped
    st = by_node(core.statistics(JOB, T0 + 195))["w0"]
    assert st.bpt_short_s == pytest.approx(1.0)
    # Long window holds the last 15 reports: 5 at 2.0 and 10 at 1.0 (equal steps).
    assert st.bpt_long_s == pytest.approx((5 * 2.0 + 10 * 1.0) / 15)


def test_bpt_mean_is_weighted_by_steps() -> None:
    core = MonitorCore()
    core.observe_metrics(metrics("w0", T0, 1.0, steps=30), T0)
    core.observe_metrics(metrics("w0", T0 + 10, 3.0, steps=10), T0 + 10)
    assert by_node(core.statistics(JOB, T0 + 10))["w0"].bpt_short_s == pytest.approx(60 / 40)


def test_replayed_old_and_future_reports() -> None:
    core = MonitorCore()
    core.observe_metrics(metrics("w0", T0 - 10_000, 1.0), T0)  # older than the long window: dropped
    assert len(core.jobs[JOB].nodes["w0"].samples) == 0
    core.observe_metrics(metrics("w0", T0 + 50, 1.0), T0)  # agent clock ahead: clamped to now
    assert core.jobs[JOB].nodes["w0"].samples[0].t == T0
    core.observe_metrics(metrics("w0", T0 - 20, 1.0), T0)  # out of order: kept sorted
    assert [s.t for s in core.jobs[JOB].nodes["w0"].samples] == [T0 - 20, T0]


# ------------------------------------------------------------------ stragglers


def test_two_times_slower_for_ten_minutes_is_persistent() -> None:
    core = cluster_of(3)
    feed(core, "slow", T0, T0 + 600, 2.0)
    st = by_node(core.statistics(JOB, T0 + 600))
    assert st["slow"].straggler is StragglerKind.PERSISTENT
    assert st["slow"].slowdown_long == pytest.approx(2.0)
    assert st["slow"].slowdown_short == pytest.approx(2.0)
    assert all(st[f"worker-{i}"].straggler is StragglerKind.NONE for i in range(3))


def test_two_times_slower_for_the_last_four_minutes_is_transient() -> None:
    core = cluster_of(3)
    feed(core, "slow", T0, T0 + 360, 1.0)
    feed(core, "slow", T0 + 360, T0 + 600, 2.0)
    st = by_node(core.statistics(JOB, T0 + 600))["slow"]
    # Short window: 6 reports at 1.0, 24 at 2.0 -> 1.8; long: 36 at 1.0, 24 at 2.0 -> 1.4.
    assert st.slowdown_short == pytest.approx(1.8)
    assert st.slowdown_long == pytest.approx(1.4)
    assert st.straggler is StragglerKind.TRANSIENT


def test_new_node_slow_for_four_minutes_is_not_yet_persistent() -> None:
    core = cluster_of(3)
    feed(core, "new", T0 + 360, T0 + 600, 2.0)
    st = by_node(core.statistics(JOB, T0 + 600))["new"]
    assert st.slowdown_long == pytest.approx(2.0)  # slow over L_per, but no older evidence
    assert st.straggler is StragglerKind.TRANSIENT


def test_recovered_node_is_not_a_straggler() -> None:
    core = cluster_of(3)
    feed(core, "x", T0, T0 + 300, 1.4)
    feed(core, "x", T0 + 300, T0 + 600, 1.0)
    assert by_node(core.statistics(JOB, T0 + 600))["x"].straggler is StragglerKind.NONE


@pytest.mark.parametrize(
    ("bpt", "expected"),
    [
        (1.5, StragglerKind.PERSISTENT),  # exactly lambda x median: slow (T_i >= lambda * T)
        (1.49, StragglerKind.NONE),  # just under
        (1.51, StragglerKind.PERSISTENT),
    ],
)
def test_lambda_boundary(bpt: float, expected: StragglerKind) -> None:
    core = cluster_of(3)
    feed(core, "x", T0, T0 + 600, bpt)
    assert by_node(core.statistics(JOB, T0 + 600))["x"].straggler is expected


def test_lambda_is_configurable() -> None:
    core = MonitorCore(MonitorConfig(slowness_ratio=1.3))
    for i in range(3):
        feed(core, f"w{i}", T0, T0 + 600, 1.0)
    feed(core, "x", T0, T0 + 600, 1.35)
    st = core.statistics(JOB, T0 + 600)
    assert st.slowness_ratio == 1.3
    assert by_node(st)["x"].straggler is StragglerKind.PERSISTENT


def test_reference_is_the_median_of_the_other_nodes() -> None:
    # Two stragglers do not hide each other, and the node itself is not in its reference.
    core = MonitorCore()
    for i in range(3):
        feed(core, f"w{i}", T0, T0 + 600, 1.0)
    feed(core, "a", T0, T0 + 600, 3.0)
    feed(core, "b", T0, T0 + 600, 3.0)
    st = by_node(core.statistics(JOB, T0 + 600))
    assert st["a"].slowdown_long == pytest.approx(3.0)  # median of (1, 1, 1, 3)
    assert st["a"].straggler is st["b"].straggler is StragglerKind.PERSISTENT
    assert st["w0"].straggler is StragglerKind.NONE


def test_ps_and_workers_are_compared_separately() -> None:
    core = MonitorCore()
    for i in range(3):
        feed(core, f"w{i}", T0, T0 + 600, 1.0, "worker")
    for i in range(3):
        feed(core, f"ps{i}", T0, T0 + 600, 0.1, "ps")  # PS BPTs are much smaller: not compared to workers
    feed(core, "ps-slow", T0, T0 + 600, 0.2, "ps")
    st = by_node(core.statistics(JOB, T0 + 600))
    assert all(st[f"w{i}"].straggler is StragglerKind.NONE for i in range(3))
    assert st["w0"].slowdown_long == pytest.approx(1.0)
    assert st["ps-slow"].straggler is StragglerKind.PERSISTENT
    assert st["ps-slow"].slowdown_long == pytest.approx(2.0)
    assert st["ps0"].straggler is StragglerKind.NONE


def test_a_lone_node_has_no_peers() -> None:
    core = MonitorCore()
    feed(core, "w0", T0, T0 + 600, 5.0)
    feed(core, "ps0", T0, T0 + 600, 0.1, "ps")
    st = by_node(core.statistics(JOB, T0 + 600))
    assert st["w0"].slowdown_long == 0.0
    assert st["w0"].straggler is StragglerKind.NONE


def test_dead_peers_are_not_a_reference() -> None:
    core = cluster_of(1)
    feed(core, "x", T0, T0 + 600, 2.0)
    core.observe_node_event(NodeEvent(JOB, "worker-0", "died", T0 + 600, "killed", "worker"), T0 + 600)
    st = by_node(core.statistics(JOB, T0 + 600))
    assert st["x"].straggler is StragglerKind.NONE
    assert st["worker-0"].straggler is StragglerKind.NONE


# ------------------------------------------------------------------ throughput, states


def test_throughput_is_the_sum_of_live_worker_speeds() -> None:
    core = MonitorCore()
    feed(core, "w0", T0, T0 + 300, 1.0)  # 100 samples/s
    feed(core, "w1", T0, T0 + 300, 2.0)  # 50 samples/s
    feed(core, "ps0", T0, T0 + 300, 0.5, "ps")  # not counted
    st = core.statistics(JOB, T0 + 300)
    nodes = by_node(st)
    assert nodes["w0"].speed_samples_per_s == pytest.approx(100.0)
    assert nodes["w1"].speed_samples_per_s == pytest.approx(50.0)
    assert st.throughput_samples_per_s == pytest.approx(150.0)
    # A dead worker contributes nothing.
    core.observe_node_event(NodeEvent(JOB, "w1", "died", T0 + 300, "oom", "worker"), T0 + 301)
    st = core.statistics(JOB, T0 + 301)
    assert st.throughput_samples_per_s == pytest.approx(100.0)
    assert by_node(st)["w1"].speed_samples_per_s == 0.0


def test_silent_node_is_dead_after_the_heartbeat_timeout() -> None:
    core = MonitorCore(MonitorConfig(heartbeat_timeout_s=60))
    feed(core, "w0", T0, T0 + 100, 1.0)  # last report at T0 + 90
    assert by_node(core.statistics(JOB, T0 + 150))["w0"].state is Liveness.RUNNING
    st = by_node(core.statistics(JOB, T0 + 151))["w0"]
    assert st.state is Liveness.DEAD
    assert st.last_seen == T0 + 90
    # Heard again: running.
    core.observe_heartbeat(Heartbeat(JOB, "w0", "worker", T0 + 200, "h-1", False, True), T0 + 200)
    assert by_node(core.statistics(JOB, T0 + 200))["w0"].state is Liveness.RUNNING


def test_died_relaunched_pending_running_counts_restarts_and_pending_time() -> None:
    core = MonitorCore()
    feed(core, "w0", T0, T0 + 100, 1.0)
    core.observe_node_event(NodeEvent(JOB, "w0", "died", T0 + 100, "killed", "worker"), T0 + 100)
    st = by_node(core.statistics(JOB, T0 + 100))["w0"]
    assert st.state is Liveness.DEAD and st.restarts == 0
    assert st.bpt_short_s == 0.0  # the old machine's BPTs are gone
    assert (st.cpu_percent, st.rss_bytes) == (0.0, 0)  # and so is the dead process's CPU and RSS
    # A late report of a step before the death does not revive it, nor bring its readings back.
    core.observe_metrics(metrics("w0", T0 + 95, 1.0), T0 + 101)
    st = by_node(core.statistics(JOB, T0 + 101))["w0"]
    assert st.state is Liveness.DEAD and (st.cpu_percent, st.rss_bytes) == (0.0, 0)
    core.observe_node_event(NodeEvent(JOB, "w0", "started", T0 + 110, "", "worker"), T0 + 110)
    st = by_node(core.statistics(JOB, T0 + 150))["w0"]
    assert st.state is Liveness.PENDING and st.restarts == 1
    assert st.pending_s == pytest.approx(40.0)  # still pending: time so far
    assert core.statistics(JOB, T0 + 150).pending_nodes == 1
    core.observe_node_event(NodeEvent(JOB, "w0", "running", T0 + 200, "", "worker"), T0 + 200)
    st = by_node(core.statistics(JOB, T0 + 250))["w0"]
    assert st.state is Liveness.RUNNING and st.restarts == 1
    assert st.pending_s == pytest.approx(90.0)  # the finished pending interval
    assert core.statistics(JOB, T0 + 250).pending_nodes == 0


def test_a_nodes_start_up_is_measured_from_its_pod_running_to_its_first_step() -> None:
    """What a relaunch costs this job (pacer-adaptive's init_s), measured instead of assumed."""
    core = MonitorCore()
    core.observe_node_event(NodeEvent(JOB, "w0", "running", T0, "", "worker"), T0)
    core.observe_node_event(NodeEvent(JOB, "ps-0", "running", T0, "", "ps"), T0)
    for t in (T0 + 5, T0 + 10, T0 + 15, T0 + 20):
        core.observe_heartbeat(Heartbeat(JOB, "w0", "worker", t, "a", True, True), t)
    assert by_node(core.statistics(JOB, T0 + 20))["w0"].init_s == 0.0  # no step yet: not measured
    core.observe_metrics(metrics("w0", T0 + 40, 1.0), T0 + 40)  # 10 steps of 1 s: the first began at +30
    core.observe_metrics(metrics("ps-0", T0 + 12, 0.01, role="ps"), T0 + 12)  # a PS: its first answer
    core.observe_metrics(metrics("w0", T0 + 50, 1.0), T0 + 50)  # later reports change nothing
    st = by_node(core.statistics(JOB, T0 + 50))
    assert st["w0"].init_s == pytest.approx(30.0) and st["ps-0"].init_s == pytest.approx(12.0)
    # relaunched: the next start-up replaces it; a report that beat the running event is not a start-up
    core.observe_node_event(NodeEvent(JOB, "w0", "died", T0 + 60, "killed", "worker"), T0 + 60)
    core.observe_node_event(NodeEvent(JOB, "w0", "running", T0 + 70, "", "worker"), T0 + 70)
    core.observe_metrics(metrics("w0", T0 + 90, 1.0), T0 + 90)
    assert by_node(core.statistics(JOB, T0 + 90))["w0"].init_s == pytest.approx(10.0)
    core.observe_node_event(NodeEvent(JOB, "w0", "died", T0 + 100, "killed", "worker"), T0 + 100)
    core.observe_metrics(metrics("w0", T0 + 130, 1.0), T0 + 130)
    core.observe_node_event(NodeEvent(JOB, "w0", "running", T0 + 110, "", "worker"), T0 + 131)
    core.observe_metrics(metrics("w0", T0 + 140, 1.0), T0 + 140)
    assert by_node(core.statistics(JOB, T0 + 140))["w0"].init_s == pytest.approx(10.0)


def test_metrics_after_a_death_mean_the_node_is_back() -> None:
    # The executor publishes only ``died`` today: a newer report is the relaunch.
    core = MonitorCore()
    feed(core, "w0", T0, T0 + 100, 1.0)
    core.observe_node_event(NodeEvent(JOB, "w0", "died", T0 + 100, "killed", "worker"), T0 + 100)
    core.observe_metrics(metrics("w0", T0 + 160, 1.0), T0 + 160)
    st = by_node(core.statistics(JOB, T0 + 160))["w0"]
    assert st.state is Liveness.RUNNING and st.restarts == 1


def test_unknown_node_event_kinds_are_ignored() -> None:
    core = MonitorCore()
    core.observe_node_event(NodeEvent(JOB, "w0", "rebalanced", T0), T0)
    with pytest.raises(NotFound):
        core.statistics(JOB, T0)  # the job was only created by a known observation
    core.observe_node_event(NodeEvent(JOB, "w0", "pending", T0, role="worker"), T0)
    assert by_node(core.statistics(JOB, T0))["w0"].state is Liveness.PENDING


# ------------------------------------------------------------------ cluster, shards


def test_cluster_busy_from_pending_pods_and_capacity() -> None:
    core = cluster_of(2, until=T0 + 10)
    assert core.statistics(JOB, T0 + 10).cluster_busy is False  # nothing known: not busy
    assert core.observe_cluster(0, T0 + 10, free_cpu=50, total_cpu=100) is False
    assert core.observe_cluster(3, T0 + 10) is True
    assert core.statistics(JOB, T0 + 10).cluster_busy is True
    assert core.observe_cluster(0, T0 + 10, free_cpu=2, total_cpu=100) is True  # < 5 % free
    assert core.observe_cluster(0, T0 + 10, free_cpu=50, total_cpu=100) is False
    assert core.statistics(JOB, T0 + 10).cluster_busy is False
    # Stale information is ignored.
    core.observe_cluster(5, T0 + 10)
    assert core.cluster_busy(T0 + 10 + 601) is False


def test_a_node_pending_too_long_marks_the_job_busy() -> None:
    core = MonitorCore(MonitorConfig(busy_pending_s=120))
    core.observe_node_event(NodeEvent(JOB, "w0", "pending", T0, role="worker"), T0)
    assert core.statistics(JOB, T0 + 119).cluster_busy is False
    assert core.statistics(JOB, T0 + 120).cluster_busy is True


def _status(dataset: str, todo: int, done: int, finished: bool = False) -> DatasetStatus:
    return DatasetStatus(
        job=JOB, dataset=dataset, mode=DatasetMode.FINITE, epoch=0, epochs=1, todo=todo, doing=1,
        done=done, failed=0, records_total=1000, records_done=done * 10, records_duplicated=0,
        finished=finished, closed=True,
    )


def test_shard_summary_sums_the_newest_status_of_each_dataset() -> None:
    core = MonitorCore()
    core.observe_shards(_status("a", 10, 5), T0)
    core.observe_shards(_status("a", 8, 7), T0 + 5)  # replaces the older status of "a"
    core.observe_shards(_status("b", 0, 20, finished=True), T0 + 6)
    sh = core.statistics(JOB, T0 + 10).shards
    assert sh is not None
    assert (sh.todo, sh.doing, sh.done, sh.failed, sh.records_done) == (8, 2, 27, 0, 270)
    assert (sh.datasets, sh.finished, sh.updated, sh.records_total) == (2, False, T0 + 6, 2000)


# ------------------------------------------------------------------ wire, determinism, config


def _scenario() -> MonitorCore:
    core = cluster_of(3, until=T0 + 600)
    feed(core, "slow", T0, T0 + 600, 2.0)
    feed(core, "ps0", T0, T0 + 600, 0.1, "ps")
    core.observe_node_event(NodeEvent(JOB, "p", "pending", T0 + 500, role="worker"), T0 + 500)
    core.observe_shards(_status("a", 3, 4), T0 + 590)
    core.observe_cluster(1, T0 + 590, free_cpu=10, total_cpu=100)
    return core


def test_statistics_round_trip_through_the_codec() -> None:
    st = _scenario().statistics(JOB, T0 + 600)
    assert decode(JobStatistics, encode(st)) == st
    empty = MonitorCore()
    empty.observe_node_event(NodeEvent(JOB, "w0", "pending", T0), T0)
    st2 = empty.statistics(JOB, T0)
    assert st2.shards is None
    assert decode(JobStatistics, encode(st2)) == st2
    assert decode(StatsQuery, encode(StatsQuery(JOB))) == StatsQuery(JOB)


def test_deterministic() -> None:
    a = encode(_scenario().statistics(JOB, T0 + 600))
    b = encode(_scenario().statistics(JOB, T0 + 600))
    assert a == b
    st = _scenario().statistics(JOB, T0 + 600)
    assert [n.node for n in st.nodes] == sorted(n.node for n in st.nodes)


def test_unknown_job_and_forget() -> None:
    core = _scenario()
    with pytest.raises(NotFound):
        core.statistics("other", T0)
    core.forget(JOB)
    with pytest.raises(NotFound):
        core.statistics(JOB, T0)


@pytest.mark.parametrize(
    "kw",
    [dict(window_short_s=700.0), dict(window_short_s=0.0), dict(slowness_ratio=0.0), dict(max_samples=0)],
)
def test_bad_config_is_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        MonitorConfig(**kw)  # type: ignore[arg-type]


def test_median_without_matches_the_plain_median_of_the_peers() -> None:
    import random
    import statistics

    from pacer_services.monitor.core import _median_without

    rng = random.Random(3)
    for _ in range(500):
        vals = sorted(rng.choice([0.1, 0.2, 0.3, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(1, 9)))
        own = rng.choice(vals)
        peers = list(vals)
        peers.remove(own)
        want = statistics.median(peers) if peers else 0.0
        assert _median_without(vals, own) == pytest.approx(want)
