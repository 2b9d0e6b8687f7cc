"""What the owner of a job keeps beside its lease (issue 13): ``state.brain.<job>`` of ``pacer-leases``.

One JSON document per job, written only through the owner's lease
(:meth:`pacer.ownership.Ownership.put_state`, fenced), read by the next
owner when it acquires the job:

* ``seq``: the stream sequence of the last executor or node event whose
  effect on the job (the autoscaler learning an applied plan and its pause,
  an OOM answered in the sample stage) this job's owners have applied; a
  later owner applies only what comes after it;
* ``oom_plan`` / ``oom_at``: the OOM-prevention plan published and not yet
  applied, and when it went out (its cool-down);
* ``auto``: the job's autoscaler (its spec, first plan, warm start and
  prior, and :func:`~.core.autoscaler.autoscaler_state`: the stage, the
  samples measured, the plan in force and the plan decided, the pauses,
  the memory trend), so a new owner goes on in the same stage with the
  same samples;
* ``published`` / ``outbox``: plans and decisions are written here first
  (the outbox, with their message ids), then published with those ids,
  then the outbox is cleared.  A new owner publishes an outbox it finds
  again with the same ids: the events stream stores a message id once
  within its duplicate window (2 min), so a decision is published once
  whether or not the dead owner got to it.

Building the autoscaler back needs the service's :class:`~.app.BrainConfig`
and is done by the service; this module only encodes and decodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pacer.codec import from_dict, to_dict
from pacer.contracts.brain import BrainDecision
from pacer.contracts.jobs import JobSpec, ResourcePlan
from pacer.errors import PacerError
from pacer.ids import DEFAULT_NAMESPACE

from .core.autoscaler import JobAutoscaler, autoscaler_state
from .core.calibration import Calibration
from .core.fitting import Coefficients

__all__ = ["AutoscalerSeed", "Outgoing", "OwnedJob", "decode_state", "encode_state", "seed_of"]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A plan or decision about to be published, under the message id it is always published with."""

    msg_id: str
    plan: ResourcePlan | None = None
    decision: BrainDecision | None = None


@dataclass(frozen=True, slots=True)
class AutoscalerSeed:
    """What a job's autoscaler is built from again (``BrainConfig.autoscaler``), and the state it had."""

    spec: JobSpec
    first: ResourcePlan
    warm: bool
    prior: Coefficients | None
    state: dict[str, Any]
    prior_calibration: Calibration | None = None
    namespace: str = DEFAULT_NAMESPACE  # the job's team (its quota)


@dataclass(slots=True)
class OwnedJob:
    """What the brain keeps of one job it owns, in the owner's fenced state (restored on takeover)."""

    seq: int = 0
    oom_plan: ResourcePlan | None = None
    oom_at: float | None = None
    published: int = 0
    outbox: list[Outgoing] = field(default_factory=list)
    auto: AutoscalerSeed | None = None


@dataclass(slots=True)
class JobInMemory:
    """What the brain holds of one job it owns, in memory, in one place (dropped when it loses the job):
    the state it saves (:class:`OwnedJob`, built from this by ``BrainService.state_of``) and the live
    autoscaler that state seeds."""

    seq: int = 0  # the last event whose effect was applied (the saved state's ``seq``)
    published: int = 0  # plans/decisions published so far (their message ids)
    unsent: list[Outgoing] = field(default_factory=list)  # the outbox: saved, not yet acknowledged by the stream
    oom_plan: ResourcePlan | None = None  # an OOM-prevention plan published, not yet applied
    oom_at: float | None = None  # when the job's last OOM-prevention plan went out
    autoscaler: JobAutoscaler | None = None  # a running zero-config job's
    not_autoscaled: bool = False  # looked up and found not to be the brain's to re-plan

    def drop_decisions(self) -> None:
        """What only the owner holds to decide for the job; ``seq`` and ``published`` stay (they name
        what was applied and published)."""
        self.autoscaler, self.not_autoscaled, self.oom_plan, self.oom_at, self.unsent = None, False, None, None, []


def seed_of(auto: JobAutoscaler) -> AutoscalerSeed:
    return AutoscalerSeed(auto.spec, auto.first_plan(), auto.warm, auto.prior, autoscaler_state(auto),
                          auto.prior_calibration, auto.namespace)


def _out(o: Outgoing) -> dict[str, Any]:
    return {"msg_id": o.msg_id, "plan": to_dict(o.plan) if o.plan is not None else None,
            "decision": to_dict(o.decision) if o.decision is not None else None}


def encode_state(st: OwnedJob) -> bytes:
    auto = None
    if st.auto is not None:
        a = st.auto
        auto = {"spec": to_dict(a.spec), "first": to_dict(a.first), "warm": a.warm,
                "prior": a.prior.to_dict() if a.prior is not None else None, "state": a.state,
                "prior_calibration": a.prior_calibration.to_dict() if a.prior_calibration is not None else None,
                "namespace": a.namespace}
    return json.dumps({
        "seq": st.seq, "oom_plan": to_dict(st.oom_plan) if st.oom_plan is not None else None,
        "oom_at": st.oom_at, "published": st.published, "outbox": [_out(o) for o in st.outbox], "auto": auto,
    }).encode()


def decode_state(data: bytes) -> OwnedJob:
    """The state :func:`encode_state` wrote; ``ValueError`` on anything else."""
    try:
        d = json.loads(data)
        auto = None
        if d["auto"] is not None:
            a = d["auto"]
            auto = AutoscalerSeed(from_dict(JobSpec, a["spec"]), from_dict(ResourcePlan, a["first"]), bool(a["warm"]),
                                  Coefficients.from_dict(a["prior"]) if a["prior"] is not None else None,
                                  dict(a["state"]),
                                  # absent in a state saved before the calibration prior existed
                                  Calibration.from_dict(a["prior_calibration"]) if a.get("prior_calibration") else None,
                                  # absent in a state saved before namespaces had quotas
                                  str(a.get("namespace") or DEFAULT_NAMESPACE))
        outbox = [Outgoing(str(o["msg_id"]),
                           from_dict(ResourcePlan, o["plan"]) if o["plan"] is not None else None,
                           from_dict(BrainDecision, o["decision"]) if o["decision"] is not None else None)
                  for o in d["outbox"]]
        return OwnedJob(seq=int(d["seq"]),
                        oom_plan=from_dict(ResourcePlan, d["oom_plan"]) if d["oom_plan"] is not None else None,
                        oom_at=float(d["oom_at"]) if d["oom_at"] is not None else None,
                        published=int(d["published"]), outbox=outbox, auto=auto)
    except (KeyError, TypeError, AttributeError, ValueError, PacerError) as exc:
        raise ValueError(f"unreadable brain state: {exc}") from exc
