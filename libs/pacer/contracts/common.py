"""Messages every service uses: error replies, health."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from pacer.codec import decode, doc, encode, from_dict, message
from pacer.errors import DecodeError, PacerError, remote_error


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


__all__ = ["ErrorEnvelope", "ErrorReply", "Health", "decode", "decode_reply", "encode", "encode_error"]
