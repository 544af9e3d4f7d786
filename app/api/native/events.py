"""GET /jobs/{id}/events: a job's progress as Server-Sent Events, until it ends.

Event-driven and shared: every stream on a job follows its one feed (``Door.follow``,
app/jobs/events.py), which reads the store when the job runner says the job changed (claimed,
decoded, a window done, ended), or every ``RECHECK_S`` for a job running on another replica.
Streams are capped per API key (``limits.max_event_streams_per_key``, 429). A keep-alive
comment after ``KEEPALIVE_S`` without news lets a vanished client be noticed on the next write.

Events: ``progress`` (status, windows_done, windows_total) while queued or running, then one
final event named after the final status (``done``, ``failed``, ``cancelled``) carrying the job
without its transcript, and the stream closes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.api.deps import Caller, caller, door, load_job
from app.api.errors import ErrorBody
from app.api.native.protocol import to_job
from app.jobs.door import Door, Subscription

router = APIRouter(tags=["jobs"])
RETRY_MS = 2000  # what EventSource waits before reconnecting after a dropped stream
KEEPALIVE_S = 15.0  # a comment line this long after the last event: proxies keep the stream


def sse(event: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={404: {"model": ErrorBody}, 429: {"model": ErrorBody},
               200: {"content": {"text/event-stream": {}},
                     "description": "progress events, then one done/failed/cancelled event"}},
)
async def job_events(job_id: str, d: Door = Depends(door),
                     who: Caller = Depends(caller)) -> StreamingResponse:
    await load_job(d, job_id, who)  # the owner check: another tenant's job is a plain 404
    sub = d.follow(job_id, who.owner, capped=True)  # 429 past the key's stream cap
    return FeedResponse(
        _stream(sub), sub, media_type="text/event-stream",
        # no-transform / X-Accel-Buffering: proxies must not buffer or compress the stream.
        headers={"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"},
    )


async def _stream(sub: Subscription) -> AsyncIterator[bytes]:
    """This stream's view of the job's shared feed: the newest snapshot it has not sent, then
    the final event; a keep-alive comment after ``KEEPALIVE_S`` without news."""
    feed = sub.feed
    yield f"retry: {RETRY_MS}\n\n".encode()
    seq = sent = 0
    while True:
        sub.wake.clear()  # before reading: a change meanwhile wakes the next wait
        if feed.version > sent:
            seq += 1
            sent = feed.version
            yield sse("progress", feed.progress, seq)
        if feed.final is not None:
            seq += 1
            final = to_job(feed.final).model_dump(mode="json", exclude={"result"})
            yield sse(feed.final.status, final, seq)
            return
        if feed.gone:
            yield sse("error", {"id": feed.job_id, "message": "the job no longer exists"})
            return
        if feed.closed:  # draining: end the stream so shutdown is not held open;
            return  # the client reconnects (retry) to a replica that has the job
        try:
            async with asyncio.timeout(KEEPALIVE_S):  # not wait_for: see app/jobs/webhooks.py
                await sub.wake.wait()
        except TimeoutError:
            yield b": keep-alive\n\n"


class FeedResponse(StreamingResponse):
    """A stream whose subscription is released however it ends (the client may leave before
    the body iterator ever starts, and then a generator's ``finally`` never runs)."""

    def __init__(self, content: AsyncIterator[bytes], sub: Subscription, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.sub = sub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sub.release()
