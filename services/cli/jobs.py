"""The job commands of ``pacer``: a thin client of the job service, the executor and the monitor.

    pacer submit FILE [--name NAME] [--wait] [--timeout S]
    pacer jobs [--state S] [--limit N]
    pacer job ID
    pacer logs ID [--node NODE] [--tail N] [--container trainer|agent] [-f]
    pacer stop ID

Every command takes ``--nats URL`` (default ``$PACER_NATS_URL`` or
``nats://127.0.0.1:4222``) and ``--json`` (machine-readable output on
stdout instead of tables).  With ``--api URL`` (default ``$PACER_API_URL``)
the commands go to the HTTP API instead, with the token of
``$PACER_API_TOKEN`` or ``$PACER_API_TOKEN_FILE`` (:mod:`.api_client`): a
team's user needs no NATS credentials then.  ``history`` reads the brain
over NATS only.

Exit codes: 0 success (``submit --wait``: the job completed); 1 an error
reply (not_found, conflict, unavailable, ...), NATS unreachable, or
``submit --wait`` saw the job fail or stop; 2 invalid input (a bad spec
file, a bad id, an ``invalid`` reply); 3 ``submit --wait --timeout`` gave up
while the job was still going; 130 interrupted.  Errors are one message on
stderr, never a traceback.

Each command runs its own event loop (``asyncio.run``) with one bus
connection; the formatting helpers are pure and take ``now`` as an argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeAlias

import yaml
from opentelemetry import trace
from pacer import redact, telemetry
from pacer.bus import Bus, RetryPolicy
from pacer.codec import to_dict
from pacer.contracts.executor import ExecutorStatus
from pacer.contracts.jobs import JobProgress, JobRecord, JobState
from pacer.contracts.monitor import JobStatistics
from pacer.errors import PacerError
from pacer.ids import DEFAULT_NAMESPACE
from pacer.jobs.client import JobClient
from pacer.jobs.spec import JobSpecError, inline_schema_file, load_spec_document, parse_job_spec
from pacer_services.cli.api_client import API_URL_ENV, ApiClient
from pacer_services.cli.progress import Progress, render_bar

TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED})
INVALID_CODES = frozenset({"invalid", "bad_message"})
CONNECT_TIMEOUT_S = 5.0


class CliError(Exception):
    """A problem to report on stderr and exit with (no traceback)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _default_url() -> str:
    """``$PACER_NATS_URL``, else the URL of ``pacer up``'s context file, else 127.0.0.1:4222."""
    from pacer.errors import ValidationError
    from pacer.security import default_url

    try:
        return default_url(os.environ)
    except ValidationError:  # an unreadable context file: the plain default, Bus.connect says what is wrong
        return os.environ.get("PACER_NATS_URL", "nats://127.0.0.1:4222")


# --------------------------------------------------------------- formatting


