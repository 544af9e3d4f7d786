"""Cross-request batching: the speech batcher (``batcher``: its owner task, ``owner``: the one
writer of its state, ``policy``: the pure choice of the next engine call, with ``pool``,
``fairness`` and ``urgency``; ``stages``: its vocabulary), and the primitive both batchers share
with the speaker models' batcher (``primitive``)."""
