"""What the benchmark drivers share, and the parts of one driver: imported, never run
(loadtest/__init__.py). Light on purpose: the load generator must not load torch or CTranslate2."""
