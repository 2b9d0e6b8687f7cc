"""The ``pacer`` command line: a thin client of the bus.

    pacer up [--data-dir D] [--port P]   the embedded stack in the foreground
    pacer demo                           a whole Wide&Deep job on the embedded stack
    pacer sim SCENARIO [--method M]      a cluster scenario in the simulator (examples/sim/)
    pacer status JOB DATASET             a dataset's shard status (JSON)
    pacer submit | jobs | job | logs | stop   training jobs (.jobs)
    pacer data gen | convert             Criteo-like data (.data)
    pacer train local                    a small TF job on this machine (pacer.trainer.train_cli)
    pacer schemas export | check         proto-schemas/
    pacer version
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pacer import __version__
from pacer.codec import to_dict
from pacer.extras import DISTRIBUTION, require_or_exit

if TYPE_CHECKING:
    from pacer_services.cli.stack import Stack


def _default_url() -> str:
    """``$PACER_NATS_URL``, else the URL of ``pacer up``'s context (``$PACER_CONTEXT``, ``./.pacer/context.json``)."""
    from pacer.errors import ValidationError
    from pacer.security import default_url

    try:
        return default_url(os.environ)
    except ValidationError:  # a broken context: Bus.connect says so when a command connects
        return os.environ.get("PACER_NATS_URL", "nats://127.0.0.1:4222")


def cmd_up(args: argparse.Namespace) -> int:
    require_or_exit("embedded", "pacer up (a local nats-server)")
    from pacer_services.cli.stack import Stack

    if args.cluster < 1:
        print("pacer up: --cluster must be at least 1", file=sys.stderr)
        return 2
    stack = Stack(Path(args.data_dir), port=args.port, cluster=args.cluster)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack.start()
    for line in up_banner(stack, os.environ.get("PACER_API_PORT", "8750")):
        print(line)
    try:
        while not stopping:
            dead = stack.check()
            for name in dead:
                print(f"service {name} exited ({stack.procs[name].returncode}); restarting", file=sys.stderr)
                stack.start_service(name)
            time.sleep(0.5)
    finally:
        print("pacer up: stopping")
        stack.stop()
    return 0


def up_banner(stack: Stack, api_port: str) -> list[str]:
    """What ``pacer up`` prints: where things are, and ``export`` lines that hold no credential.

    The operator's NATS credentials stay in the context file (mode 0600); the
    CLI and ``Bus.connect`` read it through ``PACER_CONTEXT``.  The API token
    stays in its file (mode 0600): the dashboard's sign-in page and the CLI's
    ``PACER_API_TOKEN_FILE`` take it from there.
    """
    tls = f"TLS, CA {stack.ca_file.resolve()}" if stack.ca_file is not None else "no TLS (PACER_NATS_TLS=0)"
    ctx = stack.context_file.resolve()
    return [
        f"pacer up: NATS at {stack.bare_url} ({tls}); services: {', '.join(stack.procs)}; logs in {stack.data_dir}",
        f"pacer up: NATS credentials (user admin) in {ctx} (mode 0600)",
        f"pacer up: dashboard at {stack.dashboard_url(api_port)} (sign in with the API token in "
        f"{stack.api_token_file.resolve()}, mode 0600)",
        f"pacer up: HTTP API at http://127.0.0.1:{api_port}/api/ with 'Authorization: Bearer <that token>'",
        f"export PACER_CONTEXT={ctx} PACER_NATS_URL={stack.bare_url}   # Ctrl-C stops everything",
        f"# or, for the job commands over the HTTP API instead of NATS: export "
        f"PACER_API_URL=http://127.0.0.1:{api_port} PACER_API_TOKEN_FILE={stack.api_token_file.resolve()}",
    ]


def cmd_status(args: argparse.Namespace) -> int:
    from pacer.shards.client import ShardAdmin
    from pacer_services.cli import jobs

    async def body(client: jobs.JobClient) -> int:
        st = await ShardAdmin(client.bus).status(args.job, args.dataset)
        print(json.dumps(to_dict(st), indent=2, default=str))
        return 0

    # Like every bus command: gives up on an unreachable NATS after seconds, an error reply is a message.
    rc: int = jobs._run("status", args.url, body)
    return rc


def cmd_demo(args: argparse.Namespace) -> int:
    require_or_exit("embedded", "pacer demo (a local nats-server)")
    require_or_exit("trainer", "pacer demo (TensorFlow PS and workers)")
    from pacer_services.cli import demo

    return int(demo.main(args))


def cmd_train_local(args: argparse.Namespace) -> int:
    require_or_exit("trainer", "pacer train local")
    if not args.url:
        require_or_exit("embedded", "pacer train local without --url (a local nats-server)")
    from pacer.trainer import train_cli
    from pacer_services.cli.stack import Stack

    def start_stack(data_dir: Path) -> Stack:
        """Without ``--url`` or ``$PACER_NATS_URL`` the job gets a stack of its own: shard service and monitor."""
        return Stack(data_dir, services=["shard", "monitor"]).start()

    return train_cli.main(args, start_stack=start_stack)


