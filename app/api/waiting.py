"""Synchronous routes (/asr, /detect-language): wait for a job, cancel it if the client leaves.

Clients of these APIs hold the request open until the answer; nobody can collect the answer of
a call whose client hung up (it retries and would pay twice), so the job is cancelled then, as
the OpenAI route does. The wait follows the job as every stream does (``Door.follow``,
app/jobs/events.py): a job ending here wakes it at once, one run by another replica is seen
when its feed next reads the store (every ``RECHECK_S``).
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from app.api.errors import Restarting, StillRunning
from app.errors import Conflict, TranscriptionFailed, public_error
from app.jobs.door import Door, JobView

__all__ = ["Conflict", "Restarting", "StillRunning", "ended_or_gone", "wait_for_job"]


async def _until_over(d: Door, job_id: str, owner: str | None, timeout_s: float) -> None:
    with d.follow(job_id, owner) as sub:
        await sub.until_over(timeout_s)


async def ended_or_gone(request: Request, d: Door, job_id: str, owner: str | None,
                        timeout_s: float) -> tuple[JobView | None, bool]:
    """Wait until the job ends (here or on another replica), the client disconnects or
    ``timeout_s`` passes: the job then, and whether the client left."""
    waiting = asyncio.create_task(_until_over(d, job_id, owner, timeout_s))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiting, gone):
            t.cancel()
        await asyncio.gather(waiting, gone, return_exceptions=True)
    return await d.get(job_id, owner), gone.done() and not gone.cancelled()


async def wait_for_job(request: Request, d: Door, job_id: str, owner: str | None) -> JobView:
    """The job once it is done; else the error to answer (:class:`ServiceError`)."""
    timeout_s = d.settings.limits.sync_timeout_s
    row, left = await ended_or_gone(request, d, job_id, owner, timeout_s)
    if row is None:
        raise StillRunning(f"job {job_id} no longer exists", job_id=job_id)
    if not row.ended and (left or d.stopped):
        await d.cancel(job_id, owner)  # nobody will collect it: the client left, or retries elsewhere
        if left:
            raise Conflict(f"the client disconnected; job {job_id} was cancelled", job_id=job_id)
        raise Restarting("the service is restarting; retry the request", job_id=job_id,
                         retry_after=1)
    if row.status == "done" and row.result is not None:
        return row
    if row.status == "failed":
        err = public_error(row.error) or {}
        raise TranscriptionFailed(str(err.get("message", "transcription failed")), job_id=job_id,
                                  cause=err.get("type"))
    if row.status == "cancelled":
        raise Conflict(f"job {job_id} was cancelled", job_id=job_id, status="cancelled")
    raise StillRunning(
        f"the transcription is still running after {timeout_s:.0f} s; it "
        f"continues as job {job_id} (GET /jobs/{job_id})", job_id=job_id,
        status_url=f"/jobs/{job_id}")


async def _disconnected(request: Request) -> None:
    # The body is fully read (the form is parsed): the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
