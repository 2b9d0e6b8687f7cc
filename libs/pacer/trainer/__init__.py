"""The TensorFlow trainer: PS and worker runners, input from shards, checkpoints."""
