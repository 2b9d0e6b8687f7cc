"""Cluster simulator: a deterministic discrete-event model of a PS training job
that drives Pacer's real decision code (shard core, monitor core, executor
core, straggler policies).  See :mod:`.engine` for the model and
:mod:`.scenario` for the scenario files.
"""

from .engine import Policy, Result, Reviewer, SimulationError, run
from .scenario import Scenario, ScenarioError, load, parse

__all__ = ["Policy", "Result", "Reviewer", "Scenario", "ScenarioError", "SimulationError", "load", "parse", "run"]
