"""The agents' KV bucket (``pacer-agents``): made by a service, used by pods without JetStream's API.

Each job's agents elect a primary through the key ``<job>.primary``
(:func:`pacer.subjects.agent_primary_key`): a publish to the key's subject
with an expected last sequence and a per-message TTL, and a direct get of
the key.  A pod's NATS user may do exactly that for its own job's key and
nothing else (:func:`pacer.security.agent_job_permissions`): no stream info,
no stream creation, no message get by a subject in the payload.  So:

* :func:`ensure` makes the bucket, or brings an existing one to this
  configuration; the executor calls it before it starts any pod (and a
  trainer run with operator rights, ``pacer train local``, may too);
* :func:`handle` is the bucket as a pod uses it: a ``KeyValue`` built
  without asking the server anything, whose gets are direct gets by subject.

The bucket's stream also refuses what a job's agent could misuse on its
own key: rollup headers (a ``Nats-Rollup: all`` on one key would purge
every job's key) and large messages.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from pacer import subjects

log = logging.getLogger(__name__)

STREAM = f"KV_{subjects.AGENT_BUCKET}"
KEY_PREFIX = f"$KV.{subjects.AGENT_BUCKET}."
MAX_RECORD_BYTES = 1024  # a PrimaryRecord is ~150 bytes; the bound keeps one job's agent from filling the store


def config(replicas: int = 1) -> StreamConfig:
    """The bucket's stream: a KV bucket of history 1 with direct gets, per-message TTLs and no rollups."""
    return StreamConfig(
        name=STREAM,
        description="Pacer agents: <job>.primary names each job's primary agent",
        subjects=[f"{KEY_PREFIX}>"],
        max_msgs_per_subject=1,
        max_msg_size=MAX_RECORD_BYTES,
        discard=DiscardPolicy.NEW,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=120.0,
        deny_delete=True,
        deny_purge=True,
        allow_rollup_hdrs=False,
        allow_direct=True,
        allow_msg_ttl=True,
        max_consumers=-1,
        max_msgs=-1,
        max_bytes=-1,
    )


# The settings ensure() keeps equal on an existing bucket (the rest cannot change, or does not matter).
_ENFORCED = ("allow_direct", "allow_rollup_hdrs", "max_msg_size", "deny_purge", "allow_msg_ttl",
             "max_msgs_per_subject")


async def ensure(js: JetStreamContext, replicas: int = 1, wait_s: float = 30.0) -> None:
    """Make the bucket, or update an existing one (e.g. made before direct gets) to :func:`config`.

    On a cluster a fresh stream has no leader for a few seconds (docs/ha.md): timeouts, 503s and a
    "not found" right after the create are waited out for ``wait_s``, as :meth:`pacer.bus.Bus.kv` does.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            await _ensure_once(js, replicas)
            return
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError,
                nats.js.errors.ServiceUnavailableError, nats.js.errors.NotFoundError) as exc:
            if loop.time() >= deadline:
                raise
            log.info("agents' bucket %s not available yet (%s); retrying", STREAM, type(exc).__name__)
            await asyncio.sleep(0.5)


async def _ensure_once(js: JetStreamContext, replicas: int) -> None:
    want = config(replicas)
    try:
        info = await js.stream_info(STREAM)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(want)
            return
        except nats.js.errors.BadRequestError:  # made concurrently by another executor instance
            info = await js.stream_info(STREAM)
    have = info.config
    if any(getattr(have, f) != getattr(want, f) for f in _ENFORCED):
        for f in _ENFORCED:
            setattr(have, f, getattr(want, f))
        await js.update_stream(have)
        log.info("agents' bucket %s updated to direct gets without rollups", STREAM)


def handle(js: JetStreamContext) -> KeyValue:
    """The bucket as a pod uses it: no JetStream API call here; ``get`` is a direct get by the key's subject."""
    return KeyValue(name=subjects.AGENT_BUCKET, stream=STREAM, pre=KEY_PREFIX, js=js, direct=True)


__all__ = ["KEY_PREFIX", "MAX_RECORD_BYTES", "STREAM", "config", "ensure", "handle"]
