"""Worker-side access to the shard service."""
