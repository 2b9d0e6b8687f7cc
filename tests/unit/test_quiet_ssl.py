"""asyncio's TLS "eof_received()" warning (Python 3.11, harmless) is dropped; other asyncio warnings are kept."""

from __future__ import annotations

import logging

import pytest
from pacer.telemetry import quiet_asyncio_ssl


def test_only_the_ssl_eof_warning_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    quiet_asyncio_ssl()
    quiet_asyncio_ssl()  # idempotent
    log = logging.getLogger("asyncio")
    assert sum(type(f).__name__ == "_SslEofNoise" for f in log.filters) == 1
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        log.warning("returning true from eof_received() has no effect when using ssl")
        log.warning("Task was destroyed but it is pending!")
    assert [r.getMessage() for r in caplog.records] == ["Task was destroyed but it is pending!"]
