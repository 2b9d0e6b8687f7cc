"""Which events PACER_EVENTS stores: all but the live heartbeats, and no event domain forgotten.

The stream lists its subjects per domain (``pacer.subjects.stored_events``)
instead of ``pacer.events.>`` so that the heartbeats stay out of it.  An event
whose domain is missing from that list would be delivered but never stored
(lost for replays, dashboards' history and durable consumers): these tests
hold the list against every event anyone may publish (the permissions) and
every event with a contract (the schemas).
"""

from __future__ import annotations

from pacer import schemas, security
from pacer import subjects as S


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest (one token at least)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def stored(subject: str) -> bool:
    return any(matches(p, subject) for p in S.stored_events())


def live(subject: str) -> bool:
    return any(matches(p, subject) for p in S.LIVE_EVENTS)


def event_publishes() -> list[str]:
    """Every event subject pattern a non-admin user may publish to (services, a job's agents)."""
    perms = [security.permissions(r) for r in security.ROLES if r != "admin"]
    perms.append(security.agent_job_permissions("j1"))
    return [p for perm in perms for p in perm.publish if p.startswith(f"{S.PREFIX}.events.")]


def test_matcher() -> None:
    assert matches("a.*.c", "a.b.c") and not matches("a.*.c", "a.b.d") and not matches("a.*", "a.b.c")
    assert matches("a.>", "a.b.c") and not matches("a.>", "a")


def test_heartbeats_are_live_and_not_stored() -> None:
    hb = S.agent_heartbeat("j1")
    assert live(hb) and not stored(hb)


def test_every_contracted_event_but_the_heartbeat_is_stored() -> None:
    kinds = [(d, k) for d, k, _ in schemas.OTHER_EVENT_CONTRACTS]
    kinds += [("shard", k) for k in schemas.SHARD_EVENT_CONTRACTS]
    kinds += [("node", k) for k in schemas.NODE_EVENT_CONTRACTS]
    assert len(kinds) > 20
    for domain, kind in kinds:
        subject = S.event(domain, "j1", kind)
        assert stored(subject) != live(subject), subject  # exactly one of the two


def test_every_event_a_user_may_publish_lands_somewhere() -> None:
    pubs = event_publishes()
    assert any(".agent." in p for p in pubs) and any(".node." in p for p in pubs)
    for pattern in pubs:
        domain = pattern.split(".")[2]
        assert domain in S.EVENT_DOMAINS, f"{pattern}: domain {domain!r} is not in EVENT_DOMAINS, so never stored"
        # a concrete subject of the pattern (job j1, kind some-kind) is stored unless it is live
        probe = ".".join("j1" if t == "*" and i == 3 else "some-kind" if t in ("*", ">") else t
                         for i, t in enumerate(pattern.split(".")))
        if domain != S.AGENT_SERVICE:  # the agent's kinds are listed one by one (test above)
            assert stored(probe), probe


def test_stream_subjects_do_not_overlap() -> None:
    """JetStream refuses a stream whose subjects overlap."""
    subs = S.stored_events()
    for a in subs:
        for b in subs:
            if a != b:
                assert not matches(a, b.replace("*", "x").replace(">", "x")), (a, b)
