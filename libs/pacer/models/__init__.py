"""Recommendation models in tf.compat.v1 graph mode, built from raw variables."""
