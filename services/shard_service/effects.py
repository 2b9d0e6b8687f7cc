"""IO of the shard service: the durable shard log, snapshots and checkpoints.

* The log of job J is the subject ``pacer.shardlog.J`` of the PACER_SHARDLOG
  stream.  One message holds a group-committed batch of records (msgpack
  list of records).  Every append carries ``Nats-Expected-Last-Subject-Sequence``:
  if anyone else appended to the job's log since we last read it, JetStream
  refuses the write, so two service instances can never both believe they
  own a job (a fencing token, like torch elastic's).
* Snapshots (whole job) and checkpoints (one dataset, under an id) live in a
  JetStream object store: they can exceed the max message size.  A snapshot
  records the log sequence it covers; replay starts after it, and the log
  before it is purged to bound disk and restart time.
* Encoding and decoding snapshots and checkpoints, and rebuilding a job
  from its snapshot, run in a thread: they grow with the job's shards and
  must not hold the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    Header,
    ObjectStoreConfig,
    StorageType,
)
from nats.js.object_store import ObjectStore
from pacer import subjects
from pacer.errors import Conflict, NotFound, Unavailable
from pacer_services.shard_service.core import JobShards

log = logging.getLogger("pacer.shard.effects")

REPLAY_BATCH = 1000


class Fenced(Conflict):
    """Another writer appended to this job's log: our in-memory state is stale."""

    code = "fenced"
    temporary = True


def _pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class ShardLogStore:
    """Durable storage of shard state; one per service instance."""

    def __init__(self, js: JetStreamContext, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas
        self._obs: ObjectStore | None = None

    async def open(self) -> None:
        try:
            self._obs = await self.js.object_store(subjects.SNAPSHOT_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            self._obs = await self.js.create_object_store(
                subjects.SNAPSHOT_BUCKET,
                config=ObjectStoreConfig(storage=StorageType.FILE, replicas=self.replicas,
                                         description="Pacer shard snapshots and checkpoints"),
            )

    @property
    def obs(self) -> ObjectStore:
        assert self._obs is not None, "ShardLogStore.open() first"
        return self._obs

    # ------------------------------------------------------------ log
    async def jobs(self) -> list[str]:
        """Every job that has a shard log."""
        info = await self.js.stream_info(subjects.SHARD_LOG_STREAM, subjects_filter=subjects.SHARD_LOG_SUBJECTS)
        return sorted(subjects.job_of_shard_log(s) for s in (info.state.subjects or {}))

    async def append(self, job: str, records: list[list[Any]], expected_last_seq: int, timeout: float = 5.0) -> int:
        """Append one batch; returns its stream sequence.  Raises Fenced or Unavailable."""
        try:
            ack = await self.js.publish(
                subjects.shard_log(job),
                _pack(records),
                timeout=timeout,
                headers={Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(expected_last_seq)},
            )
        except nats.js.errors.APIError as exc:
            if exc.err_code in (10071, 10164):  # wrong last sequence (10164: nats-server 2.12+, e.g. a cluster)
                raise Fenced(f"shard log of job {job!r} was appended to by another writer") from exc
            raise Unavailable(f"shard log append failed: {exc}") from exc
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
                nats.js.errors.NoStreamResponseError) as exc:
            raise Unavailable(f"shard log append failed: {type(exc).__name__}") from exc
        return int(ack.seq)

    async def last_seq(self, job: str) -> int:
        try:
            msg = await self.js.get_last_msg(subjects.SHARD_LOG_STREAM, subjects.shard_log(job))
        except nats.js.errors.NotFoundError:
            return 0
        return int(msg.seq or 0)

    async def replay(self, job: str, state: JobShards, start_seq: int) -> tuple[int, int]:
        """Apply every record after ``start_seq``; returns (last seq, records applied)."""
        last = await self.last_seq(job)
        if last <= start_seq:
            return start_seq, 0
        sub = await self.js.pull_subscribe(
            subjects.shard_log(job),
            stream=subjects.SHARD_LOG_STREAM,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=start_seq + 1,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=30.0,
                filter_subject=subjects.shard_log(job),
            ),
        )
        applied, seq = 0, start_seq
        try:
            while seq < last:
                msgs = await sub.fetch(REPLAY_BATCH, timeout=5.0)
                for m in msgs:
                    seq = m.metadata.sequence.stream
                    for rec in _unpack(m.data):
                        if rec[0] == "restore":
                            state.apply(rec, checkpoint=await self.get_checkpoint(job, rec[1], rec[2]))
                        else:
                            state.apply(rec)
                        applied += 1
        finally:
            await sub.unsubscribe()
        return seq, applied

    async def load(self, job: str) -> tuple[JobShards, int, int]:
        """Newest snapshot + log tail -> (state, last seq, records replayed)."""
        snap = await self.get_snapshot(job)
        if snap is None:
            state, start = JobShards(job), 0
        else:
            # ~7 us per shard (seconds for a large job): in a thread, so the event loop keeps serving the
            # other jobs and renewing leases meanwhile (the state is nobody else's until load returns).
            state, start = await asyncio.to_thread(JobShards.from_snapshot, snap["state"]), int(snap["seq"])
        seq, applied = await self.replay(job, state, start)
        state.settle()
        return state, seq, applied

    # ------------------------------------------------------------ snapshots
    async def put_snapshot(self, job: str, state: dict[str, Any], seq: int) -> None:
        """Store a snapshot covering the log up to ``seq``, then purge the log before it."""
        await self.obs.put(f"snap.{job}", await asyncio.to_thread(_pack, {"seq": seq, "state": state}))
        # Keep the message at `seq` itself so the job's subject never empties.
        await self.js.purge_stream(subjects.SHARD_LOG_STREAM, subject=subjects.shard_log(job), seq=seq)

    async def get_snapshot(self, job: str) -> dict[str, Any] | None:
        try:
            res = await self.obs.get(f"snap.{job}")
        except nats.js.errors.ObjectNotFoundError:
            return None
        data: dict[str, Any] = await asyncio.to_thread(_unpack, res.data or b"")
        return data

    async def put_checkpoint(self, job: str, dataset: str, ckpt: str, snap: dict[str, Any]) -> None:
        await self.obs.put(f"ckpt.{job}.{dataset}.{ckpt}", await asyncio.to_thread(_pack, snap))

    async def get_checkpoint(self, job: str, dataset: str, ckpt: str) -> dict[str, Any]:
        try:
            res = await self.obs.get(f"ckpt.{job}.{dataset}.{ckpt}")
        except nats.js.errors.ObjectNotFoundError:
            raise NotFound(f"no checkpoint {ckpt!r} of dataset {dataset!r} in job {job!r}") from None
        data: dict[str, Any] = await asyncio.to_thread(_unpack, res.data or b"")
        return data


async def retry_forever(what: str, fn: Any, *args: Any, first: float = 0.1, cap: float = 5.0) -> Any:
    """Call ``fn(*args)`` until it succeeds (used to rebuild state while the bus is down)."""
    delay = first
    while True:
        try:
            return await fn(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)
