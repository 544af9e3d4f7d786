"""POST /transcribe with an ``Idempotency-Key`` already known: the first job's answer before
the body is read (the header itself, and the rest of the rules: app/api/idempotency.py)."""

from __future__ import annotations

from starlette.datastructures import QueryParams
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import edge_reply
from app.api.idempotency import parse_key
from app.api.middleware.limits import MULTIPART_SLACK, declared_length, too_large
from app.api.native.serving import job_answer
from app.errors import BadRequest, ServiceError
from app.jobs.door import Door

GATED = frozenset({"/transcribe"})
TRUE = frozenset({"1", "true", "on", "yes"})
FALSE = frozenset({"0", "false", "off", "no"})


class IdempotencyGate:
    """POST /transcribe with a known key: the first job's answer, the body never spooled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        door: Door | None = (getattr(scope["app"].state, "door", None)
                             if scope["type"] == "http" else None)
        raw = _header(scope) if door is not None and scope["method"] == "POST" else None
        if door is None or raw is None or scope["path"] not in GATED or not door.ready:
            await self.app(scope, receive, send)
            return
        try:
            key = parse_key(raw)
        except BadRequest as exc:
            await edge_reply(exc, scope["path"]).send(send, close=True)
            return
        wait = QueryParams(scope.get("query_string", b"").decode("latin-1")).get("wait", "false")
        owner = scope.get("state", {}).get("owner")  # set by the API key middleware, outside
        try:
            first = await door.replay(owner, key) if key and wait.lower() in TRUE | FALSE else None
        except ServiceError as exc:  # outside the routes' handlers: rendered here (503)
            await edge_reply(exc, scope["path"]).send(send, close=True)
            return
        if first is None:  # unknown key (or a request the route must reject): the normal path
            await self.app(scope, receive, send)
            return
        limit = door.settings.limits.max_upload_bytes
        if not await _discard_body(scope, receive, limit + MULTIPART_SLACK):
            await edge_reply(too_large(limit), scope["path"]).send(send, close=True)
            return
        answer = await job_answer(door, first.id, owner, wait.lower() in TRUE, replayed=True)
        await answer(scope, receive, send)


def _header(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"idempotency-key":
            return str(value.decode("latin-1"))
    return None


async def _discard_body(scope: Scope, receive: Receive, max_bytes: int) -> bool:
    """Read the request body to its end without keeping it; False past ``max_bytes``."""
    declared = declared_length(scope)
    if declared is not None and declared > max_bytes:
        return False
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return True  # the client left: nothing more to read
        seen += len(message.get("body", b""))
        if seen > max_bytes:
            return False
        if not message.get("more_body", False):
            return True
