"""The brain's configuration (env: ``PACER_BRAIN_*``, docs/settings.md): what it re-plans running jobs
with, the cluster's capacity when the operator gives it, and the teams' quotas."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pacer.contracts.jobs import JobSpec, ResourcePlan
from pacer.errors import ValidationError
from pacer.ids import DEFAULT_NAMESPACE, is_namespace
from pacer.ownership import DEFAULT_TTL_S
from pacer_services.brain.core.autoscaler import AutoscaleConfig, JobAutoscaler
from pacer_services.brain.core.calibration import Calibration
from pacer_services.brain.core.cluster import OverheadModel
from pacer_services.brain.core.fitting import Coefficients

__all__ = ["BrainConfig", "namespace_quotas"]


@dataclass(frozen=True, slots=True)
class BrainConfig:
    """What the brain re-plans running jobs with (env: ``PACER_BRAIN_*``)."""

    autoscale: bool = True  # re-plan zero-config jobs while they run
    cpu_quota: float = 64.0  # C_total of a job; limits.max_cpu, when smaller, wins (DLRover 2023 §4.2)
    node_cpu: float = 16.0  # C_max: CPUs of one node
    adjust_interval_s: float = 180.0  # DLRover-RM §6: every 3 min
    settle_s: float = 30.0  # a plan counts as measured after its nodes ran this long
    autoscale_config: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    # What the autoscaled jobs share (DLRover-RM Eq. 13's S); None: from the executor's ClusterStatus.
    cluster_cpu: float | None = None
    cluster_memory_mb: float | None = None
    cluster_status_ttl_s: float = 60.0  # an older ClusterStatus (the executor is gone?) is not used
    round_delay_s: float = 0.5  # a cluster round waits this long for the rest of the monitor's burst
    lease_ttl_s: float = DEFAULT_TTL_S  # a dead instance's jobs (and rounds) move about this long after
    instance: str | None = None  # None: PACER_INSTANCE, else brain-<random>
    inactive_s: float = 300.0  # the server deletes a gone instance's durable consumer after this long
    # CPUs the autoscaled jobs of one namespace (a team) may hold together (PACER_BRAIN_NAMESPACE_CPU,
    # "team-a=32,team-b=16"); a namespace not named has no quota of its own.  cpu_quota still bounds each job.
    namespace_cpu: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> BrainConfig:
        env = os.environ
        return cls(autoscale=env.get("PACER_BRAIN_AUTOSCALE", "1") not in ("0", "false", "no"),
                   cpu_quota=float(env.get("PACER_BRAIN_CPU_QUOTA", "64")),
                   namespace_cpu=namespace_quotas(env.get("PACER_BRAIN_NAMESPACE_CPU", "")),
                   node_cpu=float(env.get("PACER_BRAIN_NODE_CPU", "16")),
                   adjust_interval_s=float(env.get("PACER_BRAIN_ADJUST_S", "180")),
                   settle_s=float(env.get("PACER_BRAIN_SETTLE_S", "30")),
                   cluster_cpu=_amount(env.get("PACER_BRAIN_CLUSTER_CPU")),
                   cluster_memory_mb=_amount(env.get("PACER_BRAIN_CLUSTER_MEMORY_MB")),
                   lease_ttl_s=float(env.get("PACER_LEASE_TTL_S", DEFAULT_TTL_S)),
                   # Eq. 8's pauses until the executor has reported real ones: a pod's start where Pacer runs
                   autoscale_config=AutoscaleConfig(overhead=OverheadModel(
                       worker_pause_s=float(env.get("PACER_BRAIN_WORKER_PAUSE_S", "30")),
                       ps_pause_s=float(env.get("PACER_BRAIN_PS_PAUSE_S", "120")))))

    def autoscaler(self, spec: JobSpec, first: ResourcePlan, warm: bool,
                   prior: Coefficients | None = None, prior_calibration: Calibration | None = None,
                   namespace: str = DEFAULT_NAMESPACE) -> JobAutoscaler:
        stages = replace(self.autoscale_config.stages, c_total=self.cpu_quota, c_max=self.node_cpu,
                         ps_cpu_target=min(self.autoscale_config.stages.ps_cpu_target, self.node_cpu))
        cfg = replace(self.autoscale_config, stages=stages, adjust_interval_s=self.adjust_interval_s,
                      settle_s=self.settle_s)
        # m of DLRover-RM Eq. 1 is per worker; the spec's batch is global (launch divides it).
        m = max(1, spec.batch_size // max(1, first.workers))
        return JobAutoscaler(spec, m, cfg, first=first, warm=warm, prior=prior, prior_calibration=prior_calibration,
                             namespace=namespace)


def namespace_quotas(text: str) -> dict[str, float]:
    """``"team-a=32, team-b=16"`` -> ``{"team-a": 32.0, "team-b": 16.0}``; ValidationError naming the bad entry."""
    out: dict[str, float] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        ns, sep, amount = item.partition("=")
        ns = ns.strip()
        try:
            cpu = float(amount) if sep else math.nan
        except ValueError:
            cpu = math.nan
        if not is_namespace(ns) or not math.isfinite(cpu) or cpu < 0:
            raise ValidationError(f"PACER_BRAIN_NAMESPACE_CPU: {item!r}: expected <namespace>=<CPUs >= 0>, "
                                  "e.g. team-a=32,team-b=16")
        out[ns] = cpu
    return out


def _amount(text: str | None) -> float | None:
    """An optional amount from the environment: unset or empty is None."""
    return float(text) if text not in (None, "") else None


