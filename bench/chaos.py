"""Chaos during real TensorFlow jobs (issue 13): the harness of ``make bench-chaos`` and tests/integration/test_chaos.py.

A run starts the embedded stack on a 3-server NATS cluster (JetStream at
replicas 3) with two instances of every service that can run two
(:data:`INSTANCES`: the controller, monitor, shard and job services and the
pod-executor, with per-job ownership by :mod:`pacer.ownership`, and the
stateless policies and auth callout (as deploy/ runs them); ``single`` lists
any service run once), submits
a real Wide&Deep job (2 PS + 2 workers, the demo's generated Criteo-like
data) and, while it trains, kills one target with SIGKILL every
``interval_s`` seconds, the kind chosen by a seeded RNG among:

``nats``      one of the three nats-servers; restarted after ``down_s``
              (same ports and store: it catches up from its peers);
``service``   one service process (or one instance of a service); restarted
              after ``down_s``;
``worker``    the TensorFlow process of one worker (the chief included);
              nothing restarts it but the pod-executor;
``ps``        the TensorFlow process of one PS, likewise.

The kinds come in rounds, each kind once per round in an order drawn from the
seeded RNG (so a short run covers every kind).  Kills are sequential: the next one waits for the previous target to be
back, so the cluster never loses its quorum to two overlapping NATS kills.

Times, per kill (seconds from the SIGKILL):

``back_s``       the target is back: for ``nats`` the restarted server is
                 healthy and caught up (``EmbeddedCluster.restart``); for
                 ``service`` the process runs again and its service answers
                 its health subject (with two instances the other one may
                 answer); for ``worker``/``ps`` the executor reports the node
                 ``running`` in a newer generation than the killed pod's;
``recover_s``    the job progresses again: the first time at or after
                 ``back_s`` that the shard service's ``records_done`` of the
                 job's dataset grows (over its previous value, polled every
                 0.25 s: a dataset rewound after a PS lost its state counts
                 once it grows again), or the job ended.

At the end of a job the harness collects what the durable record says: the
shard service's dataset status (``records_lost = records_total -
records_done``, failed shards, ``records_duplicated``: records re-served
after a loss), the job's final state and AUC, the controller's decisions
(``pacer.events.controller.<job>.decision``) and the executor's node
events (a ``died`` with reason ``restart_requested`` is one relaunch the
executor carried out on request): each KILL_RESTART the controller executed
must have made exactly one relaunch (``duplicate_actions`` counts
relaunches beyond the decisions that asked for them), and no node may be
KILL_RESTARTed twice within the controller's cool-down
(``repeated_kill_restarts``: two instances both acting for one job).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.contracts.agent import ActionKind
from pacer.contracts.jobs import JobRecord, JobState
from pacer.contracts.nodes import NodeEvent
from pacer.contracts.policy import ControllerDecision
from pacer.embedded import EmbeddedCluster
from pacer.jobs.client import JobClient
from pacer.shards.client import ShardAdmin
from pacer_services.cli.stack import Stack
from pacer_services.pod_executor.backends.local import reap_pods

KINDS = ("nats", "service", "worker", "ps")
# Services that run as two instances (per-job ownership, pacer.ownership); the rest run once.
INSTANCES = {"controller": 2, "monitor": 2, "shard": 2, "jobs": 2, "executor": 2, "policies": 2, "auth": 2}
SERVICES = ["auth", "shard", "monitor", "jobs", "executor", "controller", "policies"]
TERMINAL = (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED)
DATASET = "train"
COOLDOWN_S = 600.0  # the controller's default PACER_CONTROLLER_COOLDOWN_S: one KILL_RESTART per node within it


@dataclass
class ChaosConfig:
    kills: int = 6  # per job
    interval_s: float = 8.0  # from one kill to the next (or from the previous target's return, if later)
    down_s: float = 1.0  # how long a killed NATS server or service stays down
    seed: int = 13  # chooses the kinds and targets
    kinds: tuple[str, ...] = KINDS
    rows: int = 48_000
    batch_size: int = 256  # global batch (2 workers)
    step_sleep_s: float = 0.4  # injected per-step sleep of every worker (no CPU): stretches the job
    straggler: bool = True  # worker-1 is a persistent straggler (a KILL_RESTART decision to carry out)
    # PACER_RELAUNCH_BUDGET of the stack; 0: the executor's default (3 failures per node; since 3265777 a
    # worker that dies because its PS died spends none of it: before, 10 kills failed a job this way).
    relaunch_budget: int = 0
    lease_ttl_s: float = 3.0  # controller/monitor ownership lease: hand-over a few seconds after an owner dies
    job_timeout_s: float = 900.0
    stuck_s: float = 60.0  # the executor tore the job down this long ago, its record not terminal: stuck
    instances: dict[str, int] = field(default_factory=lambda: dict(INSTANCES))


@dataclass
class Kill:
    kind: str
    target: str
    at_s: float  # since the job was submitted
    back_s: float | None = None  # since the kill
    recover_s: float | None = None  # since the kill
    records_at_kill: int = 0
    detail: str = ""


@dataclass
class JobOutcome:
    job: str
    state: str
    reason: str
    auc: float | None
    records_total: int
    records_done: int
    records_lost: int
    records_duplicated: int
    shards_failed: int
    node_restarts: int
    kill_restart_decisions: int
    requested_relaunches: int
    duplicate_actions: int
    repeated_kill_restarts: int
    jct_s: float
    kills: list[Kill] = field(default_factory=list)
    single: list[str] = field(default_factory=list)  # services run once (no second instance)

    @property
    def completed(self) -> bool:
        return self.state == JobState.COMPLETED.value


def spec_yaml(job: str, data: Path, test: Path, batch_size: int = 256) -> str:
    return (f"name: {job}\nmodel: wide_deep\n"
            f"dataset:\n  path: {data}\n  test_path: {test}\n"
            f"epochs: 1\nbatch_size: {batch_size}\nmode: asp\n"
            "policies: {optimizer: default}\n"
            "resources:\n  workers: 2\n  ps: 2\n")


def generate_data(root: Path, rows: int, seed: int = 7) -> tuple[Path, Path]:
    """The demo's data: a Criteo-like training file with a planted signal, and held-out rows."""
    from pacer.data.criteo import generate, heldout_path

    data = root / "train.rec"
    data.parent.mkdir(parents=True, exist_ok=True)
    if not data.exists():
        generate(data, rows, seed=seed)
        generate(heldout_path(data), max(10_000, rows // 10), seed=seed, stream=1)
    return data, heldout_path(data)


def make_stack(data_dir: Path, cfg: ChaosConfig) -> Stack:
    stragglers: dict[str, Any] = {"*": {"kind": "persistent", "sleep_s": cfg.step_sleep_s, "sticky": True}}
    if cfg.straggler:  # worker-1 twice as slow, its relaunches too (else the job races through after one)
        stragglers["worker-1"] = {"kind": "persistent", "sleep_s": 2 * cfg.step_sleep_s, "sticky": True}
    env = {
        "PACER_MONITOR_INTERVAL_S": "2",
        "PACER_BATCHES_PER_SHARD": "5",
        "PACER_SHARD_LEASE_S": "20",
        "PACER_LEASE_TTL_S": str(cfg.lease_ttl_s),
        # sticky: a relaunched worker sleeps too (else the job would race through after the first kills)
        "PACER_INJECT_STRAGGLERS": json.dumps(stragglers),
        # A persistent straggler is seen within seconds, and KILL_RESTARTed by antdt-nd (at most once per
        # node: the default cool-down of 600 s), so that the controller has decisions to carry out while
        # its instances are killed.
        "PACER_MONITOR_WINDOW_SHORT_S": "6", "PACER_MONITOR_WINDOW_LONG_S": "12", "PACER_CONTROLLER_EVERY_S": "3",
    }
    if cfg.relaunch_budget:
        env["PACER_RELAUNCH_BUDGET"] = str(cfg.relaunch_budget)
    return Stack(data_dir, services=list(SERVICES), cluster=3, instances=dict(cfg.instances), env=env)


def _pods(job: str, node: str) -> list[tuple[int, psutil.Process]]:
    """The local pod supervisors of ``job``'s ``node``: (generation, process), newest first."""
    pat = re.compile(rf"^{re.escape(job)}-{re.escape(node)}-g(\d+)$")
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "pacer_services.pod_executor.backends.pod" not in cmd or "--dir" not in cmd:
            continue
        m = pat.match(Path(cmd[cmd.index("--dir") + 1]).name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out, key=lambda gp: -gp[0])


def kill_trainer(job: str, node: str) -> int | None:
    """SIGKILL the TensorFlow process of ``node``'s newest pod; returns that pod's generation (None: none runs)."""
    module = "pacer.trainer.ps" if node.startswith("ps-") else "pacer.trainer.worker"
    for gen, sup in _pods(job, node):
        with contextlib.suppress(psutil.Error):
            for child in sup.children(recursive=True):
                if module in (child.cmdline() or []):
                    os.kill(child.pid, signal.SIGKILL)
                    return gen
        return None  # the newest pod has no trainer (starting or stopping): not a target now
    return None


class Chaos:
    """One job under chaos on ``stack`` (or no chaos with ``kills=0``: the fault-free reference)."""

    def __init__(self, stack: Stack, cfg: ChaosConfig, rng: random.Random, log: Any = None) -> None:
        self.stack, self.cfg, self.rng = stack, cfg, rng
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.records_done = 0
        self.samples: list[tuple[float, int]] = []  # (monotonic, records_done) whenever it changed
        self.nodes: dict[str, tuple[int, str]] = {}  # node -> (generation, phase) as the executor says
        self.executor_state = ""
        self.torn_down_at: float | None = None  # when the executor first said torn_down/failed
        self.ended = False
        self._bag: list[str] = []

    async def run(self, job: str, data: Path, test: Path, kills: int) -> JobOutcome:
        bus = await Bus.connect(self.stack.url, name="pacer-chaos")
        try:
            client = JobClient(bus, timeout=30.0)
            await _retry(lambda: client.submit(job, spec_yaml(job, data, test, self.cfg.batch_size)), 60)
            t0 = time.monotonic()
            watcher = asyncio.create_task(self._watch(bus, client, job))
            done: list[Kill] = []
            try:
                await self._until(lambda: self.records_done > 0, 300, "first records")
                next_at = time.monotonic() + self.cfg.interval_s / 2
                while len(done) < kills and not self.ended:
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                    if self.ended:
                        break
                    k = await self._kill_one(job, t0)
                    if k is None:
                        await asyncio.sleep(1.0)
                        continue
                    done.append(k)
                    self.log(f"  kill {len(done)}/{kills}: {k.kind} {k.target} at {k.at_s:.1f}s, back in "
                             f"{_fmt(k.back_s)}, progressing in {_fmt(k.recover_s)} {k.detail}".rstrip())
                    next_at = max(time.monotonic(), t0 + k.at_s + self.cfg.interval_s)
                rec = await self._until_terminal(client, job)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            for k in done:  # progress after the last kills may only have been seen at the end
                if k.recover_s is None and k.back_s is not None:
                    k.recover_s = self._progress_after(t0 + k.at_s, t0 + k.at_s + k.back_s)
            return await self._outcome(bus, client, rec, done)
        finally:
            await bus.close()

    # ------------------------------------------------------------------ observation
    async def _watch(self, bus: Bus, client: JobClient, job: str) -> None:
        admin = ShardAdmin(bus)
        while True:
            with contextlib.suppress(Exception):
                st = await admin.status(job, DATASET)
                if st.records_done != self.records_done:  # grows; drops when a PS's loss rewinds the dataset
                    self.records_done = st.records_done
                    self.samples.append((time.monotonic(), st.records_done))
            with contextlib.suppress(Exception):
                es = await client.nodes(job)
                self.nodes = {n.node: (n.generation, n.phase.value) for n in es.nodes}
                self.executor_state = es.state
                if es.state in ("torn_down", "failed"):
                    self.ended = True  # no node left to kill
                    self.torn_down_at = self.torn_down_at or time.monotonic()
            with contextlib.suppress(Exception):
                rec = await client.get(job)
                if rec.state in TERMINAL:
                    self.ended = True
                    self.samples.append((time.monotonic(), self.records_done))
            await asyncio.sleep(0.25)

    async def _until(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: no {what} within {timeout:.0f}s")
            await asyncio.sleep(0.1)

    async def _until_terminal(self, client: JobClient, job: str) -> JobRecord:
        deadline = time.monotonic() + self.cfg.job_timeout_s
        while True:
            with contextlib.suppress(Exception):
                rec = await client.get(job)
                if rec.state in TERMINAL and rec.torn_down:
                    return rec
            if self.torn_down_at is not None and time.monotonic() - self.torn_down_at > self.cfg.stuck_s:
                # Every pod is gone but the job's record never became terminal: a lost event. Reported as
                # not completed (state as recorded), not waited for until the timeout.
                rec = await client.get(job)
                self.log(f"  job {job} stuck: the executor tore it down {self.cfg.stuck_s:.0f}s ago, "
                         f"its record still says {rec.state.value}")
                return rec
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: job {job} not finished within {self.cfg.job_timeout_s:.0f}s")
            await asyncio.sleep(0.5)

    def _progress_after(self, kill_at: float, back_at: float) -> float | None:
        """Seconds from the kill to the first growth of records_done seen at or after ``back_at``.

        Growth is over the previous observation, so a dataset rewound after a PS lost its state
        (records_done drops to the shard checkpoint's) progresses as soon as it grows again.
        """
        prev = 0
        for t, n in self.samples:
            if t >= back_at and (n > prev or self.ended):
                return round(t - kill_at, 2)
            prev = n
        return None

    # ------------------------------------------------------------------ kills
    async def _kill_one(self, job: str, t0: float) -> Kill | None:
        if not self._bag:  # the kinds in a seeded order, each once per round: every kind is covered
            self._bag = self.rng.sample(list(self.cfg.kinds), len(self.cfg.kinds))
        kind = self._bag.pop()
        at = time.monotonic()
        rec_at = self.records_done
        if kind == "nats":
            assert isinstance(self.stack.nats, EmbeddedCluster)
            i = self.rng.randrange(len(self.stack.nats.servers))
            target = self.stack.nats.servers[i].server_name
            self.stack.nats.kill(i)
            await asyncio.sleep(self.cfg.down_s)
            await asyncio.to_thread(self.stack.nats.restart, i, 60.0)
            back = time.monotonic()
        elif kind == "service":
            target = self.rng.choice(sorted(self.stack.procs))
            self.stack.kill(target)
            await asyncio.sleep(self.cfg.down_s)
            await asyncio.to_thread(self.stack.restart, target, 120.0)
            back = time.monotonic()
        else:
            nodes = sorted(n for n in self.nodes if n.startswith("worker-" if kind == "worker" else "ps-"))
            if not nodes:
                self._bag.append(kind)
                return None
            target = self.rng.choice(nodes)
            gen = kill_trainer(job, target)
            if gen is None:
                self._bag.append(kind)  # between pods: nothing to kill now; the same kind is drawn again
                return None
            at = time.monotonic()
            deadline = at + 240.0
            while not self.ended:
                g, phase = self.nodes.get(target, (-1, ""))
                if g > gen and phase == "running":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chaos: {job}/{target} not running again within 240 s of its kill")
                await asyncio.sleep(0.1)
            back = time.monotonic()
        k = Kill(kind, target, round(at - t0, 2), round(back - at, 2), None, rec_at)
        if self.ended:
            k.detail = "(the job ended meanwhile)"
        k.recover_s = self._progress_after(at, back)
        if k.recover_s is None:  # wait (bounded) for the job to progress before the next kill
            deadline = time.monotonic() + 120.0
            while k.recover_s is None and time.monotonic() < deadline and not self.ended:
                await asyncio.sleep(0.1)
                k.recover_s = self._progress_after(at, back)
        return k

    # ------------------------------------------------------------------ the record
    async def _outcome(self, bus: Bus, client: JobClient, rec: JobRecord, kills: list[Kill]) -> JobOutcome:
        job = rec.job
        try:
            # bounded as a whole: one attempt may itself retry for long, and a hung owner must end here, with
            # its last words below, not in the test's hang guard (a fresh-clone run beside a burner, e400d41)
            st = await asyncio.wait_for(_retry(lambda: ShardAdmin(bus).status(job, DATASET), 40, within_s=120.0),
                                        180.0)
        except Exception as exc:  # say why: the shard instances' last words (a silent hang left none, once)
            tails = "\n".join(f"--- {n}\n{self.stack.log_tail(n, 40)}" for n in ("shard-0", "shard-1"))
            raise RuntimeError(f"the shard service never answered the status of {job}: {exc}\n{tails}") from exc
        decisions = await read_events(bus, subjects.controller_decision(job), ControllerDecision)
        asked: Counter[str] = Counter()
        last: dict[str, float] = {}
        repeated = 0  # a node KILL_RESTARTed again within the controller's cool-down: two owners deciding
        for d in sorted(decisions, key=lambda d: d.ts):
            for a in [*d.executed, *(r.action for r in d.failed)]:
                if a.kind is ActionKind.KILL_RESTART:
                    asked[a.node] += 1
                    if a.node in last and d.ts - last[a.node] < COOLDOWN_S:
                        repeated += 1
                    last[a.node] = d.ts
        # Relaunches the executor carried out on request: a node stopped by it for a restart (a KILL_RESTART's
        # command) or that exited 75 (an agent's KILL_RESTART) dies with reason restart_requested.  Not the
        # executor's requested_restarts: since 3265777 it also counts workers relaunched after their PS died.
        died = await read_events(bus, subjects.node_event(job, "died"), NodeEvent)
        relaunched = Counter(e.node for e in died if e.reason == "restart_requested")
        dup = sum(max(0, relaunched.get(n, 0) - asked.get(n, 0)) for n in set(relaunched) | set(asked))
        auc = rec.result.get("auc")
        return JobOutcome(
            job=job, state=rec.state.value, reason=rec.reason,
            auc=float(auc) if isinstance(auc, int | float) else None,
            records_total=st.records_total, records_done=st.records_done,
            records_lost=st.records_total - st.records_done, records_duplicated=st.records_duplicated,
            shards_failed=st.failed, node_restarts=rec.node_restarts,
            kill_restart_decisions=sum(asked.values()), requested_relaunches=sum(relaunched.values()),
            duplicate_actions=dup, repeated_kill_restarts=repeated,
            jct_s=round((rec.finished_at or time.time()) - rec.submitted_at, 2), kills=kills,
            single=[s for s in SERVICES if self.cfg.instances.get(s, 1) < 2])


async def read_events(bus: Bus, subject: str, cls: type[Any]) -> list[Any]:
    """Every event kept on ``subject`` (:meth:`pacer.bus.Bus.replay`)."""
    return [decode(cls, m.data) for m in await bus.replay(subject)]


async def _retry(call: Any, attempts: int, within_s: float = math.inf) -> Any:
    """``call()`` until it answers: at most ``attempts`` times, none begun after ``within_s``."""
    last: Exception | None = None
    deadline = time.monotonic() + within_s
    for _ in range(attempts):
        try:
            return await call()
        except Exception as e:  # a request during a leader election or a restart
            last = e
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)
    assert last is not None
    raise last


def _fmt(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f}s"


def quiet_logs() -> None:
    """The harness's own client logs every reconnect it rides out at warning level: keep the output readable."""
    import logging

    for name in ("pacer.bus", "asyncio", "nats"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_job(data_dir: Path, job: str, data: Path, test: Path, cfg: ChaosConfig, kills: int,
            log: Any = None) -> JobOutcome:
    """A fresh chaos stack in ``data_dir``, one job with ``kills`` kills on it, the stack stopped after."""
    quiet_logs()
    stack = make_stack(data_dir, cfg)
    # The job service opens datasets only under its data roots: where this run keeps its data.
    stack.env["PACER_DATA_ROOTS"] = os.pathsep.join(sorted({str(data.resolve().parent), str(test.resolve().parent)}))
    stack.start(ready_timeout=240.0)
    try:
        return asyncio.run(Chaos(stack, cfg, random.Random(cfg.seed), log).run(job, data, test, kills))
    finally:
        stack.stop()
        reap_pods(data_dir)


def outcome_dict(o: JobOutcome) -> dict[str, Any]:
    d = asdict(o)
    d["completed"] = o.completed
    return d
