"""The job routes: submit, list, get, stop and logs map to the job service (joined with the executor's and the
monitor's answers); invalid specs and malformed input are 400s naming the field, unknown paths 404s,
a job service that is down 503.
(The peer double, the API service and its client: api_support.)"""

from __future__ import annotations

import json
from typing import Any

import api_support
import pytest
from api_support import JSON, SPEC_YAML, Client, PeerDouble, executor_status, statistics
from pacer_services.api.app import ApiService

# The fixtures of api_support (pytest finds them as attributes of this module).
peers = api_support.peers
api_service = api_support.api_service
http = api_support.http


pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ job routes


async def test_submit_list_get_stop_map_to_the_job_service(http: Client, peers: PeerDouble) -> None:
    status, rec = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="yaml-job")})
    assert status == 201, rec
    assert rec["job"] == "yaml-job" and rec["state"] == "submitted"
    assert rec["spec"]["model"]["name"] == "wide_deep"  # enums as their values
    assert ("pacer.rpc.jobs.yaml-job.submit", "submit") in peers.calls

    spec_json = json.dumps({"name": "json-job", "model": "dcn", "dataset": {"path": "data/train.tsv"}})
    status, rec = await http.call("POST", "/api/v1/jobs", data=spec_json, headers={"Content-Type": "application/json"})
    assert status == 201 and rec["spec"]["model"]["name"] == "dcn"

    status, listed = await http.call("GET", "/api/v1/jobs")
    assert status == 200
    assert sorted(j["job"] for j in listed["jobs"]) == ["json-job", "yaml-job"]
    assert ("pacer.rpc.jobs._all.list", "list") in peers.calls
    status, listed = await http.call("GET", "/api/v1/jobs?state=running")
    assert status == 200 and listed["jobs"] == []

    status, body = await http.call("GET", "/api/v1/jobs/yaml-job")
    assert status == 200
    assert body["job"]["state"] == "submitted"
    assert body["nodes"] is None and body["statistics"] is None  # neither peer knows the job
    assert set(body["unavailable"]) == {"nodes", "statistics"}

    status, rec = await http.call("POST", "/api/v1/jobs/yaml-job/stop", json={"reason": "enough"})
    assert status == 200 and rec["state"] == "stopped" and rec["reason"] == "enough"
    assert ("pacer.rpc.jobs.yaml-job.stop", "stop") in peers.calls
    status, err = await http.call("POST", "/api/v1/jobs/yaml-job/stop", headers=JSON)  # no body: the default reason
    assert status == 409 and err["error"]["code"] == "conflict"

    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="yaml-job")})
    assert status == 409, err


async def test_get_joins_executor_and_monitor_when_they_answer(http: Client, peers: PeerDouble) -> None:
    peers.add_running("run1")
    peers.executor["run1"] = executor_status("run1")
    peers.stats["run1"] = statistics("run1", 1234.5)
    status, body = await http.call("GET", "/api/v1/jobs/run1")
    assert status == 200, body
    assert body["job"]["state"] == "running" and body["job"]["plan"]["workers"] == 2
    assert [n["node"] for n in body["nodes"]["nodes"]] == ["ps-0", "worker-0", "worker-1"]
    assert body["nodes"]["nodes"][0]["phase"] == "running"
    assert body["statistics"]["throughput_samples_per_s"] == 1234.5
    assert body["statistics"]["nodes"][1]["state"] == "running"
    assert body["unavailable"] == {}

    status, logs = await http.call("GET", "/api/v1/jobs/run1/logs?node=worker-0&tail=3&container=agent")
    assert status == 200 and logs["text"].splitlines() == ["agent line 0", "agent line 1", "agent line 2"]
    assert logs["pod"] == "run1-worker-0-g0"


