"""Deep & Cross Network (Wang et al., "Deep & Cross Network for Ad Click
Predictions", ADKDD 2017).

The embedding-and-stacking layer concatenates the dense features and the
field embeddings into ``x0``; a cross network and a deep network read ``x0``
in parallel and a combination layer maps both outputs to the logit (Eq. 5).
A cross layer (Eq. 3) is

    x_{l+1} = x0 x_l^T w_l + b_l + x_l

so layer l holds feature crosses up to degree l + 1 at the cost of two
vectors per layer.  ``x0 x_l^T w_l`` is computed as ``x0 * (x_l . w_l)``,
never materialising the d x d outer product.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from pacer.models.common import ModelSpec, Table, deep_input, dense_layer, field_embeddings, mlp
from pacer.models.features import Features

v1 = tf.compat.v1


def cross_network(x0: tf.Tensor, layers: int, name: str = "cross") -> tf.Tensor:
    """``layers`` cross layers (Eq. 3) over ``x0`` ``[batch, d]``; returns ``x_L`` ``[batch, d]``."""
    d = int(x0.shape[1])
    xl = x0
    with v1.variable_scope(name):
        for i in range(layers):
            w = v1.get_variable(
                f"layer_{i}/w", shape=[d, 1], dtype=tf.float32, initializer=v1.glorot_uniform_initializer()
            )
            b = v1.get_variable(f"layer_{i}/b", shape=[d], dtype=tf.float32, initializer=v1.zeros_initializer())
            xl = x0 * tf.matmul(xl, w) + b + xl
    return xl


def logits(spec: ModelSpec, features: Features, partitioner: Any) -> tuple[tf.Tensor, list[Table]]:
    """The click logit ``[batch]`` and the partitioned tables it created."""
    emb, emb_tables = field_embeddings(features, partitioner)
    # Embedding and stacking layer (Sec. 2.1): x0 = [dense, emb_1, ..., emb_k]; widths may differ.
    x0 = deep_input(features, emb)
    cross = cross_network(x0, spec.cross_layers)
    deep = mlp(x0, spec.hidden, "deep")
    # Combination layer (Eq. 5): one logistic unit over [x_L1, h_L2].
    out = dense_layer(tf.concat([cross, deep], axis=1), 1, "combine")
    return tf.squeeze(out, axis=1), emb_tables
