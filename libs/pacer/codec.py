"""msgpack wire codec for Pacer's messages, with schema checks.

A message is a frozen dataclass decorated with :func:`message`, which gives it
a schema name and version.  The dataclass is the single source of each
schema: ``pacer schemas export`` writes it as JSON Schema into
``proto-schemas/`` (the contract that dashboards and custom policies rely on)
and a test fails when the two drift apart.

Decoding validates every field against its type and raises
:class:`~pacer.errors.DecodeError` naming the bad field; unknown fields are
ignored (forward compatibility: a newer sender may add fields).  Validators
are compiled once per class, because decoding sits on the hot path of the
shard service.

Supported field types: ``int``, ``float``, ``str``, ``bool``, ``bytes``,
``list[T]``, ``dict[str, T]``, ``T | None``, ``Any`` (any msgpack value),
``str`` enums and other message classes.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from pacer.errors import DecodeError

T = TypeVar("T")

Check = Callable[[Any, str], Any]
Dump = Callable[[Any], Any]

_MISSING = dataclasses.MISSING


@dataclasses.dataclass(slots=True)
class _Schema:
    name: str
    version: int
    doc: str
    fields: list[tuple[str, Check, bool, Any]] = dataclasses.field(default_factory=list)
    dumps: list[tuple[str, Dump]] = dataclasses.field(default_factory=list)
    compiled: bool = False


REGISTRY: dict[str, type[Any]] = {}


def message(name: str, version: int = 1) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a wire message ``name`` (``domain.Name``)."""

    def deco(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        key = f"{name}.v{version}"
        if key in REGISTRY and REGISTRY[key] is not cls:
            raise TypeError(f"message {key} registered twice")
        cls.__pacer_schema__ = _Schema(name, version, _class_doc(cls))  # type: ignore[attr-defined]
        REGISTRY[key] = cls
        return cls

    return deco


def _class_doc(cls: type[Any]) -> str:
    """The class docstring, dedented; ``""`` for the one ``dataclass`` invents.

    Without a docstring, ``dataclass`` sets ``__doc__`` to the constructor
    signature, whose text depends on the Python version; and 3.13 dedents
    docstrings while 3.11 does not.  Either would make the exported schemas
    differ between interpreters.
    """
    text = inspect.cleandoc(cls.__doc__ or "")
    if text.startswith(f"{cls.__name__}(") and "\n" not in text:
        return ""
    return text


def _schema(cls: type[Any]) -> _Schema:
    try:
        sch: _Schema = cls.__pacer_schema__
    except AttributeError:
        raise TypeError(f"{cls.__name__} is not a @message") from None
    if not sch.compiled:
        _compile(cls, sch)
    return sch


def _compile(cls: type[Any], sch: _Schema) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        required = f.default is _MISSING and f.default_factory is _MISSING
        default: Any = f.default if f.default is not _MISSING else f.default_factory
        sch.fields.append((f.name, _checker(tp), required, default))
        sch.dumps.append((f.name, _dumper(tp)))
    sch.compiled = True


def _is_message(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__pacer_schema__")


def _checker(tp: Any) -> Check:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return lambda v, p: v
    if tp is bool:

        def check_bool(v: Any, p: str) -> bool:
            if v is True or v is False:
                return bool(v)
            raise DecodeError(f"{p}: expected bool, got {type(v).__name__}")

        return check_bool
    if tp is int:

        def check_int(v: Any, p: str) -> int:
            if type(v) is int:
                return v
            raise DecodeError(f"{p}: expected int, got {type(v).__name__}")

        return check_int
    if tp is float:

        def check_float(v: Any, p: str) -> float:
            if type(v) is float or type(v) is int:
                return float(v)
            raise DecodeError(f"{p}: expected number, got {type(v).__name__}")

        return check_float
    if tp is str:

        def check_str(v: Any, p: str) -> str:
            if type(v) is str:
                return v
            raise DecodeError(f"{p}: expected string, got {type(v).__name__}")

        return check_str
    if tp is bytes:

        def check_bytes(v: Any, p: str) -> bytes:
            if type(v) is bytes:
                return v
            raise DecodeError(f"{p}: expected bytes, got {type(v).__name__}")

        return check_bytes
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {m.value: m for m in tp}

        def check_enum(v: Any, p: str) -> Any:
            try:
                return members[v]
            except (KeyError, TypeError):
                raise DecodeError(f"{p}: expected one of {sorted(members)}, got {v!r}") from None

        return check_enum
    if _is_message(tp):

        def check_msg(v: Any, p: str) -> Any:
            return _from_obj(tp, v, p)

        return check_msg
    if origin in (types.UnionType, typing.Union):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) != 1 or len(args) != 2:
            raise TypeError(f"unsupported union {tp}")
        inner = _checker(non_none[0])
        return lambda v, p: None if v is None else inner(v, p)
    if origin is list or origin is tuple:
        item = _checker(args[0])

        def check_list(v: Any, p: str) -> list[Any]:
            if type(v) is not list:
                raise DecodeError(f"{p}: expected array, got {type(v).__name__}")
            return [item(x, f"{p}[{i}]") for i, x in enumerate(v)]

        return check_list
    if origin is dict:
        if args[0] is not str:
            raise TypeError("dict keys must be str")
        val = _checker(args[1])

        def check_dict(v: Any, p: str) -> dict[str, Any]:
            if type(v) is not dict:
                raise DecodeError(f"{p}: expected map, got {type(v).__name__}")
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    raise DecodeError(f"{p}: map keys must be strings")
                out[k] = val(x, f"{p}.{k}")
            return out

        return check_dict
    raise TypeError(f"unsupported field type {tp!r}")


def _dumper(tp: Any) -> Dump:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_message(tp):
        return _to_obj
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v: v.value
    if origin in (types.UnionType, typing.Union):
        inner = _dumper(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if origin in (list, tuple):
        item = _dumper(args[0])
        if _is_message(args[0]) or _needs_dump(args[0]):
            return lambda v: [item(x) for x in v]
        return list
    if origin is dict:
        val = _dumper(args[1])
        if _needs_dump(args[1]):
            return lambda v: {k: val(x) for k, x in v.items()}
        return dict
    return _identity


def _identity(v: Any) -> Any:
    return v


def _needs_dump(tp: Any) -> bool:
    if _is_message(tp) or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        return True
    return any(_needs_dump(a) for a in typing.get_args(tp) if a is not type(None))


def _to_obj(msg: Any) -> dict[str, Any]:
    sch = _schema(type(msg))
    return {name: dump(getattr(msg, name)) for name, dump in sch.dumps}


def _from_obj(cls: type[T], obj: Any, path: str) -> T:
    if type(obj) is not dict:
        raise DecodeError(f"{path or cls.__name__}: expected a map, got {type(obj).__name__}")
    sch = _schema(cls)
    kwargs: dict[str, Any] = {}
    for name, check, required, _default in sch.fields:
        if name in obj:
            kwargs[name] = check(obj[name], f"{path}.{name}" if path else name)
        elif required:
            raise DecodeError(f"{sch.name}: missing required field {path + '.' if path else ''}{name}")
    return cls(**kwargs)


def to_dict(msg: Any) -> dict[str, Any]:
    """The plain-data form of a message (what goes into msgpack)."""
    return _to_obj(msg)


def from_dict(cls: type[T], obj: Any) -> T:
    """Validate plain data against ``cls``'s schema and build the message."""
    return _from_obj(cls, obj, "")


def encode(msg: Any) -> bytes:
    data: bytes = msgpack.packb(_to_obj(msg), use_bin_type=True)
    return data


def decode(cls: type[T], data: bytes) -> T:
    """Decode and validate; any problem becomes a :class:`DecodeError`."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"{cls.__name__}: not valid msgpack ({type(exc).__name__})") from None
    try:
        return _from_obj(cls, obj, "")
    except DecodeError:
        raise
    except (TypeError, ValueError) as exc:  # e.g. __post_init__ checks
        raise DecodeError(f"{cls.__name__}: {exc}") from None


# ---------------------------------------------------------------- JSON Schema


def _json_type(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return {}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if tp is bytes:
        return {"type": "string", "contentEncoding": "msgpack-bin"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if _is_message(tp):
        sch = tp.__pacer_schema__
        if sch.name not in defs:
            defs[sch.name] = {}
            defs[sch.name] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{sch.name}"}
    if origin in (types.UnionType, typing.Union):
        inner = next(a for a in args if a is not type(None))
        return {"anyOf": [_json_type(inner, defs), {"type": "null"}]}
    if origin in (list, tuple):
        return {"type": "array", "items": _json_type(args[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _json_type(args[1], defs)}
    raise TypeError(f"unsupported field type {tp!r}")


def _object_schema(cls: type[Any], defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        prop = _json_type(hints[f.name], defs)
        if f.default is not _MISSING and isinstance(f.default, int | float | str | bool):
            prop = {**prop, "default": f.default.value if isinstance(f.default, enum.Enum) else f.default}
        doc = f.metadata.get("doc")
        if doc:
            prop = {**prop, "description": doc}
        props[f.name] = prop
        if f.default is _MISSING and f.default_factory is _MISSING:
            required.append(f.name)
    out: dict[str, Any] = {
        "type": "object",
        "description": _class_doc(cls),
        "properties": props,
        "additionalProperties": True,
    }
    if required:
        out["required"] = required
    return out


def json_schema(cls: type[Any]) -> dict[str, Any]:
    """The JSON Schema (2020-12) of a message, as exported to ``proto-schemas/``."""
    sch = _schema(cls)
    defs: dict[str, Any] = {}
    body = _object_schema(cls, defs)
    defs.pop(sch.name, None)
    out: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"pacer:{sch.name}.v{sch.version}",
        "title": sch.name,
        "x-pacer-version": sch.version,
        "x-pacer-encoding": "msgpack",
        **body,
    }
    if defs:
        out["$defs"] = dict(sorted(defs.items()))
    return out


def doc(text: str) -> dict[str, str]:
    """Field metadata carrying a description into the exported schema."""
    return {"doc": text}
