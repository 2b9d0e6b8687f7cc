"""Authentication and cross-site requests: every API request needs the bearer token (never in the URL),
mutating requests must be JSON, and the API refuses to start without a token.
(The peer double, the API service and its client: api_support.)"""

from __future__ import annotations

import aiohttp
import api_support
import pytest
from api_support import AUTH, SPEC_YAML, TOKEN, Client, PeerDouble
from pacer.contracts.jobs import JobState
from pacer.errors import ValidationError
from pacer_services.api.app import ApiConfig, ApiService

# The fixtures of api_support (pytest finds them as attributes of this module).
peers = api_support.peers
api_service = api_support.api_service
http = api_support.http


pytestmark = pytest.mark.timeout(60)


async def test_every_api_request_needs_the_bearer_token(api_service: ApiService, peers: PeerDouble) -> None:
    peers.add_running("tok1")
    paths = [("GET", "/api/v1/jobs"), ("GET", "/api/v1/jobs/tok1"), ("POST", "/api/v1/jobs/tok1/stop"),
             ("POST", "/api/v1/jobs"),
             ("GET", "/api/v1/jobs/tok1/logs?node=worker-0"), ("GET", "/api/v1/events?job=tok1"),
             ("GET", "/api/v1/nothing-here")]
    wrong = [{}, {"Authorization": "Bearer wrong-token-0123456789abcdef"}, {"Authorization": f"Basic {TOKEN}"},
             {"Authorization": "Bearer "}, {"Authorization": f"Bearer {TOKEN}x"}]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api_service.port}") as session:
        http = Client(session)
        for method, path in paths:
            for headers in wrong:
                status, body = await http.call(method, path, headers=headers)
                assert status == 401, (method, path, headers, status, body)
                assert body["error"]["code"] == "unauthorized", body
        # A token in the URL is refused everywhere, the event stream included, even beside the header
        # (tests/integration/test_api_hostile.py has the whole story).
        for path in ("/api/v1/jobs", "/api/v1/events?job=tok1&replay=0"):
            sep = "&" if "?" in path else "?"
            status, body = await http.call("GET", f"{path}{sep}access_token={TOKEN}")
            assert status == 401 and "access_token" in body["error"]["message"], (path, body)
        async with session.get("/api/v1/events?job=tok1&replay=0", headers=AUTH) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
        status, body = await http.call("GET", "/api/v1/jobs", headers=AUTH)
        assert status == 200 and [r["job"] for r in body["jobs"]] == ["tok1"]
        status, body = await http.call("GET", "/api/v1/jobs", headers={"Authorization": f"bearer {TOKEN}"})
        assert status == 200  # the scheme is case-insensitive (RFC 7235)
        # Open: the readiness probe and the dashboard's files (they hold no data).
        for path in ("/healthz", "/", "/static/app.js"):
            async with session.get(path) as resp:
                assert resp.status == 200, path
    assert peers.records["tok1"].state is JobState.RUNNING  # no unauthenticated stop got through
    assert api_service.counters.snapshot()["errors"] >= len(paths) * len(wrong)


async def test_mutating_requests_must_be_json(http: Client, peers: PeerDouble, api_service: ApiService) -> None:
    """A cross-site form posts text/plain, form-urlencoded or multipart, or nothing: all 415, nothing stopped."""
    peers.add_running("csrf1")
    spec = SPEC_YAML.format(name="csrf2")
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "text/yaml", "application/jsonx"):
        headers = {} if ctype is None else {"Content-Type": ctype}
        for path, body in (("/api/v1/jobs/csrf1/stop", b""), ("/api/v1/jobs/csrf1/stop", b'{"reason": "x"}'),
                           ("/api/v1/jobs", spec.encode())):
            status, err = await http.call("POST", path, data=body, headers=headers)
            assert status == 415, (ctype, path, status, err)
            assert err["error"]["code"] == "unsupported_media_type" and "application/json" in err["error"]["message"]
    assert peers.records["csrf1"].state is JobState.RUNNING and "csrf2" not in peers.records
    assert not [c for c in peers.calls if c[1] in ("stop", "submit")]  # none reached the job service
    status, rec = await http.call("POST", "/api/v1/jobs/csrf1/stop", headers={"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and rec["state"] == "stopped" and rec["reason"] == "stopped by the user"


def test_the_api_refuses_to_start_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PACER_API_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="PACER_API_TOKEN"):
        ApiConfig.from_env()
    monkeypatch.setenv("PACER_API_TOKEN", "short")
    with pytest.raises(ValidationError, match="PACER_API_TOKEN"):
        ApiConfig.from_env()
    monkeypatch.setenv("PACER_API_TOKEN", TOKEN)
    assert ApiConfig.from_env().token == TOKEN
