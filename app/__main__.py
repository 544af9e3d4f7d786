"""``python -m app``: run the service on its settings (environment variables, see README)."""

from __future__ import annotations

import os
import sys

import uvicorn

from app.config import Settings
from app.main import create_app, setup_logging


def main() -> int:
    if "libtcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        print("warning: tcmalloc is not preloaded; CPU batching runs ~2x slower with glibc "
              "malloc (see README)", file=sys.stderr)
    settings = Settings()
    setup_logging(os.environ.get("BATCHSCRIBE_LOG_LEVEL", "INFO"))
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_config=None,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) or None,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
