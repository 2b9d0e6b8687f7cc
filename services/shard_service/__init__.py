"""shard-service: durable, leased, lossless dynamic data sharding (see ``core``)."""
