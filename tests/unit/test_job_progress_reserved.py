"""The job's record shows how many records were served again because their gradients were discarded.

The job service copies each shard progress event of the job's training
dataset into ``JobRecord.progress`` (``core.progress_of``); records from
before the count existed still decode.
"""

from __future__ import annotations

import msgpack
from pacer.codec import decode, encode
from pacer.contracts.jobs import JobProgress
from pacer.contracts.shards import DatasetMode, DatasetStatus, NodeShardStats
from pacer_services.job_service.core import progress_of


def test_the_job_record_gets_the_records_served_again() -> None:
    st = DatasetStatus(job="j", dataset="train", mode=DatasetMode.FINITE, epoch=0, epochs=1, todo=2, doing=1,
                       done=5, failed=0, records_total=800, records_done=450, records_duplicated=30,
                       finished=False, closed=True,
                       nodes=[NodeShardStats("worker-2", doing=1, records=300, shards_done=2, records_discarded=120)],
                       records_reserved=120)
    p = progress_of(st)
    assert (p.records_reserved, p.records_duplicated, p.records_done, p.records_total) == (120, 30, 450, 800)


def test_a_job_progress_without_the_count_still_decodes() -> None:
    wire = msgpack.unpackb(encode(JobProgress(records_done=5, records_reserved=3)), raw=False)
    del wire["records_reserved"]
    old = decode(JobProgress, msgpack.packb(wire))
    assert old.records_reserved == 0 and old.records_done == 5
