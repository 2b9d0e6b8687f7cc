"""Wire contracts: round trips, decode errors, and the exported schemas.

Strategies are built from the dataclass field types, so a new message (or a
new field) is covered without touching this file; a field type the builder
does not know fails loudly instead of being skipped.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path
from typing import Any

import msgpack
import pacer.contracts  # noqa: F401  (registers every message)
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pacer import codec, errors, schemas, subjects
from pacer.codec import REGISTRY, decode, encode, from_dict, to_dict
from pacer.contracts.common import ErrorEnvelope, ErrorReply, Health, decode_reply, encode_error
from pacer.contracts.shards import DatasetStatus, LeaseRequest, ProgressEvent

REPO = Path(__file__).resolve().parents[2]
MESSAGES = sorted(REGISTRY.items())
IDS = [k for k, _ in MESSAGES]

FAST = settings(
    max_examples=25,
    deadline=None,
    database=None,  # no .hypothesis/ in the repo
    suppress_health_check=[HealthCheck.too_slow],
)

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1

# ----------------------------------------------------------------- strategies


def _hints(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# Any msgpack value that decodes back equal to itself (lists, not tuples; no NaN).
MSGPACK_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(INT64_MIN, UINT64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=8,
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of field type ``tp`` that survive msgpack unchanged."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return MSGPACK_VALUES
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(INT64_MIN, UINT64_MAX)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=12)
    if tp is bytes:
        return st.binary(max_size=12)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if codec._is_message(tp):
        return message_strategy(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"unsupported union {tp}"
        return st.none() | strategy_for(inner[0])
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=3)
    if origin is dict:
        assert args[0] is str, f"unsupported dict key type in {tp}"
        return st.dictionaries(st.text(max_size=6), strategy_for(args[1]), max_size=3)
    raise TypeError(f"no strategy for field type {tp!r}: extend strategy_for in {__file__}")


def _deferred(tp: Any) -> st.SearchStrategy[Any]:
    # Deferred, so that messages may refer to each other (or themselves).
    def build() -> st.SearchStrategy[Any]:
        return strategy_for(tp)

    return st.deferred(build)


_STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {}


def message_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Instances of ``cls``; fields with a default are sometimes left out."""
    if cls in _STRATEGIES:
        return _STRATEGIES[cls]
    hints = _hints(cls)
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for f in dataclasses.fields(cls):
        s = _deferred(hints[f.name])
        (required if _required(f) else optional)[f.name] = s
    out = st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))
    _STRATEGIES[cls] = out
    return out


def test_strategies_cover_every_field_type() -> None:
    # Building (not just drawing) every strategy surfaces unsupported types up front.
    for _, cls in MESSAGES:
        for tp in _hints(cls).values():
            strategy_for(tp).validate()


# ------------------------------------------------------------ (a) round trips


@pytest.mark.parametrize(("key", "cls"), MESSAGES, ids=IDS)
@FAST
@given(data=st.data())
def test_round_trip(key: str, cls: type[Any], data: st.DataObject) -> None:
    msg = data.draw(message_strategy(cls))
    wire = encode(msg)
    assert decode(cls, wire) == msg
    assert from_dict(cls, to_dict(msg)) == msg
    # What goes on the wire follows the exported schema's shape.
    sch = codec.json_schema(cls)
    obj = msgpack.unpackb(wire, raw=False)
    assert set(obj) == set(sch["properties"])
    assert set(sch.get("required", [])) <= set(obj)


def test_registry_keys_match_schema_names() -> None:
    for key, cls in MESSAGES:
        sch = cls.__pacer_schema__
        assert key == f"{sch.name}.v{sch.version}"
        assert sch.name.count(".") == 1, f"{sch.name} is not <domain>.<Name>"


# ------------------------------------------------------- (b) decode errors


def _sample(cls: type[Any]) -> dict[str, Any]:
    """A valid plain-data instance with every field present."""
    return to_dict(_example(cls))


def _example(cls: type[Any]) -> Any:
    hints = _hints(cls)
    return cls(**{f.name: _value(hints[f.name]) for f in dataclasses.fields(cls)})


