"""A thin client of the job service and the executor (what the CLI and the HTTP API use)."""

from __future__ import annotations

from collections.abc import Sequence

from pacer import subjects
from pacer.bus import Bus, RetryPolicy
from pacer.contracts.executor import ExecutorStatus, LogsQuery, LogsReply
from pacer.contracts.executor import JobQuery as ExecutorQuery
from pacer.contracts.jobs import (
    JobList,
    JobQuery,
    JobRecord,
    JobState,
    ListRequest,
    StopRequest,
    SubmitRequest,
)
from pacer.contracts.monitor import JobStatistics, StatsQuery
from pacer.ids import DEFAULT_NAMESPACE
from pacer.subjects import ExecutorOp, JobOp


class JobClient:
    """Request/reply into the job service, the executor and the monitor, with retries."""

    def __init__(self, bus: Bus, timeout: float = 10.0, retry: RetryPolicy | None = None) -> None:
        self.bus = bus
        self.timeout = timeout
        self.retry = retry or RetryPolicy(attempts=5)

    async def submit(self, name: str, spec_text: str, namespace: str = DEFAULT_NAMESPACE) -> JobRecord:
        """Submit a spec document (YAML/JSON) for the team ``namespace``; ``name`` must be the spec's ``name``."""
        return await self.bus.request(subjects.job_rpc(name, JobOp.SUBMIT), SubmitRequest(spec_text, namespace),
                                      JobRecord, timeout=max(self.timeout, 60.0), retry=self.retry)

    async def get(self, job: str) -> JobRecord:
        return await self.bus.request(subjects.job_rpc(job, JobOp.GET), JobQuery(job), JobRecord,
                                      timeout=self.timeout, retry=self.retry)

    async def list(self, limit: int = 100, state: JobState | None = None,
                   namespaces: Sequence[str] = ()) -> JobList:
        """The newest ``limit`` jobs (in ``state``, of ``namespaces``: empty = every one)."""
        return await self.bus.request(subjects.job_rpc(subjects.ALL_JOBS, JobOp.LIST),
                                      ListRequest(limit, state, list(namespaces)),
                                      JobList, timeout=self.timeout, retry=self.retry)

    async def stop(self, job: str, reason: str = "stopped by the user") -> JobRecord:
        return await self.bus.request(subjects.job_rpc(job, JobOp.STOP), StopRequest(job, reason), JobRecord,
                                      timeout=self.timeout, retry=self.retry)

    async def nodes(self, job: str) -> ExecutorStatus:
        return await self.bus.request(subjects.executor_rpc(job, ExecutorOp.STATUS), ExecutorQuery(job),
                                      ExecutorStatus, timeout=self.timeout, retry=self.retry)

    async def logs(self, job: str, node: str, tail: int = 200, container: str = "trainer") -> LogsReply:
        return await self.bus.request(subjects.executor_rpc(job, ExecutorOp.LOGS),
                                      LogsQuery(job, node, tail, container), LogsReply,
                                      timeout=self.timeout, retry=self.retry)

    async def statistics(self, job: str) -> JobStatistics:
        return await self.bus.request(subjects.monitor_stats(job), StatsQuery(job), JobStatistics,
                                      timeout=self.timeout, retry=self.retry)
