"""A job's pods hold the least privilege: every forbidden thing an attacker's probe did, tried again.

The probe (issue 21) ran as the trainer of an ordinary job, ``mallory``, and
as the static ``agent`` user that pods got without the auth callout.  Here
each of its moves is made again as that identity against a real nats-server
with the real auth callout responder (``callout`` of test_auth_callout.py),
and each must be refused by the server itself: a permissions violation, or
a refused connection.  A positive control beside each shows the same
connection can do what a pod must (its own key, its own lease), so a refusal
is not a broken connection.
"""

from __future__ import annotations

import json

import nats
import nats.aio.msg
import nats.errors
import nats.js.errors
import pytest
from pacer import authjwt, security, subjects
from pacer.agent import bucket as agent_bucket
from pacer.bus import Bus
from pacer.embedded import EmbeddedNats
from test_auth_callout import SECRET, agent, callout, violation

__all__ = ["callout"]  # the fixture, used by name

VICTIM, MALLORY = "victim", "mallory"


async def admin_bus(srv: EmbeddedNats) -> Bus:
    bus = await Bus.connect(security.with_credentials(srv.url, "admin", "pw-admin"), name="operator")
    await bus.ensure_streams()
    await agent_bucket.ensure(bus.js)
    return bus


async def test_the_static_agent_user_is_gone(callout: EmbeddedNats) -> None:
    """No user serves every job's pods: the name ``agent`` with what used to be its password is refused."""
    assert subjects.AGENT_SERVICE not in security.ROLES
    with pytest.raises((nats.errors.Error, OSError)) as info:
        await agent(callout, MALLORY, token=f"pw-{subjects.AGENT_SERVICE}", user=subjects.AGENT_SERVICE)
    assert "authorization" in str(info.value).lower() or isinstance(info.value, nats.errors.NoServersError)


async def test_an_agent_reads_its_own_key_and_not_another_jobs(callout: EmbeddedNats) -> None:
    """Finding 4: ``$JS.API.STREAM.MSG.GET.KV_pacer-agents`` with ``last_by_subj`` of the victim's key
    returned the victim's record.  Now only the direct get naming the pod's own key is granted."""
    admin = await admin_bus(callout)
    nc, errors = await agent(callout, MALLORY)
    try:
        kv = agent_bucket.handle(admin.js)
        await kv.put(subjects.agent_primary_key(VICTIM), b"victim-record")
        await kv.put(subjects.agent_primary_key(MALLORY), b"own-record")
        own = await agent_bucket.handle(nc.jetstream()).get(subjects.agent_primary_key(MALLORY))
        assert own.value == b"own-record"  # the control: a pod reads its own key

        stream = agent_bucket.STREAM
        victim_key = f"{agent_bucket.KEY_PREFIX}{subjects.agent_primary_key(VICTIM)}"
        msg_get = f"$JS.API.STREAM.MSG.GET.{stream}"
        with pytest.raises(nats.errors.Error):
            await nc.request(msg_get, json.dumps({"last_by_subj": victim_key}).encode(), timeout=1)
        await violation(errors, msg_get)
        direct = f"$JS.API.DIRECT.GET.{stream}.{victim_key}"
        with pytest.raises(nats.errors.Error):
            await nc.request(direct, b"", timeout=1)
        await violation(errors, direct)
        # Nor may it write the victim's key (the election of another job's agents).
        await nc.publish(victim_key, b"forged")
        await nc.flush()
        await violation(errors, victim_key)
        assert (await kv.get(subjects.agent_primary_key(VICTIM))).value == b"victim-record"
    finally:
        await nc.close()
        await admin.close()


async def test_a_rollup_on_its_own_key_cannot_purge_other_jobs_keys(callout: EmbeddedNats) -> None:
    """Its own key is writable, but the bucket refuses a ``Nats-Rollup: all`` header (it would purge
    every job's key in the bucket's stream) and a record larger than an election record."""
    admin = await admin_bus(callout)
    nc, errors = await agent(callout, MALLORY)
    try:
        kv = agent_bucket.handle(admin.js)
        await kv.put(subjects.agent_primary_key(VICTIM), b"victim-record")
        js = nc.jetstream()
        own = f"{agent_bucket.KEY_PREFIX}{subjects.agent_primary_key(MALLORY)}"
        assert (await js.publish(own, b"own-record")).seq > 0  # the control
        with pytest.raises(nats.js.errors.Error):
            await js.publish(own, b"x", headers={"Nats-Rollup": "all"})
        with pytest.raises(nats.js.errors.Error):
            await js.publish(own, b"x" * (agent_bucket.MAX_RECORD_BYTES + 1))
        assert (await kv.get(subjects.agent_primary_key(VICTIM))).value == b"victim-record"
        assert errors == []
    finally:
        await nc.close()
        await admin.close()


