"""``batchscribe`` (pyproject's console script) and ``python -m app.cli``: see app/client/cli.py."""

from __future__ import annotations

from app.client.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
