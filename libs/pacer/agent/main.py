"""Entry point of the agent sidecar.

``python -m pacer.agent.main --job J --node N --role worker|ps --ipc PATH
[--nats URL] [--k 10] [--election-ttl 3] [--probe HOST:PORT]``

A PS's agent (``--role ps``) times a small TF RPC to ``--probe`` every
``--probe-every`` s and reports every ``--report-every`` s (see
:mod:`pacer.agent.agent`, "Servers").

Runs until SIGTERM/SIGINT, or until the bus has refused the pod's credentials
for ``--give-up-refused`` seconds: it then exits with 77
(:data:`pacer.contracts.executor.EXIT_REFUSED`), and the pod with it.  The
trainer beside it attaches to the same ``--ipc`` file (:class:`pacer.agent.ipc.TrainerIPC`; the launcher usually
passes it as ``$PACER_AGENT_IPC``); the agent waits for the file to appear.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pacer import telemetry
from pacer.agent.agent import AgentConfig, AgentService
from pacer.agent.ipc import default_path
from pacer.bus import DEFAULT_GIVE_UP_REFUSED_S, DEFAULT_URL, GIVE_UP_REFUSED_ENV, Bus
from pacer.contracts.executor import EXIT_REFUSED
from pacer.runtime import Refused, RuntimeConfig, run_service


def parse(argv: Sequence[str] | None = None) -> tuple[AgentConfig, RuntimeConfig]:
    p = argparse.ArgumentParser(prog="python -m pacer.agent.main", description="Pacer agent sidecar")
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True, help="this node's id, e.g. worker-0")
    p.add_argument("--role", default="worker", choices=["worker", "ps", "chief"])
    p.add_argument("--ipc", type=Path, default=None, help="IPC file shared with the trainer (default /dev/shm/pacer-<job>-<node>.ipc)")
    p.add_argument("--nats", default=os.environ.get("PACER_NATS_URL", DEFAULT_URL))
    p.add_argument("--k", type=int, default=10, help="publish metrics every k trainer steps")
    p.add_argument("--worker-report", type=float, default=os.environ.get("PACER_AGENT_WORKER_REPORT_S", "4"),
                   help="a worker reports after fewer than k steps when k take longer than this many seconds "
                        "($PACER_AGENT_WORKER_REPORT_S)")
    p.add_argument("--election-ttl", type=float, default=3.0, help="seconds; the primary refreshes every ttl/3")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument("--member-ttl", type=float, default=3.0, help="an agent not heard for this long leaves the barrier")
    p.add_argument("--prepare-lead", type=float, default=0.5, help="seconds of the fastest worker's steps before T")
    p.add_argument("--probe", default="", help="role ps: the TF server's host:port to time RPCs against")
    p.add_argument("--no-rpc", action="store_true",
                   help="role ps: the server at --probe is not TF's (a user's ps_command): find its process by "
                        "the port, send it nothing")
    # Environment defaults as strings: argparse converts them with `type`, so a bad one is a usage error.
    p.add_argument("--probe-every", type=float, default=os.environ.get("PACER_AGENT_PROBE_EVERY_S", "0.25"),
                   help="role ps: seconds between probes ($PACER_AGENT_PROBE_EVERY_S)")
    p.add_argument("--report-every", type=float, default=os.environ.get("PACER_AGENT_REPORT_EVERY_S", "2"),
                   help="role ps: seconds between metrics reports ($PACER_AGENT_REPORT_EVERY_S)")
    p.add_argument("--give-up-refused", type=float,
                   default=os.environ.get(GIVE_UP_REFUSED_ENV, str(DEFAULT_GIVE_UP_REFUSED_S)),
                   help="exit with 77 (the pod ends with it) once the bus has refused this pod's credentials "
                        "for this many seconds: its job was torn down or its token expired; 0 = never "
                        "($PACER_AGENT_GIVE_UP_REFUSED_S)")
    a = p.parse_args(argv)
    try:
        cfg = AgentConfig(
            job=a.job,
            node=a.node,
            role=a.role,
            ipc_path=a.ipc or default_path(a.job, a.node),
            k=a.k,
            worker_report_s=a.worker_report,
            election_ttl_s=a.election_ttl,
            heartbeat_s=a.heartbeat,
            member_ttl_s=a.member_ttl,
            prepare_lead_s=a.prepare_lead,
            probe=a.probe,
            probe_rpc=not a.no_rpc,
            probe_every_s=a.probe_every,
            report_every_s=a.report_every,
        )
    except Exception as exc:  # ids and ranges: a usage error, not a traceback
        p.error(str(exc))
    rc = RuntimeConfig(nats_url=a.nats, instance=cfg.instance, give_up_refused_s=a.give_up_refused)
    return cfg, rc


def main(argv: Sequence[str] | None = None) -> None:
    cfg, rc = parse(argv)
    telemetry.setup("agent")

    async def factory(bus: Bus, _: RuntimeConfig) -> AgentService:
        return AgentService(bus, cfg)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(run_service(factory, rc))
    except Refused as exc:
        print(f"agent: {exc}: exiting with {EXIT_REFUSED}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)


if __name__ == "__main__":
    main(sys.argv[1:])
