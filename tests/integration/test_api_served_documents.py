"""What the API serves beside the job routes: its OpenAPI document (valid, and describing exactly what is
served and answered) and the dashboard's files (relative URLs only, nothing from outside).
(The peer double, the API service and its client: api_support.)"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import api_support
import pytest
from api_support import AUTH, SPEC_YAML, Client, PeerDouble, executor_status, statistics
from pacer.jobs.spec import parse_job_spec, spec_to_json
from pacer_services.api.app import ApiService

# The fixtures of api_support (pytest finds them as attributes of this module).
peers = api_support.peers
api_service = api_support.api_service
http = api_support.http


pytestmark = pytest.mark.timeout(60)


async def test_openapi_document_validates_and_describes_what_is_served(
        api_service: ApiService, peers: PeerDouble) -> None:
    import jsonschema
    from openapi_spec_validator import validate

    async with aiohttp.ClientSession(f"http://127.0.0.1:{api_service.port}") as session:
        http = Client(session)
        status, doc = await http.call("GET", "/api/v1/openapi.json")  # no token: it holds no job data
        assert status == 200
        validate(doc)  # OpenAPI 3.1, every $ref resolved, every path parameter declared
        # Every route the app serves is in the document, and nothing else.
        served = {(r.method.lower(), r.resource.canonical) for r in api_service_routes(api_service)
                  if r.resource is not None and r.method != "HEAD"
                  and r.resource.canonical.startswith(("/api/", "/healthz"))}
        documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
        assert served == documented, served ^ documented

        # Real answers validate against their documented schemas.
        def check(schema: str, body: Any) -> None:
            jsonschema.Draft202012Validator(
                {"$ref": f"#/components/schemas/{schema}", "components": doc["components"]}).validate(body)

        peers.add_running("doc1")
        peers.executor["doc1"] = executor_status("doc1")
        peers.stats["doc1"] = statistics("doc1", 10.0)
        http.session.headers.update(AUTH)
        for path, schema in (("/api/v1/jobs", "job.JobList"), ("/api/v1/jobs/doc1", "JobPage"),
                             ("/api/v1/jobs/doc1/logs?node=worker-0&tail=2", "executor.LogsReply"),
                             ("/api/v1/jobs/nope", "Error")):
            status, body = await http.call("GET", path)
            check(schema, body)
        status, body = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="doc2")})
        assert status == 201
        check("job.JobRecord", body)
        with pytest.raises(jsonschema.ValidationError):
            check("job.JobRecord", {**body, "state": "sleeping"})  # the check can fail
        # The submit body is typed: a spec in its full form (as a record holds it) validates, and the
        # API takes it; a spec with a wrongly typed field does not validate.
        full = spec_to_json(parse_job_spec(SPEC_YAML.format(name="doc3")))
        check("SubmitBody", json.loads(full))
        status, _ = await http.call("POST", "/api/v1/jobs", json=json.loads(full))
        assert status == 201
        with pytest.raises(jsonschema.ValidationError):
            check("SubmitBody", {**json.loads(full), "epochs": "two"})


def api_service_routes(svc: ApiService) -> list[Any]:
    return list(svc.make_app().router.routes())


async def test_dashboard_is_served(http: Client) -> None:
    for path, base in (("/", None), ("/jobs/some-job", "../")):
        async with http.session.get(path) as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            html = await resp.text()
            assert '<script src="static/app.js">' in html and 'id="app"' in html
            assert "http://" not in html and "https://" not in html  # nothing from outside
            # Relative URLs only, so that the page works behind a path prefix (an Ingress at /pacer/);
            # the job page's base is the dashboard's root, one level up.
            assert re.findall(r'<base href="([^"]*)">', html) == ([] if base is None else [base])
            assert not re.search(r'(?:src|href)="/', html), html
    async with http.session.get("/static/app.js") as resp:
        js = await resp.text()
    assert "api/v1/jobs" in js and "api/v1/events" in js
    assert not re.search(r'["`\'](?:/api|/static)', js)  # no absolute path to the API or the files
    for path, ctype in (("/static/app.js", "application/javascript"), ("/static/style.css", "text/css")):
        async with http.session.get(path) as resp:
            assert resp.status == 200 and resp.content_type in (ctype, "text/javascript"), resp.content_type
    async with http.session.get("/static/../app.py") as resp:
        assert resp.status in (403, 404)
