"""Datasets past one machine: the service's pipeline as a Ray Data stage, no HTTP.

* :mod:`app.dataset.local`: the service's prep, batcher and engine in one process, on a private
  event loop (what a Ray actor holds: the model loaded once);
* :mod:`app.dataset.inputs`: what a row gives (a path, a URL, bytes, decoded samples) as a local
  file, and the request options of a row;
* :mod:`app.dataset.stage`: :class:`~app.dataset.stage.Transcriber`, the callable class for
  ``Dataset.map_batches``; output rows are those of ``batchscribe dataset``;
* :mod:`app.dataset.parts`: output written per block, named by the row ids it holds (a retried
  block rewrites the same file; a rerun skips the ids already written);
* :mod:`app.dataset.plan`: actors, resources and batch sizes for the hardware Ray reports;
* :mod:`app.dataset.run`: ``batchscribe dataset MANIFEST -o OUT --ray [ADDRESS]``.

``ray`` is imported only by ``plan`` and ``run`` (and lazily): the stage itself is a plain class.
"""
