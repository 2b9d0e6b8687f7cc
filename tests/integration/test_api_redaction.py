"""What the API shows of a running job's pods carries no bus credential.

Each pod of job J gets the user ``agent-J`` and its token in its environment
(``PACER_NATS_USER`` / ``PACER_NATS_PASSWORD``: services/pod_executor/launch.py,
with the executor's agent token secret), and a pod's log, an exit reason or
an event may quote them: a trainer that prints its environment, or the URL
it built from it (``nats://agent-J:<token>@...``) and could not reach.  The pods here are the ones launch.py really builds for the job;
the executor's answers (status, logs) and its node events quote them.  Every
API view (the job, its logs, the dashboard's event stream, an error) shows
the user ``agent-J`` but never the token.  Peers are api_support's double on a
real nats-server.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pytest
from api_support import Client, PeerDouble, api_service, executor_status, http, read_sse  # noqa: F401
from nats.aio.msg import Msg
from pacer import authjwt, codec, security, subjects
from pacer.bus import Bus
from pacer.contracts.executor import LogsQuery, LogsReply, PodSpec
from pacer.contracts.nodes import NodeEvent
from pacer.trainer.cluster import ClusterDesc
from pacer_services.pod_executor import launch

pytestmark = pytest.mark.timeout(60)

SECRET = "executor-agent-secret"
JOB = "secret1"


@dataclass
class QuotingPeers(PeerDouble):  # type: ignore[misc]  # (api_support is a test module mypy does not follow)
    """api_support's double whose executor answers a node's logs with ``printed[node]``: what its pod printed."""

    printed: dict[str, str] = field(default_factory=dict)

    async def _logs(self, job: str, msg: Msg) -> None:
        q = codec.decode(LogsQuery, msg.data)
        await self.bus.respond(msg, LogsReply(job, q.node, f"{job}-{q.node}-g0", self.printed[q.node]))


@pytest.fixture
async def peers(bus: Bus) -> AsyncIterator[QuotingPeers]:
    double = await QuotingPeers(bus).start()
    yield double
    await double.stop()


def pods(peers: PeerDouble) -> list[PodSpec]:
    """The pods launch.py builds for the running job (a worker with its agent, a PS), with per-job credentials."""
    rec = peers.add_running(JOB)
    assert rec.plan is not None
    cluster = ClusterDesc(("ps-0.secret1:2222",), ("worker-0.secret1:2222", "worker-1.secret1:2222"))
    cfg = launch.LaunchConfig("nats://nats:4222", "/ckpt", agent_secret=SECRET)
    return [launch.pod_spec(rec, rec.plan, cluster, role, 0, 0, 1.0, 1024, 2222, cfg) for role in ("worker", "ps")]


def with_user(spec: PodSpec) -> str:
    """The URL a trainer builds from its environment (user and password in it) and may print."""
    return security.with_credentials(spec.env["PACER_NATS_URL"], spec.env["PACER_NATS_USER"],
                                     spec.env["PACER_NATS_PASSWORD"])


def shown(spec: PodSpec) -> str:
    """What a trainer that prints its argv, its environment and the URL it connects to writes to its log."""
    env = "\n".join(f"{k}={v}" for k, v in sorted(spec.env.items()))
    return (f"argv: {' '.join(spec.command)}\nagent argv: {' '.join(spec.agent)}\n{env}\n"
            f"connecting to {with_user(spec)}\nstep 1 loss=0.5")


async def test_the_api_shows_no_agent_token_of_a_running_jobs_pods(http: Client, peers: QuotingPeers,  # noqa: F811
                                                                   bus: Bus) -> None:
    specs = pods(peers)
    token = specs[0].env["PACER_NATS_PASSWORD"]
    # The credentials are really there in what is launched (else this test would prove nothing): in the
    # pods' environment, and never in an argv (which every local user reads with `ps`).
    assert authjwt.token_ok(SECRET, JOB, token, time.time())
    assert all(spec.env["PACER_NATS_PASSWORD"] == token for spec in specs)
    assert all(token not in " ".join([*spec.command, *spec.agent]) for spec in specs)
    url = with_user(specs[0])
    status = executor_status(JOB)
    status = replace(status, nodes=[replace(n, last_reason=f"exit 1: no servers available at {url}")
                                    for n in status.nodes])
    peers.executor[JOB] = status
    peers.printed = {s.node: shown(s) for s in specs}

    seen: list[str] = []
    code, body = await http.call("GET", f"/api/v1/jobs/{JOB}")
    assert code == 200, body
    seen.append(str(body))
    assert all(f"agent-{JOB}:***@" in n["last_reason"] for n in body["nodes"]["nodes"]), body["nodes"]
    for node in ("worker-0", "ps-0"):
        code, body = await http.call("GET", f"/api/v1/jobs/{JOB}/logs?node={node}")
        assert code == 200, body
        assert f"agent-{JOB}:***@nats:4222" in body["text"] and "step 1 loss=0.5" in body["text"], body["text"]
        seen.append(body["text"])

    # The dashboard's stream: a node event whose reason quotes the command line.
    await bus.publish_durable(subjects.node_event(JOB, "died"),
                              NodeEvent(job=JOB, node="worker-0", kind="died", ts=time.time(), role="worker",
                                        reason=f"exited running {' '.join(specs[0].command)} against {url}"))
    async with http.session.get(f"/api/v1/events?job={JOB}") as resp:
        events = await read_sse(resp, "replayed")
    (died,) = [data for name, data in events if name == "node.died"]
    assert f"agent-{JOB}:***@" in died["reason"]
    seen.append(str(events))

    for text in seen:
        assert token not in text
        assert SECRET not in text
