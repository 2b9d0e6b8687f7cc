"""Messages every service uses: error replies, health."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from pacer.codec import decode, doc, encode, from_dict, message
from pacer.errors import DecodeError, PacerError, remote_error


class Role(str, enum.Enum):
    """What a node of a PS job is: a worker computes gradients, a PS holds a partition of the model.

    A ``str`` enum, so ``Role.PS == "ps"`` and it encodes as the plain string
    that the wire schemas and node names (``ps-0``, ``worker-3``) use.
    """

    WORKER = "worker"
    PS = "ps"

    @classmethod
    def of_node(cls, node: str) -> Role:
        """The role that a node name (``<role>-<index>``) carries; ValueError for any other name."""
        return cls(node.rsplit("-", 1)[0])


@message("common.ErrorReply")
@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The body of an error reply: ``{"error": ErrorReply}`` on the reply subject.

    A success reply never has a top-level ``error`` field, so a client can tell
    them apart before decoding the success type.
    """

    code: str = field(metadata=doc("stable error code, e.g. not_found, invalid, bad_message"))
    message: str = field(metadata=doc("human-readable explanation naming the bad field or id"))
    temporary: bool = field(default=False, metadata=doc("true if the same request may succeed later"))


@message("common.ErrorEnvelope")
@dataclass(frozen=True, slots=True)
class ErrorEnvelope:
    """What an error reply looks like on the wire."""

    error: ErrorReply


def encode_error(exc: PacerError) -> bytes:
    return encode(ErrorEnvelope(ErrorReply(exc.code, exc.message, exc.temporary)))


T = TypeVar("T")


def decode_reply(cls: type[T], data: bytes) -> T:
    """Decode a reply; raise the matching :class:`PacerError` for an error reply."""
    try:
        obj: Any = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        raise DecodeError(f"{cls.__name__}: reply is not valid msgpack") from None
    if isinstance(obj, dict) and "error" in obj:
        err = from_dict(ErrorEnvelope, obj).error
        raise remote_error(err.code, err.message, err.temporary)
    return from_dict(cls, obj)


@message("common.Health")
@dataclass(frozen=True, slots=True)
class Health:
    """Reply of ``pacer.svc.<service>.health``."""

    service: str
    instance: str
    status: str = field(metadata=doc("starting | ready | draining"))
    uptime_s: float
    counters: dict[str, int] = field(default_factory=dict)


__all__ = ["ErrorEnvelope", "ErrorReply", "Health", "Role", "decode", "decode_reply", "encode", "encode_error"]
