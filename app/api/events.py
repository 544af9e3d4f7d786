"""GET /jobs/{id}/events: a job's progress as Server-Sent Events, until it ends.

Event-driven: the stream sleeps on an event the job runner sets when the job changes (claimed,
decoded, a window done, ended), then sends a snapshot if anything changed. The keep-alive
timeout doubles as the fallback for a job running on another replica (whose progress reaches
this one through the store's heartbeat) and lets a vanished client be noticed on the next write.

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

from app.api.deps import Caller, caller, load_job, state, to_job
from app.jobs.store import TERMINAL
from app.schemas import ErrorBody
from app.state import AppState

router = APIRouter(tags=["jobs"])
KEEPALIVE_S = 15.0
RETRY_MS = 2000  # what EventSource waits before reconnecting after a dropped stream


def sse(event: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@router.get(
    "/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={404: {"model": ErrorBody},
               200: {"content": {"text/event-stream": {}},
                     "description": "progress events, then one done/failed/cancelled event"}},
)
async def job_events(job_id: str, st: AppState = Depends(state),
                     who: Caller = Depends(caller)) -> StreamingResponse:
    await load_job(st, job_id, who)  # the owner check: another tenant's job is a plain 404
    return StreamingResponse(
        _stream(st, job_id), media_type="text/event-stream",
        # no-transform / X-Accel-Buffering: proxies must not buffer or compress the stream.
        headers={"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"},
    )


async def _stream(st: AppState, job_id: str) -> AsyncIterator[bytes]:
    yield f"retry: {RETRY_MS}\n\n".encode()
    seq = 0
    last: dict[str, Any] | None = None
    with st.runner.watch(job_id) as changed:
        while True:
            changed.clear()  # before reading: a change during the read wakes the next wait
            row = await st.store.get(job_id)
            if row is None:  # deleted meanwhile (results expire)
                yield sse("error", {"id": job_id, "message": "the job no longer exists"})
                return
            job = to_job(row, st)
            snap = {"id": job.id, "status": job.status,
                    "windows_done": job.progress.windows_done,
                    "windows_total": job.progress.windows_total,
                    "audio_seconds": job.audio_seconds}
            if snap != last:
                seq += 1
                yield sse("progress", snap, seq)
                last = snap
            if row.status in TERMINAL:
                seq += 1
                yield sse(row.status, job.model_dump(mode="json", exclude={"result"}), seq)
                return
            if st.runner.stopped:  # draining: end the stream so shutdown is not held open;
                return  # the client reconnects (retry) to a replica that has the job
            try:
                await asyncio.wait_for(changed.wait(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
