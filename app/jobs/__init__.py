"""Jobs: the runner, the durable store, upkeep, upload blobs and webhooks."""
