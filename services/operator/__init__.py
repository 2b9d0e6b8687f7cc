"""operator: PacerJob custom resources in Kubernetes -> Pacer jobs, their state written back (docs/kubernetes.md)."""
