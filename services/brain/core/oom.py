"""DLRover-RM §5.3 OOM prevention: predict a node's memory growth and raise its memory in time.

The paper models "the dynamics of memory usage", checks whether a PS "would
exceed the memory capacity before the job completion (e.g., 10,000 steps to
complete)" and, if so, "scales the PSes with larger memory capacity" before
the OOM happens.  It leaves the model to a technical report; here it is the
least-squares line through the newest samples of (progress -> RSS), where
progress is whatever the caller measures the job's completion in (global
steps, or seconds):

    rss(x) ~= a + b * x           (ordinary least squares over the window)
    peak    = a + b * x_end + z * sigma

with sigma the residual standard deviation, so noise widens the margin
instead of triggering actions.  A fit over a recent window follows the
current growth rate: embedding tables grow fast while new ids arrive and
level off later (DLRover-RM Fig. 1(b)); a line over-predicts a levelling
curve, which errs on the safe side.

When to act: a slope fitted over a few minutes of noisy readings is itself
noisy, and extrapolated over hours it cries wolf (every raise of a PS's
memory is a migration, a pause; and among forty workers with flat memory
one always shows a steep slope by chance).  So the decision looks only
``lead`` ahead - the time a raise needs to be in force (a decision interval
and a restart): act when ``rss(now + lead) + z sigma`` would cross the
limit *and* the growth is real: the slope is significantly above zero
(one-sided t-test of ``slope / (sigma / sqrt(Sxx))`` with n - 2 degrees of
freedom at level ``alpha``, Bonferroni-corrected for the nodes of the role
tested together, since a plan raises them as one), or the node already
holds ``high_water`` of its limit and still grows.  The new memory is sized for
the job's end as above, so one raise lasts.  ``lead=None`` acts on the
forecast to the end directly.

If ``peak`` exceeds the node's limit, the node gets ``peak * (1 + headroom)``
rounded up, at most ``max_memory_mb`` (the machine).  Fewer than
``min_samples`` samples, or samples that do not span any progress, predict
nothing.  Pure: samples, limits and the horizon come in as arguments.

The paper names PS; workers run out of memory too (large batches, wide
feature crosses, input pipelines), so the same forecast covers them.  A
raised PS memory moves the PS by a seamless migration (DLRover-RM §5.2); a
raised worker memory makes the pod-executor replace the running workers a
batch at a time (workers hold no state in PS training).  A plan gives all
nodes of a role one size, so a role gets the most any of its nodes needs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pacer.contracts.jobs import ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness
from scipy.stats import t as student_t  # type: ignore[import-untyped]

from .stages import WORKER_ROLES

ALL_ROLES = ("ps", *WORKER_ROLES)  # every role whose memory OOM prevention may raise


@dataclass(frozen=True, slots=True)
class MemorySample:
    """The RSS of a node at a point of the job's progress (step or seconds)."""

    at: float
    rss_mb: float


@dataclass(frozen=True, slots=True)
class OomConfig:
    """Knobs of OOM prediction; the defaults are the documented ones."""

    min_samples: int = 5  # no prediction from fewer samples
    window: int = 60  # fit the newest this many samples
    z: float = 2.0  # margin: peak + z residual standard deviations
    headroom: float = 0.2  # new memory = predicted peak x (1 + headroom)
    memory_step_mb: int = 64  # new memory is rounded up to this
    max_memory_mb: int = 64 * 1024  # the most memory one node can get
    min_growth_mb: float = 1.0  # growth over the remaining horizon below this counts as flat
    lead: float | None = 900.0  # act when the limit would be crossed within this much progress (None: by the end)
    alpha: float = 0.01  # ... and the slope is above zero at this level (over all nodes of the role) ...
    high_water: float = 0.9  # ... or the node holds this share of its limit and grows (slope t >= 2, 2x min_samples)


DEFAULT_OOM = OomConfig()


