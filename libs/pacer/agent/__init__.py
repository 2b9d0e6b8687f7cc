"""The agent sidecar: one process beside every PS/worker, executing global actions."""
