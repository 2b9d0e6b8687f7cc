"""Policy inputs in sane ranges, and error replies that always fit (issue 21, findings 7 and 8).

A PolicyRequest to ``antdt-dd`` with ``global_batch = 2**64-1`` raised
MemoryError inside the policy.  :func:`validate_request` now refuses such
numbers before any policy runs (the serving shell answers ``invalid``), and
the built-in policies refuse parameters outside :data:`PARAM_RANGES` and
AntDT-DD's solver inputs that would make it enumerate without bound.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from pacer.contracts import policy as contract
from pacer.contracts.common import decode_reply, encode_error
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats
from pacer.contracts.policy import PolicyDecision, PolicyRequest
from pacer.contracts.shards import DatasetStatus
from pacer.errors import PacerError, ValidationError
from pacer_services.controller.policies import adaptive, antdt_dd, antdt_nd, baselines
from pacer_services.controller.policies.registry import BUILTINS

MAX_GLOBAL_BATCH = 1 << 24  # pacer.contracts.policy's (spelled out: the module's names are what is tested)
MAX_NODES = 10_000

def node(name: str, bpt: float = 0.1, **kw: Any) -> NodeStats:
    base: dict[str, Any] = dict(node=name, role="worker", bpt_short_s=bpt, bpt_long_s=bpt, speed_samples_per_s=100.0,
                                samples_total=1000, cpu_percent=100.0, rss_bytes=1, last_seen=1.0,
                                state=Liveness.RUNNING, pending_s=0.0, restarts=0, slowdown_short=1.0,
                                slowdown_long=1.0)
    base.update(kw)
    return NodeStats(**base)


def request(**kw: Any) -> PolicyRequest:
    nodes = [node("worker-0", 0.1), node("worker-1", 0.3, slowdown_short=3.0, slowdown_long=3.0)]
    base: dict[str, Any] = dict(job="j", stats=JobStatistics("j", 1.0, 60.0, 300.0, 200.0, nodes), mode="bsp",
                                global_batch=512, device_groups={"worker-0": "fast", "worker-1": "slow"})
    base.update(kw)
    return PolicyRequest(**base)


def test_the_ranges_are_the_contract_s() -> None:
    assert (contract.MAX_GLOBAL_BATCH, contract.MAX_NODES) == (MAX_GLOBAL_BATCH, MAX_NODES)


def test_a_normal_request_is_valid_and_every_builtin_decides_it() -> None:
    contract.validate_request(request())
    for name, decide in BUILTINS.items():
        assert isinstance(decide(request()), PolicyDecision), name


BAD: list[tuple[str, dict[str, Any]]] = [
    ("global_batch", {"global_batch": 2**64 - 1}),
    ("global_batch", {"global_batch": 0}),
    ("global_batch", {"global_batch": MAX_GLOBAL_BATCH + 1}),
    ("mode", {"mode": "x" * 100}),
    ("job", {"job": "a.b"}),
    ("min_batch", {"min_batch": 513}),
    ("min_batch", {"min_batch": -1}),
    ("max_batch", {"max_batch": 2**63}),
    ("backup_workers", {"backup_workers": -1}),
    ("batch_sizes.worker-0", {"batch_sizes": {"worker-0": 2**40}}),
    ("accumulations.worker-0", {"accumulations": {"worker-0": 10**9}}),
    ("batch_sizes", {"batch_sizes": {f"w{i}": 1 for i in range(MAX_NODES + 1)}}),
    ("restart_blocked", {"restart_blocked": ["w"] * (MAX_NODES + 1)}),
    ("params", {"params": {f"p{i}": 1 for i in range(100)}}),
]


@pytest.mark.parametrize(("field", "kw"), BAD, ids=[f for f, _ in BAD])
def test_out_of_range_requests_are_invalid_naming_the_field(field: str, kw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as ei:
        contract.validate_request(request(**kw))
    assert ei.value.message.startswith(f"{field}:"), ei.value.message


@pytest.mark.parametrize("key", ["bpt_short_s", "speed_samples_per_s", "slowdown_long", "rss_bytes"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1])
def test_node_statistics_must_be_finite_and_not_negative(key: str, value: float) -> None:
    req = request()
    bad = replace(req.stats, nodes=[node("worker-0", **{key: value})])
    with pytest.raises(ValidationError, match=rf"^stats\.nodes\.worker-0\.{key}:"):
        contract.validate_request(replace(req, stats=bad))


def test_antdt_dd_refuses_a_solver_too_large_before_solving() -> None:
    # In range for the request, but no per-device bound: Eq. 4's candidate sets would hold ~5 x 2**24 sums.
    with pytest.raises(ValidationError, match=r"^max_batch:.*word operations"):
        antdt_dd.decide(request(global_batch=MAX_GLOBAL_BATCH))
    # bounded per device, the same global batch is solved
    ok = antdt_dd.decide(request(global_batch=1 << 16, max_batch=1 << 12))
    assert ok.policy == antdt_dd.NAME


@pytest.mark.parametrize(("decide", "params", "field"), [
    (antdt_dd.decide, {"c_max": 1e9}, "params.c_max"),
    (antdt_dd.decide, {"c_min": 0}, "params.c_min"),
    (antdt_dd.decide, {"max_batch_per_group": {"fast": 2**62}}, "params.max_batch_per_group.fast"),
    (antdt_nd.decide, {"lambda": math.inf}, "params.lambda"),
    (baselines.backup_workers, {"backup": 10**12}, "params.backup"),
    (baselines.lb_bsp, {"tolerance": -1}, "params.tolerance"),
    (adaptive.decide, {"wave_fraction": 5}, "params.wave_fraction"),
    (adaptive.decide, {"pending_s": 1e300}, "params.pending_s"),
])
def test_out_of_range_parameters_are_invalid(decide: Any, params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as ei:
        decide(request(params=params))
    assert ei.value.message.startswith(f"{field}:"), ei.value.message


def test_unusable_parameters_still_mean_the_default() -> None:
    assert antdt_nd.decide(request(params={"lambda": "high"})) == antdt_nd.decide(request())


def test_decision_limits_from_the_environment() -> None:
    from pacer.policy import DecisionLimits

    assert DecisionLimits.from_env({}) == DecisionLimits()
    got = DecisionLimits.from_env({"PACER_POLICY_DECIDE_TIMEOUT_S": "2.5", "PACER_POLICY_MEMORY_MB": "0",
                                   "PACER_POLICY_WORKERS": "3"})
    assert (got.timeout_s, got.memory_mb, got.workers) == (2.5, 0, 3)
    for name, bad in (("PACER_POLICY_DECIDE_TIMEOUT_S", "0"), ("PACER_POLICY_WORKERS", "-1"),
                      ("PACER_POLICY_MEMORY_MB", "lots")):
        with pytest.raises(ValueError, match=name):
            DecisionLimits.from_env({name: bad})


# ------------------------------------------------------------------ finding 8: error replies fit
def test_an_error_echoing_a_huge_input_is_cut_to_fit() -> None:
    huge = "\x00" * 2_500_000
    exc = ValidationError(f"job: {huge!r} is not a valid id")  # the repr: 10 MB
    data = encode_error(exc)
    assert len(data) < 10_000
    with pytest.raises(ValidationError) as ei:
        decode_reply(DatasetStatus, data)
    assert ei.value.message.startswith("job: '\\x00") and "more characters cut" in ei.value.message
    assert len(encode_error(PacerError("é" * 10_000), max_bytes=600)) <= 600  # multi-byte characters too
    short = ValidationError("batch_size: must be > 0, got 0")
    with pytest.raises(ValidationError) as ei:
        decode_reply(DatasetStatus, encode_error(short))
    assert ei.value.message == short.message  # a message that fits is sent whole


def test_the_memory_estimate_follows_the_jobs_schema() -> None:
    """A schema with fewer, narrower columns than Criteo's takes less memory per sample (issue 23)."""
    from pacer.contracts.jobs import ModelConfig, ModelName
    from pacer_services.controller.policies.limits import input_widths, memory_cap, sample_bytes

    model = ModelConfig(ModelName.XDEEPFM)
    small = {"label": "y", "dense": ["a"], "categorical": [{"name": "u", "embed_dim": 4}, "v"]}
    assert input_widths(model, None) == (13, 26, 26 * model.embed_dim)
    assert input_widths(model, small) == (1, 2, 4 + model.embed_dim)
    assert sample_bytes(model, {}) == sample_bytes(model)  # no schema: Criteo's
    assert sample_bytes(model, small) < sample_bytes(model) / 10
    assert memory_cap(4096, model, small) > memory_cap(4096, model)
