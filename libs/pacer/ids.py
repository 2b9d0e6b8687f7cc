"""What an id may be: one NATS subject level (jobs, datasets, nodes, checkpoints are plain ``str``)."""

# A token is what may appear in one NATS subject level: we keep ids to this
# alphabet so that a job id can never inject a wildcard or a new level.
_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_TOKEN_LEN = 64


def is_token(value: str) -> bool:
    """True if ``value`` can be used as an id and as one subject level."""
    return 0 < len(value) <= MAX_TOKEN_LEN and all(c in _TOKEN_CHARS for c in value)
