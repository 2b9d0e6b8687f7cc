"""Wire contracts: every message that crosses the bus.

Importing this package registers every message class with the codec, which
is what ``pacer schemas export`` and the round-trip test iterate over.
"""

from pacer.contracts import agent, brain, common, executor, jobs, monitor, nodes, policy, shards

__all__ = ["agent", "brain", "common", "executor", "jobs", "monitor", "nodes", "policy", "shards"]
