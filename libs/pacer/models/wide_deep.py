"""Wide & Deep (Cheng et al., "Wide & Deep Learning for Recommender Systems", DLRS 2016).

logit = wide + deep (the paper's Eq. 3 without the hand-made cross-product
columns): the wide part is a linear model over the raw categorical ids and
the dense features; the deep part is a ReLU MLP over the dense features and
the concatenated field embeddings (fields may differ in width).  Both are trained jointly on one loss.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from pacer.models.common import (
    ModelSpec,
    Table,
    deep_input,
    dense_layer,
    field_embeddings,
    linear_logit,
    mlp,
)
from pacer.models.features import Features

v1 = tf.compat.v1


def logits(spec: ModelSpec, features: Features, partitioner: Any) -> tuple[tf.Tensor, list[Table]]:
    """The click logit ``[batch]`` and the partitioned tables it created."""
    with v1.variable_scope("wide"):
        wide, wide_tables = linear_logit(features, partitioner)
    with v1.variable_scope("deep"):
        emb, emb_tables = field_embeddings(features, partitioner)
        x = deep_input(features, emb)  # dense features + every field's embedding, side by side
        deep = dense_layer(mlp(x, spec.hidden, "mlp"), 1, "out")
    return tf.squeeze(wide + deep, axis=1), [*wide_tables, *emb_tables]
