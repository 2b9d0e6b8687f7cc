"""Jobs: the spec a user submits, its validation and default plan, and the job lifecycle.

:mod:`pacer.jobs.spec` parses and validates YAML/JSON job specs and holds the
documented default plan; :mod:`pacer.jobs.lifecycle` holds the legal state
transitions.  Both are pure (no IO, no clock) so that services, the CLI and
the simulator share them.
"""

from pacer.jobs.lifecycle import (
    TERMINAL,
    TRANSITIONS,
    IllegalJobTransition,
    JobLifecycle,
    JobState,
    JobTrigger,
)
from pacer.jobs.spec import (
    DEFAULT_PLAN,
    JobSpecError,
    default_plan,
    load_job_spec,
    parse_job_spec,
    validate_job_spec,
)

__all__ = [
    "DEFAULT_PLAN",
    "TERMINAL",
    "TRANSITIONS",
    "IllegalJobTransition",
    "JobLifecycle",
    "JobSpecError",
    "JobState",
    "JobTrigger",
    "default_plan",
    "load_job_spec",
    "parse_job_spec",
    "validate_job_spec",
]
