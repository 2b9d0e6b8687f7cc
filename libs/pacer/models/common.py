"""Shared pieces of the models: the spec, embeddings, dense layers, optimizers.

The inputs come from :func:`pacer.models.features.transform` (a schema's
columns as :class:`~pacer.models.features.Features`): nothing here knows a
column count.

Everything is ``tf.compat.v1`` graph mode built from ``get_variable`` only:
Keras 3 breaks ``tf.compat.v1.layers`` (docs/design.md, "Facts measured"), and
raw variables keep the variable names under our control, which between-graph
PS training needs: every worker process builds the same graph on its own, and
the variables are matched by name on the parameter servers.

Embeddings are the big tensors of a recommendation model, so they are the
ones partitioned (``fixed_size_partitioner(num_ps_partitions)``): under
``replica_device_setter`` each part lands on another PS task, which spreads
both memory and the lookup/update traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from pacer.models.features import Features

v1 = tf.compat.v1

OPTIMIZERS = ("adagrad", "adam", "sgd")

# A variable as get_variable returns it: plain, or split into parts.
Table = Any  # tf.Variable | PartitionedVariable (the latter has no public type)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The blueprint of a model: which one and its sizes. Two processes with equal specs build equal graphs."""

    name: str = "wide_deep"
    hash_buckets: int = 100_000
    embed_dim: int = 8
    hidden: tuple[int, ...] = (64, 32)
    cross_layers: int = 3  # DCN: number of cross layers
    cin_layers: tuple[int, ...] = (16, 16)  # xDeepFM: feature maps per CIN layer
    learning_rate: float = 0.05
    optimizer: str = "adagrad"

    def __post_init__(self) -> None:
        # Lists from JSON/YAML specs become tuples, so the spec stays hashable.
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        object.__setattr__(self, "cin_layers", tuple(int(h) for h in self.cin_layers))
        if self.hash_buckets <= 0 or self.embed_dim <= 0:
            raise ValueError("hash_buckets and embed_dim must be positive")
        if any(h <= 0 for h in (*self.hidden, *self.cin_layers)) or self.cross_layers < 0:
            raise ValueError("layer sizes must be positive")
        if self.learning_rate <= 0:
            raise ValueError("learning_rate must be positive")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} not in {OPTIMIZERS}")


def partitioner(num_ps_partitions: int) -> Callable[..., Any]:
    """The partitioner of the embedding tables: ``num_ps_partitions`` row blocks."""
    if num_ps_partitions < 1:
        raise ValueError("num_ps_partitions must be >= 1")
    return v1.fixed_size_partitioner(num_ps_partitions)  # type: ignore[no-any-return]


def embedding_table(
    name: str,
    rows: int,
    dim: int,
    partitioner: Callable[..., Any] | None = None,
    initializer: Any = None,
) -> Table:
    """A ``[rows, dim]`` table, split into row blocks by ``partitioner`` if given."""
    init = initializer if initializer is not None else v1.truncated_normal_initializer(stddev=0.05)
    return v1.get_variable(name, shape=[rows, dim], dtype=tf.float32, initializer=init, partitioner=partitioner)


def embedding_lookup(table: Table, ids: tf.Tensor) -> tf.Tensor:
    """Rows ``ids`` of ``table``.

    ``partition_strategy="div"`` matches how ``fixed_size_partitioner``
    splits rows (contiguous blocks), so row ``i`` of the logical table is
    id ``i`` whatever the number of parts: a checkpoint saved with N PS tasks
    then restores correctly into M.  The v1 default ("mod") would scatter
    ids by ``i % N`` and scramble the embeddings on such a restore.
    """
    return v1.nn.embedding_lookup(table, ids, partition_strategy="div")


def _combine(rows: tf.Tensor, ids: tf.RaggedTensor, combiner: str) -> tf.Tensor:
    """Per-row ``sum`` / ``mean`` / ``sqrtn`` (sum / sqrt(count)) of the looked-up ``rows`` of a ragged batch.

    An empty list gives zeros (the count is clamped to 1 in the divisors).
    """
    total = tf.math.unsorted_segment_sum(rows, ids.value_rowids(), ids.nrows())
    if combiner == "sum":
        return total
    count = tf.cast(tf.maximum(ids.row_lengths(), 1), tf.float32)[:, None]
    if combiner == "mean":
        return total / count
    if combiner == "sqrtn":
        return total / tf.sqrt(count)
    raise ValueError(f"unknown combiner {combiner!r}")


