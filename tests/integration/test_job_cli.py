"""The job commands of the ``pacer`` CLI against a real nats-server.

The job service, the executor and the monitor are played by
:class:`ServiceDouble`: one subscription per service on the real bus that
answers with real contract messages (and real error replies), records every
request it got, and moves a job one step forward on each ``get`` so that
``submit --wait`` and ``logs -f`` are driven by requests, not by time.
The CLI runs through ``pacer_services.cli.main.main(argv)`` in a thread (its own event
loop), with stdout/stderr captured.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pacer import subjects
from pacer.bus import Bus
from pacer.codec import decode
from pacer.contracts.executor import ExecutorStatus, LogsQuery, LogsReply, NodeInfo, PodPhase
from pacer.contracts.jobs import (
    JobList,
    JobProgress,
    JobRecord,
    JobState,
    ListRequest,
    StopRequest,
    SubmitRequest,
)
from pacer.contracts.monitor import JobStatistics, Liveness, NodeStats, StatsQuery, StragglerKind
from pacer.embedded import EmbeddedNats
from pacer.errors import Conflict, NotFound, PacerError
from pacer.jobs.spec import DEFAULT_PLAN, default_plan, parse_job_spec
from pacer_services.cli.jobs import new_lines
from pacer_services.cli.main import main
from pacer_services.cli.progress import Progress, render_bar

pytestmark = pytest.mark.timeout(60)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"
T0 = 1_700_000_000.0


@dataclass
class Script:
    """What successive ``get`` requests of one job return (the last one repeats)."""

    states: list[tuple[JobState, int]]  # (state, shards done) per get
    total: int = 10
    reason: str = ""
    gets: int = 0


@dataclass
class ServiceDouble:
    """Answers pacer.rpc.jobs/executor/monitor like the peer services would."""

    bus: Bus
    monitor: bool = True
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    scripts: dict[str, Script] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)  # (service, op, message)
    log_lines: list[str] = field(default_factory=lambda: [f"step {i}" for i in range(5)])
    subs: list[Subscription] = field(default_factory=list)

    async def start(self) -> None:
        for svc, handler in ((subjects.JOB_SERVICE, self._jobs), (subjects.EXECUTOR_SERVICE, self._executor),
                             (subjects.MONITOR_SERVICE, self._monitor)):
            if svc == subjects.MONITOR_SERVICE and not self.monitor:
                continue
            self.subs.append(await self.bus.nc.subscribe(subjects.rpc_wildcard(svc), cb=self._guard(handler)))
        await self.bus.nc.flush()

    async def stop(self) -> None:
        for s in self.subs:
            await s.unsubscribe()
        self.subs.clear()

    def _guard(self, handler: Any) -> Any:
        async def cb(msg: Msg) -> None:
            job, op = subjects.parse_rpc(msg.subject)
            try:
                await self.bus.respond(msg, handler(job, op, msg.data))
            except PacerError as exc:
                await self.bus.respond_error(msg, exc)

        return cb

    def add(self, job: str, state: JobState = JobState.RUNNING, done: int = 4, **kw: Any) -> JobRecord:
        spec = replace(parse_job_spec((EXAMPLES / "wide_deep.yaml").read_text()), name=job)
        rec = JobRecord(job=job, spec=spec, state=state, submitted_at=T0, updated_at=T0,
                        plan=default_plan(spec), progress=_progress(done, 10), **kw)
        self.jobs[job] = rec
        return rec

    def _record(self, job: str) -> JobRecord:
        if job not in self.jobs:
            raise NotFound(f"no job {job!r}")
        return self.jobs[job]

    def _jobs(self, job: str, op: str, data: bytes) -> Any:
        if op == subjects.JobOp.SUBMIT:
            req = decode(SubmitRequest, data)
            self.requests.append(("jobs", op, req))
            spec = parse_job_spec(req.spec)
            assert spec.name == job, "the subject's job token must equal the spec's name"
            rec = JobRecord(job=job, spec=spec, state=JobState.SUBMITTED, submitted_at=T0, updated_at=T0,
                            namespace=req.namespace)
            self.jobs[job] = rec
            return rec
        if op == subjects.JobOp.LIST:
            lr = decode(ListRequest, data)
            self.requests.append(("jobs", op, lr))
            return JobList([r for r in self.jobs.values() if (not lr.state or r.state.value == lr.state)
                            and (not lr.namespaces or r.namespace in lr.namespaces)][: lr.limit])
        if op == subjects.JobOp.STOP:
            sr = decode(StopRequest, data)
            self.requests.append(("jobs", op, sr))
            rec = self._record(job)
            if rec.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED):
                raise Conflict(f"job {job!r} is already {rec.state.value}")
            rec = replace(rec, state=JobState.STOPPED, reason=sr.reason, finished_at=T0 + 90)
            self.jobs[job] = rec
            return rec
        self.requests.append(("jobs", op, job))
        rec = self._record(job)
        if (s := self.scripts.get(job)) is not None:
            state, done = s.states[min(s.gets, len(s.states) - 1)]
            s.gets += 1
            terminal = state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED)
            rec = replace(rec, state=state, progress=_progress(done, s.total), reason=s.reason if terminal else "",
                          finished_at=T0 + 125 if terminal else 0.0,
                          result={"auc": 0.78123, "steps": 400} if state is JobState.COMPLETED else {})
            self.jobs[job] = rec
        return rec

    def _executor(self, job: str, op: str, data: bytes) -> Any:
        self.requests.append(("executor", op, job))
        rec = self._record(job)
        if op == subjects.ExecutorOp.LOGS:
            q = decode(LogsQuery, data)
            return LogsReply(job, q.node, f"{job}-{q.node}-g0", "\n".join(self.log_lines[-q.tail:]) + "\n")
        nodes = [NodeInfo(node=f"{role}-{i}", role=role, pod=f"{job}-{role}-{i}-g0", phase=PodPhase.RUNNING,
                          cpu=1.0, memory_mb=1024, restarts=1 if (role, i) == ("worker", 1) else 0,
                          requested_restarts=0, generation=0, pending_s=0.5)
                 for role in ("ps", "worker") for i in range(2)]
        return ExecutorStatus(job=job, state="running", plan=rec.plan, nodes=nodes, backend="local")

    def _monitor(self, job: str, op: str, data: bytes) -> Any:
        self.requests.append(("monitor", op, decode(StatsQuery, data)))
        self._record(job)
        nodes = [NodeStats(node=f"worker-{i}", role="worker", bpt_short_s=0.02 * (1 + 2 * i), bpt_long_s=0.02,
                           speed_samples_per_s=1000.0 / (1 + 2 * i), samples_total=5000, cpu_percent=90.0,
                           rss_bytes=1 << 28, last_seen=T0, state=Liveness.RUNNING, pending_s=0.0, restarts=0,
                           slowdown_short=1.0, slowdown_long=1.0,
                           straggler=StragglerKind.TRANSIENT if i else StragglerKind.NONE) for i in range(2)]
        return JobStatistics(job=job, ts=T0, window_short_s=30, window_long_s=300,
                             throughput_samples_per_s=1333.3, nodes=nodes)


def _progress(done: int, total: int) -> JobProgress:
    return JobProgress(shards_total=total, shards_todo=total - done, shards_done=done, records_done=done * 100,
                       records_total=total * 100, epoch=1)


@pytest.fixture
async def double(bus: Bus) -> AsyncIterator[ServiceDouble]:
    d = ServiceDouble(bus)
    await d.start()
    yield d
    await d.stop()


class Cli:
    """``pacer ARGS --nats URL`` in a thread; returns (exit code, stdout, stderr)."""

    def __init__(self, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.url, self.capsys = url, capsys

    async def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = await asyncio.to_thread(main, [*argv, "--nats", self.url])
        out, err = self.capsys.readouterr()
        return rc, out, err


@pytest.fixture
def cli(nats_server: EmbeddedNats, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(nats_server.url, capsys)


# ------------------------------------------------------------------- submit


async def test_submit_sends_the_spec_text_and_prints_the_id(cli: Cli, double: ServiceDouble) -> None:
    path = EXAMPLES / "wide_deep.yaml"
    rc, out, err = await cli("submit", str(path))
    assert (rc, err) == (0, "")
    assert out.split() == ["wide-deep-demo", "submitted"]
    [(svc, op, req)] = double.requests
    assert (svc, op) == ("jobs", "submit")
    assert req.spec == path.read_text()  # the document as written, comments included


async def test_submit_name_overrides_the_spec_name(cli: Cli, double: ServiceDouble) -> None:
    rc, out, _ = await cli("submit", str(EXAMPLES / "xdeepfm_bsp.yaml"), "--name", "other-run", "--json")
    assert rc == 0
    assert json.loads(out)["job"] == "other-run"
    [(_, _, req)] = double.requests
    assert parse_job_spec(req.spec).name == "other-run"
    assert parse_job_spec(req.spec).model.embed_dim == 16  # the rest of the document is kept


async def test_invalid_spec_exits_2_naming_the_field_and_sends_nothing(
    cli: Cli, double: ServiceDouble, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: j1\nmodel: wide_deep\ndataset: {path: d.tsv}\nepoch: 2\nmode: sync\n")
    rc, out, err = await cli("submit", str(bad))
    assert rc == 2 and out == ""
    assert "epoch: unknown field (did you mean 'epochs'?)" in err
    assert "mode: must be asp or bsp, got 'sync'" in err
    assert "Traceback" not in err
    assert double.requests == []


async def test_invalid_spec_fails_without_any_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "j1", "model": "wide_deep"}')
    rc = main(["submit", str(bad), "--nats", "nats://127.0.0.1:1"])  # nothing listens there
    assert rc == 2
    assert "dataset: required" in capsys.readouterr().err


async def test_a_bad_name_override_is_reported_as_the_name_field(cli: Cli, double: ServiceDouble) -> None:
    rc, _, err = await cli("submit", str(EXAMPLES / "wide_deep.yaml"), "--name", "no spaces")
    assert rc == 2 and "name:" in err
    assert double.requests == []


async def test_missing_file_exits_2(cli: Cli, tmp_path: Path) -> None:
    rc, _, err = await cli("submit", str(tmp_path / "absent.yaml"))
    assert rc == 2 and "cannot read" in err


@pytest.mark.parametrize(("final", "rc"), [(JobState.COMPLETED, 0), (JobState.FAILED, 1), (JobState.STOPPED, 1)])
async def test_submit_wait_follows_the_job_to_its_end(
    cli: Cli, double: ServiceDouble, final: JobState, rc: int
) -> None:
    double.scripts["wide-deep-demo"] = Script(
        [(JobState.PLANNING, 0), (JobState.RUNNING, 3), (JobState.RUNNING, 7), (final, 10 if rc == 0 else 7)],
        reason="worker-0: OOMKilled" if final is JobState.FAILED else "")
    code, out, err = await cli("submit", str(EXAMPLES / "wide_deep.yaml"), "--wait", "--interval", "0.01")
    assert code == rc, err
    assert double.scripts["wide-deep-demo"].gets == 4  # polled until terminal, not further
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"job wide-deep-demo {final.value}")
    # stderr is not a terminal here: one plain line per state, the bar on each
    assert "\r" not in err
    assert "running  [#########" in err and "3/10" in err
    if final is JobState.COMPLETED:
        assert "auc 0.7812" in last and "10/10" in err
    if final is JobState.FAILED:
        assert "OOMKilled" in last


async def test_submit_wait_timeout_exits_3(cli: Cli, double: ServiceDouble) -> None:
    double.scripts["wide-deep-demo"] = Script([(JobState.RUNNING, 1)])
    rc, _, err = await cli("submit", str(EXAMPLES / "wide_deep.yaml"), "--wait", "--interval", "0.01",
                           "--timeout", "0.05")
    assert rc == 3 and "gave up waiting" in err and "running" in err


async def test_invalid_reply_from_the_service_exits_2(cli: Cli, bus: Bus, tmp_path: Path) -> None:
    async def refuse(msg: Msg) -> None:
        from pacer.errors import ValidationError

        await bus.respond_error(msg, ValidationError("dataset.path: no such file 'data/train.tsv'"))

    sub = await bus.nc.subscribe(subjects.rpc_wildcard(subjects.JOB_SERVICE), cb=refuse)
    await bus.nc.flush()
    rc, _, err = await cli("submit", str(EXAMPLES / "wide_deep.yaml"))
    await sub.unsubscribe()
    assert rc == 2 and "dataset.path: no such file" in err


# --------------------------------------------------------------- jobs, job


async def test_jobs_prints_a_row_per_job(cli: Cli, double: ServiceDouble) -> None:
    double.add("alpha", JobState.RUNNING, done=4)
    double.add("beta", JobState.COMPLETED, done=10, finished_at=T0 + 3725)
    rc, out, _ = await cli("jobs")
    assert rc == 0
    head, *rows = out.strip().splitlines()
    assert head.split() == ["NAME", "MODEL", "STATE", "PROGRESS", "AGE", "JCT"]
    assert rows[0].split()[:4] == ["alpha", "wide_deep", "running", "40.0%"]
    assert rows[0].split()[-1] == "-"
    assert rows[1].split()[:4] == ["beta", "wide_deep", "completed", "100.0%"]
    assert rows[1].split()[-1] == "1h02m"

    rc, out, _ = await cli("jobs", "--state", "completed", "--json")
    assert rc == 0 and [j["job"] for j in json.loads(out)] == ["beta"]
    assert double.requests[-1][2] == ListRequest(100, JobState.COMPLETED)


async def test_job_shows_plan_nodes_progress_and_speed(cli: Cli, double: ServiceDouble) -> None:
    double.add("alpha", JobState.RUNNING, done=4, result={"auc": 0.7, "logloss": 0.45})
    rc, out, err = await cli("job", "alpha")
    assert (rc, err) == (0, "")
    assert "running" in out
    d = DEFAULT_PLAN
    assert (f"{d.workers} workers x 1 cpu / {d.worker_memory_mb} MiB, {d.ps} ps x 1 cpu / {d.ps_memory_mb} MiB"
            "  (source default)") in out
    assert "40.0% 4/10" in out
    assert "todo 6  doing 0  done 4  failed 0" in out
    summary, nodes, speed = out.split("\n\n")
    assert "auc 0.7000" in summary
    rows = {line.split()[0]: line.split() for line in nodes.splitlines()[2:]}
    assert sorted(rows) == ["ps-0", "ps-1", "worker-0", "worker-1"]
    assert rows["worker-1"][:4] == ["worker-1", "worker", "running", "1"]  # node, role, phase, restarts
    assert speed.splitlines()[0] == "throughput 1333.3 samples/s"
    rows = {line.split()[0]: line.split() for line in speed.splitlines()[2:]}
    assert rows["worker-1"][3:] == ["60.0ms", "20.0ms", "333.3", "transient"]  # BPT short/long, speed
    assert "auc 0.7000" in out
    assert "note:" not in out


async def test_job_without_a_monitor_notes_the_missing_part(cli: Cli, bus: Bus) -> None:
    d = ServiceDouble(bus, monitor=False)
    await d.start()
    d.add("alpha")
    rc, out, _ = await cli("job", "alpha", "--json")
    await d.stop()
    assert rc == 0
    doc = json.loads(out)
    assert doc["job"]["job"] == "alpha" and len(doc["nodes"]["nodes"]) == 4
    assert doc["statistics"] is None
    assert doc["notes"] and "monitor did not answer" in doc["notes"][0]


async def test_unknown_job_exits_1_with_a_clear_message(cli: Cli, double: ServiceDouble) -> None:
    for argv in (("job", "ghost"), ("stop", "ghost"), ("logs", "ghost")):
        rc, out, err = await cli(*argv)
        assert rc == 1 and out == ""
        assert err.strip() == f"pacer {argv[0]}: no job 'ghost' [not_found]"


async def test_bad_job_id_exits_2(cli: Cli, double: ServiceDouble) -> None:
    rc, _, err = await cli("job", "a.b")
    assert rc == 2 and "not a valid id" in err and "Traceback" not in err
    assert double.requests == []


async def test_unreachable_nats_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    rc = await asyncio.to_thread(main, ["jobs", "--nats", "nats://127.0.0.1:1"])
    assert rc == 1 and "cannot reach NATS" in capsys.readouterr().err


# ---------------------------------------------------------------- stop, logs


async def test_stop_prints_the_new_state_and_a_second_stop_conflicts(cli: Cli, double: ServiceDouble) -> None:
    double.add("alpha")
    rc, out, _ = await cli("stop", "alpha", "--reason", "enough")
    assert rc == 0 and out.split() == ["alpha", "stopped", "(enough)"]
    rc, _, err = await cli("stop", "alpha")
    assert rc == 1 and "already stopped" in err and "[conflict]" in err


async def test_logs_prints_the_tail(cli: Cli, double: ServiceDouble) -> None:
    double.add("alpha")
    rc, out, _ = await cli("logs", "alpha", "--tail", "2", "--node", "worker-1", "--container", "agent")
    assert rc == 0 and out.splitlines() == ["step 3", "step 4"]
    assert ("executor", "logs", "alpha") in double.requests


async def test_logs_follow_prints_new_lines_until_the_job_ends(cli: Cli, double: ServiceDouble) -> None:
    double.add("alpha")
    gets = {"n": 0}
    orig = double._jobs

    def jobs(job: str, op: str, data: bytes) -> Any:
        if op == subjects.JobOp.GET:
            # Each poll the trainer wrote one more line; the third poll sees the job done.
            gets["n"] += 1
            double.log_lines.append(f"step {4 + gets['n']}")
            if gets["n"] == 3:
                double.jobs[job] = replace(double.jobs[job], state=JobState.COMPLETED)
        return orig(job, op, data)

    double._jobs = jobs  # type: ignore[method-assign]
    await double.stop()
    await double.start()
    rc, out, _ = await cli("logs", "alpha", "-f", "--interval", "0.01", "--tail", "3")
    assert rc == 0
    assert out.splitlines() == ["step 2", "step 3", "step 4", "step 5", "step 6", "step 7"]


def test_new_lines_finds_the_overlap() -> None:
    assert new_lines(["a", "b", "c"], ["b", "c", "d", "e"]) == ["d", "e"]
    assert new_lines(["a", "b"], ["a", "b"]) == []
    assert new_lines(["a", "b"], ["x", "y"]) == ["x", "y"]
    assert new_lines([], ["x"]) == ["x"]
    assert new_lines(["c", "d"], ["a", "b", "c", "d", "e"]) == ["e"]  # a longer tail than before


# ------------------------------------------------------------------ progress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_pipe_prints_plain_lines_at_most_once_per_interval() -> None:
    out, clock = io.StringIO(), FakeClock()
    bar = Progress(out, width=10, interval=5.0, clock=clock)
    bar.update(0, 10, "running")
    bar.update(1, 10, "running")  # same status, too soon: not printed
    clock.t = 5.0
    bar.update(2, 10, "running")
    bar.update(2, 10, "completed")  # a new status prints at once
    bar.close("done")
    assert out.getvalue().splitlines() == [
        "running  [..........]   0.0% 0/10",
        "running  [##........]  20.0% 2/10",
        "completed  [##........]  20.0% 2/10",
        "done",
    ]


def test_progress_on_a_terminal_redraws_in_place() -> None:
    out = Tty()
    bar = Progress(out, width=4)
    assert bar.tty
    bar.update(1, 2, "running", "a long detail")
    bar.update(2, 2, "running")
    bar.close("done")
    text = out.getvalue()
    assert text.startswith("\rrunning  [##..]  50.0% 1/2  a long detail")
    first, second = text.split("\r")[1], text.split("\r")[2].split("\n")[0]
    assert second.rstrip() == "running  [####] 100.0% 2/2"
    assert len(second) == len(first)  # padded: no tail of the longer line is left on screen
    assert text.endswith("\ndone\n")


def test_progress_without_a_total_spins() -> None:
    out = Tty()
    bar = Progress(out)
    bar.update(0, 0, "planning")
    bar.update(0, 0, "planning")
    frames = [f.strip() for f in out.getvalue().split("\r") if f]
    assert frames == ["planning  |", "planning  /"]
    assert render_bar(3, 0) == "3/?"
