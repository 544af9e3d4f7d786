"""The benchmarks (loadtest/README.md is their index, with each one's method and latest figures).

- ``loadtest/<name>.py``: the drivers, each run as ``python -m loadtest.<name>`` and writing its
  results file under ``loadtest/results/`` (the commit and a clean tree recorded in it).
- ``loadtest/lib/``: what the drivers share (the corpus, the service under test and its client,
  probes of /metrics and /proc, statistics, reports) and the parts of one driver; imported, never
  run. The tests import from it too (the corpus, hostile inputs), never the other way round.
- ``loadtest/gpu/``: the tools carried to a lent GPU host (``scripts/gpu-device``,
  ``scripts/gpu-check``): the bundle, the probe, the check and its steps.
"""
