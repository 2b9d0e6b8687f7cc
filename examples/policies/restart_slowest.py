"""A custom straggler policy as a service, in a few lines: restart the slowest worker.

Run it beside a Pacer stack (``make up`` prints PACER_NATS_URL)::

    PACER_NATS_URL=nats://127.0.0.1:4222 .venv/bin/python examples/policies/restart_slowest.py

and name it in a job spec, with its parameters if the default does not suit::

    policies:
      straggler: restart-slowest
      params: {threshold: 2.5}

Every statistics window of that job (``pacer.events.monitor.<job>.statistics``)
the controller sends a ``PolicyRequest`` on ``pacer.policy.restart-slowest.decide``;
this answers with KILL_RESTART for the slowest live worker when its BPT over
the short window is at least ``threshold`` times its peers' median
(``policies.params.threshold`` of the job spec, arriving in
``PolicyRequest.params``; THRESHOLD when the spec gives none).  The controller
still applies its own rules: no restart while the cluster is busy, none of
the same node within the cool-down, and a malformed answer means "none".
"""

from __future__ import annotations

from pacer.contracts.agent import ActionKind
from pacer.contracts.monitor import Liveness
from pacer.contracts.policy import PolicyAction, PolicyDecision, PolicyRequest
from pacer.policy import run_policy

NAME = "restart-slowest"
THRESHOLD = 2.0


def decide(req: PolicyRequest) -> PolicyDecision:
    threshold = float(req.params.get("threshold", THRESHOLD))
    workers = [n for n in req.stats.nodes
               if n.role != "ps" and n.state is Liveness.RUNNING and n.node not in req.restart_blocked]
    slow = max(workers, key=lambda n: n.slowdown_short, default=None)
    if slow is None or slow.slowdown_short < threshold:
        return PolicyDecision(req.job, NAME, [], reason="no worker is slow enough")
    why = f"{slow.node} BPT {slow.slowdown_short:.1f}x its peers' median over the short window"
    return PolicyDecision(req.job, NAME, [PolicyAction(ActionKind.KILL_RESTART, node=slow.node, reason=why)],
                          reason=why)


if __name__ == "__main__":
    run_policy(NAME, decide)