def fmt_duration(seconds: float) -> str:
    """``42s``, ``12m03s``, ``3h05m``, ``2d04h``."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_percent(p: JobProgress) -> str:
    return f"{100 * p.shards_done / p.shards_total:.1f}%" if p.shards_total else "-"


def jct(rec: JobRecord) -> float | None:
    """Job completion time: submission to a terminal state (None while the job is not terminal)."""
    return rec.finished_at - rec.submitted_at if rec.finished_at else None


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]]
    return "\n".join(lines)


def jobs_table(records: list[JobRecord], now: float) -> str:
    rows = []
    for r in records:
        done = jct(r)
        rows.append([r.job, r.spec.model.name.value, r.state.value, fmt_percent(r.progress),
                     fmt_duration(now - r.submitted_at), fmt_duration(done) if done is not None else "-"])
    return table(["NAME", "MODEL", "STATE", "PROGRESS", "AGE", "JCT"], rows)


def _num(v: float) -> str:
    return f"{v:g}"


def job_summary(rec: JobRecord, now: float) -> str:
    """The job service's part of ``pacer job``: state, spec, plan, progress, result."""
    s, p = rec.spec, rec.progress
    out = [f"job        {rec.job}", f"state      {rec.state.value}" + (f"  ({rec.reason})" if rec.reason else "")]
    out.append(f"model      {s.model.name.value}  dataset {s.dataset.path} ({s.dataset.format.value})  "
               f"epochs {s.epochs}  batch {s.batch_size}  mode {s.mode.value}"
               + (f"  backup_workers {s.backup_workers}" if s.backup_workers else ""))
    times = f"submitted {fmt_duration(now - rec.submitted_at)} ago"
    if rec.started_at:
        times += f"  started {fmt_duration(now - rec.started_at)} ago"
    if (done := jct(rec)) is not None:
        times += f"  JCT {fmt_duration(done)}"
    out.append(f"time       {times}")
    if rec.plan is not None:
        pl = rec.plan
        out.append(f"plan       {pl.workers} workers x {_num(pl.worker_cpu)} cpu / {pl.worker_memory_mb} MiB, "
                   f"{pl.ps} ps x {_num(pl.ps_cpu)} cpu / {pl.ps_memory_mb} MiB  (source {pl.source.value})")
        if pl.reason:
            out.append(f"           {pl.reason}")
    else:
        out.append("plan       (none yet)")
    out.append(f"progress   {render_bar(p.shards_done, p.shards_total)}  epoch {p.epoch}")
    out.append(f"shards     todo {p.shards_todo}  doing {p.shards_doing}  done {p.shards_done}  "
               f"failed {p.shards_failed}")
    out.append(f"records    {p.records_done}/{p.records_total}  duplicated {p.records_duplicated}")
    if rec.node_restarts:
        out.append(f"restarts   {rec.node_restarts}")
    if rec.result:
        out.append(f"result     {fmt_result(rec.result)}")
    return "\n".join(out)


def fmt_result(result: dict[str, Any]) -> str:
    """``auc 0.7812  logloss 0.4510  steps 1000``: auc first, numbers rounded."""
    keys = sorted(result, key=lambda k: (k != "auc", k))
    return "  ".join(f"{k} {result[k]:.4f}" if isinstance(result[k], float) else f"{k} {result[k]}" for k in keys)


def nodes_table(st: ExecutorStatus) -> str:
    head = f"nodes      executor {st.state}" + (f", backend {st.backend}" if st.backend else "") \
        + (f"  ({st.reason})" if st.reason else "")
    if not st.nodes:
        return head + "\n           (no nodes)"
    rows = [[n.node, n.role, n.phase.value, str(n.restarts), _num(n.cpu), f"{n.memory_mb}MiB",
             f"{n.pending_s:.1f}s", n.last_reason or "-"] for n in st.nodes]
    return head + "\n" + table(["NODE", "ROLE", "PHASE", "RESTARTS", "CPU", "MEMORY", "PENDING", "LAST_REASON"], rows)


def stats_table(st: JobStatistics) -> str:
    head = f"throughput {st.throughput_samples_per_s:.1f} samples/s" + ("  (cluster busy)" if st.cluster_busy else "")
    if not st.nodes:
        return head
    rows = [[n.node, n.role or "-", n.state.value, f"{n.bpt_short_s * 1000:.1f}ms", f"{n.bpt_long_s * 1000:.1f}ms",
             f"{n.speed_samples_per_s:.1f}", n.straggler.value or "-"] for n in st.nodes]
    return head + "\n" + table(["NODE", "ROLE", "STATE", "BPT_SHORT", "BPT_LONG", "SAMPLES/S", "STRAGGLER"], rows)


def finish_line(rec: JobRecord) -> str:
    """The summary ``submit --wait`` prints once the job is terminal."""
    parts = [f"job {rec.job} {rec.state.value}"]
    if rec.reason:
        parts.append(f"({rec.reason})")
    if (done := jct(rec)) is not None:
        parts.append(f"in {fmt_duration(done)}")
    p = rec.progress
    parts.append(f"shards {p.shards_done}/{p.shards_total}  records {p.records_done}")
    if rec.node_restarts:
        parts.append(f"restarts {rec.node_restarts}")
    if rec.result:
        parts.append(fmt_result(rec.result))
    return "  ".join(parts)


