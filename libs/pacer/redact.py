"""Credentials out of what users are shown: URL passwords, password/secret settings, nkey seeds.

What the executor launches carries credentials: every pod of job J gets
the user ``agent-J`` and a token in its environment (the token admits it as
job J's agents, pacer.authjwt), a trainer may print them (or a URL it built
from them, ``nats://agent-J:<token>@host``), and an error text may quote
them.  What users see (API responses and the dashboard's events,
``pacer job`` / ``pacer logs``) passes through :func:`text` or :func:`data`
at the display boundary, never what is launched.

Masked, the name kept so a reader still sees who connects:

* a URL's password: ``nats://agent-j1:<token>@nats:4222`` -> ``nats://agent-j1:***@nats:4222``;
* the value of a setting named like a password, secret or seed, in
  ``KEY=value``, ``key: value``, JSON ``"key": "value"`` or ``--key value``
  form (``PACER_NATS_PASSWORD=...``, ``"pass": "..."``, ``--password ...``);
* an nkey seed (``SA...``, ``SU...``: 58 base32 characters);
* in :func:`data`, the string value of a map key named like those.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# scheme://user:password@  (the password stops at the first / @ or blank: with_credentials %-escapes them)
_URL = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:'\"]*:)[^\s/@'\"]+(?=@)")
# (not a bare "seed": a data-shuffling seed is no secret; an nkey seed is masked by its form anyway)
_NAME = r"(?:\w*(?:password|passwd|secret)|pass|\w*issuer[_-]?seed)"
# KEY=value, key: value, "key": "value", key = 'value' (on one line: an empty KEY= never takes the next line)
_SETTING = re.compile(rf"(?i)(\b{_NAME}[\"']?[ \t]*[:=][ \t]*[\"']?)(?!\*\*\*)[^\s\"',;}}&)]+")
# --password value, --nats-password=value
_FLAG = re.compile(r"(?i)(--[\w-]*(?:password|passwd|secret|issuer-seed)(?:=|[ \t]+))(?!\*\*\*)\S+")
_SEED = re.compile(r"\bS[AOUNCPX][A-Z2-7]{56}\b")
_KEY = re.compile(rf"(?i)^{_NAME}$")


def text(s: str) -> str:
    """``s`` with every credential it shows masked (see the module docstring)."""
    s = _URL.sub(rf"\g<1>{MASK}", s)
    s = _SETTING.sub(rf"\g<1>{MASK}", s)
    s = _FLAG.sub(rf"\g<1>{MASK}", s)
    return _SEED.sub(MASK, s)


def secret_key(name: str) -> bool:
    """Whether a map key names a credential (``password``, ``PACER_NATS_PASSWORD``, ``pass``, ``issuer-seed``)."""
    return bool(_KEY.match(name.replace("-", "_")))


def data(obj: Any) -> Any:
    """Plain data (maps, lists, strings, numbers) with :func:`text` applied to every string and the string
    value of every credential-named key masked; anything else is returned as it is."""
    if isinstance(obj, str):
        return text(obj)
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(k, str) and secret_key(k) and isinstance(v, str) and v else data(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [data(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(data(v) for v in obj)
    return obj
