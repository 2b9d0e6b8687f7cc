"""Per-job policy parameters: ``policies.params`` in the spec reaches every PolicyRequest.params.

They used to be dropped: ``PolicyRequest.params`` existed but nothing
filled it, so a policy could only be tuned by editing its code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pacer import codec
from pacer.contracts.jobs import JobRecord, JobSpec, JobState, PlanSource, ResourcePlan
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer.jobs import JobSpecError
from pacer.jobs.spec import MAX_POLICY_PARAMS, parse_job_spec
from pacer_services.controller.core import ControllerCore, JobSetup

BASE = "name: j\nmodel: wide_deep\ndataset: /d.rec\nmode: bsp\n"
REPO = Path(__file__).resolve().parents[2]


def _spec(policies: str) -> JobSpec:
    return parse_job_spec(BASE + "policies:\n" + policies)


def test_params_are_parsed_and_survive_the_wire() -> None:
    spec = _spec("  straggler: restart-slowest\n  params: {threshold: 2.5, nodes: [worker-1, worker-2], enabled: true}\n")
    assert spec.policies.params == {"threshold": 2.5, "nodes": ["worker-1", "worker-2"], "enabled": True}
    back = codec.decode(JobSpec, codec.encode(spec))
    assert back.policies.params == spec.policies.params
    assert parse_job_spec(BASE).policies.params == {}


@pytest.mark.parametrize(("params", "problem"), [
    ("[1, 2]", "policies.params: must be a map"),
    ("{deep: {a: 1}}", "policies.params.deep: must be a number, string, boolean or a list"),
    ("{x: .nan}", "policies.params.x: must be a finite number"),
    ("{" + ", ".join(f"p{i}: {i}" for i in range(MAX_POLICY_PARAMS + 1)) + "}", "at most 32 parameters"),
])
def test_bad_params_are_refused_naming_the_field(params: str, problem: str) -> None:
    with pytest.raises(JobSpecError) as err:
        _spec(f"  params: {params}\n")
    assert problem in str(err.value)


def _stats(slow: float) -> JobStatistics:
    def node(name: str, bpt: float) -> NodeStats:
        return NodeStats(node=name, role="worker", bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=1.0,
                         samples_total=0, cpu_percent=100.0, rss_bytes=1, last_seen=1.0, state=Liveness.RUNNING,
                         pending_s=0.0, restarts=0, slowdown_short=bpt, slowdown_long=bpt)

    return JobStatistics(job="j", ts=100.0, window_short_s=300.0, window_long_s=600.0,
                         throughput_samples_per_s=3.0,
                         nodes=[node("worker-0", 1.0), node("worker-1", 1.0), node("worker-2", slow)])


def _core(policies: str) -> tuple[ControllerCore, JobSpec]:
    spec = _spec(policies)
    rec = JobRecord("j", spec, JobState.RUNNING, 0.0,
                    plan=ResourcePlan("j", 3, 1, 1.0, 2048, 1.0, 2048, PlanSource.DEFAULT))
    return ControllerCore("j", JobSetup.of_record(rec), policy=spec.policies.straggler), spec


def test_the_controller_sends_the_specs_params_in_every_request() -> None:
    core, _ = _core("  straggler: restart-slowest\n  params: {threshold: 3.0}\n")
    req = core.request(_stats(2.5), 100.0)
    assert req.params == {"threshold": 3.0}
    req.params["threshold"] = 9.0  # a policy mutating its copy does not change the job's setup
    assert core.request(_stats(2.5), 101.0).params == {"threshold": 3.0}


def test_the_example_policy_is_tuned_by_the_spec() -> None:
    """examples/policies/restart_slowest.py restarts a worker >= threshold x its peers (default 2.0)."""
    import importlib.util

    path = REPO / "examples/policies/restart_slowest.py"
    found = importlib.util.spec_from_file_location("restart_slowest_example", path)
    assert found and found.loader
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    default, _ = _core("  straggler: restart-slowest\n")
    strict, _ = _core("  straggler: restart-slowest\n  params: {threshold: 3.0}\n")
    acted = module.decide(default.request(_stats(2.5), 100.0))
    held = module.decide(strict.request(_stats(2.5), 100.0))
    assert [a.node for a in acted.actions] == ["worker-2"]
    assert held.actions == []
