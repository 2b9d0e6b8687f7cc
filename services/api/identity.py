"""Who calls the API, and what they may do: bearer tokens with a role and the namespaces they may act in.

Pure: no IO but :func:`load_tokens_file`, no clock.

* A **role** orders what a caller may do: ``viewer`` reads (list, get, logs,
  events), ``submitter`` also submits and stops, ``admin`` also acts in every
  namespace it is given (today that is all it adds; more admin-only routes
  come with it).
* **Namespaces** are teams (Kubernetes namespace names).  A job belongs to
  the namespace it was submitted to (``JobRecord.namespace``).  A caller sees
  only its namespaces' jobs: another team's job answers ``not_found``, as a
  job that does not exist would (its name is not revealed), across the JSON
  routes and the event stream alike.  ``"*"`` is every namespace.
* **Tokens** live in a file (``PACER_API_TOKENS_FILE``, mounted from a
  Secret), by their SHA-256, never in clear::

      tokens:
        - name: alice            # who: the audit log's "who"
          role: submitter        # viewer | submitter | admin
          namespaces: [team-a]   # or ["*"]
          sha256: 9f86d08...     # hex SHA-256 of the token (python -m pacer_services.api.identity <token>)

  ``PACER_API_TOKEN`` (one shared token) stays: it is the identity
  ``api-token``, an admin of every namespace.  A token is found by its hash,
  so the lookup's time does not depend on how much of it matched.
"""

from __future__ import annotations

import enum
import hashlib
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pacer.errors import ValidationError
from pacer.ids import DEFAULT_NAMESPACE, is_namespace, is_token

#: Every namespace.
ALL = "*"

#: The shortest bearer token accepted (``secrets.token_urlsafe(32)`` gives 43 characters).
MIN_TOKEN_LEN = 16

#: The identity of the shared ``PACER_API_TOKEN``.
SHARED_NAME = "api-token"


class Role(enum.IntEnum):
    """What a caller may do; each role may do what the ones below it may."""

    VIEWER = 1
    SUBMITTER = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    role: Role
    namespaces: frozenset[str]

    def sees(self, namespace: str) -> bool:
        """May read (and, with the role, act on) the jobs of ``namespace``."""
        return ALL in self.namespaces or namespace in self.namespaces

    def may(self, role: Role) -> bool:
        return self.role >= role

    def listed(self) -> list[str]:
        """The namespaces to list jobs of: empty = every one."""
        return [] if ALL in self.namespaces else sorted(self.namespaces)

    def submit_namespace(self, asked: str) -> str:
        """The namespace a submission goes to: ``asked``, else the caller's only one, else ``default``."""
        if asked:
            return asked
        own = sorted(self.namespaces - {ALL})
        return own[0] if len(own) == 1 and ALL not in self.namespaces else DEFAULT_NAMESPACE


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Identities:
    """Every known token (by its hash) and who it is."""

    by_hash: Mapping[str, Identity]

    def find(self, token: str) -> Identity | None:
        if len(token) < MIN_TOKEN_LEN:
            return None
        return self.by_hash.get(token_hash(token))

    def __len__(self) -> int:
        return len(self.by_hash)


def parse_tokens(data: Any, where: str = "tokens file") -> dict[str, Identity]:
    """The ``tokens:`` list of a tokens file -> {sha256: Identity}; a ValidationError lists every bad entry."""
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise ValidationError(f"{where}: expected a mapping with a 'tokens' list")
    out: dict[str, Identity] = {}
    errors: list[str] = []
    for i, item in enumerate(data["tokens"]):
        at = f"{where}: tokens[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{at}: expected a mapping")
            continue
        bad: list[str] = []
        if unknown := set(item) - {"name", "role", "namespaces", "sha256"}:
            bad.append(f"{at}: unknown keys {sorted(unknown)}")
        name, role, spaces, digest = (item.get(k) for k in ("name", "role", "namespaces", "sha256"))
        if not isinstance(name, str) or not is_token(name):
            bad.append(f"{at}.name: expected 1-64 of [A-Za-z0-9_-], got {name!r}")
        if role not in {r.label for r in Role}:
            bad.append(f"{at}.role: one of {', '.join(r.label for r in Role)}, got {role!r}")
        if (not isinstance(spaces, list) or not spaces
                or not all(isinstance(n, str) and (n == ALL or is_namespace(n)) for n in spaces)):
            bad.append(f"{at}.namespaces: expected a non-empty list of namespace names or '*', got {spaces!r}")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            bad.append(f"{at}.sha256: expected 64 lowercase hex digits (the token's SHA-256)")
        elif digest in out:
            bad.append(f"{at}.sha256: the same token as {out[digest].name!r}")
        if bad:
            errors += bad
        else:
            out[str(digest)] = Identity(str(name), Role[str(role).upper()], frozenset(spaces))  # type: ignore[arg-type]
    if errors:
        raise ValidationError("\n".join(errors))
    return out


def identities(shared_token: str = "", tokens: Mapping[str, Identity] | None = None, *,
               others: bool = False) -> Identities:
    """The API's identities: the shared token's (an admin of every namespace) and the tokens file's.
    ``others``: callers are also known another way (an OIDC issuer), so none here is no error."""
    out = dict(tokens or {})
    if shared_token:
        if len(shared_token) < MIN_TOKEN_LEN:
            raise ValidationError(f"api token: shorter than {MIN_TOKEN_LEN} characters")
        out[token_hash(shared_token)] = Identity(SHARED_NAME, Role.ADMIN, frozenset({ALL}))
    if not out and not others:
        raise ValidationError("the API has no token: set PACER_API_TOKEN, PACER_API_TOKENS_FILE or "
                              "PACER_API_OIDC_ISSUER")
    return Identities(out)


def load_tokens_file(path: Path) -> dict[str, Identity]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValidationError(f"{path}: cannot read the tokens file: {exc}") from None
    return parse_tokens(data, str(path))


def entry(name: str, role: str, namespaces: Iterable[str], token: str) -> dict[str, Any]:
    """A tokens-file entry for ``token`` (what an operator pastes into the Secret)."""
    return {"name": name, "role": role, "namespaces": list(namespaces), "sha256": token_hash(token)}


if __name__ == "__main__":  # python -m pacer_services.api.identity <token>: the hash for the file
    for t in sys.argv[1:] or [sys.stdin.readline().strip()]:
        print(token_hash(t))