def new_lines(prev: list[str], cur: list[str]) -> list[str]:
    """The lines of a fresh tail ``cur`` that come after what ``prev`` showed.

    ``cur`` may reach further back than ``prev`` (a longer tail) or start
    inside it (the log grew past the window).  Ambiguous repeats resolve to
    printing a line twice rather than missing one; with no overlap at all
    (more lines came than a tail holds) all of ``cur`` is new.
    """
    n = len(prev)
    if n == 0:
        return cur
    for j in range(n, len(cur) + 1):  # all of prev inside cur
        if cur[j - n:j] == prev:
            return cur[j:]
    for k in range(min(n, len(cur)) - 1, 0, -1):  # the start of prev scrolled out of cur
        if prev[n - k:] == cur[:k]:
            return cur[k:]
    return cur


def _dump(obj: Any) -> str:
    return json.dumps(redact.data(obj), indent=2, default=lambda o: redact.text(str(o)))


def _show(text: str = "", **kw: Any) -> None:
    """Print what the user is shown, credentials masked: a pod's bus URL carries its job's agent token
    (pacer.redact), and a log line, a reason or an error may quote it."""
    print(redact.text(text), **kw)


# ----------------------------------------------------------------- plumbing


async def _connect(url: str) -> Bus:
    # The bus reconnects forever, initial connect included; a CLI gives up instead.
    logging.getLogger("pacer.bus").setLevel(logging.ERROR)
    try:
        return await asyncio.wait_for(Bus.connect(url, name="pacer-cli", connect_timeout=2.0), CONNECT_TIMEOUT_S)
    except (TimeoutError, OSError) as exc:
        raise CliError(f"cannot reach NATS at {url} ({type(exc).__name__}); is `pacer up` running?") from None


Client: TypeAlias = JobClient | ApiClient


def _run(cmd: str, url: str, body: Callable[[Client], Awaitable[int]], api: str = "") -> int:
    """Connect (to the HTTP API at ``api`` when given, else to NATS at ``url``), run ``body``, close; turn
    every expected failure into a message and an exit code."""

    # OTEL_TRACES_EXPORTER=otlp (or PACER_OTEL_EXPORTER): the command is the root span of what it causes
    telemetry.setup_otel("cli")

    async def go() -> int:
        with trace.get_tracer("pacer.cli").start_as_current_span(f"pacer {cmd}"):
            if api:
                client = ApiClient.from_env(api)
                try:
                    return await body(client)
                finally:
                    await client.close()
            bus = await _connect(url)
            try:
                return await body(JobClient(bus))
            finally:
                await bus.close()

    try:
        return asyncio.run(go())
    except CliError as exc:
        return _fail(cmd, exc.message, exc.code)
    except JobSpecError as exc:
        return _fail(cmd, "invalid job spec:\n" + "\n".join(exc.problems), 2)
    except PacerError as exc:
        return _fail(cmd, exc.message, 2 if exc.code in INVALID_CODES else 1, exc.code)
    except KeyboardInterrupt:
        return 130


def _fail(cmd: str, message: str, rc: int, code: str = "") -> int:
    if code and code not in INVALID_CODES:
        msg = message.replace("\n", "; ")  # one line: a service's error is one fact
    else:
        msg = message.replace("\n", "\n  ")  # one problem per line, each naming its field
    _show(f"pacer {cmd}: {msg}" + (f" [{code}]" if code else ""), file=sys.stderr)
    return rc


