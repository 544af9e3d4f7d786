"""Request limits before the route runs: the body size, enforced while it streams in, and the
backlog gate (429 before the body is read).

Body size: audio routes (``UPLOAD_PATHS``) take ``limits.max_upload_bytes`` of multipart (and
each form field its own limit as it streams, app/api/middleware/fields.py);
everything else, and a JSON body on any route, at most ``MAX_JSON_BYTES`` (64 KiB: issue 51
measured an 8 MiB JSON body answered 200 by ``POST /v1/realtime/client_secrets``, read whole).
Two checks, both answering 413 with the JSON error body (app/api/errors.py):

* a declared ``Content-Length`` over the limit is refused before a byte of the body is read;
* otherwise (chunked uploads, or a lying length) the bytes are counted as they arrive and the
  request is cut off the moment the count passes the limit. Starlette's form parser spools file
  parts to a temporary file past 1 MiB, so an upload is never held whole in memory either way.

The exact per-file limit (``limits.max_upload_bytes``) is checked again when the upload is copied
to the spool (:func:`app.api.uploads.spool_upload`); this layer allows a little multipart
framing on top so that a file of exactly the limit is accepted.

Why the response is swapped rather than rendered by an exception handler: an exception raised
from ``receive()`` inside FastAPI's form parsing is turned into a generic 400 ("error parsing
the body") before any handler sees it. So the guard remembers that it cut the body off and
replaces whatever response the app then starts with the 413.

Backlog: the bounds themselves (the global backlog, each API key's share) are the core's
(app/jobs/admission.py); the exact check, with the upload's duration, runs when the door takes
the upload. While the backlog is already full, :class:`BacklogGate` asks the door before the
body is read: in a burst the rejected clients then cost a header each, not an upload spooled
to disk and probed only to be refused.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import edge_reply
from app.api.json_form import MAX_JSON_BYTES
from app.api.middleware.fields import FIELD_LIMITS, FieldMeter
from app.errors import PayloadTooLarge, ServiceError
from app.jobs.door import Door

# Multipart boundaries, part headers and the small form fields (initial_prompt <= 1000 chars).
MULTIPART_SLACK = 64 * 1024


def header(scope: Scope, wanted: bytes) -> str:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return str(value.decode("latin-1"))
    return ""


def content_type(scope: Scope) -> str:
    return header(scope, b"content-type").split(";")[0].strip().lower()


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``; None when absent or malformed (the server rejects a
    malformed length before we run)."""
    value = header(scope, b"content-length")
    try:
        return int(value) if value else None
    except ValueError:
        return None


def too_large(limit: int, received: int | None = None) -> PayloadTooLarge:
    what = f"request body of {received} bytes" if received is not None else "upload"
    return PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes", limit_bytes=limit)


class _Guard:
    """Per request: counts body bytes (and, with a :class:`FieldMeter`, each form field's);
    once over a limit, owns the response."""

    def __init__(self, receive: Receive, send: Send, max_body: int, limit: int, path: str,
                 fields: FieldMeter | None = None) -> None:
        self._receive = receive
        self._send = send
        self.path = path
        self.max_body = max_body
        self.limit = limit
        self.fields = fields
        self.received = 0
        self.error: ServiceError | None = None  # a 413, or a field meter's 400
        self.started = False  # a response has begun (ours or the app's)
        self.replaced = False  # the app's response is being dropped for our 413

    async def receive(self) -> Message:
        if self.error is not None:  # the app asks again after the cut-off: keep refusing
            raise self.error
        message = await self._receive()
        if message["type"] == "http.request":
            body = message.get("body", b"")
            self.received += len(body)
            if self.received > self.max_body:
                self.error = too_large(self.limit)
                raise self.error
            if self.fields is not None:
                try:
                    self.fields.feed(body)
                except ServiceError as exc:
                    self.error = exc
                    raise
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if self.error is not None and not self.started:
                self.replaced = True
                self.started = True
                await edge_reply(self.error, self.path).send(self._send, close=True)
                return
            self.started = True
        elif message["type"] == "http.response.body" and self.replaced:
            return  # the app's own rendering of the cut-off (e.g. a 400): dropped
        await self._send(message)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_upload_bytes: int) -> None:
        self.app = app
        self.upload_limit = max_upload_bytes

    def limits(self, scope: Scope) -> tuple[int, int]:
        """(the limit a 413 names, the bytes allowed including multipart framing)."""
        if scope["path"] in UPLOAD_PATHS and content_type(scope) != "application/json":
            return self.upload_limit, self.upload_limit + MULTIPART_SLACK
        return MAX_JSON_BYTES, MAX_JSON_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, max_body = self.limits(scope)
        declared = declared_length(scope)
        if declared is not None and declared > max_body:
            await edge_reply(too_large(limit, declared), scope["path"]).send(send, close=True)  # unread
            return
        ctype = content_type(scope)
        fields = FIELD_LIMITS.get(scope["path"])
        meter = (FieldMeter(header(scope, b"content-type"), fields)
                 if fields is not None and ctype == "multipart/form-data" else None)
        guard = _Guard(receive, send, max_body, limit, scope["path"], meter)
        try:
            await self.app(scope, guard.receive, guard.send)
        except PayloadTooLarge as exc:  # escaped the app unrendered (e.g. raised by a stream)
            if guard.started:
                raise
            await edge_reply(exc, scope["path"]).send(send, close=True)


class BacklogGate:
    """An upload (``GATED_PATHS``) while the backlog (or the caller's key's share) is already
    full: 429 before the body is read (:meth:`app.jobs.door.Door.gate`). Every upload
    (``UPLOAD_PATHS``) holds one of its key's transfers (app/jobs/transfers.py) until its body
    is in: 429 past ``limits.max_transfers_per_key``, so a key's trickling uploads cannot hold
    every connection, and they count in its share meanwhile."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                scope["path"] not in UPLOAD_PATHS:
            await self.app(scope, receive, send)
            return
        door: Door | None = getattr(scope["app"].state, "door", None)
        if door is None or not door.ready:
            await self.app(scope, receive, send)
            return
        owner = scope.get("state", {}).get("owner")  # set by the API key check
        try:
            if scope["path"] in GATED_PATHS:
                await door.gate(owner)  # the key's share, its transfers included
            hold = await door.transfer(owner)
        except ServiceError as exc:  # 429 (or 503: the store away): outside the routes' handlers
            await edge_reply(exc, scope["path"]).send(send, close=True)
            return
        try:
            async def receiving() -> Message:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    hold.release()  # the body is in (or the client left): the transfer is over
                return message

            await self.app(scope, receiving, send)
        finally:
            hold.release()


GATED_PATHS = frozenset({"/transcribe", "/asr", "/detect-language"})
UPLOAD_PATHS = GATED_PATHS | {"/v1/audio/transcriptions", "/v1/audio/translations"}
