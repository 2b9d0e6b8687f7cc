"""Pacer: a control plane for elastic, straggler-proof parameter-server training.

This package (``libs/pacer``) holds what more than one service needs: the bus,
the message codec and contracts, telemetry, the service runtime, the embedded
NATS server and the clients that workers and users import.
"""

__version__ = "0.1.0"
