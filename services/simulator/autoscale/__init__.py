"""Autoscaling simulator: a PS job (or a cluster of them) under a resource scaler.

Why: DLRover-RM §6 compares its auto-scaling with ES and Optimus on the JCT
and on how fast a cold-started job reaches its best throughput (Fig. 7,
Fig. 10).  Pacer's brain must be judged the same way without a real
cluster, so this package simulates jobs whose *true* resource-performance
behaviour is hidden from the scalers, which only see
:class:`~pacer.contracts.monitor.JobStatistics` as Pacer's monitor would
publish them, and whose plan changes cost what they cost in a real cluster.

Modules, each importing only those above it:

* :mod:`.truth` - the hidden job model (throughput, CPU, memory) and its draws;
* :mod:`.types` - what the parts exchange: :class:`SimJob`, :class:`SimConfig`,
  the :class:`Scaler` / :class:`ClusterScaler` protocols, results;
* :mod:`.jobsim` - one simulated job, tick by tick;
* :mod:`.scalers` - the baselines (static, ES, Optimus, oracle, first-come)
  and Pacer's brain, by name;
* :mod:`.runner` - :func:`run_job` and :func:`run_cluster`;
* :mod:`.scenario` - the YAML scenario files of ``pacer sim``.
"""

from .jobsim import JobSim
from .runner import cluster_jobs, run_cluster, run_job
from .scalers import CLUSTER_SCALERS, SCALERS, make_scaler
from .truth import (
    PROFILES,
    JobTruth,
    Profile,
    cpu_used,
    draw_truth,
    ps_rss_mb,
    ps_shares,
    rngs,
    throughput,
)
from .types import (
    AutoscaleError,
    ClusterJobView,
    ClusterRun,
    ClusterScaler,
    JobRun,
    Scaler,
    ScalerContext,
    SharedCluster,
    SimConfig,
    SimJob,
    UserPlan,
    plan_summary,
    sim_job,
    time_to_fraction_of,
)

__all__ = [
    "CLUSTER_SCALERS",
    "PROFILES",
    "SCALERS",
    "AutoscaleError",
    "ClusterJobView",
    "ClusterRun",
    "ClusterScaler",
    "JobRun",
    "JobSim",
    "JobTruth",
    "Profile",
    "Scaler",
    "ScalerContext",
    "SharedCluster",
    "SimConfig",
    "SimJob",
    "UserPlan",
    "cluster_jobs",
    "cpu_used",
    "draw_truth",
    "make_scaler",
    "plan_summary",
    "ps_rss_mb",
    "ps_shares",
    "rngs",
    "run_cluster",
    "run_job",
    "sim_job",
    "throughput",
    "time_to_fraction_of",
]
