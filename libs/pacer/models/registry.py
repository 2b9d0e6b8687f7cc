"""Build a model graph by name: the one entry point the trainer uses.

``build`` must be called inside the graph (and device scope) the caller
wants, e.g. ``with tf.Graph().as_default(), tf.compat.v1.device(setter):``.
Every variable lives under the variable scope ``spec.name`` with fixed
names, so two processes that build the same spec get the same variable
names, which is how between-graph replicas find their shared variables on
the parameter servers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from pacer.models import dcn, wide_deep, xdeepfm
from pacer.models.common import ModelSpec, Table, make_optimizer, partitioner

v1 = tf.compat.v1

LogitsFn = Callable[[ModelSpec, tf.Tensor, tf.Tensor, Any], tuple[tf.Tensor, list[Table]]]

MODELS: dict[str, LogitsFn] = {
    "wide_deep": wide_deep.logits,
    "xdeepfm": xdeepfm.logits,
    "dcn": dcn.logits,
}


@dataclass(frozen=True, slots=True)
class ModelGraph:
    """The tensors of a built model.

    ``loss`` is the mean log loss of the batch; ``train_loss`` is what to
    minimise: ``loss * loss_scale`` when ``build`` got a scale (the trainer
    feeds a worker's share of the global batch, so that asynchronous updates
    from workers with different batch sizes weigh in proportion), else
    ``loss``.
    """

    spec: ModelSpec
    logits: tf.Tensor
    probs: tf.Tensor
    loss: tf.Tensor
    train_loss: tf.Tensor
    embedding_tables: tuple[Table, ...]

    def weighted_loss(self, weight: tf.Tensor | float) -> tf.Tensor:
        """``loss * weight``, for a caller that decides the weight after building."""
        return self.loss * weight

    def train_op(self, global_step: tf.Variable | None = None, optimizer: Any = None) -> tf.Operation:
        """One optimiser step on ``train_loss`` (the spec's optimiser unless one is given)."""
        opt = optimizer if optimizer is not None else make_optimizer(self.spec)
        op: tf.Operation = opt.minimize(self.train_loss, global_step=global_step)
        return op


def build(
    spec: ModelSpec,
    dense: tf.Tensor,
    cat_ids: tf.Tensor,
    labels: tf.Tensor,
    num_ps_partitions: int = 1,
    loss_scale: tf.Tensor | None = None,
) -> ModelGraph:
    """Build ``spec.name``'s graph on these inputs; embeddings split into ``num_ps_partitions`` parts.

    The tables are always partitioned, even into 1 part, so the variable
    names (``.../part_0``...) do not change shape with the PS count.
    """
    fn = MODELS.get(spec.name)
    if fn is None:
        raise ValueError(f"unknown model {spec.name!r}; known: {sorted(MODELS)}")
    with v1.variable_scope(spec.name):
        logits, tables = fn(spec, dense, cat_ids, partitioner(num_ps_partitions))
        probs = tf.sigmoid(logits, name="probs")
        loss = tf.reduce_mean(
            v1.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits), name="loss"
        )
        train_loss = loss if loss_scale is None else tf.multiply(loss, loss_scale, name="train_loss")
    return ModelGraph(spec, logits, probs, loss, train_loss, tuple(tables))