async def _job_view(c: Client, job: str) -> tuple[JobRecord, ExecutorStatus | None, JobStatistics | None,
                                                 list[str]]:
    """``pacer job``'s parts: the record, the executor's nodes and the monitor's statistics (None when that
    service did not answer: asked briefly, not insisted on), and a note for each missing part."""
    if isinstance(c, ApiClient):  # the API joins the parts itself
        rec, nodes, stats, missing = await c.view(job)
        return rec, nodes, stats, [f"{what}: {why}" for what, why in missing.items()]
    rec = await c.get(job)
    opt = JobClient(c.bus, timeout=3.0, retry=RetryPolicy(attempts=2))
    nodes_r, stats_r = await asyncio.gather(opt.nodes(job), opt.statistics(job), return_exceptions=True)
    notes = []
    for what, r in (("nodes", nodes_r), ("statistics", stats_r)):
        if isinstance(r, PacerError):
            service = "executor" if what == "nodes" else "monitor"
            notes.append(f"{what}: the {service} did not answer ({r.code}: {r.message.splitlines()[0]})")
        elif isinstance(r, BaseException):
            raise r
    return (rec, nodes_r if isinstance(nodes_r, ExecutorStatus) else None,
            stats_r if isinstance(stats_r, JobStatistics) else None, notes)


# ----------------------------------------------------------------- commands


def read_spec(path: str, name: str | None) -> tuple[str, str]:
    """Read and validate a spec file; return (job name, the text to send).

    ``name`` overrides the document's ``name`` (the document is re-written
    as YAML then, comments dropped).  Raises :class:`JobSpecError` or
    :class:`CliError` (exit 2) before anything is sent.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", 2) from None
    try:
        data = load_spec_document(text)  # the services' own reader: no aliases, bounded
    except JobSpecError:
        data = None  # parse_job_spec below names the problem
    if isinstance(data, dict):
        changed = name is not None
        if name is not None:
            data["name"] = name
        # A schema file beside the spec (examples/schemas/) is sent inline: the services read no client files.
        changed = inline_schema_file(data, str(Path(path).parent)) or changed
        if changed:
            text = yaml.safe_dump(data, sort_keys=False)
    spec = parse_job_spec(text)
    return spec.name, text


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        name, text = read_spec(args.file, args.name)
    except JobSpecError as exc:
        return _fail("submit", f"invalid job spec {args.file}:\n" + "\n".join(exc.problems), 2)
    except CliError as exc:
        return _fail("submit", exc.message, exc.code)

    async def body(c: Client) -> int:
        # the API picks the token's only namespace when none is named; the job service takes "default"
        rec = await (c.submit(name, text, args.namespace) if isinstance(c, ApiClient)
                     else c.submit(name, text, args.namespace or DEFAULT_NAMESPACE))
        if not args.wait:
            print(_dump(to_dict(rec)) if args.json else f"{rec.job}  {rec.state.value}")
            return 0
        if not args.json:
            _show(f"{rec.job}  {rec.state.value}")
        rec, timed_out = await _wait(c, rec, args.timeout, args.interval)
        if args.json:
            print(_dump(to_dict(rec)))
        else:
            _show(finish_line(rec))
        if timed_out:
            _show(f"pacer submit: gave up waiting after {args.timeout:g}s; job {rec.job} is {rec.state.value}",
                  file=sys.stderr)
            return 3
        return 0 if rec.state is JobState.COMPLETED else 1

    return _run("submit", args.nats, body, args.api)


async def _wait(c: Client, rec: JobRecord, timeout: float | None, interval: float) -> tuple[JobRecord, bool]:
    """Poll the job until it is terminal (or ``timeout`` passed), drawing progress on stderr."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with Progress(sys.stderr) as bar:
        while True:
            p = rec.progress
            bar.update(p.shards_done, p.shards_total, rec.state.value,
                       f"records {p.records_done}" + (f"  epoch {p.epoch}" if p.epoch else ""))
            if rec.state in TERMINAL:
                return rec, False
            if deadline is not None and time.monotonic() >= deadline:
                return rec, True
            await asyncio.sleep(interval)
            try:
                rec = await c.get(rec.job)
            except PacerError as exc:
                if not exc.temporary:
                    raise
                # The job service restarting is no reason to stop waiting: show it and go on.
                bar.update(p.shards_done, p.shards_total, "(job service not answering)")


