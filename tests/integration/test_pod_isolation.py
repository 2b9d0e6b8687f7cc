"""What a job's own code finds in its pod, and what it can do with it (issue 21, findings 1, 3 and 6).

The embedded stack (shard service, job service, pod-executor with the local
backend) runs two ``trainer:`` jobs.  ``victim`` trains; ``mallory``'s
trainer is an attacker's probe: it records its whole environment, then
uses the bus credentials it was given to try what the probe of issue 21
did (purge the shard log, make a stream that republishes into node deaths,
read another job's agent record and events through JetStream, register a
huge dataset, stop the victim) once it has trained its own shards, and
reports what answered in its result line.

Checked from outside, as another local user would look: the agent's and
trainer's argv (``/proc/<pid>/cmdline``, what ``ps`` shows) and the pod
directory's and ``spec.json``'s modes.
"""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import job_client, running_stack
from pacer.contracts.jobs import JobRecord, JobState
from pacer.data.criteo import generate
from pacer.jobs.client import JobClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

PROBE = r'''
import asyncio, json, os, sys, time

if "--ps" in sys.argv:  # the PS of a trainer job: nothing to serve here
    time.sleep(3600)

from pacer import subjects as S
from pacer.bus import Bus
from pacer.codec import encode
from pacer.contracts.shards import DatasetSpec
from pacer.trainer import sdk

VICTIM = sys.argv[1]


async def probe(url: str) -> dict[str, str]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    bus = await Bus.connect(url, name="mallory")
    bus.nc._error_cb = on_error
    tries = {
        "purge the shard log": (f"$JS.API.STREAM.PURGE.{S.SHARD_LOG_STREAM}", b"{}"),
        "make a stream into node deaths": ("$JS.API.STREAM.CREATE.forged", json.dumps({
            "name": "forged", "subjects": ["forged.>"],
            "republish": {"src": ">", "dest": S.node_event(VICTIM, S.NodeEventKind.DIED)}}).encode()),
        "read the victim's events": (f"$JS.API.CONSUMER.CREATE.{S.EVENTS_STREAM}", json.dumps({
            "stream_name": S.EVENTS_STREAM, "config": {"filter_subject": f"pacer.events.*.{VICTIM}.*"}}).encode()),
        "read the victim's agent record": (f"$JS.API.STREAM.MSG.GET.KV_{S.AGENT_BUCKET}", json.dumps({
            "last_by_subj": f"$KV.{S.AGENT_BUCKET}.{S.agent_primary_key(VICTIM)}"}).encode()),
        "register a huge dataset": (S.rpc(S.SHARD_SERVICE, os.environ["PACER_JOB"], S.ShardOp.REGISTER), encode(
            DatasetSpec(job=os.environ["PACER_JOB"], dataset="huge", records=1_000_000, batch_size=1,
                        batches_per_shard=1))),
        "stop the victim": (S.job_rpc(VICTIM, S.JobOp.STOP), b"{}"),
    }
    out = {}
    for what, (subject, data) in tries.items():
        try:
            reply = await bus.nc.request(subject, data, timeout=2)
            out[what] = "answered: " + reply.data[:120].decode(errors="replace")
        except Exception as exc:  # a refusal times out; anything else is reported too
            await asyncio.sleep(0.2)
            refused = any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in errors)
            out[what] = "refused" if refused else f"no answer ({type(exc).__name__})"
    await bus.close()
    return out


with sdk.Worker.from_env() as w:
    for shard in w.shards():
        for lo, hi in w.batches(shard):
            w.step_done(samples=hi - lo)
    found = asyncio.run(probe(w.env.nats_url))  # after its own shards: on an open bus a purge would lose them
    w.finish(environ=dict(os.environ), probes=found)
'''

ROWS = 4_000


