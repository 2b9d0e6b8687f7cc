"""Raw columns in, model inputs out: the feature transforms of a :class:`~pacer.data.schema.Schema` as graph ops.

All hashing, vocabulary lookups and numeric transforms are TensorFlow ops
in the model's graph, not numpy in the input pipeline: the exported
SavedModel (:mod:`pacer.models.export`) is built from the very same
:func:`transform`, so serving computes exactly the features the model was
trained on, by construction.

* :func:`raw_inputs`: placeholders for one batch of raw training columns.
  Scalar columns are grouped by dtype into one ``[batch, k]`` placeholder
  each (float32 / int64 / string), so a step feeds three arrays plus two per
  list column instead of one per column; list columns are fed as ``values``
  + ``row_splits`` (a ragged batch, no padding).
* :func:`serving_inputs`: one placeholder per feature column, named by the
  column, for a serving signature; list columns are padded dense
  ``[batch, None]`` (``""`` / ``-1`` as trailing padding).
* :func:`transform`: the model inputs (:class:`Features`) of either.

Vocabulary columns use ``tf.lookup.StaticHashTable``: a session must run
``tf.compat.v1.tables_initializer()`` once before the first step (each
worker itself: the tables are not variables, they live on the worker's own
device, not on the parameter servers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from pacer.data.schema import CategoricalColumn, ListColumn, Schema

v1 = tf.compat.v1

#: Serving pads list columns on the right with these (removed before the lookup).
STRING_PAD = ""
INT_PAD = -1

_GROUPS = {"float": (tf.float32, np.float32), "int": (tf.int64, np.int64), "string": (tf.string, object)}


@dataclass
class RawInputs:
    """Placeholders for one batch of raw columns (see the module docstring for the grouping).

    ``tensors`` maps every column to the tensor :func:`transform` reads
    (a slice of a group placeholder, or a ``tf.RaggedTensor`` for a list
    column); :meth:`feed` turns numpy columns into the feed dict.
    """

    tensors: dict[str, Any]
    groups: dict[str, tuple[tf.Tensor, list[str]]] = field(default_factory=dict)  # kind -> (placeholder, columns)
    lists: dict[str, tuple[tf.Tensor, tf.Tensor, str]] = field(default_factory=dict)  # name -> (values, splits, kind)

    def feed(self, cols: Mapping[str, np.ndarray]) -> dict[tf.Tensor, np.ndarray]:
        """The feed dict of a batch of numpy columns (float32/int64/object-of-str arrays; list columns:
        object arrays of 1-D arrays or lists).  Columns not read by the model are ignored."""
        missing = [n for n in self.tensors if n not in cols]
        if missing:
            raise KeyError(f"batch lacks column(s) {', '.join(missing)} (it has: {', '.join(sorted(cols))})")
        out: dict[tf.Tensor, np.ndarray] = {}
        for kind, (ph, names) in self.groups.items():
            dtype = _GROUPS[kind][1]
            if len(names) == 1:
                out[ph] = np.asarray(cols[names[0]]).astype(dtype, copy=False)[:, None]
            else:
                out[ph] = np.stack([np.asarray(cols[n]).astype(dtype, copy=False) for n in names], axis=1)
        for name, (values, splits, kind) in self.lists.items():
            col = cols[name]
            lengths = np.fromiter((len(x) for x in col), dtype=np.int64, count=len(col))
            row_splits = np.zeros(len(col) + 1, dtype=np.int64)
            np.cumsum(lengths, out=row_splits[1:])
            dtype = np.int64 if kind == "list<int>" else object
            flat = np.concatenate([np.asarray(x, dtype=dtype) for x in col]) if len(col) else np.zeros(0, dtype)
            out[values] = flat.astype(dtype, copy=False)
            out[splits] = row_splits
        return out


def _op_name(column: str) -> str:
    """A valid TF op name for a column (the column's own name when it already is one)."""
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", column)
    return name if re.match(r"[A-Za-z0-9.]", name) else f"c_{name}"


def raw_inputs(schema: Schema, kinds: Mapping[str, str], with_label: bool = True) -> RawInputs:
    """Placeholders for the columns ``schema`` reads (label and weight only if ``with_label``).

    ``kinds`` (column -> kind, as in :meth:`Schema.check`) decides each
    placeholder's dtype.
    """
    names = list(schema.columns() if with_label else schema.feature_columns())
    scalar: dict[str, list[str]] = {"float": [], "int": [], "string": []}
    list_cols: list[tuple[str, str]] = []
    for n in names:
        kind = kinds.get(n)
        if kind in scalar:
            scalar[kind].append(n)
        elif kind in ("list<int>", "list<string>"):
            list_cols.append((n, kind))
        else:
            raise ValueError(f"column {n!r} has kind {kind!r}; expected one of float, int, string, list<int>, "
                             "list<string> (Schema.check explains)")
    raw = RawInputs(tensors={})
    with tf.name_scope("raw"):
        for kind, cols in scalar.items():
            if not cols:
                continue
            ph = v1.placeholder(_GROUPS[kind][0], [None, len(cols)], name=kind)
            raw.groups[kind] = (ph, cols)
            for j, n in enumerate(cols):
                raw.tensors[n] = ph[:, j]
        for n, kind in list_cols:
            dtype = tf.int64 if kind == "list<int>" else tf.string
            values = v1.placeholder(dtype, [None], name=f"{_op_name(n)}/values")
            splits = v1.placeholder(tf.int64, [None], name=f"{_op_name(n)}/row_splits")
            raw.lists[n] = (values, splits, kind)
            raw.tensors[n] = tf.RaggedTensor.from_row_splits(values, splits, validate=False)
    # Keep the schema's order, which makes the dict easy to read when debugging.
    raw.tensors = {n: raw.tensors[n] for n in names}
    return raw


def serving_inputs(schema: Schema, kinds: Mapping[str, str]) -> dict[str, tf.Tensor]:
    """One placeholder per feature column, named by the column: ``[None]`` for scalars, padded
    ``[None, None]`` for lists (trailing ``""`` / ``-1`` padding)."""
    out: dict[str, tf.Tensor] = {}
    for n in schema.feature_columns():
        kind = kinds.get(n)
        if kind in _GROUPS:
            out[n] = v1.placeholder(_GROUPS[kind][0], [None], name=_op_name(n))
        elif kind == "list<int>":
            out[n] = v1.placeholder(tf.int64, [None, None], name=_op_name(n))
        elif kind == "list<string>":
            out[n] = v1.placeholder(tf.string, [None, None], name=_op_name(n))
        else:
            raise ValueError(f"column {n!r} has kind {kind!r}, which cannot be served")
    return out


@dataclass
class Features:
    """The model inputs of a batch.

    ``fields`` has one entry per categorical then multi_hot column:
    ``(ids, buckets, embed_dim, combiner)`` with ids in ``[0, buckets)``,
    ``[B]`` int64 for a categorical column (combiner ``""``) and a
    ``tf.RaggedTensor`` ``[B, None]`` for a list column.
    """

    dense: tf.Tensor  # [B, D] float32; D may be 0
    fields: list[tuple[Any, int, int, str]]
    labels: tf.Tensor | None = None  # [B] float32
    weights: tf.Tensor | None = None  # [B] float32; None = every example weighs 1
    names: list[str] = field(default_factory=list)  # the column of each field

    @property
    def dims(self) -> list[int]:
        return [f[2] for f in self.fields]


def transform(schema: Schema, raw: Mapping[str, Any]) -> Features:
    """The model inputs of raw columns ``raw`` (name -> tensor; list columns ragged or padded dense).

    ``schema`` must have its defaults filled in (:meth:`Schema.with_defaults`).
    Label and weight are read when present in ``raw`` (serving has neither).
    """
    missing = [n for n in schema.feature_columns() if n not in raw]
    if missing:
        raise ValueError(f"no input for column(s) {', '.join(missing)}")
    with tf.name_scope("features"):
        dense_cols = [_dense(raw[d.name], d.transform, d.mean, d.std) for d in schema.dense]
        fields: list[tuple[Any, int, int, str]] = []
        names: list[str] = []
        for c in schema.id_columns():
            if c.buckets <= 0 or c.embed_dim <= 0:
                raise ValueError(f"column {c.name!r} has buckets/embed_dim 0: call schema.with_defaults first")
            if isinstance(c, ListColumn):
                ids = _list_ids(raw[c.name], c)
                fields.append((ids, c.buckets, c.embed_dim, c.combiner))
            else:
                fields.append((_ids(raw[c.name], c), c.buckets, c.embed_dim, ""))
            names.append(c.name)
        if dense_cols:
            dense = tf.stack(dense_cols, axis=1)
        else:
            dense = tf.zeros(tf.stack([_batch_size(raw[schema.feature_columns()[0]]), 0]), tf.float32)
        labels = weights = None
        if schema.label in raw:
            labels = tf.cast(raw[schema.label], tf.float32, name="labels")
        if schema.weight and schema.weight in raw:
            w = tf.cast(raw[schema.weight], tf.float32)
            weights = tf.where(tf.math.is_nan(w), tf.ones_like(w), w, name="weights")
    return Features(dense, fields, labels, weights, names)


def _batch_size(x: Any) -> tf.Tensor:
    if isinstance(x, tf.RaggedTensor):
        return x.nrows(out_type=tf.int32)
    return tf.shape(x, out_type=tf.int32)[0]


def _dense(x: tf.Tensor, how: str, mean: float, std: float) -> tf.Tensor:
    x = tf.cast(x, tf.float32)
    x = tf.where(tf.math.is_nan(x), tf.zeros_like(x), x)
    if how == "log1p":
        # As pacer.data.criteo.features: counts span orders of magnitude.
        return tf.math.log1p(tf.maximum(x, 0.0))
    if how == "standardize":
        return (x - mean) / std
    return x


def _table(c: CategoricalColumn | ListColumn) -> Any:
    """Vocabulary value -> 0..n-1; anything else -> n (the one out-of-vocabulary id)."""
    keys = tf.constant(list(c.vocabulary), dtype=tf.string)
    values = tf.range(len(c.vocabulary), dtype=tf.int64)
    init = tf.lookup.KeyValueTensorInitializer(keys, values)
    return tf.lookup.StaticHashTable(init, default_value=len(c.vocabulary), name=f"vocab_{_op_name(c.name)}")


def _flat_ids(x: tf.Tensor, c: CategoricalColumn | ListColumn) -> tf.Tensor:
    """ids in ``[0, c.buckets)`` of a flat tensor of raw values."""
    if c.vocabulary:
        if x.dtype != tf.string:
            x = tf.strings.as_string(x)  # int columns are looked up by their decimal text
        return _table(c).lookup(x)
    if x.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(x, c.buckets)
    # Int ids: id mod buckets, as pacer.data.criteo.features, so record files keep their ids.
    return tf.math.floormod(tf.cast(x, tf.int64), tf.constant(c.buckets, tf.int64))


def _ids(x: Any, c: CategoricalColumn) -> tf.Tensor:
    return _flat_ids(x, c)


def _list_ids(x: Any, c: ListColumn) -> tf.RaggedTensor:
    if not isinstance(x, tf.RaggedTensor):
        # Serving: a padded [B, None] batch; drop the trailing padding.
        pad = STRING_PAD if x.dtype == tf.string else tf.cast(INT_PAD, x.dtype)
        x = tf.RaggedTensor.from_tensor(x, padding=pad)
    return x.with_flat_values(_flat_ids(x.flat_values, c))
