"""monitor: sliding windows of node, application and cluster state -> job statistics and straggler signals (see ``core``)."""
