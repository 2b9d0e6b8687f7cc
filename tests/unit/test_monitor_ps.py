"""The monitor core on PS reports (the PS agent's probe latency as ``bpt_s``): short and long windows."""

from __future__ import annotations

from pacer.contracts.agent import AgentMetrics
from pacer.contracts.monitor import StragglerKind
from pacer.contracts.nodes import NodeEvent
from pacer_services.monitor.core import MonitorConfig, MonitorCore

CFG = MonitorConfig(window_short_s=6.0, window_long_s=12.0, slowness_ratio=1.5)


def ps_report(node: str, t: float, latency_s: float, probes: int = 8, cpu: float = 30.0) -> AgentMetrics:
    return AgentMetrics(job="j", node=node, role="ps", ts=t, local_step=0, iteration=-1, bpt_s=latency_s,
                        batch_size=0, samples_per_s=0.0, samples_total=0, cpu_percent=cpu, rss_bytes=1 << 20,
                        last_action_seq=0, last_action_iteration=-1, primary=False, steps=probes)


def worker_report(node: str, t: float, bpt_s: float) -> AgentMetrics:
    return AgentMetrics(job="j", node=node, role="worker", ts=t, local_step=0, iteration=0, bpt_s=bpt_s,
                        batch_size=256, samples_per_s=256 / bpt_s, samples_total=0, cpu_percent=90.0,
                        rss_bytes=1 << 20, last_action_seq=0, last_action_iteration=-1, primary=False, steps=10)


def feed(core: MonitorCore, until: float, slow: dict[str, float], start: float = 0.0) -> None:
    """ps-0 and ps-1 report every 2 s; workers every 2 s at 0.1 s (they must not be compared with PS)."""
    t = start
    while t <= until:
        for ps in ("ps-0", "ps-1"):
            core.observe_metrics(ps_report(ps, t, slow.get(ps, 0.0004)), t)
        for w in ("worker-0", "worker-1"):
            core.observe_metrics(worker_report(w, t, 0.1), t)
        t += 2.0


def kinds(core: MonitorCore, now: float) -> dict[str, tuple[StragglerKind, float, float, float]]:
    st = core.statistics("j", now)
    return {n.node: (n.straggler, round(n.slowdown_short, 1), round(n.slowdown_long, 1), n.cpu_percent)
            for n in st.nodes}


def test_a_throttled_ps_is_transient_then_persistent_and_its_peer_and_the_workers_are_not() -> None:
    core = MonitorCore(CFG)
    feed(core, 4.0, {"ps-1": 0.08})
    early = kinds(core, 4.0)
    assert early["ps-1"][0] is StragglerKind.TRANSIENT  # slow, but no evidence older than L_trans yet
    feed(core, 14.0, {"ps-1": 0.08}, start=6.0)
    late = kinds(core, 14.0)
    # 80 ms against the floor of 20 ms (the healthy PS answers in 0.4 ms): 4x.
    assert late["ps-1"][:3] == (StragglerKind.PERSISTENT, 4.0, 4.0)
    assert late["ps-0"][0] is StragglerKind.NONE and late["ps-0"][1] < 1.0
    assert {late[w][0] for w in ("worker-0", "worker-1")} == {StragglerKind.NONE}
    assert late["ps-1"][3] == 30.0  # the PS's CPU reading reaches the statistics
    st = core.statistics("j", 14.0)
    assert st.throughput_samples_per_s == 2 * 256 / 0.1  # PS reports add no throughput


def test_sub_millisecond_noise_between_healthy_ps_is_no_straggler() -> None:
    core = MonitorCore(CFG)
    feed(core, 14.0, {"ps-1": 0.0012})  # 3x its peer, but both far under the 20 ms floor
    got = kinds(core, 14.0)
    assert got["ps-1"][0] is StragglerKind.NONE and got["ps-1"][2] < 1.5
    # Without the floor the same readings would be a straggler: the floor is what keeps it quiet.
    bare = MonitorCore(MonitorConfig(window_short_s=6.0, window_long_s=12.0, ps_latency_floor_s=0.0))
    feed(bare, 14.0, {"ps-1": 0.0012})
    assert kinds(bare, 14.0)["ps-1"][0] is StragglerKind.PERSISTENT


def test_a_migrated_ps_starts_over() -> None:
    core = MonitorCore(CFG)
    feed(core, 14.0, {"ps-1": 0.08})
    core.observe_node_event(NodeEvent(job="j", node="ps-1", role="ps", kind="died", ts=14.5), 14.5)
    feed(core, 20.0, {}, start=16.0)  # the new PS answers like its peer
    got = kinds(core, 20.0)
    assert got["ps-1"][0] is StragglerKind.NONE
    assert {n.node: n.restarts for n in core.statistics("j", 20.0).nodes}["ps-1"] == 1
