"""What the executor launches for a PS: its agent, and a CPU-throttled PS injected as a straggler."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pacer.contracts.executor import PodSpec
from pacer.contracts.jobs import JobRecord, JobState, PlanSource, ResourcePlan
from pacer.jobs.spec import parse_job_spec
from pacer.trainer.cluster import ClusterDesc
from pacer.trainer.straggler import StragglerSpec
from pacer_services.pod_executor import launch
from pacer_services.pod_executor.backends.pod import THROTTLE_ENV, Supervisor

JOB = "j1"
CLUSTER = ClusterDesc(("127.0.0.1:7000", "127.0.0.1:7001"), ("127.0.0.1:7100", "127.0.0.1:7101"))


def record(extra: str = "") -> tuple[JobRecord, ResourcePlan]:
    spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: /data/train.rec\n{extra}")
    plan = ResourcePlan(JOB, 2, 2, 1.0, 1024, 1.5, 2048, PlanSource.BRAIN)
    return JobRecord(JOB, spec, JobState.RUNNING, time.time(), data_path="/data/train.rec", records=1000), plan


def cfg(stragglers: dict[str, dict[str, object]] | None = None) -> launch.LaunchConfig:
    return launch.LaunchConfig("nats://127.0.0.1:4222", "/ckpt", stragglers=tuple(
        (n, json.dumps(f)) for n, f in (stragglers or {}).items()))


def ps_pod(c: launch.LaunchConfig, index: int = 1, generation: int = 0, extra: str = "") -> PodSpec:
    rec, plan = record(extra)
    return launch.pod_spec(rec, plan, CLUSTER, "ps", index, generation, 1.5, 2048, 7001, c)


def test_every_ps_gets_an_agent_that_probes_its_own_address_and_the_ps_tells_it_its_pid() -> None:
    pod = ps_pod(cfg())
    assert pod.agent[:3] == ["python", "-m", "pacer.agent.main"]
    args = pod.agent
    assert args[args.index("--role") + 1] == "ps" and args[args.index("--node") + 1] == "ps-1"
    assert args[args.index("--probe") + 1] == "127.0.0.1:7001"
    assert pod.command[-2:] == ["--ipc", launch.IPC] and args[args.index("--ipc") + 1] == launch.IPC
    # Without agents (LaunchConfig.agents=False) neither the sidecar nor the IPC argument.
    bare = ps_pod(launch.LaunchConfig("nats://127.0.0.1:4222", agents=False))
    assert bare.agent == [] and "--ipc" not in bare.command


def test_a_users_ps_command_gets_the_agent_too() -> None:
    pod = ps_pod(cfg(), extra="trainer:\n  command: [python, train.py]\n  ps_command: [python, serve.py]\n")
    assert pod.command == ["python", "serve.py"]
    assert "--probe" in pod.agent  # its address finds its process ...
    assert "--no-rpc" in pod.agent  # ... but it is sent no TF RPC: it speaks its own protocol
    assert "--no-rpc" not in ps_pod(cfg()).agent  # the built-in TF PS is probed


def test_a_cpu_straggler_lowers_the_first_pods_limit_only_and_the_worker_wildcard_spares_the_ps() -> None:
    c = cfg({"ps-1": {"cpu": 0.05}, "*": {"kind": "persistent", "sleep_s": 0.5, "cpu": 0.2}})
    assert ps_pod(c).cpu == 0.05
    assert ps_pod(c, generation=1).cpu == 1.5  # migrated: a healthy machine
    assert ps_pod(c, index=0).cpu == 1.5  # "*" is every worker, never a PS
    rec, plan = record()
    w = launch.pod_spec(rec, plan, CLUSTER, "worker", 1, 0, 1.0, 1024, 7101, c)
    assert w.cpu == 0.2
    sticky = cfg({"ps-1": {"cpu": 0.05, "sticky": True}})
    assert ps_pod(sticky, generation=3).cpu == 0.05


def test_a_delayed_cpu_straggler_travels_to_the_pod_supervisor() -> None:
    pod = ps_pod(cfg({"ps-1": {"cpu": 0.05, "start_s": 15}}))
    assert pod.cpu == 1.5  # the limit stays: the supervisor throttles later
    env = pod.env
    assert json.loads(env[THROTTLE_ENV]) == {"cpu": 0.05, "start_s": 15.0}
    sup = Supervisor(spec=pod, dir=Path("/nonexistent"))
    assert sup._throttle() == (0.05, 15.0)
    assert THROTTLE_ENV not in ps_pod(cfg({"ps-1": {"cpu": 0.05}})).env


def test_a_bad_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu"):
        StragglerSpec(cpu=-1.0)


def test_a_streaming_jobs_pods_get_a_token_for_their_stream_and_its_kinds() -> None:
    """The workers of a stream job open it at the resolved first sequence with the kinds checked at submit,
    in stream order; every pod's password grants that stream (and only a file job's grants none)."""
    from pacer import authjwt
    from pacer.data.feed import DataRef
    from pacer.trainer.worker import WorkerConfig

    spec = parse_job_spec(f"name: {JOB}\nmodel: wide_deep\ndataset:\n  path: jetstream://ADS\n"
                          "  schema: {label: click, dense: [price]}\n")
    spec = replace(spec, dataset=replace(spec.dataset, options={**spec.dataset.options, "first_seq": 42}))
    rec = JobRecord(JOB, spec, JobState.RUNNING, time.time(), data_path="jetstream://ADS", records=10,
                    columns={"click": "int", "price": "float"})
    plan = ResourcePlan(JOB, 2, 1, 1.0, 1024, 1.5, 2048, PlanSource.BRAIN)
    c = launch.LaunchConfig("nats://127.0.0.1:4222", agent_secret="s3cret")
    worker = launch.pod_spec(rec, plan, CLUSTER, "worker", 0, 0, 1.0, 1024, 7100, c)
    ref = DataRef.from_json(WorkerConfig(**json.loads(worker.command[-1])).data)
    assert ref.streaming and ref.order_seed is None and ref.options["first_seq"] == 42
    assert ref.columns == {"click": "int", "price": "float"}
    for pod in (worker, launch.pod_spec(rec, plan, CLUSTER, "ps", 0, 0, 1.0, 1024, 7000, c)):
        token = pod.env["PACER_NATS_PASSWORD"]
        assert authjwt.token_stream(token) == "ADS" and authjwt.token_ok("s3cret", JOB, token, time.time())
        assert not authjwt.token_ok("s3cret", "j2", token, time.time())
        claims = authjwt.parse_token(token)
        assert claims is not None and claims.incarnation == authjwt.incarnation(rec.submitted_at)
        assert claims.expires >= time.time() + c.token_ttl_s - 1
    file_rec, _ = record()
    assert authjwt.token_stream(launch.pod_credentials(c, file_rec, launch.stream_of(file_rec))["PACER_NATS_PASSWORD"]) == ""


def test_a_later_job_of_the_same_name_gets_other_tokens() -> None:
    """The token names the job's incarnation (its record's submission time) and an expiry: the pods of a new
    job called like an old one never hold a password the old one's pods held."""
    from pacer import authjwt

    old, _ = record()
    new = replace(old, submitted_at=old.submitted_at + 60.0)
    c = launch.LaunchConfig("nats://127.0.0.1:4222", agent_secret="s3cret", token_ttl_s=3600.0, clock=lambda: 1e9)
    a, b = (launch.pod_credentials(c, r)["PACER_NATS_PASSWORD"] for r in (old, new))
    assert a != b
    pa, pb = authjwt.parse_token(a), authjwt.parse_token(b)
    assert pa is not None and pb is not None
    assert pa.incarnation == authjwt.incarnation(old.submitted_at) != pb.incarnation
    assert pa.expires == pb.expires == authjwt.token_expiry(1e9, 3600.0)
