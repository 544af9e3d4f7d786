"""Cross-request batching: the primitive both batchers share and the speaker models' batcher
(``queue``), the speech batcher's task (``batcher``), its two stages, fair order and cap."""
