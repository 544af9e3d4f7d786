"""Upload bodies handed to the form parser in blocks of 1 MiB, not as the socket delivers them.

Starlette's multipart parser writes every body message of a file part to the part's spooled
temporary file, and once that file has rolled over to disk (past 1 MiB) every write is a hop to
a worker thread (``run_in_threadpool``: a task, a thread hand-off and a wake-up of the loop).
uvicorn hands the app a body message per socket read, ~250 KiB on a local link here (asyncio's
read size): 153 messages, so 153 hops, for one 20-minute 16 kHz WAV (38 MB). In py-spy of the
service while such uploads were posted (stand-in engine, this 2-core host) ``UploadFile.write``
and its hops held more samples of ``POST /transcribe`` than the parser itself.

Joined into blocks of :data:`BLOCK`, the same upload is 37 writes. Posted with curl
(``?wait=false``) to the feed bench's service, 12 times each in turn with the tree before:
median 0.115 -> 0.098 s, min 0.087 -> 0.082 s from the first byte to the 202. The cost is
one block of memory per upload in flight, and a trickling client's bytes reach the parser a
block at a time (its limits are counted before this layer, as the bytes arrive:
app/api/middleware/limits.py).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.middleware.limits import UPLOAD_PATHS, content_type

BLOCK = 1 << 20  # Starlette's own spool threshold: smaller blocks only add hops


def coalescing(receive: Receive, block: int = BLOCK) -> Receive:
    """``receive`` with consecutive body messages joined until ``block`` bytes or the body's
    end. Any other message (``http.disconnect``) is passed on at once: the client left, and
    the bytes held back for it are of no use."""

    async def coalesced() -> Message:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            body: bytes = message.get("body", b"")
            more = bool(message.get("more_body", False))
            if not parts and (not more or len(body) >= block):
                return message
            parts.append(body)
            size += len(body)
            if not more or size >= block:
                return {"type": "http.request", "body": b"".join(parts), "more_body": more}

    return coalesced


class CoalesceBody:
    """Multipart POSTs to the audio routes (``UPLOAD_PATHS``) get :func:`coalescing` bodies;
    everything else passes untouched."""

    def __init__(self, app: ASGIApp, block: int = BLOCK) -> None:
        self.app = app
        self.block = block

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in UPLOAD_PATHS
                and content_type(scope) == "multipart/form-data"):
            receive = coalescing(receive, self.block)
        await self.app(scope, receive, send)
