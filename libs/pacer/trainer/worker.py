"""A training worker: ``python -m pacer.trainer.worker --config JSON``.

Between-graph PS training in ``tf.compat.v1`` graph mode (docs/design.md, measured
facts): each worker builds the graph under ``replica_device_setter``, runs a
``Session`` on its own ``tf.distribute.Server`` with ``device_filters`` so it
depends only on the PS tasks and itself, and reads its data only through the
shard client: records [start, end) of the job's dataset, read in place
(Parquet, CSV, TFRecord or a record file; pacer.data.sources) as raw columns
that the graph turns into features (pacer.models.features), so that the
SavedModel the chief exports does exactly what training did.

Modes
-----
* ``asp``: every worker updates the PS on its own.
* ``bsp``: ``SyncReplicasOptimizer``; the chief's queue runner aggregates the
  first ``n - b`` gradients of each step (``b`` backup workers, whose late
  gradients are dropped as stale).  The aggregation count is a PS variable so
  that BACKUP_WORKERS can change it while the job runs.  A worker whose
  gradient was dropped reports the batch's records to the shard service as
  discarded, which serves them again (see ``Trainer.push``): a late worker's
  records are trained by the others instead of being lost.

Global batch (AntDT §V-C): with per-worker batch sizes B_i and gradient accumulation C_i
(AntDT-DD, Eq. 4), B = sum_i B_i * C_i samples per step.  The accumulator
averages ``n - b`` pushes, so worker i scales each micro-batch's mean loss
by ``(n - b) * B_i / B`` and pushes the sum of its C_i micro-batch
gradients; with ``b = 0`` the aggregated update is exactly the mean
gradient over the B samples of the step (see ``Trainer.loss_scale_for``).

Synchronized global actions arrive through the agent's shared-memory IPC: the
worker calls ``check(iteration)`` once per step (iteration = global step in
BSP, local step in ASP) and applies what it returns in that very iteration.

Exit codes: 0 finished; 75 KILL_RESTART requested (relaunch me); 1 error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pacer.data.feed import DataRef, ShardReader, rows_of, seed_of
from pacer.data.sources import SourceError
from pacer.extras import require_or_exit
from pacer.trainer.cluster import ClusterDesc
from pacer.trainer.straggler import StragglerSpec

log = logging.getLogger("pacer.trainer.worker")

EXIT_RESTART = 75


@dataclass
class WorkerConfig:
    job: str
    node: str
    index: int  # worker slot in the ClusterSpec; 0 is the chief
    cluster: str  # ClusterDesc JSON
    data: str  # the dataset: a DataRef JSON (pacer.data.feed), or a bare record file path
    dataset: str = "train"
    nats_url: str = "nats://127.0.0.1:4222"
    model: str = "wide_deep"
    model_args: dict[str, Any] = field(default_factory=dict)
    mode: str = "asp"  # asp | bsp
    num_workers: int = 1  # n: workers taking part in a BSP step
    backup_workers: int = 0  # b
    batch_size: int = 256  # B_i of this worker
    global_batch: int = 0  # B (BSP); 0 = batch_size * num_workers
    accumulation: int = 1  # C_i
    learning_rate: float = 0.05
    ipc: str = ""  # agent shared-memory file; "" = no agent
    straggler: str = ""  # StragglerSpec JSON
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # steps between checkpoints (chief); 0 = only at the end
    flash: bool = True  # flash checkpoints (shared memory, persisted async); False = tf Saver
    restore: bool = False  # start from the newest checkpoint in checkpoint_dir
    eval_data: str = ""  # held-out dataset (URI, read like ``data``): the chief reports AUC at the end
    export_dir: str = ""  # the chief writes SavedModels here (a new subdirectory each time); "" = none
    export_every_s: float = 0.0  # between exports while training; 0 = at the end only
    result: str = ""  # where the chief writes its result JSON
    max_steps: int = 0  # stop after this many local steps (0 = until the data ends)
    prefetch: int = 2
    progress_every: int = 10  # steps between progress reports to the shard service
    memory_fed: bool = False  # benchmark: read records directly, no shard service
    memory_fed_records: int = 0
    intra_threads: int = 1
    inter_threads: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def data_ref(self) -> DataRef:
        """The dataset as a :class:`DataRef` (a bare path: one of Pacer's record files)."""
        if self.data.lstrip().startswith("{"):
            return DataRef.from_json(self.data)
        return DataRef(self.data, "record", seed=seed_of(self.job))


Batch = dict[str, np.ndarray]  # one batch of raw columns, as the source returned them
READ_AHEAD_TRIES = 4  # batches per shard that ask for the next shard early (ShardFeed._read_ahead)


class ShardFeed:
    """Batches of records from the shards this worker is granted.

    A batch never spans two shards (the last batch of a shard may be short):
    asking for the next shard before the step that finishes the current one
    has run would hold that shard unreported, and if it were the last one
    the dataset could never finish.  Progress and completion are reported
    after the step that consumed the records (at-least-once), and so are the
    records of a step whose gradient was discarded, before the shard is done.

    A shard is read in the dataset's seeded order (:func:`pacer.data.feed.read_rows`):
    the service counts a holder's progress, resumes a lost shard and re-serves a
    discarded range by position from the shard's offset, so position p must be
    the same record for every reader; that order maps every aligned block of
    records onto itself, so any split of a range keeps each record in exactly
    one part.  The order of the shards is shuffled per epoch by the service
    (``DatasetSpec.shuffle``).  A shard is read ahead in chunks by a background
    thread (:class:`~pacer.data.feed.ShardReader`), so I/O overlaps the steps.

    Near the end of the data the service may give the last part of the shard
    being read to an idle worker (work stealing): ``client.end_of`` then
    returns an earlier end, checked before every batch.  No batch crosses it;
    the batch that reaches it reports the shard done.  A worker already past
    it (the news came after it read on) reports the shard done at once, with
    how far it read (those records are trained twice, and counted so), once
    the steps that read them ran.
    """

    def __init__(self, client: Any, source: Any, columns: Sequence[str] | None, seed: int | None) -> None:
        self.client = client
        self.source = source
        self.columns = columns
        self.seed = seed
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pacer-read")
        self._cur: Any = None  # the shard being read
        self._arr: ShardReader | None = None
        self._len = 0  # records of the current shard to read (less than the shard's after a cut)
        self._pos = 0
        # (shard, first position, one past the last, shard done) of each batch since the last commit
        self.pending: list[tuple[Any, int, int, bool]] = []
        self._taken = 0  # records in the batches since the last commit
        self.read_errors = 0  # shards reported failed because they could not be read
        self._next: tuple[Any, ShardReader] | None = None  # the next shard, taken and being read ahead
        self._tries_left = READ_AHEAD_TRIES

    def batch(self, size: int, wait: bool = True) -> Batch | None:
        """The next batch; None when the dataset is finished (or, with ``wait=False``,
        when no shard can be had right now)."""
        self._check_cut()
        if self._arr is None or self._pos >= self._len:
            if self._next is not None:
                (shard, reader), self._next = self._next, None
                self.client.report_soon()  # the last shard's done, as next() would have sent it
            else:
                shard = self.client.next(wait)  # reports what earlier steps finished
                if shard is None:
                    return None
                reader = ShardReader(self._pool, self.source, shard.start, shard.end, self.columns, self.seed)
            self._cur, self._pos, self._arr = shard, 0, reader
            self._len = len(reader)
            self._tries_left = READ_AHEAD_TRIES
        elif self._next is None and self._pos >= self._len // 2 and self._tries_left:
            self._read_ahead()
        n = min(size, self._len - self._pos)
        try:
            take = self._arr.get(self._pos, n)
        except SourceError as exc:
            return self._unreadable(exc, size, wait)
        first = self._cur.start - self._cur.offset + self._pos
        self._pos += n
        self._taken += n
        self.pending.append((self._cur, first, first + n, self._pos >= self._len))
        return take

    def _read_ahead(self) -> None:
        """Half-way through a shard, take the next one if the client has it at hand (never wait: holding
        this shard unreported while blocked on another could stall the end of the dataset) and start
        reading it, so that its first batch is not read on the training path."""
        shard = self.client.next(False)
        if shard is None:
            self._tries_left -= 1  # none at hand: try a few more times in this shard, then leave it
            return
        self._next = (shard, ShardReader(self._pool, self.source, shard.start, shard.end, self.columns, self.seed))

    def close(self) -> None:
        """Put a shard taken ahead and not started back, so the client hands it back to the service."""
        if self._next is not None:
            shard, reader = self._next
            reader.cancel()
            self.client.put_back(shard)
            self._next = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _unreadable(self, exc: Exception, size: int, wait: bool) -> Batch | None:
        """A shard that cannot be read (a corrupt line, an object gone, access revoked): reported failed, so
        the service serves it again and parks it after repeated failures (the job then fails, naming it);
        this worker goes on with the next shard.  The reason is logged, never the data."""
        cur = self._cur
        log.error("shard %s [%d, %d) cannot be read: %s", cur.shard, cur.start, cur.end, exc)
        self.read_errors += 1
        self.pending = [p for p in self.pending if p[0] is not cur]
        self.client.failed(cur)
        if self._arr is not None:
            self._arr.cancel()
        self._arr, self._len, self._pos = None, 0, 0
        return self.batch(size, wait)

    def _check_cut(self) -> None:
        """Apply a cut of the current shard (``client.end_of``, work stealing) before the next batch."""
        cur, arr = self._cur, self._arr
        if cur is None or arr is None or self._pos >= self._len:
            return
        limit = self.client.end_of(cur) - cur.start
        if limit >= self._len:
            return
        if self._pos < limit:
            self._len = limit  # the batch that reaches the new end reports the shard done
            return
        # At or past the new end already.  A batch of it not yet committed reports the shard done after
        # its step; else every step that read it ran, so report it done now.
        for i in range(len(self.pending) - 1, -1, -1):
            if self.pending[i][0] is cur:
                shard, first, end, _ = self.pending[i]
                self.pending[i] = (shard, first, end, True)
                break
        else:
            self._done(cur, cur.start - cur.offset + self._pos)
        arr.cancel()
        self._arr = None

    def _done(self, shard: Any, end: int) -> None:
        """Report ``shard`` done; read up to ``end`` (from its offset), past its new end if it was cut."""
        if end > self.client.end_of(shard) - shard.offset:
            self.client.progress(shard, end)  # kept beside the done: counted as trained twice
        self.client.done(shard)

    def commit(self, report_progress: bool, kept: bool = True) -> None:
        """The step ran: report what it consumed; ``kept=False``: its gradient was discarded,
        so the service serves those records again (reported before the shard is done)."""
        for shard, first, end, done in self.pending:
            if not kept:
                self.client.discarded(shard, first, end)
            if done:
                self._done(shard, end)
            elif report_progress:
                self.client.progress(shard, end)
        self.pending.clear()
        if self._taken:
            self.client.trained(self._taken)
            self._taken = 0


class MemoryFeed:
    """The same batches straight from the source, no shard service (benchmark baseline)."""

    def __init__(self, source: Any, columns: Sequence[str] | None, limit: int) -> None:
        self.source = source
        self.columns = columns
        self.limit = min(limit or source.rows, source.rows)
        self.pos = 0

    def batch(self, size: int, wait: bool = True) -> Batch | None:
        if self.pos >= self.limit:
            return None
        cols = dict(self.source.read(self.pos, min(self.pos + size, self.limit), self.columns))
        self.pos += rows_of(cols)
        return cols

    def commit(self, report_progress: bool, kept: bool = True) -> None:
        pass


class Trainer:
    """Builds the graph and runs the training loop of one worker."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.cluster = ClusterDesc.from_json(cfg.cluster)
        self.is_chief = cfg.index == 0
        self.n = max(1, cfg.num_workers)
        self.global_batch = cfg.global_batch or cfg.batch_size * self.n
        self.batch_size = cfg.batch_size
        self.accumulation = max(1, cfg.accumulation)
        self.lr = cfg.learning_rate
        # The one straggler generator (shared with the simulator), seeded by this node's name.
        self.straggler = StragglerSpec.from_json(cfg.straggler).on(cfg.node)
        self.applied: list[dict[str, Any]] = []  # actions applied: {seq, kind, iteration}
        self._export_version = 0  # the last export's directory name (_export_version)
        self.checkpoint_on_exit = False  # set by a KILL_RESTART {"checkpoint": true} (migration)
        self.step_t0 = 0.0  # perf_counter at the start of the current step (straggler delay included)
        self.own_s = 0.0  # BSP: the current step's time up to the barrier
        self.kept = True  # BSP: whether the last step's gradient was kept (see ``push``)

    # ------------------------------------------------------------ graph
    def build(self, kinds: dict[str, str]) -> None:
        """The graph, for a dataset whose columns are ``kinds`` (name -> kind, as the source tells)."""
        import tensorflow as tf

        from pacer.models.common import ModelSpec
        from pacer.models.features import raw_inputs
        from pacer.models.registry import build

        tf.compat.v1.disable_eager_execution()
        cfg = self.cfg
        self.tf = tf
        cluster = tf.train.ClusterSpec(self.cluster.as_tf())
        config = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=cfg.intra_threads,
            inter_op_parallelism_threads=cfg.inter_threads,
            device_filters=["/job:ps", f"/job:worker/task:{cfg.index}"],
        )
        self.server = tf.distribute.Server(cluster, job_name="worker", task_index=cfg.index, config=config)
        self.graph = tf.Graph()
        self.spec = ModelSpec(name=cfg.model, **cfg.model_args)
        self.kinds = dict(kinds)
        self.schema = cfg.data_ref().feature_schema().with_defaults(self.spec.hash_buckets, self.spec.embed_dim)
        problems = self.schema.check(self.kinds)
        if problems:
            raise ValueError("the dataset does not fit the schema: " + "; ".join(problems))
        self.columns = list(self.schema.columns())
        with self.graph.as_default(), tf.compat.v1.device(
            tf.compat.v1.train.replica_device_setter(
                worker_device=f"/job:worker/task:{cfg.index}", cluster=cluster)
        ):
            self.global_step = tf.compat.v1.train.get_or_create_global_step()
            self.raw = raw_inputs(self.schema, self.kinds)
            self.loss_scale = tf.compat.v1.placeholder_with_default(tf.constant(1.0), [], name="loss_scale")
            self.lr_ph = tf.compat.v1.placeholder_with_default(tf.constant(cfg.learning_rate), [], name="lr")
            self.model = build(self.spec, self.schema, self.raw.tensors,
                               num_ps_partitions=len(self.cluster.ps), loss_scale=self.loss_scale)
            opt = _optimizer(tf, self.spec.optimizer, self.lr_ph)
            self.sync = None
            if cfg.mode == "bsp":
                # The aggregation count lives on the PS: BACKUP_WORKERS changes it live.
                self.agg_var = tf.compat.v1.get_variable(
                    "pacer/replicas_to_aggregate", initializer=tf.constant(self.n - cfg.backup_workers),
                    trainable=False)
                self.agg_ph = tf.compat.v1.placeholder(tf.int32, [])
                self.agg_assign = self.agg_var.assign(self.agg_ph)
                sync = tf.compat.v1.train.SyncReplicasOptimizer(
                    opt, replicas_to_aggregate=self.n - cfg.backup_workers, total_num_replicas=self.n)
                sync._replicas_to_aggregate = self.agg_var.read_value()
                self.sync, opt = sync, sync
            grads_and_vars = [(g, v) for g, v in opt.compute_gradients(self.model.train_loss) if g is not None]
            self.grads = [g for g, _ in grads_and_vars]
            self.vars = [v for _, v in grads_and_vars]
            # Gradient accumulation feeds summed gradients back in; build that path only if asked.
            self.fed: list[Any] = []
            if self.accumulation > 1:
                fed_pairs = []
                for g, v in grads_and_vars:
                    if isinstance(g, tf.IndexedSlices):
                        vals = tf.compat.v1.placeholder(g.values.dtype, [None, *g.values.shape[1:]])
                        idx = tf.compat.v1.placeholder(g.indices.dtype, [None])
                        self.fed.append((vals, idx))
                        fed_pairs.append((tf.IndexedSlices(vals, idx, g.dense_shape), v))
                    else:
                        ph = tf.compat.v1.placeholder(g.dtype, g.shape)
                        self.fed.append(ph)
                        fed_pairs.append((ph, v))
                self.train_op = opt.apply_gradients(fed_pairs, global_step=self.global_step)
            else:
                self.train_op = opt.apply_gradients(grads_and_vars, global_step=self.global_step)
            if self.sync is not None:
                with tf.compat.v1.device(self.global_step.device):
                    self.init_tokens = self.sync._sync_token_queue.enqueue_many(
                        (tf.fill([self.n], self.global_step),))
                self.queue_runner = self.sync.get_chief_queue_runner()
                # Split SyncReplicas' train_op (assign(local_step, dequeue) with a control
                # dependency on the accumulator pushes) into the push and the barrier, so that
                # this worker's BPT is its own time: AntDT's straggler signal compares workers'
                # T_i, and every BSP worker waits at the barrier for the slowest one.
                assign = self.train_op.op if hasattr(self.train_op, "op") else self.train_op
                dequeue = assign.inputs[1].op
                self.push_op = tf.group(*dequeue.control_inputs)  # every accumulator's push
                with tf.compat.v1.device(dequeue.device):
                    token = self.sync._sync_token_queue.dequeue()
                self.barrier_op = self.sync._local_step.assign(token)
                # Was the gradient kept?  The global step read once the push is in, in the same run
                # (no extra round trip), and the local step the gradient was pushed for (``push``).
                # It waits on the accumulator pushes themselves, on the PS, not on push_op (a no-op
                # on this worker): a wait routed through the worker cost ~1 ms more per step.
                with tf.compat.v1.device(self.global_step.device), tf.control_dependencies(dequeue.control_inputs):
                    step_after_push = tf.identity(self.global_step.read_value())
                self.push_probe = [step_after_push, tf.identity(self.sync._local_step.read_value())]
            self.saver = tf.compat.v1.train.Saver(sharded=True, max_to_keep=3, allow_empty=True)
            self.flash = None
            if cfg.flash and cfg.checkpoint_dir and self.is_chief:
                from pacer.trainer.flashckpt import FlashCheckpointer
                from pacer.trainer.tfckpt import flatten_variables, prepare_snapshot

                # What Saver would save: every global variable (optimizer slots and step included).
                self.ckpt_vars = flatten_variables(tf.compat.v1.global_variables())
                prepare_snapshot(self.ckpt_vars)
                self.flash = FlashCheckpointer(f"{cfg.job}-chief", Path(cfg.checkpoint_dir) / "flash")
                self.flash_pending: list[Any] = []
            self.uninit = tf.compat.v1.report_uninitialized_variables(tf.compat.v1.global_variables())
            self.global_init = {v.op.name: v.initializer for v in tf.compat.v1.global_variables()}
            # Vocabulary tables are local to each worker (not PS variables): every session fills its own.
            self.local_init = tf.group(tf.compat.v1.local_variables_initializer(),
                                       tf.compat.v1.tables_initializer())

    # ------------------------------------------------------------ session
    def open_session(self, timeout_s: float = 120.0) -> None:
        tf = self.tf
        config = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=self.cfg.intra_threads,
            inter_op_parallelism_threads=self.cfg.inter_threads,
            device_filters=["/job:ps", f"/job:worker/task:{self.cfg.index}"],
        )
        self.sess = tf.compat.v1.Session(self.server.target, graph=self.graph, config=config)
        deadline = time.monotonic() + timeout_s
        restored = False
        self.restored_from = ""
        self.restored_id = ""
        missing_at_start = [m.decode() for m in self.sess.run(self.uninit)] if self.is_chief else []
        every = bool(missing_at_start) and len(missing_at_start) == len(self.global_init)
        # A PS came back empty (the executor relaunched this chief to restore, or some variables are
        # gone), or a migration's new PS set is empty.  All missing without a restore: a new job.
        lost = bool(missing_at_start) and (self.cfg.restore or not every)
        if self.is_chief and lost and self.cfg.checkpoint_dir:
            restored = self._restore()  # the newest checkpoint; with every variable on its PS, no rollback
        # What the shard service must be rewound to (rewind_target): the model now holds nothing
        # trained after it, so those records must be trained again, never skipped.
        self.rewind_to = rewind_target(self.is_chief, lost, bool(missing_at_start),
                                       self.restored_id if restored else "")
        self.fresh = self.is_chief and every and not lost
        while True:
            missing = [m.decode() for m in self.sess.run(self.uninit)]
            if not missing:
                break
            if self.is_chief and not restored:
                # Initialise only what is missing: a restarted chief must not wipe the PS
                # (MonitoredTrainingSession would; docs/design.md, measured facts).
                self.sess.run([self.global_init[m] for m in missing if m in self.global_init])
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"variables never initialised: {missing[:5]}")
            time.sleep(0.2)
        self.sess.run(self.local_init)
        if self.sync is not None:
            self.sess.run(self.sync.local_step_init_op)
            if self.is_chief:
                self.sess.run(self.sync.chief_init_op)
                self.sess.run(self.init_tokens)
                self.coord = tf.train.Coordinator()
                self.qr_threads = self.queue_runner.create_threads(self.sess, coord=self.coord, daemon=True, start=True)

    def _restore(self) -> bool:
        """The newest checkpoint: flash (shared memory, else its disk copy), else Saver."""
        meta_file = Path(self.cfg.checkpoint_dir, "shard_checkpoint")
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        self.restored_id = str(meta.get("id", ""))  # the shard checkpoint saved with this model checkpoint
        if meta.get("format") == "flash" and self.flash is not None:
            from pacer.trainer.tfckpt import arrays_to_variables, repartition

            got = self.flash.restore(step=int(meta["step"]))
            arrays_to_variables(self.sess, self.ckpt_vars, repartition(got.arrays, self.ckpt_vars))
            self.restored_from = f"flash:{got.source}"
            log.info("restored step %s from flash (%s)", got.step, got.source)
            return True
        path = self.tf.train.latest_checkpoint(self.cfg.checkpoint_dir)
        if path:
            self.saver.restore(self.sess, path)
            self.restored_from = "saver"
            log.info("restored %s", path)
            return True
        return False

    # ------------------------------------------------------------ steps
    def loss_scale_for(self, batch: int, zero: bool = False) -> float:
        """Weight of one micro-batch's mean loss.

        BSP (AntDT §V-C, and Eq. 4 for accumulation): B = sum_i B_i * C_i samples
        per step; worker i pushes the sum of its C_i micro-batch gradients, each
        scaled by (n - b) * B_i / B, and the accumulator averages n - b pushes,
        so worker i weighs B_i * C_i / B: the update is the mean over B samples.
        ASP: each push is the mean over the worker's C_i micro-batches.
        """
        if zero:
            return 0.0
        if self.sync is None:
            return 1.0 / self.accumulation
        agg = self.n - self.cfg.backup_workers
        return agg * batch / self.global_batch

    def feed(self, batch: Batch, zero: bool = False) -> dict[Any, Any]:
        """The feed of one batch of raw columns, with its loss weight and the learning rate."""
        feed: dict[Any, Any] = self.raw.feed(batch)
        feed[self.loss_scale] = self.loss_scale_for(rows_of(batch), zero)
        feed[self.lr_ph] = self.lr
        return feed

    def step(self, feed_batch: Batch, timeout_ms: int = 0, zero: bool = False) -> tuple[float, int]:
        tf = self.tf
        feed = self.feed(feed_batch, zero)
        opts = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms) if timeout_ms else None
        if self.sync is None:
            loss, _, gstep = self.sess.run([self.model.loss, self.train_op, self.global_step], feed, options=opts)
            return float(loss), int(gstep)
        loss = self.push([self.model.loss], feed, opts)[0]
        return float(loss), self.barrier(opts)

    def push(self, fetches: list[Any], feed: dict[Any, Any], opts: Any) -> list[Any]:
        """BSP: push this worker's gradient into the accumulators; sets :attr:`kept`.

        With backup workers (b > 0) each accumulator drops a gradient whose local step
        is behind its own time step: once the first n - b gradients of a step are in,
        the step is taken and every later push for it is lost (TF
        ``ConditionalAccumulator.apply_grad``).  The global step grows only after every
        accumulator took the step, so a global step past the local step, read once the
        push is in, says the step was over before the read: before this gradient
        arrived (discarded), or just after (kept, but reported discarded: those records
        are only trained again).  A worker whose step was over when it pushed (a
        straggler, or a worker that took a straggler's leftover sync token: its local
        step lags) is always caught.  Not caught: a gradient that arrives while its step
        is being taken (some accumulators took it, the global step has not moved yet);
        SyncReplicas' per-variable accumulators may then keep it for some variables and
        drop it for others, and nothing a worker can read tells.  Without backup
        workers nothing is dropped and nothing is read.  A push that fails (a timeout)
        counts as discarded.
        """
        detect = self.cfg.backup_workers > 0
        self.kept = not detect
        if not detect:
            return list(self.sess.run([*fetches, self.push_op], feed, options=opts))[:len(fetches)]
        # The probe waits on every accumulator push: fetching it runs the push (push_op is not needed).
        *out, after, local = self.sess.run([*fetches, *self.push_probe], feed, options=opts)
        self.kept = int(after) <= int(local)
        return list(out)

    def barrier(self, opts: Any = None) -> int:
        """BSP: wait for this step's token (the other workers' gradients); marks the own part's end."""
        self.own_s = time.perf_counter() - self.step_t0
        self.sess.run(self.barrier_op, options=opts)
        return int(self.sess.run(self.global_step))

    def step_accumulated(self, micro: list[Batch], timeout_ms: int = 0,
                         zero: bool = False) -> tuple[float, int]:
        """AntDT-DD: sum C_i micro-batch gradients locally, push once."""
        tf = self.tf
        sums: list[Any] = [None] * len(self.grads)
        losses = []
        for batch in micro:
            loss, grads = self.sess.run([self.model.loss, self.grads], self.feed(batch, zero))
            losses.append(loss)
            for i, g in enumerate(grads):
                if hasattr(g, "indices"):
                    prev = sums[i]
                    sums[i] = (g.values, g.indices) if prev is None else (
                        np.concatenate([prev[0], g.values]), np.concatenate([prev[1], g.indices]))
                else:
                    sums[i] = g if sums[i] is None else sums[i] + g
        feed2: dict[Any, Any] = {self.lr_ph: self.lr}
        for ph, s in zip(self.fed, sums, strict=True):
            if isinstance(ph, tuple):
                feed2[ph[0]], feed2[ph[1]] = s
            else:
                feed2[ph] = s
        opts = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms) if timeout_ms else None
        if self.sync is None:
            _, gstep = self.sess.run([self.train_op, self.global_step], feed2, options=opts)
            return float(np.mean(losses)), int(gstep)
        self.push([], feed2, opts)
        return float(np.mean(losses)), self.barrier(opts)

    def checkpoint(self, shard_admin: Any) -> str:
        """Shard state first, then the model: a restore may re-train, never skip, records.

        The step is read here, not taken from the last ``sess.run``: a fetch of
        the global step beside ``train_op`` may see it before the increment.
        """
        step = int(self.sess.run(self.global_step))
        ckpt_id = f"step-{step}"
        records_done = shard_admin(ckpt_id) if shard_admin is not None else -1
        if self.flash is not None:
            # DLRover-RM §5.2: only the copy into shared memory is on the training path.
            from pacer.trainer.tfckpt import variables_to_arrays

            arrays = variables_to_arrays(self.sess, self.ckpt_vars)
            self.flash_pending.append(self.flash.save(step, arrays, {"shard_checkpoint": ckpt_id}))
            fmt, path = "flash", str(self.flash.ckpt_dir(step))
        else:
            fmt = "saver"
            path = self.saver.save(self.sess, os.path.join(self.cfg.checkpoint_dir, "model"), global_step=step)
        Path(self.cfg.checkpoint_dir, "shard_checkpoint").write_text(
            json.dumps({"id": ckpt_id, "step": step, "model": path, "format": fmt, "records_done": records_done}))
        return ckpt_id

    def close_checkpoints(self) -> None:
        """Wait until every flash checkpoint is on disk too (a machine loss keeps them)."""
        if self.flash is not None:
            self.flash.close()

    def evaluate(self, uri: str, batch: int = 4096) -> dict[str, float]:
        """AUC and log loss on the held-out dataset ``uri`` (read like the training data)."""
        from pacer.models.metrics import auc, logloss

        ref = self.cfg.data_ref()
        probs, labels = [], []
        with ref.with_uri(uri).open() as src:
            for s in range(0, src.rows, batch):
                cols = src.read(s, min(s + batch, src.rows), self.columns)
                probs.append(self.sess.run(self.model.probs, self.raw.feed(cols)))
                labels.append(np.asarray(cols[self.schema.label], dtype=np.float32))
        p, y = np.concatenate(probs), np.concatenate(labels)
        return {"auc": float(auc(y, p)), "logloss": float(logloss(y, p)), "eval_records": len(y)}

    def export(self) -> str:
        """A SavedModel of the model now (raw columns in, probability out) in a new subdirectory of
        ``export_dir``; returns its path."""
        from pacer.models.export import export_saved_model, model_values

        step = int(self.sess.run(self.global_step))
        values = model_values(self.sess, self.graph, scope=self.spec.name)
        self._export_version = _export_version(self._export_version)
        dest = f"{self.cfg.export_dir.rstrip('/')}/{self._export_version}"
        meta = {"step": step, "job": self.cfg.job, "time": time.time()}
        if "://" not in dest or dest.startswith("file://"):
            return str(export_saved_model(dest.removeprefix("file://"), self.spec, self.schema, self.kinds, values,
                                          meta))
        # Object storage: written locally, then uploaded whole (credentials from the environment).
        import shutil
        import tempfile

        import fsspec

        tmp = tempfile.mkdtemp(prefix="pacer-export-")
        try:
            local = export_saved_model(Path(tmp, "model"), self.spec, self.schema, self.kinds, values, meta)
            fs, key = fsspec.core.url_to_fs(dest)
            fs.put(str(local), key, recursive=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    # ------------------------------------------------------------ actions
    def apply_action(self, action: Any, iteration: int) -> bool:
        """Apply an agent action; returns False when the worker must exit for a restart."""
        from pacer.contracts.agent import ActionKind

        kind = ActionKind(action.kind) if not isinstance(action.kind, ActionKind) else action.kind
        payload = action.payload or {}
        if kind is ActionKind.ADJUST_BS:
            sizes = payload.get("batch_sizes", {})
            if self.cfg.node in sizes:
                self.batch_size = int(sizes[self.cfg.node])
            accs = payload.get("accumulations", payload.get("accumulation", {}))  # policy.PolicyAction's key
            if self.cfg.node in accs and self.fed:
                self.accumulation = int(accs[self.cfg.node])
            if "global_batch" in payload:
                self.global_batch = int(payload["global_batch"])
        elif kind is ActionKind.ADJUST_LR:
            self.lr = self.lr * float(payload.get("scale", 1.0))
        elif kind is ActionKind.BACKUP_WORKERS:
            b = int(payload.get("backup", 0))
            if self.sync is not None and 0 <= b < self.n:
                self.cfg.backup_workers = b
                if self.is_chief:
                    self.sess.run(self.agg_assign, {self.agg_ph: self.n - b})
        elif kind is ActionKind.KILL_RESTART and payload.get("checkpoint"):
            # A migration (DLRover-RM §5.2): the chief checkpoints the shard state and the
            # model before it exits, and the executor restores both into the new cluster.
            self.checkpoint_on_exit = True
        self.applied.append({"seq": action.seq, "kind": kind.value, "iteration": iteration,
                             "batch_size": self.batch_size})
        return kind is not ActionKind.KILL_RESTART


def _optimizer(tf: Any, name: str, lr: Any) -> Any:
    if name == "adagrad":
        return tf.compat.v1.train.AdagradOptimizer(lr)
    if name == "adam":
        return tf.compat.v1.train.AdamOptimizer(lr)
    if name == "sgd":
        return tf.compat.v1.train.GradientDescentOptimizer(lr)
    raise ValueError(f"optimizer: unknown {name!r} (adagrad|adam|sgd)")


def _export_version(last: int) -> int:
    """The next export's directory name: milliseconds since the epoch, above ``last``.  An integer, so that
    TensorFlow Serving, given the export path as its ``model_base_path``, serves the newest on its own
    (an online job's exports never end); the step is in the export's ``pacer.json``."""
    return max(int(time.time() * 1000), last + 1)


def run(cfg: WorkerConfig) -> int:
    t_start = time.monotonic()
    ref = cfg.data_ref()
    source = ref.open(cfg.nats_url)  # metadata only (Parquet footers, an index): a missing object fails here, clearly
    trainer = Trainer(cfg)
    trainer.build({c.name: c.kind for c in source.columns})
    tf = trainer.tf
    client = None
    admin_ckpt = None
    if cfg.memory_fed:
        feed: Any = MemoryFeed(source, trainer.columns, cfg.memory_fed_records)
    else:
        from pacer.shards.client import BlockingShardClient

        # BSP steps wait for every worker anyway: a prefetched shard would only sit idle
        # while another worker has none, lengthening the tail of the epoch.
        prefetch = 1 if cfg.mode == "bsp" else cfg.prefetch
        client = BlockingShardClient(cfg.nats_url, cfg.job, cfg.dataset, cfg.node, prefetch=prefetch)
        feed = ShardFeed(client, source, trainer.columns, ref.order_seed)
        if trainer.is_chief and cfg.checkpoint_dir:
            admin_ckpt = _flushed(client, _shard_checkpointer(cfg))
    ipc = None
    if cfg.ipc:
        from pacer.agent.ipc import TrainerIPC

        ipc = TrainerIPC(cfg.ipc, create=True, role="worker")
    trainer.open_session()
    if admin_ckpt is not None:
        if trainer.rewind_to:
            done = _shard_rewinder(cfg)(trainer.rewind_to)
            log.warning("a PS lost its state: dataset rewound to shard checkpoint %r (%d records done)",
                        trainer.rewind_to, done)
        elif trainer.fresh:
            admin_ckpt(START_CHECKPOINT)  # before any step: where a PS loss without a checkpoint rewinds to
    first_step_at = None
    null_batch = dict(source.read(0, 1, trainer.columns))  # BSP's zero-weight step when this worker has no data
    exporting = trainer.is_chief and bool(cfg.export_dir)
    next_export = time.monotonic() + cfg.export_every_s if exporting and cfg.export_every_s > 0 else math.inf
    exports: list[str] = []
    local_step, gstep, samples = 0, int(trainer.sess.run(trainer.global_step)), 0
    start_gstep = gstep
    exit_code = 0
    loss = float("nan")  # a first BSP step that times out at the barrier has no loss yet
    bsp = trainer.sync is not None
    # samples_kept + samples_discarded = samples: BSP gradients dropped as stale (backup workers)
    # are reported to the shard service, which serves their records again.
    stats: dict[str, Any] = {"steps": 0, "null_steps": 0, "samples_kept": 0, "samples_discarded": 0,
                             "steps_discarded": 0}
    try:
        while True:
            iteration = gstep if bsp else local_step
            if ipc is not None:
                keep = True
                while keep and (action := ipc.check(iteration)) is not None:  # ~1 us when none is due
                    keep = trainer.apply_action(action, iteration)
                    ipc.ack(action, iteration)
                if not keep:
                    exit_code = EXIT_RESTART
                    break
            t0 = trainer.step_t0 = time.perf_counter()
            trainer.own_s = 0.0
            delay = trainer.straggler.delay_at(time.monotonic() - t_start)
            if delay:
                time.sleep(delay)
            # BSP must not block on data: the others' step waits for this worker.
            batches = [feed.batch(trainer.batch_size, wait=not bsp) for _ in range(trainer.accumulation)]
            batches = [b for b in batches if b is not None]
            if not batches:
                if not bsp or client is None or client.finished:
                    break
                # BSP: this worker has no data now but the others still do: take part in the
                # step with a zero-weight gradient, or the barrier would wait for us forever.
                try:
                    if trainer.fed:
                        trainer.step_accumulated([null_batch], 3000, zero=True)
                    else:
                        trainer.step(null_batch, 3000, zero=True)
                except tf.errors.DeadlineExceededError:
                    pass
                stats["null_steps"] += 1
                gstep = int(trainer.sess.run(trainer.global_step))
                continue
            try:
                timeout = 10_000 if bsp else 0
                if len(batches) > 1 or trainer.fed:
                    loss, gstep = trainer.step_accumulated(batches, timeout)
                else:
                    loss, gstep = trainer.step(batches[0], timeout)
            except tf.errors.DeadlineExceededError:
                # BSP: timed out at the token barrier (SyncReplicasOptimizer) after the push, whose
                # outcome ``trainer.kept`` holds, or in the push itself: counted as discarded.
                stats["barrier_timeouts"] = stats.get("barrier_timeouts", 0) + 1
                gstep = int(trainer.sess.run(trainer.global_step))
            # BPT = this worker's own time (BSP: up to the barrier), the straggler signal.
            bpt = trainer.own_s or (time.perf_counter() - t0)
            if first_step_at is None:
                first_step_at = time.monotonic() - t_start
            local_step += 1
            n = sum(rows_of(b) for b in batches)
            samples += n
            kept = trainer.kept or not bsp
            stats["samples_kept" if kept else "samples_discarded"] += n
            stats["steps_discarded"] += not kept
            feed.commit(local_step % cfg.progress_every == 0, kept)
            if ipc is not None:
                ipc.record_step(local_step, gstep if bsp else local_step, bpt, trainer.batch_size, n)
            stats["steps"] = local_step
            stats["last_loss"] = loss
            if trainer.is_chief and cfg.checkpoint_every and local_step % cfg.checkpoint_every == 0:
                trainer.checkpoint(admin_ckpt)
            if time.monotonic() >= next_export:
                exports.append(trainer.export())
                next_export = time.monotonic() + cfg.export_every_s
            if cfg.max_steps and local_step >= cfg.max_steps:
                break
        result: dict[str, Any] = {"node": cfg.node, "exit": exit_code, "local_steps": local_step,
                                  "global_step": gstep, "start_global_step": start_gstep, "samples": samples,
                                  "first_step_s": first_step_at, "seconds": time.monotonic() - t_start,
                                  "actions": trainer.applied, **stats}
        # Records of this worker's shards that the service gave to idle workers near the end (work stealing).
        result["records_stolen"] = client.records_stolen if client is not None else 0
        result["read_errors"] = getattr(feed, "read_errors", 0)  # shards that could not be read (reported failed)
        result["restored_from"] = trainer.restored_from
        result["rewound_to"] = trainer.rewind_to  # the shard checkpoint the dataset went back to ("" = none)
        if trainer.is_chief and (exit_code == 0 or trainer.checkpoint_on_exit):
            if cfg.checkpoint_dir:
                result["checkpoint"] = trainer.checkpoint(admin_ckpt)
                trainer.close_checkpoints()
        if exit_code == 0 and trainer.is_chief:
            if cfg.eval_data:
                result.update(trainer.evaluate(cfg.eval_data))
            if exporting:
                exports.append(trainer.export())
        if exports:
            result["exports"] = exports  # oldest first; the last is the model the job ends with
        if cfg.result:
            Path(cfg.result).write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
    except tf.errors.OpError as exc:
        # A PS died: the session may hang at exit (docs/design.md): leave at once.
        print(f"worker {cfg.node}: TensorFlow error {type(exc).__name__}: {exc.message[:300]}", file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        if ipc is not None:
            ipc.mark_exiting()
        if isinstance(feed, ShardFeed):
            feed.close()
        if client is not None:
            client.close(release=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # TF's server threads would keep a clean exit waiting


START_CHECKPOINT = "start"  # the shard state before the first step: a job's rewind point without a checkpoint


def rewind_target(chief: bool, ps_lost: bool, missing: bool, restored_id: str) -> str:
    """The shard checkpoint a chief rewinds the dataset to when it opens its session ("" = none).

    The model and the shard state must agree (docs/architecture.md: a restore
    may re-train records, never skip one).  When a PS lost its variables
    (``ps_lost``: the executor relaunched the chief to restore, or some but
    not all variables are missing) the model no longer holds what was trained
    since the newest checkpoint: the dataset goes back to the shard checkpoint
    saved with the model checkpoint just restored, or, with none, to the
    state before the first step (:data:`START_CHECKPOINT`).  With every
    variable on its PS, nothing was lost and nothing is rewound.
    """
    if not chief or not ps_lost or not missing:
        return ""
    return restored_id or START_CHECKPOINT


def _shard_rewinder(cfg: WorkerConfig) -> Any:
    """A blocking call that restores the dataset's shard state to a checkpoint id."""
    import asyncio

    from pacer.bus import Bus
    from pacer.shards.client import ShardAdmin

    def rewind(ckpt_id: str) -> int:
        async def go() -> int:
            from pacer.errors import NotFound

            bus = await Bus.connect(cfg.nats_url, name=f"{cfg.node}-rewind")
            try:
                admin = ShardAdmin(bus)
                try:
                    return (await admin.restore(cfg.job, cfg.dataset, ckpt_id)).records_done
                except NotFound:
                    if ckpt_id == START_CHECKPOINT:
                        raise
                    # A model checkpoint whose shard checkpoint this job does not have (a checkpoint
                    # directory left by an earlier job of the same name): all the way back, then.
                    log.error("shard checkpoint %r not found; rewinding to %r", ckpt_id, START_CHECKPOINT)
                    return (await admin.restore(cfg.job, cfg.dataset, START_CHECKPOINT)).records_done
            finally:
                await bus.close()

        return asyncio.run(go())

    return rewind


def _flushed(client: Any, checkpoint: Any) -> Any:
    """``checkpoint``, after this worker's reports reached the shard service: the shard checkpoint then
    holds every record the model has been trained on that was reported (a record not yet reported is
    trained again after a restore, never skipped)."""
    def save(ckpt_id: str) -> int:
        client.flush()
        return int(checkpoint(ckpt_id))

    return save


def _shard_checkpointer(cfg: WorkerConfig) -> Any:
    """A blocking call that checkpoints the dataset's shard state under an id."""
    import asyncio

    from pacer.bus import Bus
    from pacer.shards.client import ShardAdmin

    def save(ckpt_id: str) -> int:
        async def go() -> int:
            bus = await Bus.connect(cfg.nats_url, name=f"{cfg.node}-ckpt")
            try:
                return (await ShardAdmin(bus).checkpoint(cfg.job, cfg.dataset, ckpt_id)).records_done
            finally:
                await bus.close()

        return asyncio.run(go())

    return save


def main(argv: list[str] | None = None) -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="WorkerConfig as JSON")
    args = ap.parse_args(argv)
    require_or_exit("trainer", "a TensorFlow worker")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = WorkerConfig(**json.loads(args.config))
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
