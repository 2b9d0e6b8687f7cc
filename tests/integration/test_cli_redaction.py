"""``pacer logs`` and ``pacer job`` mask the bus credentials a pod's log or a job's reason quotes.

Each pod of job J runs with ``nats://agent-J:<token>@...`` (launch.py); a
trainer that prints its environment, or a failure reason naming the URL,
would put the token on the user's terminal.  Peers are test_job_cli's
double on a real nats-server.
"""

from __future__ import annotations

import json

from pacer import authjwt, security
from pacer.contracts.jobs import JobState
from test_job_cli import Cli, ServiceDouble, cli, double  # noqa: F401

TOKEN = authjwt.agent_token("the-executors-secret", "alpha", incarnation=authjwt.incarnation(1.7e9),
                            expires=1_800_000_000)
URL = security.with_credentials("nats://nats:4222", "agent-alpha", TOKEN)


async def test_logs_and_job_show_the_user_but_not_the_token(cli: Cli, double: ServiceDouble) -> None:  # noqa: F811
    double.add("alpha", JobState.FAILED, reason=f"worker-0 failed: no servers available at {URL}")
    double.log_lines = [f"PACER_NATS_URL={URL}", "PACER_NATS_PASSWORD=", "step 1"]
    outs = []
    for argv in (("logs", "alpha", "--node", "worker-0"), ("logs", "alpha", "--node", "worker-0", "--json"),
                 ("job", "alpha"), ("job", "alpha", "--json")):
        rc, out, err = await cli(*argv)
        assert rc == 0, (argv, err)
        outs.append(out + err)
    logs, logs_json, job, job_json = outs
    assert logs.splitlines() == ["PACER_NATS_URL=nats://agent-alpha:***@nats:4222", "PACER_NATS_PASSWORD=", "step 1"]
    assert "agent-alpha:***@" in json.loads(logs_json)["text"]
    assert "agent-alpha:***@" in job and "agent-alpha:***@" in json.loads(job_json)["job"]["reason"]
    for out in outs:
        assert TOKEN not in out