@dataclass(frozen=True, slots=True)
class MemoryTrend:
    """A least-squares line ``rss = intercept + slope * at`` with its residual spread."""

    intercept_mb: float
    slope_mb: float  # MiB per unit of progress
    sigma_mb: float  # residual standard deviation
    samples: int
    last_at: float
    sxx: float = 0.0  # sum of squared deviations of their progress

    def at(self, x: float) -> float:
        return self.intercept_mb + self.slope_mb * x

    def slope_t(self) -> float:
        """The slope in standard errors (``slope / (sigma / sqrt(Sxx))``; inf for a noiseless rise)."""
        if self.sxx <= 0.0:
            return 0.0
        if self.sigma_mb <= 0.0:
            return math.inf if self.slope_mb > 0 else 0.0
        return self.slope_mb / (self.sigma_mb / math.sqrt(self.sxx))


def fit_memory_trend(samples: Sequence[MemorySample], config: OomConfig = DEFAULT_OOM) -> MemoryTrend | None:
    """The trend of the newest ``window`` samples; ``None`` if too few or all at one point."""
    pts = sorted(samples, key=lambda s: s.at)[-config.window:] if config.window > 0 else sorted(samples, key=lambda s: s.at)
    n = len(pts)
    if n < max(2, config.min_samples):
        return None
    mx = sum(p.at for p in pts) / n
    my = sum(p.rss_mb for p in pts) / n
    sxx = sum((p.at - mx) ** 2 for p in pts)
    if sxx <= 0:
        return None
    slope = sum((p.at - mx) * (p.rss_mb - my) for p in pts) / sxx
    intercept = my - slope * mx
    # n - 2 degrees of freedom: two parameters were fitted.
    sse = sum((p.rss_mb - (intercept + slope * p.at)) ** 2 for p in pts)
    sigma = math.sqrt(sse / (n - 2)) if n > 2 else 0.0
    return MemoryTrend(intercept_mb=intercept, slope_mb=slope, sigma_mb=sigma, samples=n, last_at=pts[-1].at,
                       sxx=sxx)


@dataclass(frozen=True, slots=True)
class OomForecast:
    """The prediction for one node; ``new_memory_mb`` is set when its memory must be raised."""

    node: str
    role: str
    limit_mb: int
    trend: MemoryTrend | None
    peak_mb: float  # predicted RSS (with margin) at the end of the horizon; 0 without a trend
    oom_at: float | None  # progress at which the limit would be hit; None if not within the horizon
    new_memory_mb: int | None
    reason: str

    @property
    def act(self) -> bool:
        return self.new_memory_mb is not None


def forecast_oom(node: str, samples: Sequence[MemorySample], limit_mb: int, end_at: float,
                 config: OomConfig = DEFAULT_OOM, *, role: str = "ps", tested: int = 1) -> OomForecast:
    """Will ``node`` exceed ``limit_mb`` before the job's progress reaches ``end_at``? (DLRover-RM §5.3)"""
    trend = fit_memory_trend(samples, config)
    if trend is None:
        return OomForecast(node, role, limit_mb, None, 0.0, None, None,
                           f"too few samples to predict ({len(samples)} < {config.min_samples})")
    end = max(end_at, trend.last_at)
    margin = config.z * trend.sigma_mb
    peak = trend.at(end) + margin
    grows = trend.slope_mb * (end - trend.last_at) >= config.min_growth_mb
    if peak <= limit_mb or (not grows and trend.at(trend.last_at) + margin <= limit_mb):
        return OomForecast(node, role, limit_mb, trend, peak, None, None,
                           f"predicted peak {peak:.0f} MiB within the limit {limit_mb} MiB")
    if config.lead is not None:  # act only on what the line can tell: the near future (module docstring)
        soon = min(end, trend.last_at + config.lead)
        near = trend.at(soon) + margin
        level = trend.at(trend.last_at)
        critical = float(student_t.ppf(1.0 - config.alpha / max(1, tested), max(1, trend.samples - 2)))
        close = (level >= config.high_water * limit_mb and trend.slope_t() >= 2.0
                 and trend.samples >= 2 * config.min_samples)
        real = trend.slope_t() >= critical or close
        if near <= limit_mb or not real:
            why = (f"not within {config.lead:g} ({near:.0f} MiB by {soon:g})" if near <= limit_mb
                   else "its growth is not yet told from noise")
            return OomForecast(node, role, limit_mb, trend, peak, None, None,
                               f"{peak:.0f} MiB by the end would cross the limit {limit_mb} MiB, but {why}: "
                               "wait for a surer slope")
    # Where the line (plus margin) crosses the limit; at or before now when it is there already.
    crossing = (limit_mb - margin - trend.intercept_mb) / trend.slope_mb if trend.slope_mb > 0 else trend.last_at
    oom_at = max(crossing, trend.last_at)
    step = config.memory_step_mb
    want = math.ceil(peak * (1.0 + config.headroom) / step) * step
    new = min(max(want, limit_mb), config.max_memory_mb)
    if new <= limit_mb:
        return OomForecast(node, role, limit_mb, trend, peak, oom_at, None,
                           f"OOM predicted at {oom_at:.0f} but the limit {limit_mb} MiB is already the maximum")
    capped = " (capped: OOM still predicted)" if want > config.max_memory_mb else ""
    return OomForecast(node, role, limit_mb, trend, peak, oom_at, int(new),
                       f"RSS grows {trend.slope_mb:.3g} MiB/unit: {peak:.0f} MiB predicted by {end:g} "
                       f"> limit {limit_mb} MiB (hit at {oom_at:.0f}); raise to {new} MiB{capped}")


