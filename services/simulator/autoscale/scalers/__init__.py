"""The scalers of the autoscaling simulator, by name: baselines and Pacer's brain.

:data:`SCALERS` maps a name to ``factory(ctx: ScalerContext) -> Scaler`` (one
job), :data:`CLUSTER_SCALERS` to ``factory(ctx) -> ClusterScaler`` (jobs
sharing a quota; ``ctx.truth`` is the scenario's nominal truth).
"""

from __future__ import annotations

from collections.abc import Callable

from ..types import AutoscaleError, ClusterScaler, Scaler, ScalerContext
from .baselines import (
    EsScaler,
    FirstComeStatic,
    OptimusScaler,
    OracleScaler,
    StaticScaler,
    oracle_plan,
)
from .pacer import PacerCluster, PacerScaler, autoscale_config, pacer, pacer_cluster

__all__ = [
    "CLUSTER_SCALERS",
    "SCALERS",
    "EsScaler",
    "FirstComeStatic",
    "OptimusScaler",
    "OracleScaler",
    "PacerCluster",
    "PacerScaler",
    "StaticScaler",
    "autoscale_config",
    "make_scaler",
    "oracle_plan",
]


def _static(ctx: ScalerContext) -> Scaler:
    up = ctx.user_plan
    return StaticScaler(lambda job: up.plan(job.name, "static user plan"))


def _es(ctx: ScalerContext) -> Scaler:
    return EsScaler(ctx.user_plan, step_workers=int(ctx.params.get("step_workers", 4)),
                    threshold=float(ctx.params.get("threshold", 0.3)))


def _optimus(ctx: ScalerContext) -> Scaler:
    return OptimusScaler(ctx.user_plan)


def _oracle(ctx: ScalerContext) -> Scaler:
    return OracleScaler(ctx.truth, ctx.config.quota_cpu, ctx.config.max_pod_cpu, samples_total=ctx.samples_total)


def _first_come(ctx: ScalerContext) -> ClusterScaler:
    return FirstComeStatic(ctx.user_plan)


SCALERS: dict[str, Callable[[ScalerContext], Scaler]] = {
    "pacer": pacer,
    "oracle": _oracle,
    "es": _es,
    "optimus": _optimus,
    "static": _static,
}

CLUSTER_SCALERS: dict[str, Callable[[ScalerContext], ClusterScaler]] = {
    "pacer": pacer_cluster,
    "first-come-static": _first_come,
}


def make_scaler(name: str, ctx: ScalerContext) -> Scaler:
    """The registered scaler ``name`` for one job (:class:`AutoscaleError` listing the known names)."""
    factory = SCALERS.get(name)
    if factory is None:
        raise AutoscaleError(f"unknown scaler {name!r}; known: {', '.join(sorted(SCALERS))}")
    return factory(ctx)
