"""Every reply fits the bus's max payload (issue 21, finding 8), on a real stack.

A request carrying a 2.5-MB string used to get no reply at all: its error
message echoed the string (as a ``repr``: four bytes per control character,
10 MB) past the server's max payload (8 MB in the stack), nats-py refused to
publish it and the requester waited out its timeout.  Here every request
subject of the stack's services (each ``pacer.rpc.<service>.<job>.<op>`` of
:mod:`pacer.schemas`, and each built-in policy's decide subject) gets such a
request: each must be answered with a reply that fits, and the service must
go on answering.

The agent's subjects (``pacer.rpc.agent.<job>...``) are left out: they are
served by a running job's agents, and :mod:`pacer.agent` answers through the
same ``Bus.respond_error``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import msgpack
import nats.errors
import pytest
from conftest import running_stack
from pacer import codec, subjects
from pacer.bus import NO_RETRY, Bus
from pacer.contracts.common import Health
from pacer.schemas import RPC_CONTRACTS, _other_rpcs
from pacer_services.controller.policies.registry import BUILTINS

BIG = "\x00" * 2_500_000  # 2.5 MB on the wire; its repr is 10 MB
JOB = "ovs"
SAFETY_S = 60.0


def _value(tp: Any, first: list[bool]) -> Any:
    """A plain value of type ``tp``; the first string met is :data:`BIG`."""
    origin = typing.get_origin(tp)
    if tp is str:
        if first[0]:
            first[0] = False
            return BIG
        return "x"
    if tp is bool:
        return False
    if tp is int:
        return 1
    if tp is float:
        return 1.0
    if tp is Any:
        return 1
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp)).value
    if codec._is_message(tp):
        return _body(tp, first)
    if origin in (types.UnionType, typing.Union):
        return None
    if origin is list:
        return []
    if origin is dict:
        return {}
    raise TypeError(f"no value for {tp!r}")


def _body(cls: type[Any], first: list[bool]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: _value(hints[f.name], first) for f in dataclasses.fields(cls)}


def oversized(cls: type[Any]) -> bytes:
    """A well-formed ``cls`` whose first string field (the job, mostly) is :data:`BIG`."""
    first = [True]
    body = _body(cls, first)
    if first[0]:  # no string field: it still carries 2.5 MB, in a field the receiver ignores as unknown
        body["padding"] = BIG
    return msgpack.packb(body, use_bin_type=True)


def cases() -> list[tuple[str, str, type[Any]]]:
    """(subject, service answering it, request class) for every request subject the stack serves."""
    out = [(subjects.rpc(subjects.SHARD_SERVICE, JOB, op), subjects.SHARD_SERVICE, c.request)
           for op, c in RPC_CONTRACTS.items()]
    for rpc in _other_rpcs():
        parts = rpc.subject.split(".")
        if parts[1] != "rpc" or parts[2] == subjects.AGENT_SERVICE:
            continue
        job = JOB if parts[3].startswith("<") or parts[3] == "__job__" else parts[3]
        out.append((".".join([*parts[:3], job, *parts[4:]]), parts[2], rpc.request))
    pol = next(r for r in _other_rpcs() if r.subject == subjects.policy_decide("__policy__"))
    out += [(subjects.policy_decide(name), "policies", pol.request) for name in BUILTINS]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_stack(tmp_path_factory.mktemp("stack"), ["shard", "monitor", "jobs", "executor", "brain", "policies"],
                       {}) as st:
        yield st


def test_every_request_subject_is_covered() -> None:
    services = {svc for _, svc, _ in cases()}
    assert {"shard", "monitor", "jobs", "executor", "brain", "policies"} <= services, services
    assert len(cases()) >= len(RPC_CONTRACTS) + 10 + len(BUILTINS)


@pytest.mark.parametrize(("subject", "service", "cls"), cases(), ids=lambda v: v if isinstance(v, str) else "")
async def test_an_oversized_request_gets_a_reply_that_fits(stack: Any, subject: str, service: str,
                                                           cls: type[Any]) -> None:
    bus = await Bus.connect(stack.url, name="test-oversized")
    try:
        data = oversized(cls)
        assert 2_500_000 < len(data) < 2_600_000 < bus.nc.max_payload
        try:
            reply = await bus.nc.request(subject, data, timeout=SAFETY_S)
        except nats.errors.TimeoutError:
            pytest.fail(f"no reply on {subject} to a {len(data)}-byte request: the reply was never sent")
        assert len(reply.data) <= bus.nc.max_payload
        body = msgpack.unpackb(reply.data, raw=False, strict_map_key=False)
        if isinstance(body, dict) and "error" in body:
            assert len(body["error"]["message"]) <= 4096, len(body["error"]["message"])
        # ... and the service still answers.
        h = await bus.request(subjects.health(service), None, Health, timeout=SAFETY_S, retry=NO_RETRY)
        assert h.status == "ready"
    finally:
        await bus.close()
