"""Build a model graph by name: the one entry point the trainer uses.

``build`` must be called inside the graph (and device scope) the caller
wants, e.g. ``with tf.Graph().as_default(), tf.compat.v1.device(setter):``.
Every variable lives under the variable scope ``spec.name`` with fixed
names, so two processes that build the same spec get the same variable
names, which is how between-graph replicas find their shared variables on
the parameter servers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from pacer.data.schema import Schema
from pacer.models import dcn, wide_deep, xdeepfm
from pacer.models.common import ModelSpec, Table, make_optimizer, partitioner
from pacer.models.features import Features, transform

v1 = tf.compat.v1

LogitsFn = Callable[[ModelSpec, Features, Any], tuple[tf.Tensor, list[Table]]]

MODELS: dict[str, LogitsFn] = {
    "wide_deep": wide_deep.logits,
    "xdeepfm": xdeepfm.logits,
    "dcn": dcn.logits,
}


@dataclass(frozen=True, slots=True)
class ModelGraph:
    """The tensors of a built model.

    ``loss`` is the mean log loss of the batch (weighted by the schema's
    weight column if it has one: ``sum(w * l) / sum(w)``); ``train_loss``
    is what to minimise: ``loss * loss_scale`` when ``build`` got a scale
    (the trainer feeds a worker's share of the global batch, so that
    asynchronous updates from workers with different batch sizes weigh in
    proportion), else ``loss``.  ``features`` are the transformed inputs.
    """

    spec: ModelSpec
    logits: tf.Tensor
    probs: tf.Tensor
    loss: tf.Tensor
    train_loss: tf.Tensor
    embedding_tables: tuple[Table, ...]
    features: Features

    def weighted_loss(self, weight: tf.Tensor | float) -> tf.Tensor:
        """``loss * weight``, for a caller that decides the weight after building."""
        return self.loss * weight

    def train_op(self, global_step: tf.Variable | None = None, optimizer: Any = None) -> tf.Operation:
        """One optimiser step on ``train_loss`` (the spec's optimiser unless one is given)."""
        opt = optimizer if optimizer is not None else make_optimizer(self.spec)
        op: tf.Operation = opt.minimize(self.train_loss, global_step=global_step)
        return op


def _model(
    spec: ModelSpec, schema: Schema, raw: Mapping[str, Any], num_ps_partitions: int
) -> tuple[Features, tf.Tensor, list[Table]]:
    """Transform + logits, inside the caller's ``spec.name`` variable scope."""
    fn = MODELS.get(spec.name)
    if fn is None:
        raise ValueError(f"unknown model {spec.name!r}; known: {sorted(MODELS)}")
    features = transform(schema.with_defaults(spec.hash_buckets, spec.embed_dim), raw)
    logits, tables = fn(spec, features, partitioner(num_ps_partitions))
    return features, logits, tables


def inference(
    spec: ModelSpec, schema: Schema, raw: Mapping[str, Any], num_ps_partitions: int = 1
) -> tuple[Features, tf.Tensor, tf.Tensor]:
    """``(features, logits, probs)`` without a loss: the serving graph (no label in ``raw``)."""
    with v1.variable_scope(spec.name):
        features, logits, _ = _model(spec, schema, raw, num_ps_partitions)
        probs = tf.sigmoid(logits, name="probs")
    return features, logits, probs


def build(
    spec: ModelSpec,
    schema: Schema,
    raw: Mapping[str, Any],
    num_ps_partitions: int = 1,
    loss_scale: tf.Tensor | None = None,
) -> ModelGraph:
    """Build ``spec.name``'s graph on the raw columns ``raw`` (e.g. ``raw_inputs(schema, kinds).tensors``).

    The schema's buckets/embed_dim of 0 become ``spec.hash_buckets`` /
    ``spec.embed_dim``; ``raw`` must hold the label (and the weight, if the
    schema has one).  The tables are always partitioned, even into 1 part,
    so the variable names (``.../part_0``...) do not change shape with the
    PS count.  Vocabulary columns create lookup tables: run
    ``tf.compat.v1.tables_initializer()`` in every session before a step.
    """
    if schema.label not in raw:
        raise ValueError(f"no input for the label column {schema.label!r}")
    if schema.weight and schema.weight not in raw:
        raise ValueError(f"no input for the weight column {schema.weight!r}")
    with v1.variable_scope(spec.name):
        features, logits, tables = _model(spec, schema, raw, num_ps_partitions)
        assert features.labels is not None
        probs = tf.sigmoid(logits, name="probs")
        losses = v1.nn.sigmoid_cross_entropy_with_logits(labels=features.labels, logits=logits)
        if features.weights is not None:
            w = features.weights
            loss = tf.math.divide_no_nan(tf.reduce_sum(w * losses), tf.reduce_sum(w), name="loss")
        else:
            loss = tf.reduce_mean(losses, name="loss")
        train_loss = loss if loss_scale is None else tf.multiply(loss, loss_scale, name="train_loss")
    return ModelGraph(spec, logits, probs, loss, train_loss, tuple(tables), features)
