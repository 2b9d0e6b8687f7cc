"""The error hierarchy shared by services and clients.

Every error says whether it is *temporary* (retry later: JetStream ``nak``
with a delay, client retries) or *permanent* (the request or message is wrong:
JetStream ``term`` plus a dead-letter event, a clear error reply).  Each error
has a stable ``code`` that goes on the wire in ``ErrorReply``.
"""

from __future__ import annotations


class PacerError(Exception):
    """Base of all Pacer errors."""

    code = "internal"
    temporary = False

    def __init__(self, message: str, *, code: str | None = None, temporary: bool | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if temporary is not None:
            self.temporary = temporary


class DecodeError(PacerError):
    """A message could not be decoded or does not follow its schema."""

    code = "bad_message"


class ValidationError(PacerError):
    """A well-formed message carries a value that is not allowed (names the field)."""

    code = "invalid"


class NotFound(PacerError):
    """The request names a job, dataset or checkpoint that does not exist."""

    code = "not_found"


class Conflict(PacerError):
    """The request contradicts existing state (e.g. re-registering with another spec)."""

    code = "conflict"


class StaleRevision(Conflict):
    """A compare-and-set write lost: the KV key changed since the writer read it (re-read, re-apply)."""


class Forbidden(PacerError):
    """The caller is known but its role or namespaces do not allow this (the API's HTTP 403)."""

    code = "forbidden"


class Unavailable(PacerError):
    """The service cannot answer now (starting, rebuilding, bus down); retry."""

    code = "unavailable"
    temporary = True


class LimitExceeded(PacerError):
    """A request would cause more work than a bound allows: a decision ran past its time or memory
    limit (the worker deciding it was killed and replaced)."""

    code = "limit_exceeded"


class ReplyTooLarge(LimitExceeded):
    """The success reply is larger than the bus's max payload; the request was handled, its reply
    replaced by this error."""

    code = "reply_too_large"


class RemoteError(PacerError):
    """An error reply received from another service, re-raised in the caller."""


def remote_error(code: str, message: str, temporary: bool) -> PacerError:
    """Rebuild the most specific local error class for a wire error."""
    for cls in (DecodeError, ValidationError, NotFound, Conflict, Forbidden, Unavailable, LimitExceeded,
                ReplyTooLarge):
        if cls.code == code:
            return cls(message, temporary=temporary)
    return RemoteError(message, code=code, temporary=temporary)
