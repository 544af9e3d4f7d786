"""What a middleware answers with: the JSON error body of :mod:`app.errors`, sent before any
route (and its exception handlers) runs; and the request's declared body length."""

from __future__ import annotations

import json

from starlette.types import Scope, Send

from app.errors import ServiceError


async def send_error(send: Send, err: ServiceError, path: str, close: bool = False,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """``close``: the rest of the request body is not read, so the connection cannot be
    reused (``Connection: close``)."""
    body = json.dumps(err.body_for(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status_code,
                "headers": [*headers, *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length before we run
    return None
