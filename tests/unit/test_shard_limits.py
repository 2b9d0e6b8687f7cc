"""The shard core's limits (issue 21, finding 5): every request's work is bounded before it starts.

One agent's register of 1,000,000 one-record shards built them all (15 s
of the service's event loop, 280 MB).  The same core serves the service and
the simulators, so these checks hold for both.  The fold never checks them:
a log written under looser limits still replays.
"""

from __future__ import annotations

from typing import Any

import pytest
from pacer.contracts.shards import DatasetMode, DatasetSpec, LeaseRequest, ShardProgress
from pacer.errors import ValidationError
from pacer_services.shard_service import core
from pacer_services.shard_service.core import JobShards, fold

JOB = "j"


def spec(dataset: str = "d", **kw: Any) -> DatasetSpec:
    base: dict[str, Any] = dict(job=JOB, dataset=dataset, records=1000, batch_size=10, batches_per_shard=10)
    base.update(kw)
    return DatasetSpec(**base)


def test_a_million_one_record_shards_are_refused_before_any_is_built() -> None:
    js = JobShards(JOB)
    with pytest.raises(ValidationError) as ei:
        js.register(spec(records=1_000_000, batch_size=1, batches_per_shard=1))
    assert ei.value.message.startswith("records:") and "PACER_SHARD_MAX_SHARDS_PER_EPOCH" in ei.value.message
    assert js.datasets == {} and js.transitions == 0
    # the largest epoch allowed is built
    n = core.DEFAULT_LIMITS.shards_per_epoch
    assert js.register(spec(records=n, batch_size=1, batches_per_shard=1)).reply.todo == n


def test_shards_over_all_epochs_and_datasets_are_bounded_per_job() -> None:
    lim = core.ShardLimits(shards_per_epoch=100, shards_per_job=250)
    js = JobShards(JOB, lim)
    with pytest.raises(ValidationError, match=r"^epochs:.*PACER_SHARD_MAX_SHARDS_PER_JOB"):
        js.register(spec(records=10_000, epochs=3))  # 100 shards per epoch x 3 = 300
    js.register(spec(records=10_000, epochs=2))  # 100 per epoch x 2 = 200
    with pytest.raises(ValidationError, match=r"^records:.*already holds 200"):
        js.register(spec("second", records=10_000))  # 100 more would make 300
    js.register(spec("second", records=5_000))  # 50 more: 250
    assert js.shards_planned() == 250
    with pytest.raises(ValidationError, match=r"^epochs:"):
        js.register(spec("many", epochs=core.DEFAULT_LIMITS.epochs + 1))


def test_datasets_per_job_are_bounded() -> None:
    js = JobShards(JOB, core.ShardLimits(datasets_per_job=2))
    js.register(spec("a"))
    js.register(spec("b"))
    js.register(spec("a"))  # the same spec again is no new dataset
    with pytest.raises(ValidationError, match=r"^dataset:.*PACER_SHARD_MAX_DATASETS_PER_JOB"):
        js.register(spec("c"))


def test_appends_are_bounded_per_request_and_per_job() -> None:
    js = JobShards(JOB, core.ShardLimits(shards_per_epoch=10, shards_per_job=25))
    js.register(spec(records=0, mode=DatasetMode.STREAMING))
    with pytest.raises(ValidationError, match=r"^records:.*one append"):
        js.append("d", 1100, close=False)  # 11 shards of 100
    js.append("d", 1000, close=False)
    js.append("d", 1000, close=False)
    with pytest.raises(ValidationError, match=r"^records:.*PACER_SHARD_MAX_SHARDS_PER_JOB"):
        js.append("d", 600, close=False)
    assert js.status("d").todo == 20


@pytest.mark.parametrize("field", ["held", "done", "failed", "released", "progress"])
def test_a_report_with_too_many_ids_is_refused_before_any_is_looked_at(field: str) -> None:
    js = JobShards(JOB, core.ShardLimits(report_ids=5))
    js.register(spec())
    snap = js.snapshot()
    ids: list[Any] = [ShardProgress(i, 1) for i in range(6)] if field == "progress" else list(range(6))
    with pytest.raises(ValidationError, match=rf"^{field}: 6 entries"):
        js.lease(LeaseRequest(JOB, "d", "w0", want=1, **{field: ids}), 0.0)
    assert js.snapshot() == snap
    js.lease(LeaseRequest(JOB, "d", "w0", want=1, **{field: ids[:5]}), 0.0)  # at the limit: served


def test_nodes_per_dataset_are_bounded() -> None:
    js = JobShards(JOB, core.ShardLimits(nodes_per_dataset=2))
    js.register(spec())
    for node in ("w0", "w1"):
        got = js.lease(LeaseRequest(JOB, "d", node, want=1), 0.0).reply.shards
        js.lease(LeaseRequest(JOB, "d", node, done=[got[0].shard]), 0.0)  # each has consumed: known
    with pytest.raises(ValidationError, match=r"^node:.*PACER_SHARD_MAX_NODES_PER_DATASET"):
        js.lease(LeaseRequest(JOB, "d", "w2", want=1), 0.0)
    assert js.lease(LeaseRequest(JOB, "d", "w1", want=1), 0.0).reply.shards  # known nodes go on


def test_a_restore_is_bounded_by_the_job_s_other_datasets() -> None:
    big = JobShards(JOB)
    big.register(spec(records=10_000))  # 100 shards
    snap = big.checkpoint("d")
    js = JobShards(JOB, core.ShardLimits(shards_per_job=150))
    js.register(spec(records=1000))  # 10 shards
    js.register(spec("other", records=6_000))  # 60
    with pytest.raises(ValidationError, match=r"^checkpoint:"):
        js.restore("d", "c1", snap)  # 100 + 60 > 150
    js2 = JobShards(JOB, core.ShardLimits(shards_per_job=150))
    js2.register(spec(records=1000))
    assert js2.restore("d", "c1", snap).reply.todo == 100


def test_the_fold_replays_a_log_written_under_looser_limits() -> None:
    loose = JobShards(JOB, core.ShardLimits(shards_per_epoch=1000))
    records = loose.register(spec(records=1000, batch_size=1, batches_per_shard=1)).records
    again = fold(JOB, records)  # default limits of the fold's JobShards do not apply to replay
    assert again.status("d").todo == 1000
    tight = JobShards(JOB, core.ShardLimits(shards_per_epoch=10))
    for rec in records:
        tight.apply(rec)
    assert tight.status("d").todo == 1000


def test_limits_from_the_environment() -> None:
    from pacer_services.shard_service.app import limits_from_env

    assert limits_from_env({}) == core.DEFAULT_LIMITS
    got = limits_from_env({"PACER_SHARD_MAX_SHARDS_PER_EPOCH": "7", "PACER_SHARD_MAX_SHARDS_PER_JOB": " 70 ",
                           "PACER_SHARD_MAX_DATASETS_PER_JOB": "3", "PACER_SHARD_MAX_EPOCHS": "4",
                           "PACER_SHARD_MAX_NODES_PER_DATASET": "5", "PACER_SHARD_MAX_REPORT_IDS": "6"})
    assert got == core.ShardLimits(shards_per_epoch=7, shards_per_job=70, datasets_per_job=3, epochs=4,
                              nodes_per_dataset=5, report_ids=6)
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(ValueError, match="PACER_SHARD_MAX_REPORT_IDS"):
            limits_from_env({"PACER_SHARD_MAX_REPORT_IDS": bad})
