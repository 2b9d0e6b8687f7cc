"""The shard service's decision of what to append from a followed stream (follow.decide), pure."""

from __future__ import annotations

from pacer.contracts.shards import DatasetMode, DatasetSpec
from pacer_services.shard_service.follow import Follow, decide

SPEC = DatasetSpec(job="j", dataset="d", records=0, batch_size=5, batches_per_shard=2, mode=DatasetMode.STREAMING,
                   stream="S", max_wait_s=2.0, idle_close_s=10.0)


def test_full_shards_at_once_a_partial_one_after_max_wait() -> None:
    f = Follow()
    assert decide(f, 0, 0, SPEC, 0.0) == (0, False)
    assert decide(f, 23, 0, SPEC, 1.0) == (20, False)  # two full shards of 10; 3 wait
    assert decide(f, 23, 20, SPEC, 2.5) == (0, False)  # the 3 were first seen at 1.0: not 2 s yet
    assert decide(f, 25, 20, SPEC, 3.0) == (5, False)  # waited since 1.0: all 5 go (a partial shard)
    assert f.waiting_since is None
    assert decide(f, 25, 25, SPEC, 4.0) == (0, False)


def test_closes_only_when_everything_is_appended_and_the_stream_idles() -> None:
    f = Follow()
    assert decide(f, 3, 0, SPEC, 0.0) == (0, False)
    assert decide(f, 3, 0, SPEC, 11.0) == (3, False)  # idle, but 3 samples wait: appended, not closed
    assert decide(f, 3, 3, SPEC, 11.5) == (0, True)  # nothing new since 0.0
    f = Follow()
    assert decide(f, 0, 0, SPEC, 0.0) == (0, False)
    assert decide(f, 1, 0, SPEC, 9.0) == (0, False)  # a new sample restarts the idle clock
    assert decide(f, 1, 0, SPEC, 11.0) == (1, False)
    assert decide(f, 1, 1, SPEC, 18.0) == (0, False) and decide(f, 1, 1, SPEC, 19.0) == (0, True)


def test_never_closes_an_online_job_and_caps_one_append() -> None:
    online = DatasetSpec(job="j", dataset="d", records=0, batch_size=5, batches_per_shard=2,
                         mode=DatasetMode.STREAMING, stream="S")
    f = Follow()
    assert decide(f, 0, 0, online, 0.0) == (0, False)
    assert decide(f, 0, 0, online, 1e6) == (0, False)
    # 1000 new samples, at most 300 records per append: whole shards, the rest next round.
    assert decide(f, 1000, 0, online, 1e6 + 1, max_records=300) == (300, False)
    assert decide(f, 1000, 300, online, 1e6 + 2, max_records=300) == (300, False)
    # A stream whose tail the dataset already knows (deleted or purged): nothing to append.
    assert decide(f, 10, 20, online, 1e6 + 3) == (0, False)
