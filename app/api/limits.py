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
audio and, with API keys, under its key's share (``limits.max_queued_s_per_key`` and
``max_queued_jobs_per_key``), else 429 with ``Retry-After`` naming the limit (:func:`admitted`).
Every job costs at least one padded window (``Settings.min_job_s``): a 0.1 s clip is encoded as
a 10 s window, so it is counted as one. While the backlog is already full, :class:`BacklogGate`
answers 429 before reading the body at all.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import LimitSettings
from app.errors import Overloaded, PayloadTooLarge, ServiceError
from app.state import AppState

# Multipart boundaries, part headers and the small form fields (initial_prompt <= 1000 chars).
MULTIPART_SLACK = 64 * 1024
KEY_CACHE_MAX = 4096  # keys whose recent load the pre-body gate remembers


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
    backlog = await st.runner.backlog.seconds(max_age_s)
    limit = st.settings.limits.max_backlog_s
    if backlog + audio_s > limit:
        retry = st.retry_after_s(backlog + audio_s - limit)
        st.metrics.rejected.labels("backlog").inc()
        raise Overloaded(
            f"the queue holds {backlog:.0f} s of audio (limit {limit:.0f} s); "
            f"retry in about {retry} s", headers={"Retry-After": str(retry)},
            retry_after_s=retry, backlog_s=round(backlog, 1), limit_s=limit,
            limit="max_backlog_s",
        )


async def key_load(st: AppState, owner: str | None, max_age_s: float = 0.0) -> tuple[float, int]:
    """One key's queued + running audio seconds (each job at least ``min_job_s``) and jobs,
    including admissions not committed yet; a store answer up to ``max_age_s`` old may do."""
    now = time.monotonic()
    cached = st.key_load.get(owner)
    if max_age_s > 0 and cached is not None and now - cached[0] <= max_age_s:
        seconds, jobs = cached[1], cached[2]
    else:
        seconds, jobs = await st.store.owner_load(owner)
        st.key_load[owner] = (now, seconds, jobs)
        if len(st.key_load) > KEY_CACHE_MAX:  # keys come and go: keep the newest answers
            for k in sorted(st.key_load, key=lambda k: st.key_load[k][0])[:KEY_CACHE_MAX // 2]:
                del st.key_load[k]
    return seconds + st.key_admitting_s[owner], jobs + st.key_admitting_jobs[owner]


async def admit_key(st: AppState, owner: str | None, cost_s: float, max_age_s: float = 0.0) -> None:
    """429 (Retry-After, naming the limit) when this API key already holds its share: so one
    key flooding the service cannot fill the global backlog and push every other key into
    429s. Only with keys configured: without them every caller is the one tenant."""
    if not st.settings.security.api_key_sha256:
        return
    lim = st.settings.limits
    seconds, jobs = await key_load(st, owner, max_age_s)
    if jobs + 1 > lim.max_queued_jobs_per_key:
        retry = st.retry_after_s(st.settings.min_job_s())
        st.metrics.rejected.labels("key_jobs").inc()
        raise Overloaded(
            f"this API key has {jobs} jobs queued or running (limit "
            f"{lim.max_queued_jobs_per_key} per key); retry in about {retry} s",
            headers={"Retry-After": str(retry)}, retry_after_s=retry,
            limit="max_queued_jobs_per_key", limit_jobs=lim.max_queued_jobs_per_key, jobs=jobs)
    if seconds + cost_s > lim.max_queued_s_per_key:
        retry = st.retry_after_s(seconds + cost_s - lim.max_queued_s_per_key)
        st.metrics.rejected.labels("key_audio").inc()
        raise Overloaded(
            f"this API key has {seconds:.0f} s of audio queued or running (limit "
            f"{lim.max_queued_s_per_key:.0f} s per key); retry in about {retry} s",
            headers={"Retry-After": str(retry)}, retry_after_s=retry,
            limit="max_queued_s_per_key", limit_s=lim.max_queued_s_per_key,
            queued_s=round(seconds, 1))


def cost_of(st: AppState, audio_s: float) -> float:
    """What a job costs in every budget: its audio, but at least one padded window."""
    return max(audio_s, st.settings.min_job_s())


@asynccontextmanager
async def admitted(st: AppState, audio_s: float, owner: str | None = None) -> AsyncIterator[None]:
    """Admit a job of ``audio_s`` for ``owner`` (or raise 429) and count it in the backlogs
    until the job is committed.

    Uploads arriving together would otherwise all read the same backlog from the store and all
    fit. Checks run one at a time, each seeing the reservations of those before it; the commits
    (an S3 put each, with that blob store) run outside the lock.
    """
    cost = cost_of(st, audio_s)
    async with st.admission:
        await admit_key(st, owner, cost)
        await admit(st, cost)
        st.runner.backlog.admitting_s += cost
        st.key_admitting_s[owner] += cost
        st.key_admitting_jobs[owner] += 1
    try:
        yield
    finally:
        st.runner.backlog.admitting_s -= cost
        st.key_admitting_s[owner] -= cost
        st.key_admitting_jobs[owner] -= 1
        if st.key_admitting_jobs[owner] <= 0:
            del st.key_admitting_s[owner], st.key_admitting_jobs[owner]
        st.key_load.pop(owner, None)  # the committed job is in the store: read it next time


class BacklogGate:
    """An upload (``GATED_PATHS``) while the backlog (or the caller's key's share) is already
    full: 429 before the body is read.

    In a burst the rejected clients then cost a header each, not an upload spooled to disk and
    probed only to be refused. The exact check (with the upload's duration) is in the endpoint.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GATED_PATHS:
            st: AppState | None = getattr(scope["app"].state, "bs", None)
            if st is not None and st.ready:
                owner = scope.get("state", {}).get("owner")  # set by the API key check
                try:
                    cost = cost_of(st, MIN_UPLOAD_S)
                    await admit_key(st, owner, cost, GATE_MAX_AGE_S)
                    await admit(st, cost, GATE_MAX_AGE_S)
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
