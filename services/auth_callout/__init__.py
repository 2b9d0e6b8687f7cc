"""The auth callout responder: admits each job's agents with that job's permissions only."""
