"""The controller's per-job state as its owner keeps it in KV (issue 13): pure, no IO, no clock.

What must survive a hand-over to another controller instance is what the
:class:`~pacer_services.controller.core.ControllerCore` follows from executed
actions: the job's setup (batch sizes, accumulations, backup workers), the
KILL_RESTARTs of the cool-down window (node, controller wall time), the
re-send flag, and when the last round ran.  Everything else (the policy, the
guards) comes from the job record and the configuration again.

The encoding is JSON (readable with ``nats kv get``); :func:`decode_state`
refuses anything else with :class:`ValueError`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass

from pacer_services.controller.core import ControllerCore, JobSetup

VERSION = 1


@dataclass(frozen=True, slots=True)
class ControlState:
    setup: JobSetup
    restarts: tuple[tuple[str, float], ...] = ()
    resync: bool = False
    last: float = 0.0  # controller wall time of the last round


def snapshot(core: ControllerCore, last: float, planned: Iterable[tuple[str, float]] = ()) -> ControlState:
    """The core's state; ``planned``: restarts about to be executed, recorded before they are (an intent)."""
    return ControlState(core.setup, (*core.restarts, *planned), core.resync, last)


def restore(core: ControllerCore, st: ControlState) -> None:
    """Put ``st`` into ``core`` (a new owner continues the cool-downs and the setup)."""
    core.setup, core.restarts, core.resync = st.setup, list(st.restarts), st.resync


def encode_state(st: ControlState) -> bytes:
    return json.dumps({"v": VERSION, "setup": dataclasses.asdict(st.setup),
                       "restarts": [[n, t] for n, t in st.restarts], "resync": st.resync,
                       "last": st.last}, sort_keys=True).encode()


def decode_state(data: bytes) -> ControlState:
    try:
        raw = json.loads(data)
        if raw.get("v") != VERSION:
            raise ValueError(f"controller state version {raw.get('v')!r}, expected {VERSION}")
        fields = {f.name for f in dataclasses.fields(JobSetup)}
        setup = JobSetup(**{k: v for k, v in raw["setup"].items() if k in fields})
        restarts = tuple((str(n), float(t)) for n, t in raw["restarts"])
        return ControlState(setup, restarts, bool(raw["resync"]), float(raw["last"]))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable controller state: {exc}") from exc
