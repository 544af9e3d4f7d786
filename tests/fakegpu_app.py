"""``python -m tests.fakegpu_app``: the real service (``python -m app``) on a fake GPU.

The fake (tests/fakegpu.py, configured by ``FAKEGPU_*`` variables) is installed before the
service imports anything that reads the device; everything after that is the production code
path, started by the same ``main()``.
"""

from __future__ import annotations

from tests.fakegpu import install_from_env

if __name__ == "__main__":
    install_from_env()
    from app.__main__ import main

    raise SystemExit(main())