async def test_invalid_specs_are_400_naming_the_field(http: Client, peers: PeerDouble) -> None:
    bad = SPEC_YAML.format(name="bad1").replace("epochs: 2", "epochs: 0")
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": bad})
    assert status == 400 and err["error"]["code"] == "invalid"
    assert "epochs" in err["error"]["message"]  # the job service's own message
    assert ("pacer.rpc.jobs.bad1.submit", "submit") in peers.calls

    bad = SPEC_YAML.format(name="bad2").replace("wide_deep", "resnet")
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": bad})
    assert status == 400 and "model" in err["error"]["message"]

    # No usable name: the API cannot build the subject, and says why field by field.
    no_name = "model: wide_deep\ndataset:\n  path: data/train.tsv\n"
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": no_name})
    assert status == 400 and "name" in err["error"]["message"]
    status, err = await http.call("POST", "/api/v1/jobs", json={"model": "dcn", "dataset": {"path": "x"}})
    assert status == 400 and "name" in err["error"]["message"]
    status, err = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="a.b*c")})
    assert status == 400 and "name" in err["error"]["message"]


async def test_malformed_input_is_400_and_unknown_is_404(http: Client, peers: PeerDouble,
                                                        api_service: ApiService) -> None:
    cases: list[tuple[str, str, dict[str, Any], int]] = [
        ("POST", "/api/v1/jobs", {"json": {"spec": "{{{ not: yaml"}}, 400),
        ("POST", "/api/v1/jobs", {"data": "", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"data": "{not json", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"data": b"\xff\xfe\x00garbage", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"data": "[1, 2, 3]", "headers": JSON}, 400),
        ("POST", "/api/v1/jobs", {"json": {"spec": 42}}, 400),
        ("POST", "/api/v1/jobs", {"json": {"spec": "  "}}, 400),
        ("POST", "/api/v1/jobs/x/stop", {"data": "{not json", "headers": {"Content-Type": "application/json"}}, 400),
        ("POST", "/api/v1/jobs/x/stop", {"json": {"reason": 42}}, 400),
        ("GET", "/api/v1/jobs?limit=lots", {}, 400),
        ("GET", "/api/v1/jobs?limit=0", {}, 400),
        ("GET", "/api/v1/jobs?state=sleeping", {}, 400),
        ("GET", "/api/v1/jobs/bad.id", {}, 400),
        ("GET", "/api/v1/jobs/x/logs", {}, 400),  # no node
        ("GET", "/api/v1/jobs/x/logs?node=worker-0&tail=-1", {}, 400),
        ("GET", "/api/v1/jobs/x/logs?node=worker-0&container=sidecar", {}, 400),
        ("GET", "/api/v1/events", {}, 400),  # no job
        ("GET", "/api/v1/events?job=a.>", {}, 400),
        ("GET", "/api/v1/jobs/nope", {}, 404),
        ("POST", "/api/v1/jobs/nope/stop", {"headers": JSON}, 404),
        ("GET", "/api/v1/nothing-here", {}, 404),
        ("GET", "/api/jobs", {}, 404),  # unversioned paths are gone
        ("DELETE", "/api/v1/jobs", {"headers": JSON}, 405),
    ]
    for method, path, kw, want in cases:
        status, body = await http.call(method, path, **kw)
        assert status == want, (method, path, status, body)
        assert isinstance(body, dict) and set(body["error"]) == {"code", "message"}, body
        assert body["error"]["message"]
    status, body = await http.call("GET", "/api/v1/jobs/nope")
    assert body["error"]["code"] == "not_found" and "nope" in body["error"]["message"]
    status, body = await http.call("GET", "/api/v1/jobs?state=sleeping")
    assert body["error"]["code"] == "invalid" and body["error"]["message"].startswith("state: must be one of")
    assert api_service.counters.snapshot().get("errors", 0) >= len(cases)
    status, health = await http.call("GET", "/healthz")
    assert status == 200 and health["status"] == "ok"  # nothing above hurt the service


async def test_job_service_down_is_503(http: Client) -> None:
    status, body = await http.call("GET", "/api/v1/jobs")
    assert status == 503 and body["error"]["code"] == "unavailable"
    status, body = await http.call("GET", "/api/v1/jobs/x")
    assert status == 503
