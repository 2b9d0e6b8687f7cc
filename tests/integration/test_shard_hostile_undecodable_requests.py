"""Requests that do not decode (random msgpack values, random, truncated, corrupted or trailing bytes) get a
clear error naming the request's fields, are counted, and never cause an internal error.
(The module's nats-server and shard service, and the checks: shard_hostile_support.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import shard_hostile_support
from hypothesis import assume, given
from hypothesis import strategies as st
from pacer.codec import encode
from pacer.contracts.shards import LeaseRequest, ShardProgress
from pacer.errors import DecodeError
from shard_hostile_support import (
    DS,
    EDGE_INTS,
    JOB,
    NODE,
    OPS,
    REQUEST_CLS,
    SETTINGS,
    Harness,
    decodes,
    expect_error,
    names_a_field,
    rpc,
)

# The fixtures of shard_hostile_support (pytest finds them as attributes of this module).
h = shard_hostile_support.h


# ====================================================================== strategies
INT64 = st.integers(-(2**63), 2**64 - 1)
INTS = st.one_of(INT64, EDGE_INTS)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
NASTY_STRINGS = [
    "", ".", "*", ">", "a.b", "w0.>", "w0.*", " ", "w0 ", "w0\n", "\x00", "$SYS", "../w0",
    "x" * 65, "x" * 1000, "é", "节点", "💥", "pacer.rpc.shard.*.*", JOB, DS, NODE, "finite", "streaming",
]
STRS = st.one_of(st.text(max_size=40), st.sampled_from(NASTY_STRINGS))
FIELD_NAMES = sorted(
    {f.name for cls in (*REQUEST_CLS.values(), ShardProgress) for f in dataclasses.fields(cls)} | {"error"}
)
KEYS = st.one_of(st.sampled_from(FIELD_NAMES), STRS, INTS)
LEAVES = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRS, st.binary(max_size=40))
VALUES = st.recursive(
    LEAVES,
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(KEYS, children, max_size=8)),
    max_leaves=25,
)
TOP_VALUES = st.one_of(VALUES, st.dictionaries(KEYS, VALUES, max_size=12))


# ====================================================================== raw junk
@SETTINGS
@given(op=OPS, job=st.sampled_from([JOB, "nojob"]), value=TOP_VALUES)
def test_random_msgpack_values_get_a_clear_error(h: Harness, op: str, job: str, value: Any) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    assume(not decodes(REQUEST_CLS[op], data))
    err = expect_error(h, rpc(job, op), data, (DecodeError,))
    assert names_a_field(err.message, REQUEST_CLS[op]), err.message


@st.composite
def junk_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "corrupted", "trailing"]))
    if kind == "random":
        return draw(st.binary(max_size=4096))
    valid = encode(
        LeaseRequest(JOB, DS, "mallory", want=3, done=[1, 2, 3], progress=[ShardProgress(4, 5)], max_records=7)
    )
    if kind == "truncated":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "trailing":
        return valid + draw(st.binary(min_size=1, max_size=16))
    i = draw(st.integers(0, len(valid) - 1))
    return valid[:i] + bytes([valid[i] ^ draw(st.integers(1, 255))]) + valid[i + 1 :]


@SETTINGS
@given(op=OPS, data=junk_bytes())
def test_random_bytes_get_a_clear_error(h: Harness, op: str, data: bytes) -> None:
    assume(not decodes(REQUEST_CLS[op], data))
    err = expect_error(h, rpc(JOB, op), data, (DecodeError,))
    assert names_a_field(err.message, REQUEST_CLS[op]), err.message
