"""``pacer status`` and ``pacer --version``: the CLI's small commands behave like the others.

``pacer status`` used to hang forever on an unreachable NATS (the bus
reconnects forever, initial connect included); it now gives up like every
bus command and exits non-zero with a message.  The unreachable case runs
the real console script in a subprocess, bounded by a generous timeout: a
hang fails the test, a slow machine does not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import InProcessService
from pacer.bus import Bus
from pacer.contracts.shards import DatasetSpec
from pacer.embedded import EmbeddedNats, free_port
from pacer.extras import DISTRIBUTION
from pacer.shards.client import ShardAdmin
from pacer_services.cli.main import main

PACER = [sys.executable, "-m", "pacer_services.cli.main"]


def test_status_on_an_unreachable_nats_fails_instead_of_hanging() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    r = subprocess.run([*PACER, "status", "some-job", "train", "--url", url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "cannot reach NATS" in r.stderr and url in r.stderr
    assert r.stdout == ""


async def test_status_prints_the_datasets_counts(nats_server: EmbeddedNats, shard_service: InProcessService,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bus = await Bus.connect(nats_server.url)
    try:
        await ShardAdmin(bus).register(DatasetSpec(job="st-job", dataset="train", records=1000, batch_size=10,
                                            batches_per_shard=10, epochs=1))
    finally:
        await bus.close()
    rc = await _in_thread(["status", "st-job", "train", "--url", nats_server.url])
    out, _ = capsys.readouterr()
    assert rc == 0
    status = json.loads(out)
    assert status["job"] == "st-job" and status["todo"] == 10 and status["records_total"] == 1000


async def test_status_of_an_unknown_job_is_a_clear_error(nats_server: EmbeddedNats, shard_service: InProcessService,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = await _in_thread(["status", "no-such-job", "train", "--url", nats_server.url])
    _, err = capsys.readouterr()
    assert rc != 0
    assert err.startswith("pacer status:") and "no-such-job" in err


def test_version_names_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"pacer {metadata.version(DISTRIBUTION)} ({DISTRIBUTION})"


async def _in_thread(argv: list[str]) -> int:
    """The CLI runs its own event loop: keep it off the test's loop."""
    import asyncio

    return await asyncio.to_thread(main, argv)
