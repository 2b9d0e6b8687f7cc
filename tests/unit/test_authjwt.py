"""nkeys, JWTs and the auth callout's decision (pure; the real server is in test_auth_callout)."""

from __future__ import annotations

import base64
import json

import pytest
from pacer import authjwt, security
from pacer_services.auth_callout import core

SECRET = "s3cret"
INC = authjwt.incarnation(1_700_000_000.25)  # job j1's record was stored then
EXP = 10_000  # the tokens below expire then; "now" is 200
LIVE = core.JobView(INC, ended=False)


def token(job: str, stream: str = "", incarnation: str = INC, expires: int = EXP, secret: str = SECRET) -> str:
    return authjwt.agent_token(secret, job, stream, incarnation=incarnation, expires=expires)


def live(job: str) -> core.JobView | None:
    """Every job exists and runs, in incarnation INC."""
    return LIVE


def request(server: authjwt.KeyPair, user_nkey: str, user: str, password: str) -> str:
    claims = {"sub": "AISSUER", "aud": "nats-authorization-request",
              "nats": {"type": "authorization_request", "version": 2, "user_nkey": user_nkey,
                       "server_id": {"name": "s", "host": "127.0.0.1", "id": server.public_key},
                       "connect_opts": {"user": user, "pass": password, "protocol": 1}}}
    return authjwt.encode_jwt(claims, server, 100)


def test_nkeys_round_trip_and_name_their_kind() -> None:
    for prefix, letter in ((authjwt.PREFIX_ACCOUNT, "A"), (authjwt.PREFIX_USER, "U"), (authjwt.PREFIX_SERVER, "N")):
        kp = authjwt.KeyPair.create(prefix)
        assert kp.public_key.startswith(letter) and len(kp.public_key) == 56
        assert kp.seed.startswith("S" + letter)
        assert authjwt.KeyPair.from_seed(kp.seed).public_key == kp.public_key
        with pytest.raises(authjwt.NkeyError):  # a flipped character breaks the checksum
            authjwt.decode_public(kp.public_key[:-3] + ("A" if kp.public_key[-3] != "A" else "B")
                                  + kp.public_key[-2:], prefix)
    with pytest.raises(authjwt.NkeyError):
        authjwt.decode_public(authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key, authjwt.PREFIX_ACCOUNT)


def test_a_tampered_jwt_does_not_verify() -> None:
    kp = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    token = authjwt.encode_jwt({"sub": "x", "nats": {"v": 1}}, kp, 5)
    assert authjwt.decode_jwt(token, authjwt.PREFIX_ACCOUNT)["sub"] == "x"
    head, body, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["sub"] = "admin"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    with pytest.raises(authjwt.NkeyError):
        authjwt.decode_jwt(f"{head}.{forged}.{sig}", authjwt.PREFIX_ACCOUNT)


def test_the_callout_admits_a_jobs_agent_with_that_jobs_permissions_only() -> None:
    server, issuer = authjwt.KeyPair.create(authjwt.PREFIX_SERVER), authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    keys = core.CalloutKeys(issuer, SECRET)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    v = core.decide(request(server, user_nkey, "agent-j1", token("j1")), keys, 200, live)
    assert v.outcome == "admitted" and v.response is not None
    resp = authjwt.decode_jwt(v.response, authjwt.PREFIX_ACCOUNT)
    assert resp["sub"] == user_nkey and resp["aud"] == server.public_key and resp["iss"] == issuer.public_key
    assert resp["nats"]["type"] == "authorization_response" and "error" not in resp["nats"]
    user = authjwt.decode_jwt(resp["nats"]["jwt"], authjwt.PREFIX_ACCOUNT)
    assert user["sub"] == user_nkey and user["aud"] == "$G" and user["name"] == "agent-j1"
    perms = security.agent_job_permissions("j1")
    assert user["nats"]["pub"]["allow"] == list(perms.publish) and user["nats"]["sub"]["allow"] == list(perms.subscribe)
    assert all("j2" not in s for s in perms.publish + perms.subscribe)
    assert not any(s in (">", "pacer.>", security.JS_API, "_INBOX.>") for s in perms.publish + perms.subscribe)


