"""A node's lifecycle in the executor: one table of legal moves, checked in one place.

A node is a slot of a job (``worker-3``); each pod is one incarnation of it
(generation).  The executor's KV record keeps the node's
:class:`~pacer.contracts.executor.NodePhase`; every change of it goes
through :func:`transition`, which rejects a move the table does not list
(Ray's ``instance_manager/common.py`` keeps its instance states the same
way).  Pure: no IO, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from pacer.contracts.executor import NodeIntent, NodePhase
from pacer.errors import Conflict

P, R, S, L, F, X = (NodePhase.PENDING, NodePhase.RUNNING, NodePhase.STOPPING, NodePhase.RELAUNCHING,
                    NodePhase.FINISHED, NodePhase.REMOVED)

#: state -> {next state: why that move happens}.  The only legal moves.
TRANSITIONS: Mapping[NodePhase, Mapping[NodePhase, str]] = {
    P: {
        R: "the backend reports the pod running",
        S: "the executor stops a pod that is not running yet (restart command, replacement, migration)",
        L: "the pod ended before it ran (a failure, or a create lost in a crash): the next pod is due",
        F: "the trainer exited 0 (a pod may end before the executor saw it run)",
        X: "scaled away, stopped by a command, or torn down",
        P: "the executor created the next pod of a node (a recreate after a crash, a migration restart)",
    },
    R: {
        S: "the executor stops the pod to start it again (restart command, replacement, migration)",
        L: "the pod ended by itself with a relaunch due (KILL_RESTART, retryable failure)",
        F: "the trainer exited 0",
        X: "scaled away, stopped by a command, or torn down",
        P: "the executor starts the node's next pod: a migration's new PS (the old one keeps running), "
           "or a pod that vanished from the backend without an exit",
    },
    S: {
        L: "the pod the executor stopped ended: the next pod is due (at once, or after the migration drained)",
        F: "the trainer exited 0 while being stopped",
        X: "scaled away or torn down while being stopped",
        P: "the executor starts the node's next pod before the stopped one ended: a migration's new PS, "
           "or a pod that vanished from the backend",
    },
    L: {
        P: "the next pod was created (generation + 1)",
        S: "a PS migration drains a worker whose pod already ended (its relaunch waits for the new cluster)",
        F: "a late exit 0 of the ended pod",
        X: "the relaunch was not made: budget spent, unretryable error, scaled away, torn down",
    },
    X: {
        P: "a plan scaled the slot back up, or a migration gives a removed PS its slot again: a fresh pod",
    },
    F: {},  # terminal: a finished trainer is never started again
}

TERMINAL: frozenset[NodePhase] = frozenset(s for s, out in TRANSITIONS.items() if not out)


class IllegalTransition(Conflict):
    """A node was asked to move along an edge the table does not have (a bug, or a stale record)."""


def can_move(frm: NodePhase, to: NodePhase) -> bool:
    return to in TRANSITIONS[frm]


def transition(node: str, frm: NodePhase, to: NodePhase, intent: NodeIntent = NodeIntent.NONE) -> NodePhase:
    """``to``, if the table allows ``frm -> to``; otherwise :class:`IllegalTransition`.

    ``intent`` is the reason of a stop: ``stopping`` is never entered without
    one (a restart, resize or migration).  Staying in a state is always
    allowed (an idempotent redo after a crash).
    """
    if frm is not to and to not in TRANSITIONS[frm]:
        raise IllegalTransition(f"node {node}: no move from {frm.value} to {to.value}")
    if to is NodePhase.STOPPING and intent is NodeIntent.NONE:
        raise IllegalTransition(f"node {node}: stopping without an intent (restart, resize or migrate)")
    return to


def legacy_state(*, finished: bool, removed: bool, intent: NodeIntent, running: bool) -> NodePhase:
    """The state of a node in a record written before ``NodeRecord.state`` existed (its loose fields)."""
    if finished:
        return NodePhase.FINISHED
    if removed:
        return NodePhase.REMOVED
    if intent is not NodeIntent.NONE:
        return NodePhase.STOPPING
    return NodePhase.RUNNING if running else NodePhase.PENDING
