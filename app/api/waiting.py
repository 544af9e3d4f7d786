"""Synchronous routes (/asr, /detect-language): wait for a job, cancel it if the client leaves.

Clients of these APIs hold the request open until the answer; nobody can collect the answer of
a call whose client hung up (it retries and would pay twice), so the job is cancelled then, as
the OpenAI route does. A job run by another replica ends there: this replica notices through
the store, re-read every ``RECHECK_S`` (a job ending here wakes the wait at once).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from app.errors import Conflict, ServiceError, TranscriptionFailed
from app.jobs.store import TERMINAL, JobRow
from app.state import AppState

RECHECK_S = 15.0


class StillRunning(ServiceError):
    status_code = 504
    error_type = "timeout"


class Restarting(ServiceError):
    status_code = 503
    error_type = "shutting_down"


async def ended_or_gone(request: Request, st: AppState, job_id: str, timeout_s: float
                        ) -> tuple[JobRow | None, bool]:
    """Wait until the job ends (here or on another replica), the client disconnects or
    ``timeout_s`` passes: the job's row then, and whether the client left."""
    waiting = asyncio.create_task(_until_ended(st, job_id, timeout_s))
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (waiting, gone):
            t.cancel()
        await asyncio.gather(waiting, gone, return_exceptions=True)
    return await st.store.get(job_id), gone.done() and not gone.cancelled()


async def wait_for_job(request: Request, st: AppState, job_id: str) -> JobRow:
    """The job once it is done; else the error to answer (:class:`ServiceError`)."""
    row, left = await ended_or_gone(request, st, job_id, st.settings.limits.sync_timeout_s)
    if row is None:
        raise StillRunning(f"job {job_id} no longer exists", job_id=job_id)
    if row.status not in TERMINAL and (left or st.runner.stopped):
        await st.runner.cancel(row)  # nobody will collect it: the client left, or retries elsewhere
        if left:
            raise Conflict(f"the client disconnected; job {job_id} was cancelled", job_id=job_id)
        raise Restarting("the service is restarting; retry the request", job_id=job_id,
                         headers={"Retry-After": "1"})
    if row.status == "done" and row.result is not None:
        return row
    if row.status == "failed":
        err = row.error or {}
        raise TranscriptionFailed(str(err.get("message", "transcription failed")), job_id=job_id,
                                  cause=err.get("type"))
    if row.status == "cancelled":
        raise Conflict(f"job {job_id} was cancelled", job_id=job_id, status="cancelled")
    raise StillRunning(
        f"the transcription is still running after {st.settings.limits.sync_timeout_s:.0f} s; it "
        f"continues as job {job_id} (GET /jobs/{job_id})", job_id=job_id,
        status_url=f"/jobs/{job_id}")


async def _until_ended(st: AppState, job_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and not st.runner.stopped:
        await st.runner.wait(job_id, min(left, RECHECK_S))
        row = await st.store.get(job_id)
        if row is None or row.status in TERMINAL:
            return


async def _disconnected(request: Request) -> None:
    # The body is fully read (the form is parsed): the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
