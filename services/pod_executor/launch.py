"""What runs in a pod: the trainer's and the agent's command lines for one node of a job.

Pure: a job record, the plan, the cluster addresses and a node in; a
:class:`~pacer.contracts.executor.PodSpec` out.  Both backends run the same
commands (``python -m pacer.trainer.ps|worker`` plus ``python -m
pacer.agent.main``); ``{pod_dir}`` is the backend's per-pod directory.
A job with a ``trainer`` section runs the user's ``command`` (and
``ps_command``) instead, with the environment of :func:`trainer_env`
(the contract of :class:`pacer.trainer.sdk.TrainerEnv`) and the same agent.
The machine the plan's placement names for the node travels in
:attr:`~pacer.contracts.executor.PodSpec.machine`, the job's ``scheduling``
section (priority class, Kueue queue, gang scheduler and the gang's size,
the plan's PS plus workers) in the PodSpec's fields of those names
(:func:`scheduling_fields`).

Every PS gets an agent too (``--role ps --probe <the PS address>``): it
reports the PS process's CPU and RSS and the latency of a small TF RPC it
sends the PS (:mod:`pacer.agent.agent`, "Servers").  The built-in PS
attaches to the agent's IPC file only to tell it its pid; a user's
``ps_command`` need not (the agent finds the process listening on the PS
port).  An injected straggler's ``cpu`` (``PACER_INJECT_STRAGGLERS``, node
names only: ``"*"`` stands for every *worker*) lowers the node's pod CPU
limit, the realistic way to slow a PS down; with ``start_s`` the limit
stays and the local pod supervisor throttles from that long after the
trainer started (:func:`pod_cpu`).

Bus credentials of a pod: with an agent token secret (:attr:`LaunchConfig.agent_secret`,
the executor's ``PACER_AGENT_TOKEN_SECRET``, shared with the auth callout responder) every pod of job ``j`` gets the user
``agent-<j>`` and the password :func:`pacer.authjwt.agent_token` of this job's incarnation (its
record's submission time), valid ``token_ttl_s`` to 1.5 ``token_ttl_s`` from the pod's creation,
which the auth callout admits with job ``j``'s subjects only, and only while job ``j`` is that
incarnation and has not ended (:func:`pod_credentials`).  They travel in the pod's environment
(``PACER_NATS_USER`` / ``PACER_NATS_PASSWORD``, read by :func:`pacer.security.connect_options`),
never in an argv, which every local user can read with ``ps``: the URLs in the trainer's and
the agent's arguments are bare.  (The Kubernetes backend moves the password into a per-job Secret
that the pod's env references.)  Without a secret, the pods get the URL the executor was given.

A pod's environment is the spec's variables; a local pod also gets the few of the executor's own
that :func:`pacer_services.pod_executor.backends.pod.pod_base_env` allows (the locale, the
interpreter's paths, the agents' and telemetry settings), a Kubernetes pod none.  Nothing else
of the executor's reaches a pod: not its NATS user, not the agents' token secret, not the API
token, not another service's setting.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import unquote, urlsplit

from pacer import authjwt, security
from pacer.contracts.executor import PodSpec
from pacer.contracts.jobs import GangScheduler, JobRecord, ResourcePlan
from pacer.data.feed import DataRef, seed_of
from pacer.data.stream import parse_stream_uri
from pacer.trainer.cluster import ClusterDesc
from pacer.trainer.sdk import TrainerEnv
from pacer.trainer.straggler import StragglerSpec
from pacer.trainer.worker import WorkerConfig

POD_DIR = "{pod_dir}"
IPC = f"{POD_DIR}/trainer.ipc"
RESULT = f"{POD_DIR}/result.json"
DEFAULT_TOKEN_TTL_S = 7 * 24 * 3600.0  # a week: longer than a pod usually lives; an ended job's fail at once anyway
# (a pod older than this that must reconnect is refused: docs/settings.md)
RESULT_PREFIX = '{"node"'  # the chief's last stdout line is its result JSON (pacer.trainer.worker)


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Where the executor's pods find the bus and the job's files."""

    nats_url: str
    checkpoint_root: str = ""  # "": no checkpoints; else <root>/<job> for the chief
    checkpoint_every: int = 500  # chief steps between flash checkpoints
    lease_s: float = 30.0
    agents: bool = True  # an agent sidecar beside every worker and every PS
    # Fault injection for tests and benchmarks: node ("*" = every worker) -> StragglerSpec JSON
    # (sleep-based, costs no CPU).  From PACER_INJECT_STRAGGLERS, a JSON map of node -> spec fields.
    # It emulates a slow *machine*: only a node's first pod (generation 0) is slow; a relaunched
    # pod lands elsewhere (AntDT's KILL_RESTART gain), unless the spec sets "sticky": true.
    stragglers: tuple[tuple[str, str], ...] = ()
    # Per-job agent credentials (see the module docstring); "" = every pod gets nats_url as it is.
    # (ExecutorConfig.agent_secret, from PACER_AGENT_TOKEN_SECRET.)
    agent_secret: str = field(default="", repr=False)
    # How long a pod's token is good for (PACER_AGENT_TOKEN_TTL_S): a pod that must reconnect after
    # that is refused, ends (its agent gives up: EXIT_REFUSED) and is relaunched with a new token.
    token_ttl_s: float = DEFAULT_TOKEN_TTL_S
    clock: Callable[[], float] = field(default=time.time, repr=False, compare=False)  # tokens' "now"