def prevent_oom(plan: ResourcePlan, forecasts: Iterable[OomForecast]) -> ResourcePlan | None:
    """``plan`` with memory raised for the forecasts that act, or ``None`` if none does.

    A plan gives every node of a role the same memory, so a role gets the
    largest memory any of its nodes needs.
    """
    ps_mem = plan.ps_memory_mb
    worker_mem = plan.worker_memory_mb
    why: list[str] = []
    for f in forecasts:
        if f.new_memory_mb is None:
            continue
        if f.role == "ps" and f.new_memory_mb > ps_mem:
            ps_mem = f.new_memory_mb
            why.append(f"{f.node}: {f.reason}")
        elif f.role in ("worker", "chief") and f.new_memory_mb > worker_mem:
            worker_mem = f.new_memory_mb
            why.append(f"{f.node}: {f.reason}")
    if not why:
        return None
    return replace(plan, ps_memory_mb=ps_mem, worker_memory_mb=worker_mem,
                   reason="OOM prevention (DLRover-RM §5.3): " + "; ".join(why))


class MemoryWatch:
    """Each node's RSS over a job's progress, fed from the monitor's statistics, and the plan that prevents an OOM.

    One per job.  ``feed`` keeps the newest ``config.window`` samples of
    every running node (time in seconds is the progress); ``plan_for``
    forecasts each node to the job's end and returns ``plan`` with more
    memory where a node would exceed its limit (:func:`prevent_oom`), or
    ``None``.  ``roles`` limits which roles may be raised (default: PS only;
    :data:`ALL_ROLES` adds the workers, whose new memory the executor gives
    them by replacing them).

    A node that came back (the monitor's ``restarts`` grew: relaunched,
    replaced with a new size, moved by a migration) is a new process whose
    RSS starts afresh: its old samples are dropped, and so is the old
    process's last report, which the monitor shows until the new one reports.
    A DEAD node (scaled away, a PS retired by a migration) has no process:
    its samples are dropped too, so no OOM is forecast from them.
    """

    def __init__(self, config: OomConfig = DEFAULT_OOM) -> None:
        self.config = config
        self.nodes: dict[str, deque[MemorySample]] = {}
        self.roles: dict[str, str] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # node -> (restarts, rss_bytes) last seen
        self._stale: dict[str, int] = {}  # node -> rss_bytes of its previous process, not yet replaced

    def feed(self, stats: JobStatistics) -> None:
        for n in stats.nodes:
            restarts, rss = self._seen.get(n.node, (n.restarts, 0))
            if n.restarts != restarts:
                self.forget(n.node)
                self._stale[n.node] = rss
            self._seen[n.node] = (n.restarts, n.rss_bytes)
            if n.state is Liveness.DEAD:
                # Scaled away, or a PS retired by a migration: the monitor keeps showing it
                # until the job ends, but no process is left to run out of memory.
                self.forget(n.node)
                continue
            if n.rss_bytes == self._stale.get(n.node):
                continue  # the previous process's last report
            self._stale.pop(n.node, None)
            if n.state is Liveness.RUNNING and n.rss_bytes > 0:
                q = self.nodes.setdefault(n.node, deque(maxlen=self.config.window))
                if not q or stats.ts > q[-1].at:
                    q.append(MemorySample(stats.ts, n.rss_bytes / (1 << 20)))
        self.roles = {n.node: n.role for n in stats.nodes}

    def forget(self, node: str) -> None:
        """A node was relaunched or resized: its old samples no longer describe it."""
        self.nodes.pop(node, None)

    def to_state(self) -> dict[str, Any]:
        """The samples and what was last seen of each node, as JSON-able builtins (a brain hand-over)."""
        return {"nodes": {n: [[s.at, s.rss_mb] for s in q] for n, q in self.nodes.items()},
                "roles": dict(self.roles), "seen": {n: list(v) for n, v in self._seen.items()},
                "stale": dict(self._stale)}

    def load_state(self, d: dict[str, Any]) -> None:
        """Back to where :meth:`to_state` was taken (``KeyError`` / ``TypeError`` / ``ValueError`` if malformed)."""
        self.nodes = {n: deque((MemorySample(float(at), float(mb)) for at, mb in q), maxlen=self.config.window)
                      for n, q in d["nodes"].items()}
        self.roles = {str(n): str(r) for n, r in d["roles"].items()}
        self._seen = {n: (int(v[0]), int(v[1])) for n, v in d["seen"].items()}
        self._stale = {n: int(v) for n, v in d["stale"].items()}

    def plan_for(self, plan: ResourcePlan, end_at: float, roles: Iterable[str] = ("ps",)) -> ResourcePlan | None:
        wanted = set(roles)
        nodes = [(node, q) for node, q in self.nodes.items() if self.roles.get(node) in wanted]
        per_role: dict[str, int] = {}
        for node, _ in nodes:
            per_role[self.roles[node]] = per_role.get(self.roles[node], 0) + 1
        forecasts = [
            forecast_oom(node, list(q), plan.ps_memory_mb if self.roles[node] == "ps" else plan.worker_memory_mb,
                         end_at, self.config, role=self.roles[node], tested=per_role[self.roles[node]])
            for node, q in nodes
        ]
        return prevent_oom(plan, forecasts)



