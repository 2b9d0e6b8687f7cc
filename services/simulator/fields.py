"""Reading scenario files: one YAML mapping at a time, naming every bad field by its dotted path.

Shared by both simulators' scenario parsers (:mod:`.stragglers.scenario`,
the autoscaling scenarios): a value of the wrong type, out of range, missing
or unknown raises :class:`ScenarioError` whose message starts with the
field's path (``cluster.workers``, ``stragglers[0].intensity``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pacer.errors import ValidationError


class ScenarioError(ValidationError):
    """A scenario field is unknown, missing or has a bad value (the message names it)."""

    code = "bad_scenario"


class Fields:
    """Reads one mapping, remembering which keys were used (the rest are unknown)."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, Mapping):
            raise ScenarioError(f"{path or 'scenario'}: must be a mapping, got {type(raw).__name__}")
        self.raw = raw
        self.path = path
        self.used: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, default: Any = ..., *, required: bool = False) -> Any:
        self.used.add(key)
        if key not in self.raw or self.raw[key] is None:
            if required or default is ...:
                raise ScenarioError(f"{self._name(key)}: required field is missing")
            return default
        return self.raw[key]

    def int_(self, key: str, default: Any = ..., *, lo: int | None = None) -> int:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ScenarioError(f"{self._name(key)}: must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise ScenarioError(f"{self._name(key)}: must be >= {lo}, got {v}")
        return v

    def float_(
        self, key: str, default: Any = ..., *, lo: float | None = None, hi: float | None = None, strict: bool = False
    ) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ScenarioError(f"{self._name(key)}: must be a number, got {v!r}")
        f = float(v)
        if f != f or f in (float("inf"), float("-inf")):
            raise ScenarioError(f"{self._name(key)}: must be finite, got {v!r}")
        if lo is not None and (f <= lo if strict else f < lo):
            raise ScenarioError(f"{self._name(key)}: must be {'>' if strict else '>='} {lo}, got {v}")
        if hi is not None and f > hi:
            raise ScenarioError(f"{self._name(key)}: must be <= {hi}, got {v}")
        return f

    def bool_(self, key: str, default: Any = ...) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise ScenarioError(f"{self._name(key)}: must be true or false, got {v!r}")
        return v

    def str_(self, key: str, default: Any = ..., *, choices: tuple[str, ...] = ()) -> str:
        v = self.get(key, default)
        if not isinstance(v, str) or not v:
            raise ScenarioError(f"{self._name(key)}: must be a non-empty string, got {v!r}")
        if choices and v not in choices:
            raise ScenarioError(f"{self._name(key)}: must be one of {', '.join(choices)}, got {v!r}")
        return v

    def done(self) -> None:
        unknown = sorted(str(k) for k in self.raw if k not in self.used)
        if unknown:
            raise ScenarioError(f"{self._name(unknown[0])}: unknown field")