def trainer_spec(name: str, data: Path, command: str) -> str:
    return (f"name: {name}\ndataset: {{path: {data}}}\nbatch_size: 256\npolicies: {{optimizer: default}}\n"
            "resources: {workers: 1, ps: 1, worker_cpu: 0.5, ps_cpu: 0.5, worker_memory_mb: 512, ps_memory_mb: 512}\n"
            f"trainer:\n  command: {command}\n  ps_command: [python, -c, 'import time; time.sleep(3600)']\n")


async def run_to_end(client: JobClient, job: str) -> JobRecord:
    while True:
        rec = await client.get(job)
        if rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED) and rec.torn_down:
            return rec
        await asyncio.sleep(0.3)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def test_a_pods_code_finds_only_its_own_jobs_credentials_and_can_use_them_for_nothing_else(
        tmp_path: Path) -> None:
    data = tmp_path / "train.rec"
    generate(data, ROWS, seed=3)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    with running_stack(tmp_path / "stack", ["shard", "jobs", "executor"], {"PACER_BATCHES_PER_SHARD": "4"}) as st:
        secrets = {"the API token": st.api_token, "the agents' token secret": st._agent_secret,
                   "the callout's issuer seed": st._issuer_seed,
                   **{f"{user}'s NATS password": pw for user, pw in st.passwords.items()}}
        secrets = {what: value for what, value in secrets.items() if value}
        async with job_client(st.url, "isolation-test") as client:
            await client.submit("victim", trainer_spec(
                "victim", data, "[python, -c, 'import time; time.sleep(3600)']"))
            await client.submit("mallory", trainer_spec(
                "mallory", data, json.dumps([sys.executable, str(probe), "victim"])))

            # While both run: what another local user sees of their pods.
            pods = st.data_dir / "pods"
            seen: dict[str, Any] = {}
            while len(seen) < 4:
                for meta in pods.glob("*/*/pod.json"):
                    if meta.parent.name not in seen and (p := json.loads(meta.read_text())).get("agent_pid"):
                        seen[meta.parent.name] = (meta.parent, p)
                await asyncio.sleep(0.2)
            exposed: list[str] = []  # finding 3, asserted after the job's own report
            for name, (d, p) in seen.items():
                modes = {str(x.relative_to(pods)): stat.S_IMODE(x.stat().st_mode)
                         for x in (d.parent, d, d / "spec.json", d / "pod.json")}
                exposed += [f"{x} is {oct(m)}" for x, m in modes.items() if m & 0o077]
                password = p["env"].get("PACER_NATS_PASSWORD", "")
                if p["env"].get("PACER_NATS_USER") != f"agent-{p['job']}" or not password:
                    exposed.append(f"{name}: not its job's own user in its environment: {sorted(p['env'])}")
                for pid in (p["agent_pid"], p["trainer_pid"]):
                    argv = cmdline(pid)
                    if not argv or (password and password in argv) or "@" in argv:
                        exposed.append(f"{name}: credentials in the argv `ps` shows: {argv}")
            await client.stop("victim", "the probe is over")
            mallory = await run_to_end(client, "mallory")
            await run_to_end(client, "victim")

    assert mallory.state is JobState.COMPLETED, mallory.reason
    environ: dict[str, str] = mallory.result["environ"]
    # Finding 1: nothing of another service's settings, no secret of the stack, only its own job's user.
    leaked = {what for what, value in secrets.items() if any(value in v for v in environ.values())}
    assert not leaked, leaked
    assert not {k for k in environ if k in ("PACER_API_TOKEN", "PACER_AGENT_TOKEN_SECRET", "PACER_AUTH_ISSUER_SEED",
                                            "PACER_POD_NATS_URL", "PACER_DATA_DIR", "PACER_INSTANCE")}, sorted(environ)
    assert environ["PACER_NATS_USER"] == "agent-mallory"
    assert "@" not in environ["PACER_NATS_URL"], environ["PACER_NATS_URL"]  # no credentials in the URL
    # Finding 6 (and 4, 5): with those credentials, every move of the probe is refused by the server.
    probes: dict[str, str] = mallory.result["probes"]
    assert probes and all(v == "refused" for v in probes.values()), probes
    assert not exposed, exposed
