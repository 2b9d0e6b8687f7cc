"""What the executor tells the brain about the cluster: its queue and what capacity is left.

Pure: the pods, the backend's capacity and its machines come in; a
:class:`~pacer.contracts.executor.ClusterStatus` goes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pacer.contracts.executor import ClusterStatus, MachineInfo, PodPhase, PodStatus


def cluster_status(now: float, backend: str, pods: Iterable[PodStatus], capacity: tuple[float, int],
                   reserves_capacity: bool, machines: Sequence[MachineInfo] = ()) -> ClusterStatus:
    """The backend's queue and what is left of its capacity after the limits of live pods.

    Only where limits reserve capacity (Kubernetes): locally nothing is reserved and no
    pod ever queues, so the cluster is "busy" only while pods are pending (starting).
    Where the backend lists its ``machines`` and reserves capacity, the totals are theirs
    (their free capacity counts every tenant's pods, not only ours).
    """
    live = [p for p in pods if p.phase is not PodPhase.EXITED]
    pending = sum(1 for p in live if p.phase is PodPhase.PENDING)
    cpu, mem = capacity
    used_cpu = sum(p.cpu for p in live) if reserves_capacity else 0.0
    used_mem = sum(p.memory_mb for p in live) if reserves_capacity else 0
    free_cpu, free_mem = max(0.0, cpu - used_cpu) if cpu else 0.0, max(0, mem - used_mem) if mem else 0
    if reserves_capacity and machines:
        cpu, mem = sum(m.cpu for m in machines), sum(m.memory_mb for m in machines)
        free_cpu, free_mem = sum(m.free_cpu for m in machines), sum(m.free_memory_mb for m in machines)
    return ClusterStatus(now, backend, pending, len(live) - pending, cpu, free_cpu, mem, free_mem,
                         reserves_capacity=reserves_capacity, machines=list(machines))
