"""The pod-executor's configuration: from the environment, or built by tests."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pacer.bus import Bus
from pacer.ownership import DEFAULT_TTL_S
from pacer.trainer.straggler import StragglerSpec
from pacer_services.pod_executor import core, launch


@dataclass
class ExecutorConfig:
    backend: str = "local"  # local | kubernetes
    root: Path = Path(".pacer/pods")  # local backend: where pod directories live
    checkpoint_root: str = ""  # where chiefs write checkpoints ("": none)
    checkpoint_every: int = 500
    durable: str = "pod-executor"
    reconcile_s: float = 1.0
    completion_grace_s: float = 300.0  # after the job completed, workers get this long to exit by themselves
    delete_grace_s: float = 10.0
    cluster_every_s: float = 5.0  # how often ClusterStatus is published
    orphan_grace_s: float = 300.0  # a pod of no known job is deleted after this long
    agents: bool = True
    max_worker_slots: int = 0  # TF worker slots per job (0: the first plan's workers, or limits.max_workers)
    stragglers: dict[str, str] = field(default_factory=dict)  # fault injection: node or "*" -> StragglerSpec JSON
    policy: core.ExecutorPolicy = field(default_factory=core.ExecutorPolicy)
    drain_s: float = 10.0  # on stop, how long work already queued for jobs may take to finish
    # PACER_AGENT_TOKEN_SECRET, shared with the auth callout: each job's pods get the user agent-<job> and
    # a token derived from it, in their environment (launch.pod_credentials); "": pods get the pod URL's user.
    agent_secret: str = field(default="", repr=False)
    agent_token_ttl_s: float = launch.DEFAULT_TOKEN_TTL_S  # PACER_AGENT_TOKEN_TTL_S: how long a pod's token is good for
    # Two instances (pacer.ownership): this instance's name (None: PACER_INSTANCE, else executor-<random>),
    # the per-job lease's TTL (a dead owner's jobs move about this long after its last renewal), and how
    # long start waits to win the jobs of the bucket.
    instance: str | None = None
    lease_ttl_s: float = DEFAULT_TTL_S
    claim_at_start_s: float = 2.0
    job_event_retry_s: float = 0.2  # a job event reaching the instance that does not own the job: back after

    @classmethod
    def from_env(cls) -> ExecutorConfig:
        env = os.environ
        data = Path(env.get("PACER_DATA_DIR", ".pacer"))
        return cls(
            backend=env.get("PACER_EXECUTOR_BACKEND", "local"),
            root=Path(env.get("PACER_EXECUTOR_ROOT", str(data / "pods"))),
            checkpoint_root=env.get("PACER_CHECKPOINT_ROOT", str(data / "checkpoints")),
            checkpoint_every=int(env.get("PACER_CHECKPOINT_EVERY", "500")),
            stragglers=_stragglers(env.get("PACER_INJECT_STRAGGLERS", "")),
            agent_secret=env.get("PACER_AGENT_TOKEN_SECRET", ""),
            agent_token_ttl_s=float(env.get("PACER_AGENT_TOKEN_TTL_S", str(launch.DEFAULT_TOKEN_TTL_S))),
            lease_ttl_s=float(env.get("PACER_LEASE_TTL_S", str(DEFAULT_TTL_S))),
            policy=core.ExecutorPolicy(
                relaunch_budget=int(env.get("PACER_RELAUNCH_BUDGET", "3")),
                oom_memory_factor=float(env.get("PACER_OOM_MEMORY_FACTOR", "2.0")),
                resize_fraction=float(env.get("PACER_WORKER_RESIZE_FRACTION", "0.25")),
                memory_in_place=env.get("PACER_MEMORY_IN_PLACE", "1").strip().lower() not in ("0", "false", "no"),
            ),
        )


def bus_url(bus: Bus) -> str:
    """The URL pods use to reach the bus (the executor's own, unless PACER_POD_NATS_URL says otherwise)."""
    url = os.environ.get("PACER_POD_NATS_URL", "")
    if url:
        return url
    srv = bus.nc.connected_url
    return f"nats://{srv.hostname}:{srv.port}" if srv is not None else "nats://127.0.0.1:4222"


def _stragglers(text: str) -> dict[str, str]:
    """``PACER_INJECT_STRAGGLERS``: ``{"worker-1": {"kind": "persistent", "sleep_s": 0.2}, "*": {...}}``."""
    if not text.strip():
        return {}
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("PACER_INJECT_STRAGGLERS must be a JSON map of node -> StragglerSpec fields")
    out = {}
    for node, fields in raw.items():
        sticky = bool(fields.pop("sticky", False))
        spec = json.loads(StragglerSpec(**fields).to_json())
        out[str(node)] = json.dumps({**spec, "sticky": sticky})
    return out