def cmd_schemas(args: argparse.Namespace) -> int:
    from pacer import schemas

    return schemas.main([args.action, *([args.dir] if args.dir else [])])


def cmd_sim(args: argparse.Namespace) -> int:
    """The simulator drives the services' decision cores, so it lives beside them (pacer_services)."""
    from pacer_services.simulator import cli as sim_cli

    return int(sim_cli.main(list(args.args)))


def main(argv: list[str] | None = None) -> int:
    from pacer.telemetry import quiet_asyncio_ssl

    quiet_asyncio_ssl()
    p = argparse.ArgumentParser(prog="pacer", description="Pacer control plane")
    p.add_argument("--version", action="version", version=f"pacer {__version__} ({DISTRIBUTION})")
    sub = p.add_subparsers(dest="cmd", required=True)
    from pacer_services.cli.data import add_cli as add_data_cli
    add_data_cli(sub)
    from pacer_services.cli.jobs import add_cli as add_job_cli
    add_job_cli(sub)
    sub.add_parser("version", help="print the version").set_defaults(fn=lambda a: print(__version__) or 0)

    sim = sub.add_parser("sim", help="run a cluster scenario in the discrete-event simulator (examples/sim/)",
                         add_help=False)
    sim.add_argument("args", nargs=argparse.REMAINDER, help="SCENARIO [--method M] [--seed S] [--json]")
    sim.set_defaults(fn=cmd_sim)

    up = sub.add_parser("up", help="run the embedded stack (nats-server + services) in the foreground")
    up.add_argument("--data-dir", default=".pacer", help="JetStream store and service logs")
    up.add_argument("--port", type=int, default=4222)
    up.add_argument("--cluster", type=int, default=1, metavar="N",
                    help="N clustered nats-servers on free loopback ports (JetStream replicas min(N, 3)); "
                         "kill one and the stack carries on")
    up.set_defaults(fn=cmd_up)

    st = sub.add_parser("status", help="a dataset's shard status")
    st.add_argument("job")
    st.add_argument("dataset")
    st.add_argument("--url", default=_default_url())
    st.set_defaults(fn=cmd_status)

    demo = sub.add_parser("demo", help="start the stack and run a whole Wide&Deep job with no resource config")
    demo.add_argument("--rows", type=int, default=1_000_000, help="training rows to generate")
    demo.add_argument("--seed", type=int, default=1)
    demo.add_argument("--api-port", type=int, default=0, help="dashboard port (0: a free one)")
    demo.add_argument("--timeout", type=float, default=900.0)
    demo.add_argument("--keep", action="store_true", help="keep the stack and dashboard running at the end")
    demo.add_argument("--kill-one", action="store_true", default=True,
                      help="kill -9 one worker's TensorFlow process midway: it is relaunched (default on)")
    demo.add_argument("--no-kill", dest="kill_one", action="store_false")
    demo.add_argument("--data-dir", default=".pacer/demo")
    demo.set_defaults(fn=cmd_demo)

    tr = sub.add_parser("train", help="training jobs")
    trs = tr.add_subparsers(dest="train_cmd", required=True)
    tl = trs.add_parser("local", help="a small TF PS job on this machine (PS, workers, agents as processes)")
    tl.add_argument("--job", default="local")
    tl.add_argument("--model", default="wide_deep", choices=["wide_deep", "xdeepfm", "dcn"])
    tl.add_argument("--data", help="record file (default: generate --rows rows into --work-dir)")
    tl.add_argument("--eval-data", help="held-out record file (default: generated beside --data)")
    tl.add_argument("--rows", type=int, default=1_000_000)
    tl.add_argument("--ps", type=int, default=2)
    tl.add_argument("--workers", type=int, default=2)
    tl.add_argument("--mode", default="asp", choices=["asp", "bsp"])
    tl.add_argument("--batch-size", type=int, default=256, help="per worker")
    tl.add_argument("--backup-workers", type=int, default=0)
    tl.add_argument("--epochs", type=int, default=1)
    tl.add_argument("--agents", action="store_true", help="start an agent sidecar beside every worker")
    tl.add_argument("--straggler", action="append", default=[], metavar="INDEX:SLEEP_S[:transient]",
                    help="make worker INDEX sleep SLEEP_S per step (persistent unless :transient)")
    tl.add_argument("--work-dir", default=".pacer/train")
    tl.add_argument("--url", default=None, help="NATS of a running stack (default: start an embedded one)")
    tl.set_defaults(fn=cmd_train_local)

    sc = sub.add_parser("schemas", help="export or check proto-schemas/")
    sc.add_argument("action", choices=["export", "check"])
    sc.add_argument("dir", nargs="?")
    sc.set_defaults(fn=cmd_schemas)

    args = p.parse_args(argv)
    rc: int = args.fn(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