def cmd_jobs(args: argparse.Namespace) -> int:
    async def body(c: Client) -> int:
        jl = await c.list(limit=args.limit, state=JobState(args.state) if args.state else None)
        if args.json:
            print(_dump([to_dict(r) for r in jl.jobs]))
        elif not jl.jobs:
            _show("no jobs" + (f" in state {args.state}" if args.state else ""))
        else:
            _show(jobs_table(jl.jobs, time.time()))
        return 0

    return _run("jobs", args.nats, body, args.api)


def cmd_history(args: argparse.Namespace) -> int:
    """The brain's config DB: finished jobs, their final plans and throughput."""
    from pacer import subjects
    from pacer.contracts.brain import HistoryList, HistoryQuery

    async def body(c: Client) -> int:
        if isinstance(c, ApiClient):
            raise CliError("history reads the brain's config DB over NATS; the HTTP API has no route for it "
                           "(leave out --api)", 2)
        hl = await c.bus.request(subjects.brain_rpc(subjects.ALL_JOBS, subjects.BrainOp.HISTORY),
                                 HistoryQuery(args.model or "", args.limit), HistoryList, timeout=c.timeout,
                                 retry=c.retry)
        if args.json:
            print(_dump([to_dict(e) for e in hl.jobs]))
        elif not hl.jobs:
            print("the config DB is empty" + (f" for model {args.model}" if args.model else ""))
        else:
            print(table(["JOB", "MODEL", "RECORDS", "WORKERS", "PS", "W_CPU", "PS_CPU", "SAMPLES/S", "OK"],
                        [[e.job, e.model, f"{e.records:,}", str(e.workers), str(e.ps), f"{e.worker_cpu:g}",
                          f"{e.ps_cpu:g}", f"{e.throughput:,.0f}", "yes" if e.succeeded else "no"]
                         for e in hl.jobs]))
        return 0

    return _run("history", args.nats, body, args.api)


def cmd_job(args: argparse.Namespace) -> int:
    async def body(c: Client) -> int:
        rec, nodes, stats, notes = await _job_view(c, args.id)
        if args.json:
            print(_dump({"job": to_dict(rec), "nodes": to_dict(nodes) if nodes else None,
                         "statistics": to_dict(stats) if stats else None, "notes": notes}))
            return 0
        _show(job_summary(rec, time.time()))
        if nodes is not None:
            _show()
            _show(nodes_table(nodes))
        if stats is not None:
            _show()
            _show(stats_table(stats))
        if notes:
            _show()
            for n in notes:
                _show(f"note: {n}")
        return 0

    return _run("job", args.nats, body, args.api)


def cmd_logs(args: argparse.Namespace) -> int:
    async def body(c: Client) -> int:
        reply = await c.logs(args.id, args.node, args.tail, args.container)
        lines = reply.text.splitlines()
        if args.json and not args.follow:
            print(_dump(to_dict(reply)))
            return 0
        _emit(lines, args.json, reply.pod)
        if not args.follow:
            return 0
        pod, follow_tail = reply.pod, min(max(args.tail, 1000), 5000)
        while True:
            # Stop once the job is terminal, after one last read that picks up its final lines.
            terminal = await _is_terminal(c, args.id)
            await asyncio.sleep(0 if terminal else args.interval)
            reply = await c.logs(args.id, args.node, follow_tail, args.container)
            cur = reply.text.splitlines()
            if reply.pod != pod:
                if not args.json:
                    print(f"--- {args.node}: new pod {reply.pod} ---", flush=True)
                fresh, pod = cur, reply.pod
            else:
                fresh = new_lines(lines, cur)
            _emit(fresh, args.json, pod)
            lines = cur
            if terminal:
                return 0

    return _run("logs", args.nats, body, args.api)


def _emit(lines: list[str], as_json: bool, pod: str) -> None:
    for line in lines:
        line = redact.text(line)
        print(json.dumps({"pod": pod, "line": line}) if as_json else line)
    sys.stdout.flush()


