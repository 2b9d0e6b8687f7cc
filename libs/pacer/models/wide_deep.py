"""Wide & Deep (Cheng et al., "Wide & Deep Learning for Recommender Systems", DLRS 2016).

logit = wide + deep (the paper's Eq. 3 without the hand-made cross-product
columns): the wide part is a linear model over the raw categorical ids and
the dense features; the deep part is a ReLU MLP over the dense features and
the concatenated field embeddings.  Both are trained jointly on one loss.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from pacer.models.common import ModelSpec, Table, dense_layer, field_embeddings, linear_logit, mlp

v1 = tf.compat.v1


def logits(
    spec: ModelSpec, dense: tf.Tensor, cat_ids: tf.Tensor, partitioner: Any
) -> tuple[tf.Tensor, list[Table]]:
    """The click logit ``[batch]`` and the partitioned tables it created."""
    with v1.variable_scope("wide"):
        wide, wide_table = linear_logit(dense, cat_ids, spec.hash_buckets, partitioner)
    with v1.variable_scope("deep"):
        emb, emb_table = field_embeddings("embeddings", cat_ids, spec.hash_buckets, spec.embed_dim, partitioner)
        fields = int(cat_ids.shape[1])
        x = tf.concat([dense, tf.reshape(emb, [-1, fields * spec.embed_dim])], axis=1)
        deep = dense_layer(mlp(x, spec.hidden, "mlp"), 1, "out")
    return tf.squeeze(wide + deep, axis=1), [wide_table, emb_table]