def _value(tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return True
    if tp is int:
        return 3
    if tp is float:
        return 1.5
    if tp is str:
        return "x"
    if tp is bytes:
        return b"x"
    if tp is Any:
        return 1
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp))
    if codec._is_message(tp):
        return _example(tp)
    if origin in (types.UnionType, typing.Union):
        return _value(next(a for a in args if a is not type(None)))
    if origin is list:
        return [_value(args[0])]
    if origin is dict:
        return {"k": _value(args[1])}
    raise TypeError(f"no example for {tp!r}")


def _wrong(tp: Any) -> Any:
    """A value of the wrong type for ``tp`` (``Any`` has none)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return _wrong(next(a for a in args if a is not type(None)))
    if tp is Any:
        return dataclasses.MISSING
    if tp is bool:
        return 1  # an int is not a bool
    if tp is int:
        return True  # nor is a bool an int
    if tp in (float, bytes):
        return "1"
    if tp is str:
        return b"x"  # bin is not str
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "no-such-member"
    if codec._is_message(tp) or origin is dict:
        return [1]
    if origin is list:
        return {"a": 1}
    raise TypeError(f"no wrong value for {tp!r}")


def _fields(cls: type[Any]) -> list[tuple[str, Any, bool]]:
    hints = _hints(cls)
    return [(f.name, hints[f.name], _required(f)) for f in dataclasses.fields(cls)]


WRONG_TYPE_CASES = [
    pytest.param(cls, name, tp, id=f"{key}.{name}")
    for key, cls in MESSAGES
    for name, tp, _ in _fields(cls)
    if _wrong(tp) is not dataclasses.MISSING
]
MISSING_CASES = [
    pytest.param(cls, name, id=f"{key}.{name}")
    for key, cls in MESSAGES
    for name, _, required in _fields(cls)
    if required
]


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x92\x01", b"\x81\xa1a", b"\x80\x00", b"\xff" * 7, b"\xdd\xff\xff\xff\xff"],
    ids=[
        "empty",
        "never-used-byte",
        "truncated-array",
        "truncated-map",
        "extra-data",
        "junk",
        "huge-array",
    ],
)
@pytest.mark.parametrize(("key", "cls"), MESSAGES, ids=IDS)
def test_garbage_bytes(key: str, cls: type[Any], data: bytes) -> None:
    with pytest.raises(errors.DecodeError):
        decode(cls, data)


def test_a_string_that_is_not_utf8_is_a_decode_error() -> None:
    """msgspec raises UnicodeDecodeError itself for such a string (found by the shard service's hostile
    test): it must still be a DecodeError, which the services answer as a clear error."""
    good = msgpack.packb({"job": "hostile", "dataset": "train", "node": "mallory"})
    assert decode(LeaseRequest, good).job == "hostile"
    for bad in (good.replace(b"hostile", b"\xe8ostile"), good.replace(b"\xa7dataset", b"\xa7d\xe8taset")):
        with pytest.raises(errors.DecodeError, match=r"not UTF-8|missing required field"):
            decode(LeaseRequest, bad)


@pytest.mark.parametrize("top", [None, 1, "x", b"x", [1, 2], 1.5, True])
def test_top_level_not_a_map(top: Any) -> None:
    with pytest.raises(errors.DecodeError, match="expected a map"):
        decode(LeaseRequest, msgpack.packb(top, use_bin_type=True))


@pytest.mark.parametrize(("cls", "name", "tp"), WRONG_TYPE_CASES)
def test_wrong_type_names_the_field(cls: type[Any], name: str, tp: Any) -> None:
    obj = _sample(cls)
    obj[name] = _wrong(tp)
    with pytest.raises(errors.DecodeError) as ei:
        decode(cls, msgpack.packb(obj, use_bin_type=True))
    assert name in str(ei.value)
    assert ei.value.code == "bad_message"


@pytest.mark.parametrize(("cls", "name"), MISSING_CASES)
def test_missing_required_field_names_it(cls: type[Any], name: str) -> None:
    obj = _sample(cls)
    del obj[name]
    with pytest.raises(errors.DecodeError, match=rf"missing required field {name}\b"):
        decode(cls, msgpack.packb(obj, use_bin_type=True))


def test_nested_errors_carry_the_path() -> None:
    obj = _sample(LeaseRequest)
    obj["progress"] = [{"shard": 1, "consumed": 2}, {"shard": 1, "consumed": "many"}]
    with pytest.raises(errors.DecodeError, match=r"progress\[1\]\.consumed: expected int"):
        decode(LeaseRequest, msgpack.packb(obj))

    ev = _sample(ProgressEvent)
    del ev["status"]["job"]
    with pytest.raises(errors.DecodeError, match=r"missing required field status\.job"):
        decode(ProgressEvent, msgpack.packb(ev))

    h = _sample(Health)
    h["counters"] = {"ok": 1, "bad": 1.5}
    with pytest.raises(errors.DecodeError, match=r"counters\.bad: expected int"):
        decode(Health, msgpack.packb(h))
    h["counters"] = {1: 1}
    with pytest.raises(errors.DecodeError, match=r"counters: map keys must be strings"):
        decode(Health, msgpack.packb(h))


@pytest.mark.parametrize(("key", "cls"), MESSAGES, ids=IDS)
def test_unknown_fields_are_ignored(key: str, cls: type[Any]) -> None:
    obj: dict[Any, Any] = _sample(cls)
    obj["zz_added_in_v9"] = {"nested": [1, b"2", None]}
    obj[7] = "non-string key"
    assert decode(cls, msgpack.packb(obj, use_bin_type=True)) == from_dict(cls, _sample(cls))


def test_defaults_apply_when_optional_fields_are_absent() -> None:
    wire = msgpack.packb({"job": "j", "dataset": "d", "node": "n"})
    assert decode(LeaseRequest, wire) == LeaseRequest("j", "d", "n")


# --------------------------------------------------- (c) exported schemas


def test_committed_schemas_match_the_code() -> None:
    problems = schemas.check(REPO / schemas.SCHEMA_DIR)
    assert not problems, (
        f"proto-schemas/ is out of date ({', '.join(problems)}): "
        "run `python -m pacer.schemas export` and commit the result"
    )


def test_export_is_deterministic_and_check_finds_drift(tmp_path: Path) -> None:
    assert schemas.check(tmp_path) == sorted(schemas.render())  # everything missing
    first = {p: p.read_bytes() for p in schemas.export(tmp_path)}
    assert len(first) == len(set(REGISTRY.values())) + 1  # + README.md
    assert schemas.check(tmp_path) == []
    assert {p: p.read_bytes() for p in schemas.export(tmp_path)} == first
    assert all(b.endswith(b"\n") and not b.endswith(b"\n\n") for b in first.values())

    target = tmp_path / "shard" / "LeaseRequest.v1.json"
    target.write_text(target.read_text() + " ")
    (tmp_path / "shard" / "Gone.v1.json").write_text("{}\n")
    (tmp_path / "common" / "Health.v1.json").unlink()
    assert schemas.check(tmp_path) == [
        "common/Health.v1.json",
        "shard/Gone.v1.json",
        "shard/LeaseRequest.v1.json",
    ]
    assert schemas.main(["check", str(tmp_path)]) == 1
    schemas.export(tmp_path)
    assert not (tmp_path / "shard" / "Gone.v1.json").exists()
    assert schemas.main(["check", str(tmp_path)]) == 0


def test_contract_tables_cover_every_op_and_event() -> None:
    assert set(schemas.RPC_CONTRACTS) == set(subjects.ShardOp.ALL)
    registered = set(REGISTRY.values())
    for c in schemas.RPC_CONTRACTS.values():
        assert {c.request, c.reply} <= registered
    kinds = {v for k, v in vars(subjects.ShardEventKind).items() if k.isupper()}
    assert set(schemas.SHARD_EVENT_CONTRACTS) == kinds
    assert schemas.SHARD_EVENT_CONTRACTS[subjects.ShardEventKind.PROGRESS] is ProgressEvent
    readme = schemas.render_readme()
    for op in subjects.ShardOp.ALL:
        assert f"`pacer.rpc.shard.<job>.{op}`" in readme
    assert "`pacer.events.node.<job>.died`" in readme
    assert "`pacer.svc.<service>.health`" in readme
    assert "`pacer.deadletter.<service>`" in readme


# ------------------------------------------------------ (d) error replies


@pytest.mark.parametrize(
    ("exc", "cls"),
    [
        (errors.DecodeError("bad"), errors.DecodeError),
        (errors.ValidationError("batch_size must be > 0"), errors.ValidationError),
        (errors.NotFound("no dataset d"), errors.NotFound),
        (errors.Conflict("other spec"), errors.Conflict),
        (errors.Unavailable("rebuilding"), errors.Unavailable),
        (errors.PacerError("boom"), errors.RemoteError),
        (errors.PacerError("later", code="quota", temporary=True), errors.RemoteError),
    ],
    ids=lambda v: getattr(v, "code", None) or getattr(v, "__name__", "?"),
)
def test_decode_reply_raises_the_matching_error(
    exc: errors.PacerError, cls: type[Exception]
) -> None:
    with pytest.raises(cls) as ei:
        decode_reply(DatasetStatus, encode_error(exc))
    got = ei.value
    assert type(got) is cls
    assert isinstance(got, errors.PacerError)
    assert (got.code, got.message, got.temporary) == (exc.code, exc.message, exc.temporary)


def test_decode_reply_success_and_garbage() -> None:
    status = _example(DatasetStatus)
    assert decode_reply(DatasetStatus, encode(status)) == status
    with pytest.raises(errors.DecodeError):
        decode_reply(DatasetStatus, b"\xc1")
    with pytest.raises(errors.DecodeError, match="error"):
        decode_reply(DatasetStatus, msgpack.packb({"error": "not a map"}))
    with pytest.raises(errors.DecodeError, match="missing required field job"):
        decode_reply(DatasetStatus, msgpack.packb({"dataset": "d"}))


def test_error_envelope_wire_shape() -> None:
    wire = encode(ErrorEnvelope(ErrorReply("not_found", "no job j")))
    assert msgpack.unpackb(wire) == {
        "error": {"code": "not_found", "message": "no job j", "temporary": False}
    }


# ------------------------------------------------ (e) junk never escapes


def _mutations(cls: type[Any]) -> st.SearchStrategy[Any]:
    """A valid message's plain data with some fields replaced or removed."""
    base = _sample(cls)
    keys = st.sampled_from(sorted(base))
    edits = st.lists(
        st.tuples(keys, st.none() | MSGPACK_VALUES | st.just(dataclasses.MISSING)), max_size=3
    )

    def apply(changes: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(base)
        for k, v in changes:
            if v is dataclasses.MISSING:
                out.pop(k, None)
            else:
                out[k] = v
        return out

    return edits.map(apply)


@pytest.mark.parametrize(("key", "cls"), MESSAGES, ids=IDS)
@FAST
@given(data=st.data())
def test_junk_only_ever_raises_decode_error(key: str, cls: type[Any], data: st.DataObject) -> None:
    junk = data.draw(
        st.one_of(
            MSGPACK_VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)),
            _mutations(cls).map(lambda v: msgpack.packb(v, use_bin_type=True)),
            st.binary(max_size=32),
        )
    )
    try:
        out = decode(cls, junk)
    except errors.DecodeError:
        return
    assert isinstance(out, cls)
    try:
        decode_reply(cls, junk)
    except errors.PacerError:
        pass


@pytest.mark.parametrize(("key", "cls"), MESSAGES, ids=IDS)
def test_the_wire_format_is_the_one_before_msgspec(key: str, cls: type[Any]) -> None:
    """The codec moved to msgspec (2026-11-29) without changing a byte: a message is a msgpack map of its
    fields in declaration order, enums by value, which is what the hand-written codec wrote (a plain
    ``msgpack.packb`` of the field map here), so messages stored or sent before still decode."""
    plain = _sample(cls)
    before = msgpack.packb(plain, use_bin_type=True)  # the old encoder: packb of the fields' plain map
    msg = decode(cls, before)
    assert encode(msg) == msgpack.packb(to_dict(msg), use_bin_type=True)
    assert decode(cls, encode(msg)) == msg and from_dict(cls, to_dict(msg)) == msg
