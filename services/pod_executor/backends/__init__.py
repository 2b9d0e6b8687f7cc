"""Where pods run: the :class:`Backend` protocol and its two implementations.

* :mod:`.local`: each pod is a supervisor process (:mod:`.pod`) running the
  trainer and its agent with CPU and memory limits, in its own session so
  that it outlives an executor restart;
* :mod:`.kubernetes`: pods from role templates through the official client.

Import the implementations from their modules (the Kubernetes client is
only loaded where it is used).
"""

from pacer_services.pod_executor.backends.base import Backend

__all__ = ["Backend"]