def field_embeddings(
    features: Features,
    partitioner: Callable[..., Any] | None = None,
    name: str = "embeddings",
    dim: int | None = None,
    initializer: Any = None,
) -> tuple[tf.Tensor | list[tf.Tensor], list[Table]]:
    """Per-field embeddings: ``[batch, fields, dim]`` when every field has one width, else ``[batch, dim_i]`` per field.

    Fields of one width share ONE table, named ``name`` when all fields have
    one width and ``{name}_d{dim}`` per width otherwise.  Field ``f`` owns
    rows ``[offset_f, offset_f + buckets_f)``, ``offset_f`` the sum of the
    previous fields' buckets of that table: equal raw ids of two fields do
    not share a vector, while all fields still live in one table that the
    partitioner spreads evenly over the PS tasks.  (For Criteo, 26 fields of
    ``hash_buckets`` each, that is ``26 * hash_buckets`` rows with field
    ``f`` at ``f * hash_buckets``.)  A list field's rows are combined per
    example by its combiner.  ``dim`` overrides every field's width (the
    linear part's 1-wide weights).
    """
    fields = features.fields
    if not fields:
        return [], []
    widths = [dim if dim is not None else f[2] for f in fields]
    distinct = sorted(set(widths))
    out: list[tf.Tensor | None] = [None] * len(fields)
    tables: list[Table] = []
    grouped: tf.Tensor | None = None
    for width in distinct:
        members = [i for i, w in enumerate(widths) if w == width]
        offsets = np.cumsum([0] + [fields[i][1] for i in members])
        table_name = name if len(distinct) == 1 else f"{name}_d{width}"
        table = embedding_table(table_name, int(offsets[-1]), width, partitioner, initializer)
        tables.append(table)
        singles = [k for k, i in enumerate(members) if not fields[i][3]]
        if singles:
            # All single-id fields of the table in one lookup, as [batch, fields] ids.
            ids = tf.stack([fields[members[k]][0] for k in singles], axis=1)
            offs = tf.constant(np.array([offsets[k] for k in singles], dtype=np.int64), dtype=tf.int64)
            emb = embedding_lookup(table, ids + offs[None, :])  # [batch, singles, width]
            if len(distinct) == 1 and len(singles) == len(fields):
                grouped = emb  # the common case: no unstacking needed
            else:
                for j, piece in enumerate(tf.unstack(emb, axis=1)):
                    out[members[singles[j]]] = piece
        for k, i in enumerate(members):
            ids, _, _, combiner = fields[i]
            if not combiner:
                continue
            rows = embedding_lookup(table, ids.flat_values + int(offsets[k]))
            out[i] = _combine(rows, ids, combiner)
    if grouped is not None:
        return grouped, tables
    pieces = [p for p in out if p is not None]
    if len(distinct) == 1:
        return tf.stack(pieces, axis=1), tables
    return pieces, tables


def flatten_embeddings(emb: tf.Tensor | list[tf.Tensor]) -> tf.Tensor | None:
    """``[batch, sum of widths]``: the fields' embeddings side by side (None when there are no fields)."""
    if isinstance(emb, list):
        return tf.concat(emb, axis=1) if emb else None
    fields, width = int(emb.shape[1]), int(emb.shape[2])
    return tf.reshape(emb, [-1, fields * width])


def deep_input(features: Features, emb: tf.Tensor | list[tf.Tensor]) -> tf.Tensor:
    """The dense features and the flattened field embeddings, concatenated: ``[batch, D + sum of widths]``."""
    flat = flatten_embeddings(emb)
    if flat is None:
        return features.dense
    if int(features.dense.shape[1]) == 0:
        return flat
    return tf.concat([features.dense, flat], axis=1)


def dense_layer(
    x: tf.Tensor, units: int, name: str, activation: Callable[[tf.Tensor], tf.Tensor] | None = None
) -> tf.Tensor:
    """``activation(x @ kernel + bias)`` with a Glorot-uniform kernel (Glorot & Bengio 2010) and zero bias."""
    with v1.variable_scope(name):
        kernel = v1.get_variable(
            "kernel", shape=[int(x.shape[-1]), units], dtype=tf.float32, initializer=v1.glorot_uniform_initializer()
        )
        bias = v1.get_variable("bias", shape=[units], dtype=tf.float32, initializer=v1.zeros_initializer())
        y = tf.matmul(x, kernel) + bias
        return activation(y) if activation is not None else y


def mlp(x: tf.Tensor, hidden: Sequence[int], name: str) -> tf.Tensor:
    """ReLU layers ``hidden[0]``, ``hidden[1]``, ... (scopes ``name/layer_0``, ...)."""
    with v1.variable_scope(name):
        for i, units in enumerate(hidden):
            x = dense_layer(x, units, f"layer_{i}", tf.nn.relu)
    return x


def linear_logit(features: Features, partitioner: Callable[..., Any] | None = None) -> tuple[tf.Tensor, list[Table]]:
    """A logistic-regression logit ``[batch, 1]``: dense weights + one weight per (field, id).

    The per-id weights are a 1-wide embedding table (``cat_weights``, laid
    out like the embeddings), partitioned like them because it has as many
    rows.  With no dense features the dense part is just the bias.
    """
    w_cat, tables = field_embeddings(features, partitioner, "cat_weights", dim=1, initializer=v1.zeros_initializer())
    if int(features.dense.shape[1]) > 0:
        out = dense_layer(features.dense, 1, "dense")  # holds the global bias too
    else:
        with v1.variable_scope("dense"):
            bias = v1.get_variable("bias", shape=[1], dtype=tf.float32, initializer=v1.zeros_initializer())
        out = tf.zeros(tf.stack([tf.shape(features.dense)[0], 1])) + bias  # [batch, 1]
    if tables:
        assert not isinstance(w_cat, list)  # one width (1): one [batch, fields, 1] tensor
        out = out + tf.reduce_sum(w_cat, axis=1)
    return out, tables


def make_optimizer(spec: ModelSpec) -> Any:
    """The v1 optimizer named by the spec.

    Adagrad is the default because sparse embedding rows are updated rarely
    and unevenly; its per-coordinate rates suit that (it is what the
    original Wide & Deep used for the deep part).
    """
    if spec.optimizer == "adagrad":
        return v1.train.AdagradOptimizer(spec.learning_rate, initial_accumulator_value=0.1)
    if spec.optimizer == "adam":
        return v1.train.AdamOptimizer(spec.learning_rate)
    return v1.train.GradientDescentOptimizer(spec.learning_rate)


def session_config(threads: int = 1) -> Any:
    """A ConfigProto with few threads: tests and small jobs share 2 cores with everything else."""
    return v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)
