"""pod-executor: runs the nodes of each job (local processes or Kubernetes pods)."""
