"""OIDC bearer tokens for the API: a JWT from the team's identity provider instead of a Pacer token.

Optional (``PACER_API_OIDC_ISSUER``).  A bearer token that is a JWT (three
dot-separated parts) is checked here; anything else is looked up in the
API's own tokens (:mod:`.identity`).

Checked as RFC 7519 §7.2 and OpenID Connect Core §3.1.3.7 ask of an ID token
or access token that is a JWT:

* the header's ``alg`` is RS256 or ES256 (never ``none`` nor an HMAC, whose
  key would be the public one), its ``kid`` names a key of the issuer's JWKS;
* the signature verifies with that key;
* ``iss`` is the configured issuer, ``aud`` holds the configured audience,
  ``exp`` is in the future and ``nbf``/``iat`` not in it (60 s of leeway);
* the role and namespaces come from claims (``pacer_role``, a string, and
  ``pacer_namespaces``, a list; names configurable), the caller's name from
  ``preferred_username``, else ``email``, else ``sub``.  A token without a
  valid role or namespaces is refused: nothing is granted by default.

The JWKS is found through the issuer's discovery document
(``<issuer>/.well-known/openid-configuration``, ``jwks_uri``), cached, and
fetched again when a token names a key it does not hold (key rotation), at
most every ``refresh_s``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from pacer.ids import is_namespace
from pacer_services.api.identity import ALL, Identity, Role

LEEWAY_S = 60.0
ALGORITHMS = ("RS256", "ES256")


class TokenRefused(Exception):
    """The JWT is not one this API accepts; the message says why (for the 401's body and the log)."""


@dataclass
class OidcConfig:
    issuer: str  # PACER_API_OIDC_ISSUER: the "iss" the tokens carry, and where discovery starts
    audience: str  # PACER_API_OIDC_AUDIENCE: an "aud" the tokens must hold
    role_claim: str = "pacer_role"  # PACER_API_OIDC_ROLE_CLAIM
    namespaces_claim: str = "pacer_namespaces"  # PACER_API_OIDC_NAMESPACES_CLAIM
    refresh_s: float = 60.0  # the JWKS is fetched again for an unknown kid at most this often
    timeout_s: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OidcConfig | None:
        issuer = env.get("PACER_API_OIDC_ISSUER", "").strip().rstrip("/")
        if not issuer:
            return None
        audience = env.get("PACER_API_OIDC_AUDIENCE", "").strip()
        if not audience:
            raise ValueError("PACER_API_OIDC_AUDIENCE: required with PACER_API_OIDC_ISSUER")
        return cls(issuer, audience, env.get("PACER_API_OIDC_ROLE_CLAIM", cls.role_claim),
                   env.get("PACER_API_OIDC_NAMESPACES_CLAIM", cls.namespaces_claim))


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and len(token) > 20


def _unb64(part: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (ValueError, TypeError):
        raise TokenRefused("not base64url") from None


def _json_part(part: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(_unb64(part))
    except ValueError:
        raise TokenRefused(f"its {what} is not JSON") from None
    if not isinstance(data, dict):
        raise TokenRefused(f"its {what} is not a JSON object")
    return data


def _int_b64(value: Any) -> int:
    if not isinstance(value, str):
        raise TokenRefused("a JWKS key lacks its numbers")
    return int.from_bytes(_unb64(value), "big")


def public_key(jwk: Mapping[str, Any]) -> rsa.RSAPublicKey | ec.EllipticCurvePublicKey:
    """An RSA or P-256 public key from its JWK (RFC 7517/7518)."""
    if jwk.get("kty") == "RSA":
        return rsa.RSAPublicNumbers(_int_b64(jwk.get("e")), _int_b64(jwk.get("n"))).public_key()
    if jwk.get("kty") == "EC" and jwk.get("crv") == "P-256":
        return ec.EllipticCurvePublicNumbers(_int_b64(jwk.get("x")), _int_b64(jwk.get("y")),
                                             ec.SECP256R1()).public_key()
    raise TokenRefused(f"a JWKS key of type {jwk.get('kty')!r} is not supported")


def verify_signature(alg: str, key: Any, signed: bytes, signature: bytes) -> None:
    try:
        if alg == "RS256" and isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, signed, padding.PKCS1v15(), hashes.SHA256())
            return
        if alg == "ES256" and isinstance(key, ec.EllipticCurvePublicKey) and len(signature) == 64:
            der = encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
            key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
            return
    except InvalidSignature:
        raise TokenRefused("its signature does not verify") from None
    raise TokenRefused(f"its algorithm {alg!r} does not match its key")


def check_claims(claims: Mapping[str, Any], cfg: OidcConfig, now: float) -> Identity:
    """The caller a verified token names, or TokenRefused (RFC 7519 §4.1, OIDC Core §3.1.3.7)."""
    if claims.get("iss") != cfg.issuer:
        raise TokenRefused(f"issuer {claims.get('iss')!r} is not {cfg.issuer!r}")
    aud = claims.get("aud")
    if cfg.audience not in (aud if isinstance(aud, list) else [aud]):
        raise TokenRefused(f"audience {aud!r} does not hold {cfg.audience!r}")
    exp = claims.get("exp")
    if not isinstance(exp, int | float) or exp + LEEWAY_S <= now:
        raise TokenRefused("it has expired" if isinstance(exp, int | float) else "it has no exp")
    for name in ("nbf", "iat"):
        t = claims.get(name)
        if t is not None and (not isinstance(t, int | float) or t - LEEWAY_S > now):
            raise TokenRefused(f"its {name} is in the future")
    role = claims.get(cfg.role_claim)
    if not isinstance(role, str) or role.upper() not in Role.__members__:
        raise TokenRefused(f"claim {cfg.role_claim!r}: one of viewer, submitter, admin, got {role!r}")
    spaces = claims.get(cfg.namespaces_claim)
    if (not isinstance(spaces, list) or not spaces
            or not all(isinstance(n, str) and (n == ALL or is_namespace(n)) for n in spaces)):
        raise TokenRefused(f"claim {cfg.namespaces_claim!r}: a non-empty list of namespaces, got {spaces!r}")
    name = next((v for k in ("preferred_username", "email", "sub") if isinstance(v := claims.get(k), str) and v), "")
    if not name:
        raise TokenRefused("it names no subject")
    return Identity(f"oidc:{name}"[:200], Role[role.upper()], frozenset(spaces))


@dataclass
class OidcVerifier:
    """Checks JWTs from one issuer; holds its JWKS."""

    cfg: OidcConfig
    clock: Callable[[], float] = time.time
    keys: dict[str, Any] = field(default_factory=dict)  # kid -> public key
    fetched_at: float = float("-inf")
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _session: aiohttp.ClientSession | None = None

    async def identify(self, token: str) -> Identity:
        head_b64, body_b64, sig_b64 = token.split(".")
        header = _json_part(head_b64, "header")
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in ALGORITHMS:
            raise TokenRefused(f"algorithm {alg!r}: one of {', '.join(ALGORITHMS)}")
        if not isinstance(kid, str) or not kid:
            raise TokenRefused("its header names no key (kid)")
        key = await self._key(kid)
        verify_signature(str(alg), key, f"{head_b64}.{body_b64}".encode(), _unb64(sig_b64))
        return check_claims(_json_part(body_b64, "payload"), self.cfg, self.clock())

    async def _key(self, kid: str) -> Any:
        if kid not in self.keys:
            async with self._lock:
                if kid not in self.keys and time.monotonic() - self.fetched_at >= self.cfg.refresh_s:
                    await self._fetch()
        if kid not in self.keys:
            raise TokenRefused(f"key {kid[:40]!r} is not in the issuer's JWKS")
        return self.keys[kid]

    async def _fetch(self) -> None:
        self.fetched_at = time.monotonic()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        try:
            async with self._session.get(f"{self.cfg.issuer}/.well-known/openid-configuration") as resp:
                resp.raise_for_status()
                uri = (await resp.json(content_type=None)).get("jwks_uri")
            if not isinstance(uri, str):
                raise TokenRefused("the issuer's discovery document has no jwks_uri")
            async with self._session.get(uri) as resp:
                resp.raise_for_status()
                jwks = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            raise TokenRefused(f"the issuer's keys cannot be read now: {type(exc).__name__}") from None
        keys: dict[str, Any] = {}
        for jwk in jwks.get("keys", []) if isinstance(jwks, dict) else []:
            if isinstance(jwk, dict) and isinstance(jwk.get("kid"), str) and jwk.get("use", "sig") == "sig":
                try:
                    keys[jwk["kid"]] = public_key(jwk)
                except (TokenRefused, ValueError):
                    continue  # a key type we do not use: the others still count
        self.keys = keys

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
