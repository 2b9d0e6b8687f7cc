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


#: The longest error message an error reply carries, in characters.  Messages name the bad field and
#: often echo the bad value (a 2.5-MB string, the repr of an expanded YAML alias bomb): cut to this,
#: every error reply fits far below any server's max payload (NATS: at least 1 MB by default).
MAX_ERROR_MESSAGE = 2048
#: The longest error code on the wire (codes are constants; a relayed remote one may not be).
MAX_ERROR_CODE = 64


def clip(text: str, limit: int = MAX_ERROR_MESSAGE) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut (kept whole when it fits)."""
    if len(text) <= limit:
        return text
    note = f"... [{len(text) - limit} more characters cut]"
    return text[: max(0, limit - len(note))] + note


def encode_error(exc: PacerError, max_bytes: int = 0) -> bytes:
    """The wire form of an error reply, its message cut to :data:`MAX_ERROR_MESSAGE` characters (and,
    with ``max_bytes`` > 0, shorter still until the whole reply fits in ``max_bytes``)."""
    limit = MAX_ERROR_MESSAGE
    while True:
        data = encode(ErrorEnvelope(ErrorReply(clip(exc.code, MAX_ERROR_CODE), clip(exc.message, limit),
                                               exc.temporary)))
        if not max_bytes or len(data) <= max_bytes or limit == 0:
            return data
        limit //= 4  # a message of multi-byte characters: 4 bytes each at most


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


__all__ = ["MAX_ERROR_MESSAGE", "ErrorEnvelope", "ErrorReply", "Health", "Role", "clip", "decode", "decode_reply",
           "encode", "encode_error"]
