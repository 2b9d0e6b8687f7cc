"""The SDK for a user's own trainer: ``from pacer.trainer import sdk`` (docs/trainers.md).

A job whose spec has a ``trainer:`` section runs the user's command in every
worker pod (and ``ps_command`` in every PS pod) instead of Pacer's built-in
TensorFlow trainer.  Pacer hands the process everything through environment
variables; :class:`TrainerEnv` is that contract, in one place, both ways:
the executor builds the variables with :meth:`TrainerEnv.to_env` and the
user's process reads them back with :meth:`TrainerEnv.from_env`.

A worker loop::

    from pacer.trainer import sdk

    with sdk.Worker.from_env() as w:                   # env, shard client, agent IPC
        for shard in w.shards():                       # next shard; reported done when the body ends
            for lo, hi in w.batches(shard):            # record ranges of the current batch size
                w.check()                              # applies ADJUST_BS / ADJUST_LR / BACKUP_WORKERS;
                                                       # KILL_RESTART raises RestartRequested (exit 75)
                loss, kept = train_step(w.read(lo, hi), lr=w.learning_rate)
                if not kept:                           # BSP: the gradient was dropped as stale
                    w.discarded(lo, hi)                # the shard service serves these records again
                w.step_done(samples=hi - lo)           # the agent's BPT window; progress to the shards
        w.finish(loss=loss)                            # the result line the executor keeps (chief)

The SDK imports no ML framework: ``TF_CONFIG`` is plain JSON that
TensorFlow (or anything else) reads.  Actions take effect through the
attributes the loop reads (``batch_size``, ``learning_rate``,
``backup_workers``, ``accumulation``); :meth:`Worker.check` also returns the
actions it applied, for frameworks that must be told (e.g. an optimizer's
learning-rate variable).

Semantics the built-in worker has too (``pacer.trainer.worker``):

* the per-step check comes *before* the step of that iteration; an action
  committed for iteration T is applied by every worker at T;
* a shard is reported done only after the step that consumed its last
  records ran (at-least-once); a worker that exits in the middle of a shard
  keeps it leased, and its next incarnation (same node) gets it back from
  the last progress report;
* records whose gradient was discarded (BSP with backup workers drops a
  late gradient as stale) are reported with :meth:`Worker.discarded`
  before the shard is done: the shard service serves them again, to
  another worker when one can take them (at-least-once, as after a
  relaunch);
* near the end of the data the shard service may give the last part of the
  shard being read to an idle worker (work stealing): :meth:`Worker.batches`
  then ends at the new end (no batch crosses it) and :meth:`Worker.shards`
  moves on to the next shard.  A batch already past it when the news came
  was trained twice; its progress report says so, and the service counts it;
* exit codes: 0 finished, 75 (:data:`EXIT_RESTART`) relaunch me, anything
  else is a failure of the user's code.

Concurrency: a :class:`Worker` belongs to the training loop's thread (the
IPC is single-writer); the shard client runs its own event-loop thread.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from pacer.agent.ipc import ENV_PATH as AGENT_IPC
from pacer.agent.ipc import Action, TrainerIPC
from pacer.contracts.agent import ActionKind
from pacer.contracts.shards import ShardLease
from pacer.errors import ValidationError

EXIT_RESTART = 75  # the executor relaunches the node (as pacer.trainer.worker.EXIT_RESTART)

# The environment contract.  PACER_AGENT_IPC is pacer.agent.ipc.ENV_PATH.
TF_CONFIG = "TF_CONFIG"
JOB, NODE, ROLE, INDEX, GENERATION = "PACER_JOB", "PACER_NODE", "PACER_ROLE", "PACER_INDEX", "PACER_GENERATION"
NATS_URL, DATASET, DATA, EVAL_DATA = "PACER_NATS_URL", "PACER_DATASET", "PACER_DATA", "PACER_EVAL_DATA"
DATA_REF = "PACER_DATA_REF"  # the dataset's format, reader options, index dir, schema and order seed (JSON)
NUM_WORKERS, MODE, BACKUP_WORKERS = "PACER_NUM_WORKERS", "PACER_MODE", "PACER_BACKUP_WORKERS"
BATCH_SIZE, GLOBAL_BATCH, LEARNING_RATE = "PACER_BATCH_SIZE", "PACER_GLOBAL_BATCH", "PACER_LEARNING_RATE"
RESULT, CHECKPOINT_DIR, RESTORE = "PACER_RESULT", "PACER_CHECKPOINT_DIR", "PACER_RESTORE"

#: Every variable Pacer sets (a user's ``trainer.env`` may not set these, nor any other ``PACER_*``).
VARIABLES = (TF_CONFIG, JOB, NODE, ROLE, INDEX, GENERATION, NATS_URL, DATASET, DATA, DATA_REF, EVAL_DATA, NUM_WORKERS,
             MODE, BACKUP_WORKERS, BATCH_SIZE, GLOBAL_BATCH, LEARNING_RATE, AGENT_IPC, RESULT, CHECKPOINT_DIR,
             RESTORE)


class TrainerEnvError(ValidationError):
    """The process's environment lacks a variable of the contract or holds a bad value (names it)."""


