"""The job commands of ``pacer`` over the HTTP API (``--api``), with a team's token and no NATS credentials.

The real API service runs over a real nats-server with a tokens file (a viewer and a submitter of
team-a, a submitter of team-b); the job service, the executor and the monitor behind it are
test_job_cli's :class:`ServiceDouble` on the same bus.  The CLI is given an unreachable ``--nats``:
every command must go through the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import test_job_cli
from api_support import SUBMIT_A, SUBMIT_B, VIEWER_A, teams_config
from conftest import InProcess
from pacer.contracts.jobs import JobState, StopRequest, SubmitRequest
from pacer.embedded import EmbeddedNats
from pacer_services.api.app import ApiService
from pacer_services.cli.main import main
from test_job_cli import EXAMPLES, Script, ServiceDouble

double = test_job_cli.double  # the fixture: the job service, executor and monitor behind the API

pytestmark = pytest.mark.timeout(60)

NO_NATS = "nats://127.0.0.1:1"  # nothing listens there


@pytest.fixture
async def api_url(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[str]:
    cfg = teams_config(tmp_path)
    runner = InProcess(nats_server.url, lambda b: ApiService(b, cfg))
    svc = await runner.start()
    yield f"http://127.0.0.1:{svc.port}"
    await runner.stop()


class ApiCli:
    """``pacer ARGS --api URL --nats <nothing>`` in a thread, the token in the environment."""

    def __init__(self, url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.url, self.capsys, self.monkeypatch = url, capsys, monkeypatch

    async def __call__(self, token: str | None, *argv: str) -> tuple[int, str, str]:
        for env in ("PACER_API_TOKEN", "PACER_API_TOKEN_FILE"):
            self.monkeypatch.delenv(env, raising=False)
        if token is not None:
            self.monkeypatch.setenv("PACER_API_TOKEN", token)
        self.capsys.readouterr()
        rc = await asyncio.to_thread(main, [*argv, "--api", self.url, "--nats", NO_NATS])
        out, err = self.capsys.readouterr()
        return rc, out, err


@pytest.fixture
def cli(api_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> ApiCli:
    return ApiCli(api_url, capsys, monkeypatch)


async def test_a_teams_submitter_submits_lists_shows_logs_and_stops_through_the_api(
        cli: ApiCli, double: ServiceDouble) -> None:
    rc, out, err = await cli(SUBMIT_A, "submit", str(EXAMPLES / "wide_deep.yaml"))
    assert (rc, err) == (0, ""), err
    assert out.split() == ["wide-deep-demo", "submitted"]
    [(svc, op, req)] = double.requests
    assert (svc, op) == ("jobs", "submit") and isinstance(req, SubmitRequest)
    assert req.namespace == "team-a"  # the token's only namespace
    assert req.spec == (EXAMPLES / "wide_deep.yaml").read_text()

    rc, out, _ = await cli(SUBMIT_A, "jobs", "--json")
    assert rc == 0 and [j["job"] for j in json.loads(out)] == ["wide-deep-demo"]

    rc, out, err = await cli(SUBMIT_A, "job", "wide-deep-demo")
    assert rc == 0, err
    summary, nodes, speed = out.split("\n\n")  # the API joined the executor's and the monitor's parts
    assert "state      submitted" in summary
    assert sorted(line.split()[0] for line in nodes.splitlines()[2:]) == ["ps-0", "ps-1", "worker-0", "worker-1"]
    assert speed.splitlines()[0] == "throughput 1333.3 samples/s"

    rc, out, _ = await cli(SUBMIT_A, "logs", "wide-deep-demo", "--tail", "2")
    assert rc == 0 and out.splitlines() == ["step 3", "step 4"]

    rc, out, _ = await cli(SUBMIT_A, "stop", "wide-deep-demo", "--reason", "enough")
    assert rc == 0 and out.split() == ["wide-deep-demo", "stopped", "(enough)"]
    assert [r for _, op, r in double.requests if op == "stop"] == [StopRequest("wide-deep-demo", "enough")]


async def test_submit_wait_follows_the_job_over_the_api(cli: ApiCli, double: ServiceDouble) -> None:
    double.scripts["wide-deep-demo"] = Script([(JobState.RUNNING, 3), (JobState.COMPLETED, 10)])
    rc, out, err = await cli(SUBMIT_A, "submit", str(EXAMPLES / "wide_deep.yaml"), "--wait", "--interval", "0.01")
    assert rc == 0, err
    assert out.strip().splitlines()[-1].startswith("job wide-deep-demo completed")


async def test_a_viewer_cannot_submit_or_stop_and_nothing_reaches_the_job_service(
        cli: ApiCli, double: ServiceDouble) -> None:
    double.add("alpha", namespace="team-a")
    rc, _, err = await cli(VIEWER_A, "submit", str(EXAMPLES / "wide_deep.yaml"))
    assert rc == 1 and "[forbidden]" in err and "submitter role" in err
    rc, _, err = await cli(VIEWER_A, "stop", "alpha")
    assert rc == 1 and "[forbidden]" in err
    assert [op for _, op, _ in double.requests if op in ("submit", "stop")] == []
    rc, out, _ = await cli(VIEWER_A, "job", "alpha", "--json")  # but it may look
    assert rc == 0 and json.loads(out)["job"]["namespace"] == "team-a"


async def test_another_teams_job_is_not_found_and_not_listed(cli: ApiCli, double: ServiceDouble) -> None:
    double.add("theirs", namespace="team-b")
    double.add("ours", namespace="team-a")
    for argv in (("job", "theirs"), ("stop", "theirs"), ("logs", "theirs")):
        rc, out, err = await cli(SUBMIT_A, *argv)
        assert rc == 1 and out == ""
        assert err.strip() == f"pacer {argv[0]}: no job named 'theirs' [not_found]"
    rc, out, _ = await cli(SUBMIT_A, "jobs", "--json")
    assert rc == 0 and [j["job"] for j in json.loads(out)] == ["ours"]
    rc, _, err = await cli(SUBMIT_B, "submit", str(EXAMPLES / "wide_deep.yaml"), "--namespace", "team-a")
    assert rc == 1 and "[forbidden]" in err and "team-a" in err


async def test_the_token_comes_from_the_environment_or_a_file_and_a_wrong_one_is_refused(
        cli: ApiCli, double: ServiceDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    double.add("alpha", namespace="team-a")
    rc, out, err = await cli(None, "job", "alpha")
    assert rc == 2 and out == ""
    assert "PACER_API_TOKEN" in err and "never taken from the command line" in err
    rc, _, err = await cli("not-a-known-token-0123456789abcdef", "job", "alpha")
    assert rc == 1 and "[unauthorized]" in err
    token_file = tmp_path / "token"
    token_file.write_text(VIEWER_A + "\n")
    monkeypatch.delenv("PACER_API_TOKEN")  # the file is read when the variable is unset
    monkeypatch.setenv("PACER_API_TOKEN_FILE", str(token_file))
    capsys_rc = await asyncio.to_thread(main, ["job", "alpha", "--json", "--api", cli.url, "--nats", NO_NATS])
    out, err = cli.capsys.readouterr()
    assert capsys_rc == 0, err
    assert json.loads(out)["job"]["job"] == "alpha"


async def test_history_says_it_needs_nats(cli: ApiCli) -> None:
    rc, _, err = await cli(SUBMIT_A, "history")
    assert rc == 2 and "over NATS" in err


async def test_an_unreachable_api_exits_1(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACER_API_TOKEN", SUBMIT_A)
    rc = await asyncio.to_thread(main, ["jobs", "--api", "http://127.0.0.1:1", "--nats", NO_NATS])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot reach the API at http://127.0.0.1:1" in err and "[unavailable]" in err


def test_the_token_is_not_an_option() -> None:
    """A token on the command line is in ``ps`` for every local user: there is no option for it."""
    buf = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(buf):
        main(["submit", "--help"])
    assert "--api" in buf.getvalue() and "--token" not in buf.getvalue()