# Finding 6: what the static agent user's ``$JS.API.>`` grant let it do, each as a JetStream API request.
FORBIDDEN_API = {
    # read other jobs' records, the shard log and their events through a consumer of its own
    "consumer on the events": f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}",
    "consumer on the shard log": f"$JS.API.CONSUMER.CREATE.{subjects.SHARD_LOG_STREAM}",
    "read a job record": f"$JS.API.DIRECT.GET.KV_{subjects.JOB_BUCKET}.$KV.{subjects.JOB_BUCKET}.{VICTIM}",
    # purge a job's shard log
    "purge the shard log": f"$JS.API.STREAM.PURGE.{subjects.SHARD_LOG_STREAM}",
    # create streams that republish into node deaths, the shard log, or capture a service's requests
    "create a stream": "$JS.API.STREAM.CREATE.forged",
    "update a stream": f"$JS.API.STREAM.UPDATE.{subjects.EVENTS_STREAM}",
    "delete a stream": f"$JS.API.STREAM.DELETE.{subjects.SHARD_LOG_STREAM}",
    # and even the agents' own bucket: made by the executor, never by a pod
    "make the agents' bucket": f"$JS.API.STREAM.CREATE.{agent_bucket.STREAM}",
    "the agents' bucket's info": f"$JS.API.STREAM.INFO.{agent_bucket.STREAM}",
}


@pytest.mark.parametrize("what", sorted(FORBIDDEN_API))
async def test_a_pod_has_no_jetstream_api_beyond_its_own_key(callout: EmbeddedNats, what: str) -> None:
    subject = FORBIDDEN_API[what]
    nc, errors = await agent(callout, MALLORY)
    try:
        body = {"name": "forged", "subjects": [subjects.node_event(VICTIM, subjects.NodeEventKind.DIED)]}
        with pytest.raises(nats.errors.Error):
            await nc.request(subject, json.dumps(body).encode(), timeout=1)
        await violation(errors, subject)
    finally:
        await nc.close()


FORBIDDEN_PUBLISH = {
    # forge a node death, shard-log entries, another job's lease, or answer for a service
    "a node death": subjects.node_event(VICTIM, subjects.NodeEventKind.DIED),
    "its own node death": subjects.node_event(MALLORY, subjects.NodeEventKind.DIED),
    "the shard log": subjects.shard_log(VICTIM),
    "its own shard log": subjects.shard_log(MALLORY),
    "another job's lease": subjects.rpc(subjects.SHARD_SERVICE, VICTIM, subjects.ShardOp.LEASE),
    # Finding 5: an agent has no business registering datasets (nor appending, nor re-opening failed shards)
    "register a dataset": subjects.rpc(subjects.SHARD_SERVICE, MALLORY, subjects.ShardOp.REGISTER),
    "append to a dataset": subjects.rpc(subjects.SHARD_SERVICE, MALLORY, subjects.ShardOp.APPEND),
    "retry failed shards": subjects.rpc(subjects.SHARD_SERVICE, MALLORY, subjects.ShardOp.RETRY_FAILED),
    "stop a job": subjects.job_rpc(VICTIM, subjects.JobOp.STOP),
    "an executor command": subjects.executor_rpc(VICTIM, subjects.ExecutorOp.COMMAND),
    "a job event": subjects.events_of("job", job=MALLORY, kind="completed"),
    "a health ping of every agent": subjects.health(subjects.AGENT_SERVICE),
}


@pytest.mark.parametrize("what", sorted(FORBIDDEN_PUBLISH))
async def test_a_pod_publishes_only_its_own_jobs_pod_subjects(callout: EmbeddedNats, what: str) -> None:
    subject = FORBIDDEN_PUBLISH[what]
    nc, errors = await agent(callout, MALLORY)
    try:
        await nc.publish(subject, b"forged")
        await nc.flush()
        await violation(errors, subject)
    finally:
        await nc.close()


async def test_a_pod_may_lease_its_own_jobs_shards(callout: EmbeddedNats) -> None:
    """The control for the refusals above: the pod ops of its own job reach the service."""
    admin = await admin_bus(callout)
    nc, errors = await agent(callout, MALLORY)
    async def service(m: nats.aio.msg.Msg) -> None:
        await m.respond(b"ok")

    try:
        for op in subjects.ShardOp.POD:
            subject = subjects.rpc(subjects.SHARD_SERVICE, MALLORY, op)
            sub = await admin.nc.subscribe(subject, cb=service)
            await admin.nc.flush()
            await admin.nc.flush()
            assert (await nc.request(subject, b"{}", timeout=3)).data == b"ok", op
            await sub.unsubscribe()
        assert errors == []
    finally:
        await nc.close()
        await admin.close()


def test_the_token_of_one_job_admits_no_other() -> None:
    mallorys = authjwt.agent_token(SECRET, MALLORY, incarnation="1", expires=2**40)
    assert authjwt.token_ok(SECRET, MALLORY, mallorys, 0) and not authjwt.token_ok(SECRET, VICTIM, mallorys, 0)