@pytest.mark.parametrize(("user", "password"), [
    ("agent-j1", "nope"), ("agent-j1", token("j2")), ("agent-", ""),
    ("admin", token("j1")), ("agent-a.b", token("a.b")),
    ("agent-j1", token("j1", secret="another")), ("agent-j1", token("j1", expires=200)),  # expired at "now"
    ("agent-j1", f"{INC}.{EXP + 1}.{token('j1').split('.')[2]}"),  # a later expiry than the MAC covers
    ("agent-j1", f"{int(INC) + 1}.{EXP}.{token('j1').split('.')[2]}"),  # another incarnation than it covers
    ("agent-j1", token("j1").split(".")[2]),  # the MAC alone
])
def test_the_callout_refuses_everything_else(user: str, password: str) -> None:
    server, issuer = authjwt.KeyPair.create(authjwt.PREFIX_SERVER), authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    v = core.decide(request(server, user_nkey, user, password), core.CalloutKeys(issuer, SECRET), 200, live)
    assert v.outcome == "refused" and v.response is not None
    resp = authjwt.decode_jwt(v.response, authjwt.PREFIX_ACCOUNT)
    assert resp["nats"]["error"] and "jwt" not in resp["nats"] and resp["sub"] == user_nkey


def test_a_request_not_signed_by_a_server_gets_no_answer() -> None:
    issuer = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    not_a_server = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    keys = core.CalloutKeys(issuer, SECRET)
    for req in ("garbage", request(not_a_server, user_nkey, "agent-j1", token("j1"))):
        v = core.decide(req, keys, 200, live)
        assert v.outcome == "malformed" and v.response is None


@pytest.mark.parametrize(("view", "why"), [
    (None, "no such job"),
    (core.JobView(INC, ended=True), "job has ended"),
    (core.JobView(authjwt.incarnation(1_700_000_500.0), ended=False), "earlier job"),
])
def test_a_right_token_of_a_job_that_ended_or_was_replaced_is_refused(view: core.JobView | None, why: str) -> None:
    """The MAC and expiry are right; the job's record decides: gone, ended, or a later job of that name."""
    server, issuer = authjwt.KeyPair.create(authjwt.PREFIX_SERVER), authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    asked: list[str] = []

    def lookup(job: str) -> core.JobView | None:
        asked.append(job)
        return view

    v = core.decide(request(server, user_nkey, "agent-j1", token("j1")), core.CalloutKeys(issuer, SECRET), 200, lookup)
    assert asked == ["j1"]
    assert v.outcome == "refused" and why in v.reason
    assert "jwt" not in authjwt.decode_jwt(str(v.response), authjwt.PREFIX_ACCOUNT)["nats"]


def test_a_made_up_token_costs_no_job_lookup() -> None:
    server, issuer = authjwt.KeyPair.create(authjwt.PREFIX_SERVER), authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    asked: list[str] = []

    def lookup(job: str) -> core.JobView | None:
        asked.append(job)
        return LIVE

    for password in ("nope", token("j1", secret="guess"), token("j1", expires=100)):
        v = core.decide(request(server, user_nkey, "agent-j1", password), core.CalloutKeys(issuer, SECRET), 200, lookup)
        assert v.outcome == "refused"
    assert asked == []


def test_tokens_are_per_incarnation_and_expire() -> None:
    first, later = authjwt.incarnation(1000.0), authjwt.incarnation(1000.5)
    assert first != later
    exp = authjwt.token_expiry(5000.0, 3600)
    assert 5000 + 3600 <= exp <= 5000 + 5400
    # Tokens minted within one half of the lifetime are the same (one Secret per job on Kubernetes) ...
    assert authjwt.token_expiry(5000.0 + 1, 3600) == exp
    a = token("j1", incarnation=first, expires=exp)
    assert a == token("j1", incarnation=first, expires=exp)
    # ... and a later job of the same name gets another token, which the first's MAC does not cover.
    b = token("j1", incarnation=later, expires=exp)
    assert a != b and authjwt.parse_token(b) == authjwt.AgentToken(later, exp)
    assert authjwt.token_ok(SECRET, "j1", a, exp - 1) and not authjwt.token_ok(SECRET, "j1", a, exp)
    assert authjwt.token_mac_ok(SECRET, "j1", a) and not authjwt.token_mac_ok(SECRET, "j2", a)
    with pytest.raises(ValueError):
        authjwt.agent_token(SECRET, "j1", incarnation="1.2", expires=exp)
