"""Middleware that watches every answer: request metrics, and the retry hint on 4xx."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.jobs.door import Door


class HttpMetrics:
    """Requests and latency by route and status: a plain ASGI middleware.

    Not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs every request through a
    task group and memory streams, which cost measurable CPU per request beside the engine.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router records the matched route in the (shared) scope.
            route = getattr(scope.get("route"), "path", "unmatched")
            door: Door | None = getattr(scope["app"].state, "door", None)
            if door is not None:
                door.metrics.http_requests.labels(scope["method"], route, str(status)).inc()
                door.metrics.http_duration.labels(scope["method"], route).observe(
                    time.perf_counter() - start)


# A retry cannot fix these: the OpenAI SDK (and others reading the header) must not resend.
# 408 and 429 mean "later"; 409 here means "not done yet" (GET /jobs/{id}/result).
RETRYABLE_4XX = frozenset({408, 409, 425, 429})


class RetryHints:
    """Adds ``x-should-retry: false`` to every 4xx a retry cannot fix, unless the answer
    already says. The OpenAI SDK retries 408/409/429/5xx twice by default, resending the whole
    upload each time; with the header it stops at the first answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def hinted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if 400 <= status < 500 and status not in RETRYABLE_4XX and \
                        not any(k.lower() == b"x-should-retry" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-should-retry", b"false")]}
            await send(message)

        await self.app(scope, receive, hinted)
