"""Every ASGI middleware of the service, and the one place that stacks them.

All are plain ASGI classes, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs
every request through a task group and memory streams, which cost measurable CPU per request
beside the engine. From the outside in (:func:`install_middleware`):

0. ``QuerySecretMiddleware`` (secrets.py): a WebSocket handshake's ``client_secret`` query
   parameter leaves the query string before any layer or log line sees it.
1. ``RetryHints`` (observe.py): ``x-should-retry: false`` on every 4xx a retry cannot fix; it
   sees every answer, the other middlewares' included.
2. ``HttpMetrics`` (observe.py): requests and latency by route and status.
3. ``CrossSiteGuard`` (origin.py): 403 for a browser's state-changing request or WebSocket
   handshake from another site (``Origin`` / ``Sec-Fetch-Site``), before anything else runs.
4. ``ApiKeyMiddleware`` or, without keys, ``LoopbackHostMiddleware`` (keys.py): the caller's
   tenant, or 401, before any body byte is read; on WebSocket handshakes (``/v1/realtime``)
   too, where a short-lived client secret (secrets.py) may stand in for the key.
5. ``IdempotencyGate`` (idempotency.py): a known ``Idempotency-Key`` is answered at once; the
   owner is known here, and a replay skips the backlog gate (it adds no work).
6. ``BacklogGate`` (limits.py): 429 before the body is read while the backlog is full.
7. ``BodyLimitMiddleware`` (limits.py): 413 as the body's bytes pass the limit.
8. ``CoalesceBody`` (coalesce.py): an upload's body reaches the form parser in 1 MiB blocks
   (each smaller block was a thread hop in Starlette's spooled file), after the limits counted
   its bytes as they came.
"""

from __future__ import annotations

from fastapi import FastAPI

from app.api.middleware.coalesce import CoalesceBody
from app.api.middleware.idempotency import IdempotencyGate
from app.api.middleware.keys import install_security
from app.api.middleware.limits import BacklogGate, BodyLimitMiddleware
from app.api.middleware.observe import HttpMetrics, RetryHints
from app.api.middleware.origin import CrossSiteGuard
from app.api.middleware.secrets import ClientSecrets, QuerySecretMiddleware
from app.config import Settings


def install_middleware(app: FastAPI, settings: Settings) -> None:
    """The stack above, added innermost first (Starlette wraps each new one around the last)."""
    app.add_middleware(CoalesceBody)
    app.add_middleware(BodyLimitMiddleware, max_upload_bytes=settings.limits.max_upload_bytes)
    app.add_middleware(BacklogGate)
    app.add_middleware(IdempotencyGate)
    app.state.client_secrets = ClientSecrets(settings.live)  # /v1/realtime's short-lived tokens
    install_security(app, settings.security, app.state.client_secrets)
    app.add_middleware(CrossSiteGuard, allowed_origins=settings.security.allowed_origins)
    app.add_middleware(HttpMetrics)
    app.add_middleware(RetryHints)
    app.add_middleware(QuerySecretMiddleware)
