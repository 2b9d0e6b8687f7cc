"""Identities on the API: roles and namespaces, tested against the real API service over a real nats-server.

Three callers from a tokens file (their tokens only as SHA-256): a viewer and a submitter of team-a, a
submitter of team-b; and the shared token, an admin of every namespace.  A viewer cannot submit or stop;
team A cannot see, stop, read the logs of or stream team B's jobs; every mutating request is audited on
``pacer.events.api.<job>.audit``.  (The peer double, the API service and its client: api_support.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import api_support
import pytest
import yaml
from api_support import (
    AUTH,
    JSON,
    SPEC_YAML,
    SUBMIT_A,
    SUBMIT_B,
    TOKEN,
    VIEWER_A,
    Client,
    PeerDouble,
    executor_status,
    read_sse,
    teams_config,
)
from conftest import InProcess
from nats.aio.msg import Msg
from pacer import codec, subjects
from pacer.bus import Bus
from pacer.contracts.jobs import AuditRecord, JobState
from pacer.embedded import EmbeddedNats
from pacer.errors import ValidationError
from pacer_services.api import identity
from pacer_services.api.app import ApiService

peers = api_support.peers

pytestmark = pytest.mark.timeout(60)

def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def api(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[ApiService]:
    cfg = teams_config(tmp_path)
    runner = InProcess(nats_server.url, lambda b: ApiService(b, cfg))
    yield await runner.start()
    await runner.stop()


@pytest.fixture
async def http(api: ApiService) -> AsyncIterator[Client]:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api.port}") as session:
        yield Client(session)


@pytest.fixture
async def audit(bus: Bus) -> AsyncIterator[list[AuditRecord]]:
    """Every audit record published from now on."""
    got: list[AuditRecord] = []

    async def on_msg(msg: Msg) -> None:
        got.append(codec.decode(AuditRecord, msg.data))

    sub = await bus.nc.subscribe(subjects.events_of("api", kind="audit"), cb=on_msg)
    await bus.nc.flush()
    yield got
    await sub.unsubscribe()


async def wait_for(check: object, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def submit(http: Client, token: str, name: str, query: str = "") -> tuple[int, dict[str, object]]:
    return await http.call("POST", f"/api/v1/jobs{query}", json={"spec": SPEC_YAML.format(name=name)},
                           headers={**bearer(token), **JSON})


async def test_a_submission_lands_in_the_callers_namespace_and_only_there(
        http: Client, peers: PeerDouble, audit: list[AuditRecord]) -> None:
    status, body = await submit(http, SUBMIT_A, "a-one")
    assert status == 201 and body["namespace"] == "team-a", body  # the caller's only namespace
    assert peers.records["a-one"].namespace == "team-a"
    status, body = await submit(http, SUBMIT_A, "a-two", "?namespace=team-b")
    assert status == 403 and body["error"]["code"] == "forbidden" and "team-b" in body["error"]["message"], body
    status, body = await submit(http, SUBMIT_A, "a-three", "?namespace=Team_A")
    assert status == 400 and "namespace" in body["error"]["message"], body
    status, body = await submit(http, TOKEN, "any-ns", "?namespace=team-b")  # an admin of every namespace
    assert status == 201 and body["namespace"] == "team-b", body
    assert set(peers.records) == {"a-one", "any-ns"}  # nothing refused reached the job service

    await wait_for(lambda: len(audit) >= 4, "an audit record for every submission")
    by_job = {(r.job, r.outcome): r for r in audit}
    ok = by_job[("a-one", "ok")]
    assert (ok.who, ok.role, ok.namespace, ok.status, ok.action) == (
        "sam", "submitter", "team-a", 201, "POST /api/v1/jobs")
    assert ok.remote == "127.0.0.1" and ok.ts > 0
    refused = by_job[("", "forbidden")]  # refused before its body was read: no job named
    assert (refused.who, refused.namespace, refused.status) == ("sam", "team-b", 403)
    assert by_job[("any-ns", "ok")].who == identity.SHARED_NAME


async def test_a_viewer_reads_its_teams_jobs_but_cannot_submit_or_stop(
        http: Client, peers: PeerDouble, audit: list[AuditRecord]) -> None:
    peers.add_running("a-job", namespace="team-a")
    status, body = await http.call("GET", "/api/v1/jobs/a-job", headers=bearer(VIEWER_A))
    assert status == 200 and body["job"]["job"] == "a-job"
    status, body = await submit(http, VIEWER_A, "viewer-job")
    assert status == 403 and "submitter" in body["error"]["message"], body
    status, body = await http.call("POST", "/api/v1/jobs/a-job/stop", json={}, headers={**bearer(VIEWER_A), **JSON})
    assert status == 403 and body["error"]["code"] == "forbidden", body
    assert peers.records["a-job"].state is JobState.RUNNING and "viewer-job" not in peers.records
    await wait_for(lambda: len(audit) >= 2, "the refused requests audited")
    assert {(r.who, r.role, r.outcome, r.status) for r in audit} == {("vera", "viewer", "forbidden", 403)}
    assert {r.job for r in audit} == {"", "a-job"}


async def test_team_a_cannot_see_stop_read_or_stream_team_bs_jobs(
        api: ApiService, http: Client, peers: PeerDouble, audit: list[AuditRecord]) -> None:
    peers.add_running("a-job", namespace="team-a")
    peers.add_running("b-job", namespace="team-b")
    peers.executor["b-job"] = executor_status("b-job")
    for token, mine, theirs in ((SUBMIT_A, "a-job", "b-job"), (SUBMIT_B, "b-job", "a-job")):
        status, body = await http.call("GET", "/api/v1/jobs", headers=bearer(token))
        assert status == 200 and [r["job"] for r in body["jobs"]] == [mine], body
        status, body = await http.call("GET", f"/api/v1/jobs/{mine}", headers=bearer(token))
        assert status == 200
        # Another team's job is a job that does not exist: the same 404 and words as an unknown name.
        _, unknown = await http.call("GET", "/api/v1/jobs/no-such-job", headers=bearer(token))
        for method, path in (("GET", f"/api/v1/jobs/{theirs}"), ("GET", f"/api/v1/jobs/{theirs}/logs?node=worker-0"),
                             ("POST", f"/api/v1/jobs/{theirs}/stop"), ("GET", f"/api/v1/events?job={theirs}")):
            status, body = await http.call(method, path, json={} if method == "POST" else None,
                                           headers={**bearer(token), **JSON})
            assert status == 404, (token, method, path, status, body)
            assert body["error"]["message"] == unknown["error"]["message"].replace("no-such-job", theirs), body
    assert all(r.state is JobState.RUNNING for r in peers.records.values())
    status, body = await http.call("GET", "/api/v1/jobs", headers=AUTH)  # the admin sees both teams
    assert status == 200 and {r["job"] for r in body["jobs"]} == {"a-job", "b-job"}

    # Team B's own stream works, and a stop by team B is audited with its namespace.
    async with http.session.get("/api/v1/events?job=b-job&replay=0", headers=bearer(SUBMIT_B)) as resp:
        assert resp.status == 200
        await read_sse(resp, ":", timeout=10.0)  # the first keep-alive: the stream is live
    status, body = await http.call("POST", "/api/v1/jobs/b-job/stop", json={"reason": "done"},
                                   headers={**bearer(SUBMIT_B), **JSON})
    assert status == 200 and body["state"] == "stopped", body
    await wait_for(lambda: any(r.outcome == "ok" for r in audit), "the stop audited")
    stop = next(r for r in audit if r.outcome == "ok")
    assert (stop.who, stop.job, stop.namespace, stop.action) == ("bo", "b-job", "team-b",
                                                                  "POST /api/v1/jobs/{job}/stop")
    assert {(r.who, r.job, r.outcome) for r in audit if r.outcome != "ok"} == {
        ("sam", "b-job", "not_found"), ("bo", "a-job", "not_found")}


async def test_an_unknown_token_is_audited_without_a_name(http: Client, peers: PeerDouble,
                                                          audit: list[AuditRecord]) -> None:
    peers.add_running("a-job", namespace="team-a")
    status, _ = await http.call("POST", "/api/v1/jobs/a-job/stop", json={},
                                headers={**bearer("not-a-known-token-0123456789"), **JSON})
    assert status == 401
    await wait_for(lambda: len(audit) >= 1, "the refused stop audited")
    assert (audit[0].who, audit[0].role, audit[0].job, audit[0].outcome) == ("", "", "a-job", "unauthorized")


def test_a_bad_tokens_file_names_every_bad_entry(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [
        {"name": "ok", "role": "viewer", "namespaces": ["team-a"], "sha256": identity.token_hash("x" * 20)},
        {"name": "bad name", "role": "owner", "namespaces": [], "sha256": "abc", "extra": 1},
        {"name": "dup", "role": "admin", "namespaces": ["*"], "sha256": identity.token_hash("x" * 20)},
    ]}))
    with pytest.raises(ValidationError) as err:
        identity.load_tokens_file(path)
    text = err.value.message
    for part in ("tokens[1].name", "tokens[1].role", "tokens[1].namespaces", "tokens[1].sha256",
                 "tokens[1]: unknown keys ['extra']", "tokens[2].sha256: the same token as 'ok'"):
        assert part in text, (part, text)
    assert "tokens[0]" not in text
    with pytest.raises(ValidationError, match="no token"):
        identity.identities("", {})
