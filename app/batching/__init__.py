"""Cross-request batching: the batcher task, its two stages, and the batch cap."""
