"""OIDC bearer tokens on the real API service, from a local test issuer (an aiohttp app on loopback that
serves a discovery document and a JWKS, and signs tokens with its own RSA and P-256 keys).

Roles and namespaces come from the token's claims; a token that is expired, for another audience or
issuer, signed by another key, of algorithm ``none`` or ``HS256``, or without a role is a 401.  (The
peer double, the API service and its client: api_support.)
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import api_support
import pytest
from aiohttp import web
from api_support import JSON, SPEC_YAML, Client, PeerDouble, api_config
from conftest import InProcess
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from pacer.embedded import EmbeddedNats
from pacer_services.api.app import ApiService
from pacer_services.api.oidc import OidcConfig

peers = api_support.peers

pytestmark = pytest.mark.timeout(60)

AUDIENCE = "pacer-api"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def num(n: int) -> str:
    return b64(n.to_bytes((n.bit_length() + 7) // 8, "big"))


@dataclass
class Issuer:
    """A local OIDC issuer: its keys, its JWKS on loopback, and tokens signed as a provider signs them."""

    url: str = ""
    rsa_key: rsa.RSAPrivateKey = field(default_factory=lambda: rsa.generate_private_key(65537, 2048))
    ec_key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    fetches: int = 0
    kids: tuple[str, ...] = ("rsa-1", "ec-1")

    def jwks(self) -> dict[str, Any]:
        r, e = self.rsa_key.public_key().public_numbers(), self.ec_key.public_key().public_numbers()
        keys = {"rsa-1": {"kty": "RSA", "kid": "rsa-1", "use": "sig", "alg": "RS256", "n": num(r.n), "e": num(r.e)},
                "ec-1": {"kty": "EC", "kid": "ec-1", "use": "sig", "crv": "P-256",
                         "x": b64(e.x.to_bytes(32, "big")), "y": b64(e.y.to_bytes(32, "big"))}}
        return {"keys": [keys[k] for k in self.kids]}

    def token(self, claims: dict[str, Any] | None = None, *, alg: str = "RS256", kid: str = "rsa-1",
              key: Any = None, **overrides: Any) -> str:
        now = int(time.time())
        body = {"iss": self.url, "aud": AUDIENCE, "sub": "u-123", "preferred_username": "alice",
                "exp": now + 300, "iat": now, "pacer_role": "submitter", "pacer_namespaces": ["team-a"],
                **(claims or {}), **overrides}
        body = {k: v for k, v in body.items() if v is not None}
        head = b64(json.dumps({"alg": alg, "kid": kid, "typ": "JWT"}).encode())
        signed = f"{head}.{b64(json.dumps(body).encode())}".encode()
        if alg == "RS256":
            sig = (key or self.rsa_key).sign(signed, padding.PKCS1v15(), hashes.SHA256())
        elif alg == "ES256":
            r, s = decode_dss_signature((key or self.ec_key).sign(signed, ec.ECDSA(hashes.SHA256())))
            sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
        else:
            sig = b"" if alg == "none" else b"x" * 32
        return f"{signed.decode()}.{b64(sig)}"


@pytest.fixture
async def issuer() -> AsyncIterator[Issuer]:
    iss = Issuer()

    async def discovery(request: web.Request) -> web.Response:
        return web.json_response({"issuer": iss.url, "jwks_uri": f"{iss.url}/keys"})

    async def keys(request: web.Request) -> web.Response:
        iss.fetches += 1
        return web.json_response(iss.jwks())

    app = web.Application()
    app.router.add_get("/.well-known/openid-configuration", discovery)
    app.router.add_get("/keys", keys)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    iss.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield iss
    await runner.cleanup()


@pytest.fixture
async def http(nats_server: EmbeddedNats, issuer: Issuer) -> AsyncIterator[Client]:
    cfg = api_config()
    cfg.token = ""  # OIDC only
    cfg.oidc = OidcConfig(issuer.url, AUDIENCE, refresh_s=0.0)
    runner = InProcess(nats_server.url, lambda b: ApiService(b, cfg))
    api = await runner.start()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{api.port}") as session:
        yield Client(session)
    await runner.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_providers_token_is_a_caller_with_the_role_and_namespaces_of_its_claims(
        http: Client, issuer: Issuer, peers: PeerDouble) -> None:
    peers.add_running("a-job", namespace="team-a")
    peers.add_running("b-job", namespace="team-b")
    for alg, kid in (("RS256", "rsa-1"), ("ES256", "ec-1")):
        status, body = await http.call("GET", "/api/v1/jobs", headers=bearer(issuer.token(alg=alg, kid=kid)))
        assert status == 200 and [r["job"] for r in body["jobs"]] == ["a-job"], (alg, body)
    status, body = await http.call("POST", "/api/v1/jobs", json={"spec": SPEC_YAML.format(name="from-oidc")},
                                   headers={**bearer(issuer.token()), **JSON})
    assert status == 201 and body["namespace"] == "team-a", body
    viewer = issuer.token(pacer_role="viewer", pacer_namespaces=["team-b"])
    status, body = await http.call("POST", "/api/v1/jobs/b-job/stop", json={}, headers={**bearer(viewer), **JSON})
    assert status == 403, body
    status, body = await http.call("GET", "/api/v1/jobs/a-job", headers=bearer(viewer))
    assert status == 404, body  # team-b's viewer does not see team-a's job


@pytest.mark.parametrize(("why", "make"), [
    ("expired", lambda i: i.token(exp=int(time.time()) - 120)),
    ("audience", lambda i: i.token(aud="someone-else")),
    ("issuer", lambda i: i.token(iss="https://evil.example")),
    ("signature", lambda i: i.token(key=rsa.generate_private_key(65537, 2048))),
    ("algorithm", lambda i: i.token(alg="none")),
    ("algorithm", lambda i: i.token(alg="HS256")),
    ("pacer_role", lambda i: i.token(pacer_role=None)),
    ("pacer_role", lambda i: i.token(pacer_role="owner")),
    ("pacer_namespaces", lambda i: i.token(pacer_namespaces=[])),
    ("future", lambda i: i.token(nbf=int(time.time()) + 600)),
    ("JWKS", lambda i: i.token(kid="no-such-key")),
])
async def test_a_token_the_issuer_did_not_make_for_us_now_is_a_401_saying_why(
        http: Client, issuer: Issuer, peers: PeerDouble, why: str, make: Any) -> None:
    peers.add_running("a-job", namespace="team-a")
    status, body = await http.call("POST", "/api/v1/jobs/a-job/stop", json={},
                                   headers={**bearer(make(issuer)), **JSON})
    assert status == 401 and why in body["error"]["message"], body
    assert peers.records["a-job"].state.value == "running"


async def test_a_rotated_key_is_fetched_when_a_token_names_it(http: Client, issuer: Issuer, peers: PeerDouble) -> None:
    issuer.kids = ("rsa-1",)
    status, _ = await http.call("GET", "/api/v1/jobs", headers=bearer(issuer.token()))
    assert status == 200 and issuer.fetches == 1
    status, _ = await http.call("GET", "/api/v1/jobs", headers=bearer(issuer.token()))
    assert status == 200 and issuer.fetches == 1  # cached
    issuer.kids = ("rsa-1", "ec-1")  # the provider publishes a new key
    status, body = await http.call("GET", "/api/v1/jobs", headers=bearer(issuer.token(alg="ES256", kid="ec-1")))
    assert status == 200 and issuer.fetches == 2, body
