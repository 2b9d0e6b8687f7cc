"""Run a small TensorFlow PS job on this machine against a running Pacer stack.

``pacer train local`` uses it, and so do the trainer tests and benchmarks.
Each PS and worker is its own process (``pacer.trainer.ps`` /
``pacer.trainer.worker``); with ``agents=True`` every worker gets an agent
sidecar process (``pacer.agent.main``) sharing a small IPC file with it.
A worker that exits with 75 asked to be restarted (KILL_RESTART) and is
relaunched in its slot; the pod-executor will take this role later.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pacer.bus import Bus, RetryPolicy
from pacer.contracts.shards import DatasetSpec
from pacer.shards.client import ShardAdmin
from pacer.trainer.cluster import ClusterDesc
from pacer.trainer.straggler import StragglerSpec
from pacer.trainer.worker import EXIT_RESTART, WorkerConfig


def log_tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a process log (what a failed run's error shows; "" if unreadable)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class LocalJobSpec:
    job: str
    data: str
    eval_data: str = ""
    nats_url: str = "nats://127.0.0.1:4222"
    model: str = "wide_deep"
    model_args: dict[str, Any] = field(default_factory=dict)
    num_ps: int = 2
    workers: int = 2
    max_workers: int = 0  # ClusterSpec slots (>= workers); 0 = workers
    mode: str = "asp"
    batch_size: int = 256  # per worker (B_i = B / n)
    backup_workers: int = 0
    accumulation: int = 1
    learning_rate: float = 0.05
    epochs: int = 1
    batches_per_shard: int = 100
    lease_s: float = 30.0
    agents: bool = False
    stragglers: dict[int, StragglerSpec] = field(default_factory=dict)  # worker index -> spec
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    restore: bool = False
    max_steps: int = 0
    work_dir: str = ""
    register: bool = True
    batch_sizes: dict[int, int] = field(default_factory=dict)  # worker index -> B_i override
    accumulations: dict[int, int] = field(default_factory=dict)  # worker index -> C_i override

    def global_batch(self) -> int:
        """B = sum_i B_i * C_i: samples in one synchronous step."""
        return sum(self.batch_sizes.get(i, self.batch_size) * self.accumulations.get(i, self.accumulation)
                   for i in range(self.workers))


class LocalJob:
    def __init__(self, spec: LocalJobSpec, cluster: ClusterDesc | None = None) -> None:
        self.spec = spec
        self.cluster = cluster or ClusterDesc.local(spec.num_ps, max(spec.max_workers, spec.workers))
        self.work = Path(spec.work_dir or tempfile.mkdtemp(prefix=f"pacer-{spec.job}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.ps: list[subprocess.Popen[bytes]] = []
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: dict[int, int] = {}  # worker index -> relaunches after exit 75
        self.configs: dict[int, WorkerConfig] = {}

    # ------------------------------------------------------------ processes
    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PACER_NATS_URL": self.spec.nats_url}
        with open(self.work / log_name, "ab") as log:
            return subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT)

    def node(self, i: int) -> str:
        return f"worker-{i}"

    def worker_config(self, i: int) -> WorkerConfig:
        s = self.spec
        return WorkerConfig(
            job=s.job, node=self.node(i), index=i, cluster=self.cluster.to_json(), data=s.data,
            nats_url=s.nats_url, model=s.model, model_args=s.model_args, mode=s.mode,
            num_workers=s.workers, backup_workers=s.backup_workers,
            batch_size=s.batch_sizes.get(i, s.batch_size), global_batch=s.global_batch(),
            accumulation=s.accumulations.get(i, s.accumulation), learning_rate=s.learning_rate,
            ipc=str(self.work / f"{self.node(i)}.ipc") if s.agents else "",
            straggler=s.stragglers[i].to_json() if i in s.stragglers else "",
            checkpoint_dir=s.checkpoint_dir if i == 0 else "",
            checkpoint_every=s.checkpoint_every, restore=s.restore and i == 0,
            eval_data=s.eval_data if i == 0 else "",
            result=str(self.work / f"{self.node(i)}.result.json"), max_steps=s.max_steps,
        )

    def start_ps(self) -> None:
        for i in range(len(self.cluster.ps)):
            self.ps.append(self._spawn(["-m", "pacer.trainer.ps", "--cluster", self.cluster.to_json(),
                                        "--index", str(i)], f"ps-{i}.log"))

    def start_worker(self, i: int, cfg: WorkerConfig | None = None) -> None:
        cfg = cfg or self.worker_config(i)
        self.configs[i] = cfg  # a relaunch (exit 75) reuses what this slot was started with
        res = Path(cfg.result)
        if res.exists():
            res.unlink()
        self.workers[i] = self._spawn(["-m", "pacer.trainer.worker", "--config", cfg.to_json()], f"{cfg.node}.log")
        if self.spec.agents and (i not in self.agents or self.agents[i].poll() is not None):
            self.agents[i] = self._spawn(
                ["-m", "pacer.agent.main", "--job", self.spec.job, "--node", cfg.node, "--role", "worker",
                 "--ipc", cfg.ipc, "--nats", self.spec.nats_url], f"{cfg.node}.agent.log")

    async def register(self) -> None:
        from pacer.data.feed import DataRef

        s = self.spec
        ref = DataRef.from_json(s.data) if s.data.lstrip().startswith("{") else DataRef(s.data, "record")
        with ref.open() as src:
            records = src.rows
        bus = await Bus.connect(s.nats_url, name=f"{s.job}-launcher")
        try:
            await ShardAdmin(bus, retry=RetryPolicy(attempts=50)).register(DatasetSpec(
                job=s.job, dataset="train", records=records, batch_size=s.batch_size,
                batches_per_shard=s.batches_per_shard, epochs=s.epochs, lease_s=s.lease_s))
        finally:
            await bus.close()

    def checkpoint_meta(self) -> dict[str, Any]:
        """What the chief wrote beside its newest model checkpoint (shard checkpoint id, step)."""
        meta: dict[str, Any] = json.loads(Path(self.spec.checkpoint_dir, "shard_checkpoint").read_text())
        return meta

    async def restore_shards(self) -> str:
        """Put the shard state back to the checkpoint the model will be restored from."""
        meta = self.checkpoint_meta()
        bus = await Bus.connect(self.spec.nats_url, name=f"{self.spec.job}-launcher")
        try:
            await ShardAdmin(bus, retry=RetryPolicy(attempts=50)).restore(self.spec.job, "train", meta["id"])
        finally:
            await bus.close()
        return str(meta["id"])

    def start(self) -> LocalJob:
        if self.spec.register:
            asyncio.run(self.register())
        if self.spec.restore:
            asyncio.run(self.restore_shards())
        self.start_ps()
        for i in range(self.spec.workers):
            self.start_worker(i)
        return self

    # ------------------------------------------------------------ control
    def kill_worker(self, i: int) -> None:
        p = self.workers[i]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def wait(self, timeout: float = 900.0, relaunch: bool = True, poll: float = 0.2) -> dict[int, dict[str, Any]]:
        """Until every worker finished; relaunch those that asked for it (exit 75)."""
        deadline = time.monotonic() + timeout
        while True:
            running = False
            for i, p in list(self.workers.items()):
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc == EXIT_RESTART and relaunch:
                    self.restarts[i] = self.restarts.get(i, 0) + 1
                    self.start_worker(i, self.configs.get(i))
                    running = True
                elif rc != 0:
                    log_file = self.work / (self.node(i) + ".log")
                    raise RuntimeError(f"worker {i} exited with {rc}; see {log_file}; it ends:\n{log_tail(log_file)}")
            if not running:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.spec.job} did not finish within {timeout}s")
            time.sleep(poll)
        return self.results()

    def results(self) -> dict[int, dict[str, Any]]:
        out = {}
        for i in self.workers:
            f = self.work / f"{self.node(i)}.result.json"
            if f.exists():
                out[i] = json.loads(f.read_text())
        return out

    def stop(self) -> None:
        for p in [*self.workers.values(), *self.agents.values(), *self.ps]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self.workers.values(), *self.agents.values(), *self.ps]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> LocalJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
