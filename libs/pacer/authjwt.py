"""NATS nkeys and JWTs, enough for an auth callout; and the per-job agent credential.

nats-server's auth callout (``authorization { auth_callout { ... } }``) hands
every connection whose user is not listed to a responder on
``$SYS.REQ.USER.AUTH``: the request is a JWT signed by the server, the
answer a JWT signed by the issuer account naming the user's permissions
(services/auth_callout).  This module encodes what that takes, on the
``cryptography`` package's ed25519 (no nkeys/PyNaCl dependency):

* nkeys: an ed25519 key as text -- base32 (no padding) of a prefix byte
  (``A`` account, ``U`` user, ``N`` server, ``S`` + type for seeds), the
  32 key bytes and a CRC-16 (polynomial 0x1021, little endian);
* JWTs: ``base64url(header).base64url(claims).base64url(ed25519 signature)``
  with the header ``{"typ":"JWT","alg":"ed25519-nkey"}``; ``jti`` is the
  base32 SHA-512/256 of the claims without it, as nats-io/jwt v2 computes it.

The per-job agent credential: the executor gives each pod of job ``j`` the
user ``agent-<j>`` (:func:`pacer.security.agent_user`) and the password
:func:`agent_token`, ``<incarnation>.<expires>.<mac>`` with mac =
HMAC-SHA256(secret, ``agent:<j>:<incarnation>:<expires>``); the responder,
holding the same secret, admits the user with the permissions of that job
only (:func:`pacer.security.agent_job_permissions`), and only while the token
has not expired and job ``j`` is still that incarnation (:func:`incarnation`
of its record's submission time) and has not ended and been torn down: a later job of the same
name gets other tokens, and the tokens of an ended job stop working.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pacer.errors import ValidationError

# Prefix bytes of nkeys (nats-io/nkeys): the first base32 letter of the text names the key's kind.
PREFIX_SEED = 18 << 3  # "S"
PREFIX_ACCOUNT = 0  # "A"
PREFIX_SERVER = 13 << 3  # "N"
PREFIX_USER = 20 << 3  # "U"
PREFIX_OPERATOR = 14 << 3  # "O"
_KINDS = {PREFIX_ACCOUNT: "account", PREFIX_SERVER: "server", PREFIX_USER: "user", PREFIX_OPERATOR: "operator"}

JWT_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
GLOBAL_ACCOUNT = "$G"  # where users of a config without accounts live (the callout's ``aud`` places them)


class NkeyError(ValidationError):
    """A key or JWT that does not decode, or whose checksum or signature is wrong."""


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _b32(raw: bytes) -> str:
    return base64.b32encode(raw).decode().rstrip("=")


def _unb32(text: str) -> bytes:
    try:
        return base64.b32decode(text + "=" * (-len(text) % 8))
    except ValueError as exc:
        raise NkeyError(f"not an nkey: {exc}") from None


def _with_crc(raw: bytes) -> str:
    return _b32(raw + _crc16(raw).to_bytes(2, "little"))


def _check_crc(text: str) -> bytes:
    raw = _unb32(text)
    if len(raw) < 3 or _crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise NkeyError("nkey checksum mismatch")
    return raw[:-2]


def encode_public(prefix: int, key: bytes) -> str:
    """The text of public key ``key`` (32 bytes) of kind ``prefix`` (``A...``, ``U...``, ``N...``)."""
    return _with_crc(bytes([prefix]) + key)


def decode_public(text: str, prefix: int) -> bytes:
    """The 32 key bytes of ``text``, which must be a public key of kind ``prefix``."""
    raw = _check_crc(text)
    if len(raw) != 33 or raw[0] != prefix:
        raise NkeyError(f"{text[:8]}...: not a public {_KINDS.get(prefix, prefix)} key")
    return raw[1:]


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An ed25519 nkey pair of one kind (account, user, server)."""

    prefix: int
    private: Ed25519PrivateKey

    @classmethod
    def create(cls, prefix: int) -> KeyPair:
        return cls(prefix, Ed25519PrivateKey.from_private_bytes(os.urandom(32)))

    @classmethod
    def from_seed(cls, seed: str) -> KeyPair:
        """A pair from its seed text (``SA...`` for an account, ``SU...`` for a user)."""
        raw = _check_crc(seed.strip())
        if len(raw) != 34 or raw[0] & 0xF8 != PREFIX_SEED:
            raise NkeyError("not an nkey seed")
        prefix = ((raw[0] & 0x07) << 5) | (raw[1] >> 3)
        if prefix not in _KINDS:
            raise NkeyError(f"unknown nkey seed kind {prefix}")
        return cls(prefix, Ed25519PrivateKey.from_private_bytes(raw[2:]))

    @property
    def seed(self) -> str:
        raw = self.private.private_bytes_raw()
        return _with_crc(bytes([PREFIX_SEED | (self.prefix >> 5), (self.prefix & 31) << 3]) + raw)

    @property
    def public_key(self) -> str:
        return encode_public(self.prefix, self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError as exc:
        raise NkeyError(f"not base64url: {exc}") from None


def _jti(claims: dict[str, Any]) -> str:
    """A unique id of the claims: base32 of a hash of them (nats-io/jwt hashes with SHA-512/256)."""
    body = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    try:
        digest = hashlib.new("sha512_256", body).digest()
    except ValueError:  # an OpenSSL without SHA-512/256: the id only has to be unique
        digest = hashlib.sha256(body).digest()
    return _b32(digest)


def encode_jwt(claims: dict[str, Any], issuer: KeyPair, now: int) -> str:
    """``claims`` signed by ``issuer``: ``iss`` is its public key, ``iat`` is ``now``, ``jti`` set here."""
    claims = {**claims, "iss": issuer.public_key, "iat": now}
    claims["jti"] = _jti(claims)
    head = _b64(json.dumps(JWT_HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signed = f"{head}.{body}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def decode_jwt(token: str, issuer_prefix: int) -> dict[str, Any]:
    """The claims of ``token`` after checking its signature by its ``iss`` (a key of kind ``issuer_prefix``)."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise NkeyError("a JWT has 3 parts")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except ValueError as exc:
        raise NkeyError(f"JWT is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("alg") != JWT_HEADER["alg"] or not isinstance(claims, dict):
        raise NkeyError("not an ed25519-nkey JWT")
    key = decode_public(str(claims.get("iss", "")), issuer_prefix)
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(_unb64(parts[2]), f"{parts[0]}.{parts[1]}".encode())
    except InvalidSignature:
        raise NkeyError("JWT signature does not verify") from None
    return claims


#: Separates a token's MAC from the stream it grants (a stream name never holds it).
STREAM_SEP = "~"
#: Separates a token's incarnation, expiry and MAC.
FIELD_SEP = "."


def incarnation(submitted_at: float) -> str:
    """The incarnation of a job submitted at ``submitted_at`` (its record's time, whole microseconds).

    A job name can be used again once its record is gone; the new job's
    submission time differs, so its tokens differ and the old job's fail.
    """
    return str(round(submitted_at * 1_000_000))


def token_expiry(now: float, ttl_s: float) -> int:
    """When a token minted at ``now`` expires: between ``ttl_s`` and 1.5 ``ttl_s`` later.

    Tokens minted in the same half of a ``ttl_s`` are identical (the expiry is
    rounded up to a multiple of ``ttl_s / 2``), so every pod a job starts in
    that span can share one credential (one Secret on Kubernetes).
    """
    half = max(1, round(ttl_s / 2))
    return (int(now) // half + 3) * half


def agent_token(secret: str, job: str, stream: str = "", *, incarnation: str, expires: int) -> str:
    """The password of job ``job``'s agent user, for that job's ``incarnation`` until ``expires`` (Unix s).

    ``<incarnation>.<expires>.<mac>``, mac = HMAC-SHA256(secret,
    ``agent:<job>:<incarnation>:<expires>``), hex.  A streaming job's pods also
    read its data stream: the MAC then covers ``:stream:<stream>`` too and the
    password ends in ``~<stream>``, so the auth callout learns the stream from
    the password and grants it only if the MAC, which only the executor can
    make, covers it.
    """
    if not (incarnation.isascii() and incarnation.isdigit()):
        raise ValueError(f"incarnation {incarnation!r}: digits only (authjwt.incarnation)")
    text = f"agent:{job}:{incarnation}:{int(expires)}" + (f":stream:{stream}" if stream else "")
    mac = hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()
    return f"{incarnation}{FIELD_SEP}{int(expires)}{FIELD_SEP}{mac}" + (f"{STREAM_SEP}{stream}" if stream else "")


@dataclass(frozen=True, slots=True)
class AgentToken:
    """What an agent token claims (:func:`token_ok` says whether its MAC covers it)."""

    incarnation: str
    expires: int
    stream: str = ""


def parse_token(token: str) -> AgentToken | None:
    """The claims of an agent token; ``None`` if it is not shaped like one."""
    body, _, stream = token.partition(STREAM_SEP)
    parts = body.split(FIELD_SEP)
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) <= 24 for p in parts[:2]):
        return None
    return AgentToken(parts[0], int(parts[1]), stream)


def token_stream(token: str) -> str:
    """The stream a token claims to grant ("" = none); :func:`token_ok` says whether it does."""
    return token.partition(STREAM_SEP)[2]


def token_mac_ok(secret: str, job: str, token: str) -> bool:
    """Whether ``token`` was made by the holder of ``secret`` for job ``job`` (with the stream it names, if
    any; constant-time compare), expired or not."""
    claims = parse_token(token)
    if not secret or claims is None:
        return False
    want = agent_token(secret, job, claims.stream, incarnation=claims.incarnation, expires=claims.expires)
    return hmac.compare_digest(want, token)


def token_ok(secret: str, job: str, token: str, now: float) -> bool:
    """Whether ``token`` is a password of job ``job``'s agent user that has not expired at ``now``.  Whether
    its incarnation is the job's live one is for the caller to check (:func:`parse_token`)."""
    claims = parse_token(token)
    return claims is not None and claims.expires > now and token_mac_ok(secret, job, token)