async def _is_terminal(c: Client, job: str) -> bool:
    try:
        return (await c.get(job)).state in TERMINAL
    except PacerError as exc:
        if exc.temporary:
            return False  # the job service may be restarting; keep following
        raise


def cmd_stop(args: argparse.Namespace) -> int:
    async def body(c: Client) -> int:
        rec = await c.stop(args.id, args.reason)
        if args.json:
            print(_dump(to_dict(rec)))
        else:
            _show(f"{rec.job}  {rec.state.value}" + (f"  ({rec.reason})" if rec.reason else ""))
        return 0

    return _run("stop", args.nats, body, args.api)


# --------------------------------------------------------------------- wiring


def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def check(s: str) -> Any:
        v = kind(s)
        if v <= 0:
            raise argparse.ArgumentTypeError("must be > 0")
        return v

    return check


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=_default_url(), metavar="URL",
                   help="NATS of the Pacer stack (default: $PACER_NATS_URL, else pacer up's context "
                        "($PACER_CONTEXT), else nats://127.0.0.1:4222)")
    p.add_argument("--api", default=os.environ.get(API_URL_ENV, ""), metavar="URL",
                   help="the HTTP API instead of NATS (default: $PACER_API_URL), with the token of "
                        "$PACER_API_TOKEN or of the file $PACER_API_TOKEN_FILE names")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")


def add_cli(subparsers: Any) -> None:
    """Register ``submit``, ``jobs``, ``job``, ``logs`` and ``stop`` on the top-level subparsers."""
    sp = subparsers.add_parser("submit", help="submit a job spec (YAML or JSON)")
    sp.add_argument("file", metavar="FILE")
    sp.add_argument("--name", help="job name instead of the spec's name")
    sp.add_argument("--namespace", default="", metavar="NS",
                    help="the team's namespace (default: with --api, the token's only namespace; else default)")
    sp.add_argument("--wait", action="store_true",
                    help="follow the job until it ends; exit 0 if it completed, 1 if it failed or was stopped")
    sp.add_argument("--timeout", type=_positive(float), metavar="S",
                    help="with --wait: give up after S seconds (exit 3; the job keeps running)")
    sp.add_argument("--interval", type=_positive(float), default=1.0, metavar="S", help="with --wait: poll period")
    _common(sp)
    sp.set_defaults(fn=cmd_submit)

    ls = subparsers.add_parser("jobs", help="list jobs, newest first")
    ls.add_argument("--state", choices=[s.value for s in JobState])
    ls.add_argument("--limit", type=_positive(int), default=100)
    _common(ls)
    ls.set_defaults(fn=cmd_jobs)

    jp = subparsers.add_parser("job", help="one job: state, plan, nodes, progress, speed, result")
    jp.add_argument("id", metavar="ID")
    _common(jp)
    jp.set_defaults(fn=cmd_job)

    lg = subparsers.add_parser("logs", help="the tail of a node's log")
    lg.add_argument("id", metavar="ID")
    lg.add_argument("--node", default="worker-0")
    lg.add_argument("--tail", type=_positive(int), default=200, metavar="N")
    lg.add_argument("--container", choices=["trainer", "agent"], default="trainer")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    lg.add_argument("--interval", type=_positive(float), default=1.0, metavar="S", help="with -f: poll period")
    _common(lg)
    lg.set_defaults(fn=cmd_logs)

    hp = subparsers.add_parser("history", help="the brain's config DB of finished jobs")
    hp.add_argument("--model", help="only this model family (wide_deep, xdeepfm, dcn)")
    hp.add_argument("--limit", type=_positive(int), default=50)
    _common(hp)
    hp.set_defaults(fn=cmd_history)

    st = subparsers.add_parser("stop", help="stop a job")
    st.add_argument("id", metavar="ID")
    st.add_argument("--reason", default="stopped by the user")
    _common(st)
    st.set_defaults(fn=cmd_stop)
