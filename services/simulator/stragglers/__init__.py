"""The straggler simulator: a deterministic discrete-event model of one PS training job.

It drives Pacer's real decision code (shard, monitor, executor and
controller cores, the built-in straggler policies, the trainer's straggler
patterns) on simulated time:

* :mod:`.scenario`: the scenario files (:class:`Scenario` of a
  :class:`SimCluster`, a :class:`Workload` and :class:`InjectedStraggler` s);
* :mod:`.engine`: the simulation (:func:`run`);
* :mod:`.policy`: the policies a run can use, by name;
* :mod:`.result`: what a run produced.
"""

from .engine import Simulation, SimulationError, run
from .policy import Policy, none_policy, resolve_policy
from .result import Result
from .scenario import (
    InjectedStraggler,
    MonitorSpec,
    Scenario,
    ScenarioError,
    SimCluster,
    SimDeviceGroup,
    Workload,
    load,
    parse,
)

__all__ = [
    "InjectedStraggler", "MonitorSpec", "Policy", "Result", "Scenario", "ScenarioError", "SimCluster",
    "SimDeviceGroup", "Simulation", "SimulationError", "Workload", "load", "none_policy", "parse",
    "resolve_policy", "run",
]
