"""Per-job runtime shared by the services that own jobs: routing of requests to a job's owner
(:mod:`.router`) and running a job's changes one at a time, other jobs in parallel (:mod:`.queues`)."""
