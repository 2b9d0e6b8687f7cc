"""The interface between the pod-executor and where pods run.

Two implementations: :mod:`.local` (the embedded default: each pod is a
small supervisor process running the trainer and its agent with CPU and
memory limits) and :mod:`.kubernetes` (the official client; pods from a
template, the agent as a sidecar container).

The executor never looks behind this interface: it creates pods from
:class:`~pacer.contracts.executor.PodSpec`, deletes them by name, lists
them (at start, to adopt pods that outlived an executor restart) and reacts
to the :class:`~pacer.contracts.executor.PodStatus` changes that
:meth:`Backend.watch` yields.

Contract
--------
* ``create`` returns once the pod exists (pending is fine); creating a name
  that exists raises :class:`~pacer.errors.Conflict`.
* ``delete`` asks the pod to stop (SIGTERM to the trainer, SIGKILL after
  ``grace_s``) and returns without waiting; deleting an unknown pod is a
  no-op.  The pod's last status (``exited``) is still reported by ``watch``
  and ``list`` until :meth:`Backend.forget`.
* ``watch`` yields a status every time a pod's phase changes (and once for
  every known pod when it starts), forever; it survives backend errors by
  reconnecting / re-listing.  Statuses of one pod arrive in order.
* ``resize`` raises a running pod's memory limit (its trainer's) in place,
  without a restart; an unknown pod raises
  :class:`~pacer.errors.NotFound`, a backend or cluster that cannot
  (Kubernetes before 1.33) :class:`~pacer.errors.Conflict`.  The pod's
  statuses report the new ``memory_mb`` from then on.
* ``cluster`` gives the TF addresses a job's PS and worker slots will have.
* ``machines`` lists the machines pods can run on with what is free on each
  (the brain places nodes on them, Dike); ``[]`` when the backend cannot
  tell.  A pod's :attr:`~pacer.contracts.executor.PodSpec.machine` is a
  preference the backend may honour (Kubernetes: soft node affinity) or
  ignore (local: there is one machine).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from typing import Protocol

from pacer.contracts.executor import MachineInfo, PodSpec, PodStatus
from pacer.trainer.cluster import ClusterDesc


class Backend(Protocol):
    """Where pods run (local processes or Kubernetes)."""

    name: str
    #: Pods' limits reserve capacity (a scheduler admits pods against it, as Kubernetes does).
    #: The local backend has no scheduler: pods never queue and the machine is shared.
    reserves_capacity: bool

    async def create(self, pod: PodSpec) -> None:
        """Create the pod; return once it exists."""

    async def delete(self, name: str, grace_s: float = 10.0) -> None:
        """Stop the pod (SIGTERM, then SIGKILL after ``grace_s``); unknown names are ignored."""

    async def resize(self, name: str, memory_mb: int) -> None:
        """Raise the running pod's memory limit to ``memory_mb`` MiB in place (no restart)."""

    async def list(self, job: str | None = None) -> list[PodStatus]:
        """Every pod the backend knows (of ``job``), live or exited."""

    def watch(self) -> AsyncIterator[PodStatus]:
        """Status changes of every pod, forever."""

    async def logs(self, name: str, tail: int = 200, container: str = "trainer") -> str:
        """The last ``tail`` lines of a pod's trainer (or agent) output."""

    async def forget(self, name: str) -> None:
        """Drop an exited pod's record (and, locally, its directory)."""

    def cluster(self, job: str, num_ps: int, max_workers: int) -> ClusterDesc:
        """TF addresses of the job's PS and worker slots (stable for the job's life)."""

    def pod_port(self, cluster: ClusterDesc, role: str, index: int) -> int:
        """The TF server port of one slot (what :attr:`PodSpec.port` carries)."""

    async def release(self, job: str) -> None:
        """Free what the backend keeps for a job once every pod is gone (its pods' logs stay).

        Local: the chief's flash checkpoints in shared memory (the disk copy
        stays); Kubernetes: the job's headless Service.
        """

    def capacity(self) -> tuple[float, int]:
        """(CPUs, memory MiB) that pods can use in total; (0, 0) when the backend cannot tell."""

    async def machines(self) -> builtins.list[MachineInfo]:
        """The machines pods can run on, with what is free on each; ``[]`` when the backend cannot tell.

        Never raises for a backend error: what cannot be listed is unknown.
        """

    async def close(self) -> None:
        """Release clients and background tasks (pods keep running)."""