def job_end_at(stats: JobStatistics) -> float | None:
    """When the job ends at its current throughput (monitor time), or None when that cannot be told
    (no shard summary, finished, nothing left, no throughput)."""
    sh = stats.shards
    if sh is None or sh.finished or stats.throughput_samples_per_s <= 0 or sh.records_total <= sh.records_done:
        return None
    return stats.ts + (sh.records_total - sh.records_done) / stats.throughput_samples_per_s


def prevention_plan(watch: MemoryWatch, stats: JobStatistics, plan: ResourcePlan | None, *,
                    last_at: float | None, cooldown_s: float) -> ResourcePlan | None:
    """DLRover-RM §5.3 for a job the brain does not re-plan otherwise: feed the window to ``watch``; a plan
    with more memory (PS and workers, :data:`ALL_ROLES`) when a node would run out before the job's end.

    ``plan`` is the plan in force (None: unknown yet, nothing to raise);
    at most one such plan per ``cooldown_s`` (``last_at``: when the last
    went out).  A PS moves seamlessly (DLRover-RM §5.2) and the executor
    replaces workers a batch at a time: either way the memory is in place
    before the OOM.
    """
    watch.feed(stats)
    end_at = job_end_at(stats)
    if end_at is None or plan is None:
        return None
    if last_at is not None and stats.ts - last_at < cooldown_s:
        return None
    return watch.plan_for(plan, end_at, roles=ALL_ROLES)
