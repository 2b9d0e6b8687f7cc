"""pacer.trainer.sdk: the environment contract both ways, the per-step check over a real IPC file.

The agent's end of the IPC is the real :class:`pacer.agent.ipc.AgentIPC`
writing into the same shared-memory file the SDK's worker maps; the shard
side of the SDK is exercised with real processes in
``tests/integration/test_byo_trainer.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pacer.agent.ipc import AgentIPC
from pacer.contracts.agent import ActionKind
from pacer.contracts.shards import ShardLease
from pacer.trainer import sdk
from pacer.trainer.sdk import RestartRequested, TrainerEnv, TrainerEnvError, Worker


def env(tmp_path: Path, **kw: object) -> TrainerEnv:
    base: dict[str, object] = dict(
        job="ctr", node="worker-1", role="worker", index=1, ps=("10.0.0.1:2222",),
        workers=("10.0.0.2:2222", "10.0.0.3:2222", "10.0.0.4:2222"), nats_url="nats://n:4222", generation=2,
        dataset="train", data="/data/train.rec", num_workers=2, mode="bsp", backup_workers=1, batch_size=128,
        global_batch=256, learning_rate=0.01, agent_ipc=str(tmp_path / "trainer.ipc"),
        result=str(tmp_path / "result.json"), restore=True,
    )
    base.update(kw)
    return TrainerEnv(**base)  # type: ignore[arg-type]


def test_the_environment_reads_back_to_the_same_contract(tmp_path: Path) -> None:
    e = env(tmp_path)
    assert TrainerEnv.from_env(e.to_env()) == e


def test_tf_config_is_tensorflows_cluster_description(tmp_path: Path) -> None:
    e = env(tmp_path)
    doc = json.loads(e.to_env()["TF_CONFIG"])
    assert doc == {"cluster": {"ps": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222", "10.0.0.4:2222"]},
                   "task": {"type": "worker", "index": 1}}
    assert e.address == "10.0.0.3:2222" and not e.is_chief
    ps = env(tmp_path, role="ps", index=0, node="ps-0")
    assert ps.address == "10.0.0.1:2222" and json.loads(ps.to_env()["TF_CONFIG"])["task"] == {"type": "ps", "index": 0}


def test_every_variable_set_is_part_of_the_contract(tmp_path: Path) -> None:
    """A launcher sets nothing the SDK does not know (trainer.env may not shadow them)."""
    assert set(env(tmp_path).to_env()) <= set(sdk.VARIABLES)
    assert all(v == "TF_CONFIG" or v.startswith("PACER_") for v in sdk.VARIABLES)


def test_a_missing_or_bad_environment_names_every_problem() -> None:
    with pytest.raises(TrainerEnvError) as ei:
        TrainerEnv.from_env({"PACER_BATCH_SIZE": "big"})
    msg = str(ei.value)
    for name in ("TF_CONFIG: not set", "PACER_JOB: not set", "PACER_NATS_URL: not set", "PACER_BATCH_SIZE: must be an integer"):
        assert name in msg, msg
    bad = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}),
           "PACER_JOB": "j", "PACER_NATS_URL": "nats://x"}
    with pytest.raises(TrainerEnvError, match=r"task\.index 3 is not a worker"):
        TrainerEnv.from_env(bad)
    with pytest.raises(TrainerEnvError, match="not a TF_CONFIG document"):
        TrainerEnv.from_env({**bad, "TF_CONFIG": "[1, 2]"})


def test_a_ps_environment_is_refused_by_worker(tmp_path: Path) -> None:
    with pytest.raises(TrainerEnvError, match=r"task\.type is .ps."):
        Worker.from_env(env(tmp_path, role="ps", index=0, node="ps-0", agent_ipc="").to_env())


def test_check_applies_global_actions_at_their_iteration(tmp_path: Path) -> None:
    e = env(tmp_path)
    w = Worker(e)
    agent = AgentIPC(e.agent_ipc)  # the file exists: the worker created it
    agent.commit(1, 3, ActionKind.ADJUST_BS, {"batch_sizes": {"worker-1": 64, "worker-0": 192}, "global_batch": 256})
    agent.commit(2, 3, ActionKind.ADJUST_LR, {"scale": 0.5})
    agent.commit(3, 4, ActionKind.BACKUP_WORKERS, {"backup": 0})
    seen: dict[int, list[str]] = {}
    for _ in range(5):
        it = w.step
        seen[it] = [a.kind.value for a in w.check()]
        w.step_done(samples=w.batch_size)
    assert seen == {0: [], 1: [], 2: [], 3: ["ADJUST_BS", "ADJUST_LR"], 4: ["BACKUP_WORKERS"]}
    assert (w.batch_size, w.learning_rate, w.backup_workers) == (64, 0.005, 0)
    assert [(a["kind"], a["iteration"]) for a in w.applied] == [("ADJUST_BS", 3), ("ADJUST_LR", 3), ("BACKUP_WORKERS", 4)]
    # The agent sees what the worker did: the acks and the step records (batch size after the change).
    st = agent.snapshot()
    assert (st.applied_seq, st.applied_iteration) == (3, 4)
    assert [s.batch_size for s in st.steps] == [128, 128, 128, 64, 64]
    assert st.samples_total == 3 * 128 + 2 * 64
    w.close()
    assert agent.snapshot().exiting


def test_kill_restart_raises_and_exits_75(tmp_path: Path) -> None:
    e = env(tmp_path)
    w = Worker(e)
    AgentIPC(e.agent_ipc).commit(1, 0, ActionKind.KILL_RESTART, {"checkpoint": True}, immediate=True)
    with pytest.raises(RestartRequested) as ei:
        w.check(0)
    assert ei.value.code == sdk.EXIT_RESTART and ei.value.checkpoint
    w.close()
    # Uncaught in a real process, it is exit status 75 (what the executor relaunches).
    script = ("import sys\nfrom pacer.trainer.sdk import Worker\n"
              "with Worker.from_env() as w:\n    while True:\n        w.check(); w.step_done(1)\n")
    e2 = env(tmp_path, agent_ipc=str(tmp_path / "t2.ipc"))
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, **e2.to_env()})
    agent = None
    deadline = time.monotonic() + 30
    while agent is None:
        assert time.monotonic() < deadline and proc.poll() is None, "the trainer never created its IPC file"
        time.sleep(0.01)
        agent = AgentIPC.try_open(e2.agent_ipc)
    agent.commit(agent.next_seq(), 0, ActionKind.KILL_RESTART, {}, immediate=True)
    assert proc.wait(30) == 75
    assert agent.snapshot().exiting


def test_batches_follow_the_current_batch_size_and_report_progress(tmp_path: Path) -> None:
    class Shards:
        def __init__(self) -> None:
            self.reports: list[tuple[str, int, int]] = []

        def progress(self, shard: ShardLease, consumed: int) -> None:
            self.reports.append(("progress", shard.shard, consumed))

        def done(self, shard: ShardLease) -> None:
            self.reports.append(("done", shard.shard, 0))

        def end_of(self, shard: ShardLease) -> int:
            return shard.end  # never cut (work stealing: tests/unit/test_shard_client_steal.py)

    w = Worker(env(tmp_path, agent_ipc=""))
    fake = w._client = Shards()
    shard = ShardLease(shard=7, epoch=0, start=1030, end=1300, offset=1000, seed=1)  # 30 already trained
    ranges = []
    for lo, hi in w.batches(shard):
        ranges.append((lo, hi))
        if len(ranges) == 1:
            w.batch_size = 100  # as ADJUST_BS would, mid-shard
    assert ranges == [(1030, 1158), (1158, 1258), (1258, 1300)]
    assert fake.reports == [("progress", 7, 158), ("progress", 7, 258), ("progress", 7, 300)]


def test_finish_writes_the_result_line_the_executor_keeps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pacer_services.pod_executor.launch import parse_result

    w = Worker(env(tmp_path, agent_ipc=""))
    w.step_done(10)
    w.finish(loss=0.4)
    out = capsys.readouterr().out
    assert parse_result("noise\n" + out) == {"node": "worker-1", "exit": 0, "local_steps": 1, "samples": 10,
                                             "samples_kept": 10, "samples_discarded": 0, "actions": [],
                                             "loss": 0.4}
    assert json.loads(Path(tmp_path / "result.json").read_text())["loss"] == 0.4


def test_discarded_batches_go_to_the_shard_client_before_the_shard_is_done(tmp_path: Path) -> None:
    class Shards:
        def __init__(self) -> None:
            self.reports: list[tuple[Any, ...]] = []

        def next(self, wait: bool = True) -> ShardLease | None:
            return None if self.reports else shard

        def progress(self, shard: ShardLease, consumed: int) -> None:
            self.reports.append(("progress", shard.shard, consumed))

        def discarded(self, shard: ShardLease, start: int, end: int) -> None:
            self.reports.append(("discarded", shard.shard, start, end))

        def done(self, shard: ShardLease) -> None:
            self.reports.append(("done", shard.shard))

        def end_of(self, shard: ShardLease) -> int:
            return shard.end

        def trained(self, records: int) -> None:
            pass

    w = Worker(env(tmp_path, agent_ipc="", batch_size=100))
    fake = w._client = Shards()
    shard = ShardLease(shard=7, epoch=0, start=1030, end=1300, offset=1000, seed=1)
    for sh in w.shards():
        for lo, hi in w.batches(sh):
            if lo == 1130:  # this step's gradient was dropped
                w.discarded(lo, hi)
            w.step_done(hi - lo)
    assert fake.reports == [("progress", 7, 130), ("discarded", 7, 130, 230), ("progress", 7, 230),
                            ("progress", 7, 300), ("done", 7)]
    with pytest.raises(ValueError, match="not a range of records of shard 7"):
        w.discarded(1290, 1301)
    with pytest.raises(ValueError, match="not a range of records"):
        w.discarded(5, 5, shard=shard)
    res = w.finish()
    assert (res["samples"], res["samples_kept"], res["samples_discarded"]) == (270, 170, 100)


# ------------------------------------------------ the spec's trainer section (pacer.jobs.spec)

_SPEC_PATCHED = "trainer" in __import__("pacer.jobs.spec", fromlist=["TOP_LEVEL"]).TOP_LEVEL
needs_spec = pytest.mark.skipif(not _SPEC_PATCHED, reason="pacer.jobs.spec has no trainer section yet "
                                "(patch in /tmp/pacer-coord/requests-h8-sdk.md)")


@needs_spec
def test_a_trainer_section_parses_and_model_becomes_optional() -> None:
    from pacer.contracts.jobs import TrainerConfig
    from pacer.jobs.spec import parse_job_spec, spec_to_json

    spec = parse_job_spec(
        "name: byo\ndataset: /d/train.rec\ntrainer:\n  command: [python, /app/train.py, --epochs, '2']\n"
        "  ps_command: [python, /app/train.py]\n  image: registry.example/team/trainer:1.4\n"
        "  env: {WANDB_MODE: offline}\n")
    assert spec.trainer == TrainerConfig(command=["python", "/app/train.py", "--epochs", "2"],
                                         ps_command=["python", "/app/train.py"],
                                         image="registry.example/team/trainer:1.4", env={"WANDB_MODE": "offline"})
    assert parse_job_spec(spec_to_json(spec)) == spec  # what the job service stores reads back the same
    bare = parse_job_spec("name: byo\ndataset: /d/train.rec\ntrainer: [python, /app/train.py]\n")
    assert bare.trainer == TrainerConfig(command=["python", "/app/train.py"])
    assert parse_job_spec("name: b\nmodel: dcn\ndataset: /d/t.rec\n").trainer is None


@needs_spec
def test_a_bad_trainer_section_names_every_problem() -> None:
    from pacer.jobs.spec import JobSpecError, parse_job_spec

    with pytest.raises(JobSpecError) as ei:
        parse_job_spec("name: byo\ndataset: /d/t.rec\ntrainer:\n  command: python train.py\n  ps_command: [python, 3]\n"
                       "  image: 'a b'\n  env: {PACER_JOB: x, TF_CONFIG: '{}', 9LIVES: y, THREADS: 4}\n  gpu: 1\n")
    problems = "\n".join(ei.value.problems)
    for expected in ("trainer.command: must be a list of strings", "trainer.ps_command[1]: must be a string",
                     "trainer.image: must be an image reference", "trainer.env.PACER_JOB: is set by Pacer",
                     "trainer.env.TF_CONFIG: is set by Pacer", "trainer.env.9LIVES: must be a variable name",
                     "trainer.env.THREADS: must be a string (quote it)", "trainer.gpu: unknown field"):
        assert expected in problems, problems
    with pytest.raises(JobSpecError, match=r"trainer\.command: required"):
        parse_job_spec("name: byo\ndataset: /d/t.rec\ntrainer: {image: x}\n")
    with pytest.raises(JobSpecError, match=r"model: required"):  # no trainer: the built-in needs a model
        parse_job_spec("name: byo\ndataset: /d/t.rec\n")


@needs_spec
def test_the_example_job_spec_parses_and_names_the_example_script() -> None:
    from pacer.jobs.spec import load_job_spec

    root = Path(__file__).resolve().parents[2]
    spec = load_job_spec(str(root / "examples" / "trainers" / "logreg_ps.yaml"))
    assert spec.trainer is not None and spec.trainer.command == spec.trainer.ps_command
    assert (root / spec.trainer.command[1]).is_file()  # relative to where `pacer up` runs: the repo root
