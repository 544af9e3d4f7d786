"""``Idempotency-Key`` on POST /transcribe, /v1/audio/transcriptions and /v1/audio/translations.

The same key from the same caller (API key owner, or the single keyless tenant) within
``storage.idempotency_window_s`` (24 h) names the first job instead of making a new one: a
client that lost the answer to its POST (a timeout, a crash, a resumed ``batchscribe dataset``
run) sends it again and gets that job, never a second transcription of the same file.

* Storage: the job row holds ``sha256(owner NUL key)`` under a unique index (migration 0004).
  The owner is part of the digest, so tenants' keys never meet, and the keyless tenant (owner
  NULL, which a unique index over (owner, key) would not constrain: NULLs are distinct) is
  covered by the same index. The row is inserted with its digest in one statement, so a job and
  its key exist together or not at all.
* Two POSTs with one key at once: both miss the lookup and spool their upload; the second INSERT
  violates the unique index, and that request answers with the first one's job, its own upload
  dropped (:func:`commit`).
* POST /transcribe: :class:`IdempotencyGate` looks the key up before the body is read, and a
  known key is answered as the route would answer (202 with the job; ``?wait=true`` waits). The
  upload is read and thrown away, never spooled, probed or stored: answering before reading it
  would make the server close a connection with unread bytes, which resets it under the client
  (it may never see the answer). A replay bypasses the backlog gate: it adds no work.
* /v1 needs its form fields (``response_format``) to answer, so its lookup runs after the form is
  parsed, still before spooling. A /v1 request with a key keeps its job when the client hangs up
  (without one the job is cancelled: nobody could collect it; with one, the retry will).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

import sqlalchemy as sa
from fastapi import FastAPI, Header
from starlette.datastructures import QueryParams
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.deps import job_answer
from app.api.limits import MULTIPART_SLACK, declared_length, send_error, too_large
from app.errors import BadRequest
from app.jobs.store import JobRow
from app.state import AppState

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
REPLAYED = "Idempotent-Replayed"  # response header on an answer that names an earlier job
GATED = frozenset({"/transcribe"})
TRUE = frozenset({"1", "true", "on", "yes"})
FALSE = frozenset({"0", "false", "off", "no"})

KeyHeader = Annotated[str | None, Header(
    alias=HEADER,
    description="The same key from the same caller within 24 h answers with the first job made "
    "with it instead of making a new one: a retry after a lost answer is not transcribed twice.",
)]


def parse_key(raw: str | None) -> str | None:
    """The key of a header value; None when absent. 400 (not retryable) when malformed.

    A structured-field string (``"abc"``, as the IETF draft writes it) and a bare token (as
    Stripe's clients send it) name the same key.
    """
    if raw is None:
        return None
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    if not key or len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise BadRequest(f"{HEADER} must be 1-{MAX_KEY_CHARS} printable ASCII characters",
                         field=HEADER, headers={"x-should-retry": "false"})
    return key


def digest(owner: str | None, key: str) -> str:
    return hashlib.sha256(f"{owner or ''}\0{key}".encode()).hexdigest()


async def find(st: AppState, owner: str | None, key: str) -> JobRow | None:
    """The caller's job made under ``key`` within the window, if any."""
    since = time.time() - st.settings.storage.idempotency_window_s
    row = await st.store.by_idempotency_key(digest(owner, key), since)
    return row if row is not None and row.owner == owner else None


async def commit(st: AppState, owner: str | None, key: str | None,
                 submit: Callable[[str | None], Awaitable[None]]) -> str | None:
    """Run ``submit(digest)`` (the job's INSERT). None when it committed; the first job's id when
    a request with the same key committed first (the unique index refused this one)."""
    if key is None:
        await submit(None)
        return None
    try:
        await submit(digest(owner, key))
    except sa.exc.IntegrityError:
        first = await find(st, owner, key)
        if first is None:  # not our index: a real error
            raise
        return first.id
    return None


class IdempotencyGate:
    """POST /transcribe with a known key: the first job's answer, the body never spooled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        st: AppState | None = getattr(scope["app"].state, "bs", None) if scope["type"] == "http" else None
        raw = _header(scope) if st is not None and scope["method"] == "POST" else None
        if st is None or raw is None or scope["path"] not in GATED or not st.ready:
            await self.app(scope, receive, send)
            return
        try:
            key = parse_key(raw)
        except BadRequest as exc:
            await send_error(send, exc, scope["path"])
            return
        wait = QueryParams(scope.get("query_string", b"").decode("latin-1")).get("wait", "false")
        owner = scope.get("state", {}).get("owner")  # set by the API key middleware, outside
        first = await find(st, owner, key) if key and wait.lower() in TRUE | FALSE else None
        if first is None:  # unknown key (or a request the route must reject): the normal path
            await self.app(scope, receive, send)
            return
        limit = st.settings.limits.max_upload_bytes
        if not await _discard_body(scope, receive, limit + MULTIPART_SLACK):
            await send_error(send, too_large(limit), scope["path"])
            return
        answer = await job_answer(st, first.id, wait.lower() in TRUE, replayed=True)
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


def install_idempotency(app: FastAPI) -> None:
    """Inside the API key check (the owner is known), outside the backlog gate (a replay adds
    no work, so a full backlog must not refuse it)."""
    app.add_middleware(IdempotencyGate)
