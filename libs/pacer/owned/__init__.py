"""Per-job runtime shared by the services that own jobs: routing of requests to a job's owner (:mod:`.router`)."""
