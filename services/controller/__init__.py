"""controller: straggler mitigation (AntDT §V-E): asks a job's policy for a decision, reviews it (``core``), executes it."""
