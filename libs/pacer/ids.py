"""What an id may be: one NATS subject level (jobs, datasets, nodes, checkpoints are plain ``str``)."""

# A token is what may appear in one NATS subject level: we keep ids to this
# alphabet so that a job id can never inject a wildcard or a new level.
_TOKEN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_TOKEN_LEN = 64


def is_token(value: str) -> bool:
    """True if ``value`` can be used as an id and as one subject level."""
    return 0 < len(value) <= MAX_TOKEN_LEN and all(c in _TOKEN_CHARS for c in value)


#: The namespace (team) of a job that names none: Kubernetes' own default.
DEFAULT_NAMESPACE = "default"
_NAMESPACE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def is_namespace(value: str) -> bool:
    """True if ``value`` is a Kubernetes namespace name (an RFC 1123 label: 1-63 of [a-z0-9-], alphanumeric
    at both ends): a job's team, where its resource and pods live."""
    return (0 < len(value) <= 63 and all(c in _NAMESPACE_CHARS for c in value)
            and value[0] != "-" and value[-1] != "-")
