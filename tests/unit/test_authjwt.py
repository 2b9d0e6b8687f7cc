"""nkeys, JWTs and the auth callout's decision (pure; the real server is in test_auth_callout)."""

from __future__ import annotations

import base64
import json

import pytest
from pacer import authjwt, security
from pacer_services.auth_callout import core

SECRET = "s3cret"


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
    v = core.decide(request(server, user_nkey, "agent-j1", authjwt.agent_token(SECRET, "j1")), keys, 200)
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
    ("agent-j1", "nope"), ("agent-j1", authjwt.agent_token(SECRET, "j2")), ("agent-", ""),
    ("admin", authjwt.agent_token(SECRET, "j1")), ("agent-a.b", authjwt.agent_token(SECRET, "a.b")),
])
def test_the_callout_refuses_everything_else(user: str, password: str) -> None:
    server, issuer = authjwt.KeyPair.create(authjwt.PREFIX_SERVER), authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    v = core.decide(request(server, user_nkey, user, password), core.CalloutKeys(issuer, SECRET), 200)
    assert v.outcome == "refused" and v.response is not None
    resp = authjwt.decode_jwt(v.response, authjwt.PREFIX_ACCOUNT)
    assert resp["nats"]["error"] and "jwt" not in resp["nats"] and resp["sub"] == user_nkey


def test_a_request_not_signed_by_a_server_gets_no_answer() -> None:
    issuer = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    not_a_server = authjwt.KeyPair.create(authjwt.PREFIX_ACCOUNT)
    user_nkey = authjwt.KeyPair.create(authjwt.PREFIX_USER).public_key
    keys = core.CalloutKeys(issuer, SECRET)
    for req in ("garbage", request(not_a_server, user_nkey, "agent-j1", authjwt.agent_token(SECRET, "j1"))):
        v = core.decide(req, keys, 200)
        assert v.outcome == "malformed" and v.response is None
