"""``batchscribe`` (pyproject's console script) and ``python -m app.cli``: see app/client/cli.py.

The command is the HTTP client (app/client) plus one way into the pipeline itself:
``batchscribe dataset --ray`` runs the service's prep, batcher and engine in Ray actors
(app/dataset). That path is imported here, lazily, and handed to the client; the client never
imports it, and nothing else of the command reaches the core (pyproject's import-linter
contract "client" allows exactly ``app.cli -> app.dataset.run``).
"""

from __future__ import annotations

import argparse

from app.client import cli

__all__ = ["main"]


def run_ray(args: argparse.Namespace) -> int:
    """``dataset --ray``: Ray, the model and the pipeline loaded only when asked for."""
    from app.dataset.run import run_ray as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, ray=run_ray)


if __name__ == "__main__":
    raise SystemExit(main())