def pod_nats_url(cfg: LaunchConfig) -> str:
    """The bus URL of every pod, as it appears in their argv and ``PACER_NATS_URL``: without credentials."""
    return ",".join(security.strip_userinfo(u) for u in security.split_servers(cfg.nats_url))


def pod_credentials(cfg: LaunchConfig, rec: JobRecord, stream: str = "") -> dict[str, str]:
    """The NATS user of the pods of job ``rec``, as environment variables (``{}``: none, an open bus).

    With the agents' token secret: ``agent-<job>`` and a token of this job's incarnation, valid
    ``cfg.token_ttl_s`` (to 1.5 times that) from now (which also grants reading ``stream``, a
    streaming job's data: :func:`pacer.authjwt.agent_token`).  Without, the user of the
    executor's ``PACER_POD_NATS_URL`` if it carries one (a stack whose pods share a user: a
    development setup; the credentials still move from the URL into the environment).
    """
    if cfg.agent_secret:
        token = authjwt.agent_token(cfg.agent_secret, rec.job, stream, incarnation=authjwt.incarnation(
            rec.submitted_at), expires=authjwt.token_expiry(cfg.clock(), cfg.token_ttl_s))
        return {"PACER_NATS_USER": security.agent_user(rec.job), "PACER_NATS_PASSWORD": token}
    parts = urlsplit(security.split_servers(cfg.nats_url)[0]) if cfg.nats_url else None
    if parts is not None and parts.username:
        return {"PACER_NATS_USER": unquote(parts.username), "PACER_NATS_PASSWORD": unquote(parts.password or "")}
    return {}


def pod_name(job: str, node: str, generation: int) -> str:
    return f"{job}-{node}-g{generation}"


