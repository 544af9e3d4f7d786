"""Request limits: the body size, enforced while it streams in, and the backlog bound (429).

Body size: two checks, both answering 413 with the JSON error body of :mod:`app.errors`:

* a declared ``Content-Length`` over the limit is refused before a byte of the body is read;
* otherwise (chunked uploads, or a lying length) the bytes are counted as they arrive and the
  request is cut off the moment the count passes the limit. Starlette's form parser spools file
  parts to a temporary file past 1 MiB, so an upload is never held whole in memory either way.

The exact per-file limit (``limits.max_upload_bytes``) is checked again when the upload is copied
to the spool (:func:`app.api.transcribe.spool_upload`); this layer allows a little multipart
framing on top so that a file of exactly the limit is accepted.

Why the response is swapped rather than rendered by an exception handler: an exception raised
from ``receive()`` inside FastAPI's form parsing is turned into a generic 400 ("error parsing
the body") before any handler sees it. So the guard remembers that it cut the body off and
replaces whatever response the app then starts with the 413.

Backlog: an upload is admitted only if its audio fits under ``limits.max_backlog_s`` of queued
audio, else 429 with ``Retry-After`` (:func:`admitted`); while the backlog is already full,
:class:`BacklogGate` answers 429 before reading the body at all.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import LimitSettings
from app.errors import Overloaded, PayloadTooLarge, ServiceError
from app.state import AppState

# Multipart boundaries, part headers and the small form fields (initial_prompt <= 1000 chars).
MULTIPART_SLACK = 64 * 1024


def too_large(limit: int, received: int | None = None) -> PayloadTooLarge:
    what = f"request body of {received} bytes" if received is not None else "upload"
    return PayloadTooLarge(f"{what} exceeds the limit of {limit} bytes", limit_bytes=limit)


async def send_error(send: Send, err: ServiceError, path: str) -> None:
    body = json.dumps(err.body_for(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               # The rest of the body is not read: the connection cannot be reused.
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed length before we run
    return None


class _Guard:
    """Per request: counts body bytes; once over the limit, owns the response."""

    def __init__(self, receive: Receive, send: Send, max_body: int, limit: int, path: str) -> None:
        self._receive = receive
        self._send = send
        self.path = path
        self.max_body = max_body
        self.limit = limit
        self.received = 0
        self.error: PayloadTooLarge | None = None
        self.started = False  # a response has begun (ours or the app's)
        self.replaced = False  # the app's response is being dropped for our 413

    async def receive(self) -> Message:
        if self.error is not None:  # the app asks again after the cut-off: keep refusing
            raise self.error
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_body:
                self.error = too_large(self.limit)
                raise self.error
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if self.error is not None and not self.started:
                self.replaced = True
                self.started = True
                await send_error(self._send, self.error, self.path)
                return
            self.started = True
        elif message["type"] == "http.response.body" and self.replaced:
            return  # the app's own rendering of the cut-off (e.g. a 400): dropped
        await self._send(message)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_upload_bytes: int) -> None:
        self.app = app
        self.limit = max_upload_bytes
        self.max_body = max_upload_bytes + MULTIPART_SLACK

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_body:
            await send_error(send, too_large(self.limit, declared), scope["path"])  # body never read
            return
        guard = _Guard(receive, send, self.max_body, self.limit, scope["path"])
        try:
            await self.app(scope, guard.receive, guard.send)
        except PayloadTooLarge as exc:  # escaped the app unrendered (e.g. raised by a stream)
            if guard.started:
                raise
            await send_error(send, exc, scope["path"])


async def admit(st: AppState, audio_s: float, max_age_s: float = 0.0) -> None:
    """429 unless ``audio_s`` more audio fits in the backlog (``limits.max_backlog_s``).

    Retry-After is the time the service needs, at its current speed (audio seconds per wall
    second over the last minutes of batches, see ``AppState.retry_after_s``), to work the
    backlog down far enough for this upload.
    """
    backlog = await st.runner.backlog_seconds(max_age_s)
    limit = st.settings.limits.max_backlog_s
    if backlog + audio_s > limit:
        retry = st.retry_after_s(backlog + audio_s - limit)
        st.metrics.rejected.labels("backlog").inc()
        raise Overloaded(
            f"the queue holds {backlog:.0f} s of audio (limit {limit:.0f} s); "
            f"retry in about {retry} s", headers={"Retry-After": str(retry)},
            retry_after_s=retry, backlog_s=round(backlog, 1), limit_s=limit,
        )


@asynccontextmanager
async def admitted(st: AppState, audio_s: float) -> AsyncIterator[None]:
    """Admit ``audio_s`` (or raise 429) and count it in the backlog until the job is committed.

    Uploads arriving together would otherwise all read the same backlog from the store and all
    fit. Checks run one at a time, each seeing the reservations of those before it; the commits
    (an S3 put each, with that blob store) run outside the lock.
    """
    async with st.runner.admission:
        await admit(st, audio_s)
        st.runner.admitting_s += audio_s
    try:
        yield
    finally:
        st.runner.admitting_s -= audio_s


class BacklogGate:
    """An upload (``GATED_PATHS``) while the backlog is already full: 429 before the body is read.

    In a burst the rejected clients then cost a header each, not an upload spooled to disk and
    probed only to be refused. The exact check (with the upload's duration) is in the endpoint.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GATED_PATHS:
            st: AppState | None = getattr(scope["app"].state, "bs", None)
            if st is not None and st.ready:
                try:
                    await admit(st, MIN_UPLOAD_S, GATE_MAX_AGE_S)
                except Overloaded as exc:
                    await send_error(send, exc, scope["path"])
                    return
        await self.app(scope, receive, send)


GATED_PATHS = frozenset({"/transcribe", "/asr", "/detect-language"})
MIN_UPLOAD_S = 0.1  # the gate assumes the shortest upload worth sending
# The gate may read a backlog this old instead of querying the store on every request (the
# exact check after the upload always queries): under load that query cost engine CPU.
GATE_MAX_AGE_S = 0.5


def install_limits(app: FastAPI, limits: LimitSettings) -> None:
    app.add_middleware(BodyLimitMiddleware, max_upload_bytes=limits.max_upload_bytes)
    app.add_middleware(BacklogGate)  # outside: a full backlog answers before any byte is counted
