"""Shared pieces of the models: the spec, inputs, embeddings, dense layers, optimizers.

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

v1 = tf.compat.v1

NUM_DENSE = 13
NUM_CAT = 26
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


def input_placeholders(
    num_dense: int = NUM_DENSE, num_cat: int = NUM_CAT
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(dense [None,13] f32, cat_ids [None,26] i64, labels [None] f32)``: the batch size may change every step."""
    dense = v1.placeholder(tf.float32, [None, num_dense], name="dense")
    cat_ids = v1.placeholder(tf.int64, [None, num_cat], name="cat_ids")
    labels = v1.placeholder(tf.float32, [None], name="labels")
    return dense, cat_ids, labels


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


def field_embeddings(
    name: str,
    cat_ids: tf.Tensor,
    hash_buckets: int,
    dim: int,
    partitioner: Callable[..., Any] | None = None,
    initializer: Any = None,
) -> tuple[tf.Tensor, Table]:
    """Per-field embeddings ``[batch, fields, dim]`` from one table of ``fields * hash_buckets`` rows.

    Every field's ids lie in ``[0, hash_buckets)``; adding ``field *
    hash_buckets`` gives each field its own rows, so equal raw ids of two
    fields do not share a vector, while all fields still live in one table
    that the partitioner spreads evenly over the PS tasks.
    """
    fields = int(cat_ids.shape[1])
    table = embedding_table(name, fields * hash_buckets, dim, partitioner, initializer)
    offsets = tf.constant(np.arange(fields, dtype=np.int64) * hash_buckets, dtype=tf.int64)
    emb = embedding_lookup(table, cat_ids + offsets[None, :])
    return emb, table


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


def linear_logit(
    dense: tf.Tensor,
    cat_ids: tf.Tensor,
    hash_buckets: int,
    partitioner: Callable[..., Any] | None = None,
) -> tuple[tf.Tensor, Table]:
    """A logistic-regression logit ``[batch, 1]``: dense weights + one weight per (field, id).

    The per-id weights are a 1-wide embedding table, partitioned like the
    embeddings because they have as many rows.
    """
    w_cat, table = field_embeddings(
        "cat_weights", cat_ids, hash_buckets, 1, partitioner, initializer=v1.zeros_initializer()
    )
    dense_part = dense_layer(dense, 1, "dense")  # holds the global bias too
    return dense_part + tf.reduce_sum(w_cat, axis=1), table


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