def worker_config(rec: JobRecord, plan: ResourcePlan, cluster: ClusterDesc, index: int, cfg: LaunchConfig,
                  restore: bool = False, generation: int = 0) -> WorkerConfig:
    spec = rec.spec
    m = spec.model
    per_worker = max(1, spec.batch_size // max(1, plan.workers))
    chief = index == 0
    return WorkerConfig(
        job=rec.job, node=f"worker-{index}", index=index, cluster=cluster.to_json(), data=data_ref(rec).to_json(),
        dataset=spec.dataset.name, nats_url=pod_nats_url(cfg), model=m.name.value,
        model_args={"hash_buckets": m.hash_buckets, "embed_dim": m.embed_dim, "hidden": list(m.hidden),
                    "cross_layers": m.cross_layers, "cin_layers": list(m.cin_layers),
                    "learning_rate": m.learning_rate, "optimizer": m.optimizer},
        mode=spec.mode.value, num_workers=plan.workers, backup_workers=spec.backup_workers,
        batch_size=per_worker, global_batch=per_worker * plan.workers, learning_rate=m.learning_rate,
        ipc=IPC if cfg.agents else "",
        checkpoint_dir=f"{cfg.checkpoint_root}/{rec.job}" if chief and cfg.checkpoint_root else "",
        checkpoint_every=cfg.checkpoint_every if chief and cfg.checkpoint_root else 0,
        restore=restore and chief and bool(cfg.checkpoint_root),
        eval_data=rec.eval_path if chief else "", result=RESULT,
        straggler=_straggler(cfg, f"worker-{index}", generation),
        export_dir=spec.export.path if chief and spec.export is not None else "",
        export_every_s=spec.export.every_s if spec.export is not None else 0.0,
    )


def data_ref(rec: JobRecord) -> DataRef:
    """The job's dataset as its workers open it, in place (the job service checked it at submit)."""
    d = rec.spec.dataset
    ref = DataRef(uri=rec.data_path, format=d.format.value, options=dict(d.options), index_dir=rec.index_dir,
                  schema=dict(d.schema), seed=seed_of(rec.job))
    return replace(ref, columns=dict(rec.columns)) if ref.streaming else ref


def stream_of(rec: JobRecord) -> str:
    """The JetStream stream a job trains on ("" for a file dataset): its pods may read it."""
    return parse_stream_uri(rec.data_path) if data_ref(rec).streaming else ""


def trainer_env(rec: JobRecord, plan: ResourcePlan, cluster: ClusterDesc, role: str, index: int,
                cfg: LaunchConfig, restore: bool = False, generation: int = 0) -> dict[str, str]:
    """The environment of a user's trainer (``spec.trainer``): the user's ``env``, then the SDK contract.

    A worker gets the values the built-in worker gets in its config (its share
    of the global batch, the held-out data and checkpoints on the chief only,
    the agent's IPC file, the pod's bus URL); Pacer's variables win over the
    user's (the spec parser refuses ``PACER_*`` and ``TF_CONFIG`` there anyway).
    """
    spec = rec.spec
    assert spec.trainer is not None
    worker = role == "worker"
    wc = worker_config(rec, plan, cluster, index if worker else 0, cfg, restore, generation)
    env = TrainerEnv(
        job=rec.job, node=f"{role}-{index}", role=role, index=index, ps=cluster.ps, workers=cluster.workers,
        nats_url=wc.nats_url, generation=generation, dataset=spec.dataset.name, data=rec.data_path,
        data_ref=wc.data,
        eval_data=wc.eval_data if worker else "", num_workers=plan.workers, mode=spec.mode.value,
        backup_workers=spec.backup_workers, batch_size=wc.batch_size, global_batch=wc.global_batch,
        learning_rate=spec.model.learning_rate, agent_ipc=wc.ipc if worker else "", result=RESULT,
        checkpoint_dir=wc.checkpoint_dir if worker else "", restore=wc.restore if worker else False,
    )
    return {**spec.trainer.env, **env.to_env()}


def _straggler(cfg: LaunchConfig, node: str, generation: int) -> str:
    table = dict(cfg.stragglers)
    spec = table.get(node, table.get("*", "") if node.startswith("worker-") else "")
    if not spec:
        return ""
    fields = json.loads(spec)
    sticky = bool(fields.pop("sticky", False))
    return json.dumps(fields) if generation == 0 or sticky else ""


THROTTLE_ENV = "PACER_POD_CPU_THROTTLE"  # read by the local pod supervisor (backends/pod.py)


def pod_cpu(cfg: LaunchConfig, node: str, generation: int, cpu: float) -> tuple[float, dict[str, str]]:
    """The pod's CPU limit and extra env under an injected CPU straggler (its slow pods only).

    ``cpu`` with ``start_s`` 0 lowers the pod's limit itself (every backend);
    with ``start_s`` > 0 the limit stays and the local supervisor lowers its
    quota that long after the trainer started (:data:`THROTTLE_ENV`; the
    Kubernetes backend cannot change a running container's limit).
    """
    text = _straggler(cfg, node, generation)
    spec = StragglerSpec.from_json(text) if text else None
    if spec is None or spec.cpu <= 0:
        return cpu, {}
    if spec.start_s > 0:
        return cpu, {THROTTLE_ENV: json.dumps({"cpu": spec.cpu, "start_s": spec.start_s})}
    return (min(cpu, spec.cpu) if cpu > 0 else spec.cpu), {}


def pod_spec(rec: JobRecord, plan: ResourcePlan, cluster: ClusterDesc, role: str, index: int,
             generation: int, cpu: float, memory_mb: int, port: int, cfg: LaunchConfig,
             restore: bool = False) -> PodSpec:
    node = f"{role}-{index}"
    url = pod_nats_url(cfg)
    user = rec.spec.trainer  # the user's own program instead of the built-in trainer
    extra = trainer_env(rec, plan, cluster, role, index, cfg, restore, generation) if user is not None else {}
    # A user's trainer.env may change the first two, never the bus URL or the credentials (the spec
    # parser refuses PACER_* there anyway).
    cpu, throttle = pod_cpu(cfg, node, generation, cpu)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **extra, **throttle,
           **pod_credentials(cfg, rec, stream_of(rec)), "PACER_NATS_URL": url}
    agent: list[str] = []
    if role == "ps":
        command = ["python", "-m", "pacer.trainer.ps", "--cluster", cluster.to_json(), "--index", str(index)]
        if cfg.agents:
            command += ["--ipc", IPC]
        if user is not None and user.ps_command:
            command = list(user.ps_command)
        if cfg.agents:
            agent = ["python", "-m", "pacer.agent.main", "--job", rec.job, "--node", node, "--role", role,
                     "--ipc", IPC, "--nats", url, "--probe", cluster.ps[index]]
            if user is not None and user.ps_command:
                agent.append("--no-rpc")  # the user's PS speaks its own protocol: measured from outside only
    else:
        wc = worker_config(rec, plan, cluster, index, cfg, restore, generation)
        command = ["python", "-m", "pacer.trainer.worker", "--config", wc.to_json()]
        if user is not None:
            command = list(user.command)
        if cfg.agents:
            agent = ["python", "-m", "pacer.agent.main", "--job", rec.job, "--node", node, "--role", role,
                     "--ipc", IPC, "--nats", url]
    # The plan's placement (Dike, from the brain) is a preference, never a condition: a node it does
    # not name goes anywhere, and one whose machine is full by now goes elsewhere (the backend's choice).
    priority_class, queue, gang, gang_size = scheduling_fields(rec, plan)
    return PodSpec(name=pod_name(rec.job, node, generation), job=rec.job, node=node, role=role, index=index,
                   generation=generation, cpu=cpu, memory_mb=memory_mb, command=command, agent=agent,
                   env=env, port=port, machine=plan.placement.get(node, ""),
                   image=user.image if user is not None else "", priority_class=priority_class,
                   queue=queue, gang=gang, gang_size=gang_size)


def scheduling_fields(rec: JobRecord, plan: ResourcePlan) -> tuple[str, str, str, int]:
    """The job's ``scheduling`` section as the PodSpec's ``priority_class``, ``queue``, ``gang`` and
    ``gang_size``: every pod of the job carries the same.

    A gang's size is the plan's PS plus workers at the time the pod is created.
    """
    sched = rec.spec.scheduling
    if sched is None:
        return "", "", "", 0
    gang = "" if sched.gang is GangScheduler.NONE else sched.gang.value
    return sched.priority_class, sched.queue, gang, plan.ps + plan.workers if gang else 0


def parse_result(log_tail: str) -> dict[str, object]:
    """The chief's result: the last line of its output that is a JSON object naming the node."""
    for line in reversed(log_tail.splitlines()):
        line = line.strip()
        if line.startswith(RESULT_PREFIX):
            try:
                out = json.loads(line)
            except ValueError:
                continue
            if isinstance(out, dict):
                return out
    return {}
