"""Moved to :mod:`pacer_services.simulator.autoscale.scenario`; kept only for importers that have not moved yet."""

from .autoscale.scenario import AutoscaleScenario, is_autoscale, load, parse, run

__all__ = ["AutoscaleScenario", "is_autoscale", "load", "parse", "run"]