class RestartRequested(SystemExit):
    """KILL_RESTART arrived: leave the loop; uncaught, the process exits with 75 and is relaunched.

    ``checkpoint`` is True when the action asks the chief to checkpoint first
    (a migration): catch this, save, and re-raise.
    """

    def __init__(self, checkpoint: bool = False) -> None:
        super().__init__(EXIT_RESTART)
        self.checkpoint = checkpoint


@dataclass(frozen=True, slots=True)
class TrainerEnv:
    """What Pacer tells one trainer process (the environment contract of docs/trainers.md)."""

    job: str
    node: str  # worker-<i> | ps-<i>
    role: str  # worker | ps
    index: int
    ps: tuple[str, ...]  # host:port of every PS
    workers: tuple[str, ...]  # host:port of every worker slot (the plan's workers are 0..num_workers-1)
    nats_url: str
    generation: int = 0  # 0 for the node's first pod, +1 per relaunch
    dataset: str = "train"  # the dataset's id in the shard service
    data: str = ""  # the dataset the shards index, read in place (a path, glob or URL)
    data_ref: str = ""  # how to read it: pacer.data.feed.DataRef JSON ("" = ``data`` is a record file)
    eval_data: str = ""  # held-out record file (the chief only; "" = none)
    num_workers: int = 1
    mode: str = "asp"  # asp | bsp
    backup_workers: int = 0
    batch_size: int = 256  # this worker's B_i at start
    global_batch: int = 0  # B = sum of B_i
    learning_rate: float = 0.05
    agent_ipc: str = ""  # the agent sidecar's IPC file ("" = no agent: actions never arrive)
    result: str = ""  # where finish() writes the result JSON ("" = stdout only)
    checkpoint_dir: str = ""  # the chief's checkpoint directory ("" = none)
    restore: bool = False  # start from the newest checkpoint in checkpoint_dir

    @property
    def is_chief(self) -> bool:
        """Worker 0 is the chief (between-graph PS training): it evaluates and checkpoints."""
        return self.role == "worker" and self.index == 0

    @property
    def address(self) -> str:
        """This process's own ``host:port`` in the cluster (a PS serves on it)."""
        return (self.ps if self.role == "ps" else self.workers)[self.index]

    @property
    def tf_config(self) -> dict[str, Any]:
        """The ``TF_CONFIG`` document (TensorFlow's cluster description)."""
        return {"cluster": {"ps": list(self.ps), "worker": list(self.workers)},
                "task": {"type": self.role, "index": self.index}}

    def to_env(self) -> dict[str, str]:
        """The variables a launcher sets for this process (empty optional values are left out)."""
        env = {
            TF_CONFIG: json.dumps(self.tf_config), JOB: self.job, NODE: self.node, ROLE: self.role,
            INDEX: str(self.index), GENERATION: str(self.generation), NATS_URL: self.nats_url,
            DATASET: self.dataset, DATA: self.data, DATA_REF: self.data_ref, EVAL_DATA: self.eval_data,
            NUM_WORKERS: str(self.num_workers), MODE: self.mode, BACKUP_WORKERS: str(self.backup_workers),
            BATCH_SIZE: str(self.batch_size), GLOBAL_BATCH: str(self.global_batch or self.batch_size * self.num_workers),
            LEARNING_RATE: repr(self.learning_rate), AGENT_IPC: self.agent_ipc, RESULT: self.result,
            CHECKPOINT_DIR: self.checkpoint_dir, RESTORE: "1" if self.restore else "0",
        }
        return {k: v for k, v in env.items() if v != ""}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainerEnv:
        """Read the contract from ``environ`` (default: this process's); raises :class:`TrainerEnvError`."""
        env = os.environ if environ is None else environ
        problems: list[str] = []

        def need(name: str) -> str:
            v = env.get(name, "")
            if not v:
                problems.append(f"{name}: not set (is this process running in a Pacer job?)")
            return v

        def num(name: str, default: str, kind: type[int] | type[float]) -> Any:
            raw = env.get(name, "") or default
            try:
                return kind(raw)
            except ValueError:
                problems.append(f"{name}: must be {'an integer' if kind is int else 'a number'}, got {raw!r}")
                return kind(default)

        ps: tuple[str, ...] = ()
        workers: tuple[str, ...] = ()
        role, index = "", 0
        raw = need(TF_CONFIG)
        if raw:
            try:
                doc = json.loads(raw)
                ps = tuple(str(a) for a in doc["cluster"].get("ps", []))
                workers = tuple(str(a) for a in doc["cluster"].get("worker", []))
                role, index = str(doc["task"]["type"]), int(doc["task"]["index"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                problems.append(f"{TF_CONFIG}: not a TF_CONFIG document ({type(exc).__name__}: {exc})")
        if role and role not in ("worker", "ps"):
            problems.append(f"{TF_CONFIG}: task.type must be worker or ps, got {role!r}")
        elif role and not 0 <= index < len(ps if role == "ps" else workers):
            problems.append(f"{TF_CONFIG}: task.index {index} is not a {role} of the cluster")
        out = cls(
            job=need(JOB), node=env.get(NODE, "") or f"{role}-{index}", role=role, index=index, ps=ps,
            workers=workers, nats_url=need(NATS_URL), generation=num(GENERATION, "0", int),
            dataset=env.get(DATASET, "") or "train", data=env.get(DATA, ""), data_ref=env.get(DATA_REF, ""),
            eval_data=env.get(EVAL_DATA, ""),
            num_workers=num(NUM_WORKERS, str(max(1, len(workers))), int), mode=env.get(MODE, "") or "asp",
            backup_workers=num(BACKUP_WORKERS, "0", int), batch_size=num(BATCH_SIZE, "256", int),
            global_batch=num(GLOBAL_BATCH, "0", int), learning_rate=num(LEARNING_RATE, "0.05", float),
            agent_ipc=env.get(AGENT_IPC, ""), result=env.get(RESULT, ""),
            checkpoint_dir=env.get(CHECKPOINT_DIR, ""), restore=env.get(RESTORE, "0") == "1",
        )
        if out.batch_size < 1:
            problems.append(f"{BATCH_SIZE}: must be > 0, got {out.batch_size}")
        if problems:
            raise TrainerEnvError("\n".join(problems))
        return out


@dataclass(slots=True)
class Worker:
    """One training worker as Pacer sees it: the env, its shards, its agent.

    Build it with :meth:`from_env` inside a Pacer pod (or from a
    :class:`TrainerEnv` in tests).  The shard client connects on first use,
    so a process that only reads ``env`` never touches the bus.
    """

    env: TrainerEnv
    batch_size: int = 0  # B_i now (ADJUST_BS changes it)
    learning_rate: float = 0.0  # now (ADJUST_LR scales it)
    global_batch: int = 0
    accumulation: int = 1  # C_i (ADJUST_BS "accumulations"): micro-batches per step, if the loop supports it
    backup_workers: int = 0  # BACKUP_WORKERS (BSP: the chief applies it to its aggregation)
    step: int = 0  # steps recorded by step_done in this incarnation
    samples: int = 0  # records those steps trained
    samples_discarded: int = 0  # records reported with discarded() (their gradients were dropped)
    applied: list[dict[str, Any]] = field(default_factory=list)  # {seq, kind, iteration, payload}
    _ipc: TrainerIPC | None = None
    _client: Any = None  # pacer.shards.client.BlockingShardClient, made on first use
    _source: Any = None  # pacer.data.sources.Source, opened on first read
    _shard: ShardLease | None = None  # the shard batches() is reading
    _t_check: float = 0.0
    _closed: bool = False

    def __post_init__(self) -> None:
        e = self.env
        self.batch_size = self.batch_size or e.batch_size
        self.learning_rate = self.learning_rate or e.learning_rate
        self.global_batch = self.global_batch or e.global_batch or e.batch_size * e.num_workers
        self.backup_workers = self.backup_workers or e.backup_workers
        if e.agent_ipc and self._ipc is None:
            # Attaching bumps the incarnation; the agent waits for the file to appear.
            self._ipc = TrainerIPC(e.agent_ipc, create=True, role=e.role)
        self._t_check = time.perf_counter()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Worker:
        env = TrainerEnv.from_env(environ)
        if env.role != "worker":
            raise TrainerEnvError(f"{TF_CONFIG}: task.type is {env.role!r}; a Worker runs in a worker pod")
        return cls(env)

    # ------------------------------------------------------------ shards
    @property
    def shard_client(self) -> Any:
        """The :class:`pacer.shards.client.BlockingShardClient` of this node (connected on first use)."""
        if self._client is None:
            from pacer.shards.client import BlockingShardClient

            e = self.env
            # BSP steps wait for every worker: a prefetched shard would sit idle while another has none.
            self._client = BlockingShardClient(e.nats_url, e.job, e.dataset, e.node,
                                               prefetch=1 if e.mode == "bsp" else 2)
        return self._client

    def next_shard(self, wait: bool = True) -> ShardLease | None:
        """The next shard to read, or None when the dataset is finished (``wait=False``: or none free now)."""
        return self.shard_client.next(wait)  # type: ignore[no-any-return]

    def progress(self, shard: ShardLease, consumed: int) -> None:
        """Records of ``shard`` trained so far, counted from ``shard.offset`` (queued, never blocks)."""
        self.shard_client.progress(shard, consumed)

    def done(self, shard: ShardLease) -> None:
        """Every record of ``shard`` was trained (report it only after that step ran)."""
        self.shard_client.done(shard)

    def failed(self, shard: ShardLease) -> None:
        """``shard`` could not be read: it goes back to the service (one failure counted)."""
        self.shard_client.failed(shard)

    @property
    def finished(self) -> bool:
        """The shard service said the dataset is finished (every shard done)."""
        return self._client is not None and bool(self._client.finished)

    def shards(self) -> Iterator[ShardLease]:
        """Shards until the dataset is finished; each is reported done when the loop body for it ends.

        Leaving the loop early (``break``, an exception, KILL_RESTART) does not
        report the current shard done: it stays leased to this node, which
        gets it back after a relaunch.
        """
        while (shard := self.next_shard()) is not None:
            yield shard
            self.done(shard)

    def batches(self, shard: ShardLease) -> Iterator[tuple[int, int]]:
        """Record ranges ``[lo, hi)`` of ``shard`` sized by the *current* ``batch_size``.

        After each batch's step (when the loop asks for the next range) its
        progress is reported, so a relaunch resumes after the last trained batch.
        The end is read again before each range: the shard service may have
        given the rest of the shard to an idle worker (work stealing), and then
        the ranges stop at the new end.
        """
        lo = shard.start
        self._shard = shard
        while lo < (end := self.shard_client.end_of(shard)):
            hi = min(end, lo + max(1, self.batch_size))
            yield lo, hi
            self.progress(shard, hi - shard.offset)  # past a new end: the client keeps it beside the done
            lo = hi

    def discarded(self, lo: int, hi: int, shard: ShardLease | None = None) -> None:
        """The gradient trained on records ``[lo, hi)`` was discarded: the shard service serves them again.

        ``lo`` and ``hi`` are record indices as :meth:`batches` yields them; ``shard``
        defaults to the shard :meth:`batches` is reading.  BSP with backup workers
        (``SyncReplicasOptimizer``) drops the gradients that arrive after the first
        n - b of a step; report such a batch here, after its step and before the
        shard is done (:meth:`shards` reports it done when the loop body ends).
        Queued, never blocks.  When unsure whether a gradient was kept, report it:
        a record trained twice is better than one never trained.
        """
        sh = shard or self._shard
        if sh is None:
            raise ValueError("discarded: no shard given and batches() is reading none")
        if not sh.offset <= lo < hi <= sh.end:
            raise ValueError(f"discarded: [{lo}, {hi}) is not a range of records of shard {sh.shard} "
                             f"[{sh.offset}, {sh.end})")
        self.samples_discarded += hi - lo
        self.shard_client.discarded(sh, lo - sh.offset, hi - sh.offset)

    @property
    def data(self) -> Any:
        """The job's dataset as a :class:`pacer.data.feed.DataRef` (format, options, schema, seed)."""
        from pacer.data.feed import DataRef, seed_of

        if self.env.data_ref:
            return DataRef.from_json(self.env.data_ref)
        if not self.env.data:
            raise TrainerEnvError(f"{DATA}: not set: this job has no dataset")
        return DataRef(self.env.data, "record", seed=seed_of(self.env.job))

    @property
    def schema(self) -> Any:
        """The job's feature schema (:class:`pacer.data.schema.Schema`; Criteo's when the spec named none)."""
        return self.data.feature_schema()

    def read(self, lo: int, hi: int, columns: list[str] | None = None) -> dict[str, Any]:
        """Records ``[lo, hi)`` of the job's dataset as columns (name -> numpy array), in the job's seeded
        order: the same records in the same order for every reader and after a relaunch (a stream's
        in stream order: record ``i`` is sequence ``first_seq + i``).

        Numbers come as float32 / int64 arrays, strings and lists as object arrays
        (pacer.data.sources); ``columns`` picks some (default: all).
        """
        from pacer.data.feed import read_rows

        ref = self.data
        if self._source is None:
            self._source = ref.open(self.env.nats_url)
        return read_rows(self._source, lo, hi, columns, ref.order_seed)

    # ------------------------------------------------------------ actions
    def check(self, iteration: int | None = None) -> list[Action]:
        """The per-step check, before the step of ``iteration`` (default: :attr:`step`).

        Applies every action due (ADJUST_BS, ADJUST_LR, BACKUP_WORKERS) to
        this object's attributes, acknowledges it to the agent and returns
        what it applied (usually nothing, in about a microsecond).  Blocks only
        at a pending global-action barrier (at most the IPC's barrier timeout).
        KILL_RESTART raises :class:`RestartRequested`.  ``iteration`` must
        never go down: the global step in BSP, the local step in ASP.
        """
        it = self.step if iteration is None else iteration
        self._t_check = time.perf_counter()
        if self._ipc is None:
            return []
        out: list[Action] = []
        while (action := self._ipc.check(it)) is not None:
            self.apply(action, it)
            self._ipc.ack(action, it)
            out.append(action)
            if action.kind is ActionKind.KILL_RESTART:
                self._ipc.mark_exiting()
                raise RestartRequested(bool(action.payload.get("checkpoint")))
        return out

    def apply(self, action: Action, iteration: int) -> None:
        """Apply one action to the attributes (payloads as ``pacer.contracts.agent.ActionKind``)."""
        p = action.payload or {}
        node = self.env.node
        if action.kind is ActionKind.ADJUST_BS:
            sizes = p.get("batch_sizes", {})
            if node in sizes:
                self.batch_size = max(1, int(sizes[node]))
            accs = p.get("accumulations", p.get("accumulation", {}))
            if node in accs:
                self.accumulation = max(1, int(accs[node]))
            if "global_batch" in p:
                self.global_batch = int(p["global_batch"])
        elif action.kind is ActionKind.ADJUST_LR:
            self.learning_rate *= float(p.get("scale", 1.0))
        elif action.kind is ActionKind.BACKUP_WORKERS:
            self.backup_workers = int(p.get("backup", self.backup_workers))
        self.applied.append({"seq": action.seq, "kind": action.kind.value, "iteration": iteration,
                             "late": action.late, "batch_size": self.batch_size,
                             "learning_rate": self.learning_rate})

    def step_done(self, samples: int, iteration: int | None = None, bpt_s: float | None = None) -> None:
        """One step ran: ``samples`` records were trained.

        The agent publishes this node's batch processing time (BPT, the
        straggler signal) from these records; ``bpt_s`` defaults to the
        time since the last :meth:`check`.  ``iteration`` defaults to the
        new :attr:`step`.
        """
        self.step += 1
        self.samples += samples
        if self._client is not None:
            self._client.trained(samples)  # the rate that sizes this node's pieces near the end
        if self._ipc is not None:
            bpt = time.perf_counter() - self._t_check if bpt_s is None else bpt_s
            self._ipc.record_step(self.step, self.step if iteration is None else iteration, bpt,
                                  self.batch_size, samples)

    # ------------------------------------------------------------ end
    def finish(self, **result: Any) -> dict[str, Any]:
        """Report the result: written to ``$PACER_RESULT`` and printed as the last stdout line.

        The executor keeps the chief's (worker 0) line as the job's result
        (``pacer job get``); values must be JSON.  ``node``, ``exit``,
        ``local_steps``, ``samples``, ``samples_kept``, ``samples_discarded`` and
        ``actions`` are filled in (a keyword
        given here wins).  A worker leaving for KILL_RESTART through ``with``
        prints the same line with ``"exit": 75``.
        """
        out = {"node": self.env.node, "exit": 0, "local_steps": self.step, "samples": self.samples,
               "samples_kept": self.samples - self.samples_discarded, "samples_discarded": self.samples_discarded,
               "actions": self.applied, **result}
        line = json.dumps(out)
        if self.env.result:
            Path(self.env.result).write_text(line)
        print(line, flush=True)
        return out

    def close(self, release: bool = True) -> None:
        """Flush shard reports, hand back unread prefetched shards, tell the agent we are leaving."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._ipc is not None:
                self._ipc.mark_exiting()
                self._ipc.close()
        finally:
            if self._source is not None:
                self._source.close()
            if self._client is not None:
                self._client.close(release=release)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
        if isinstance(exc, RestartRequested):
            # As the built-in worker: a last line saying how far this incarnation got.
            print(json.dumps({"node": self.env.node, "exit": EXIT_RESTART, "local_steps": self.step,
                              "samples": self.samples, "actions": self.applied}), flush=True)
        sys.stdout.flush()
