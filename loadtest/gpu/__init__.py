"""The tools carried to a lent GPU host (docs/gpu.md): ``bundle`` (the service's wheels, model
and corpus in parts, unpacked there with the standard library only), ``probe`` (does CTranslate2
run here?), ``check`` and its ``steps`` (``scripts/gpu-check``), ``watch``, ``bare``, ``peer``."""
