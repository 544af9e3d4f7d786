"""Job status, results in five formats, listing and cancellation."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.api.deps import Caller, caller, cue_query, door, load_job
from app.api.schemas import ErrorBody, Job, JobList, to_job
from app.errors import BadRequest, Conflict, NotFound, public_error
from app.jobs.door import Door
from app.results.formats import MEDIA_TYPES, CueOptions, Format, render

router = APIRouter(tags=["jobs"])
NOT_FOUND: dict[int | str, dict[str, object]] = {404: {"model": ErrorBody}}


# Ids per request: 100 ids (24 characters and a comma each) keep even a maliciously encoded URL
# (12 bytes per character at worst) under the HTTP parser's ~64 KiB request line, past which
# the server answers a plain-text 400 before the app runs.
MAX_IDS = 100
ID_CHARS = 24
# The backlog headers may be this old (as the pre-body gate's): under load that query cost CPU.
BACKLOG_MAX_AGE_S = 0.5


@router.get("/jobs", response_model=JobList, responses={400: {"model": ErrorBody}})
async def list_jobs(
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ids: Annotated[str | None, Query(
        max_length=MAX_IDS * (ID_CHARS + 1), pattern=r"^[A-Za-z0-9_,-]*$",
        description=f"Comma-separated job ids (at most {MAX_IDS}): these of your jobs, in this "
        "order, unknown ones left out, instead of the newest. A client following many jobs polls "
        "them in one request rather than holding a connection per job.",
    )] = None,
    d: Door = Depends(door), who: Caller = Depends(caller),
) -> JobList:
    """Your jobs, newest first (or the ``ids`` asked for). The headers ``X-Backlog-Seconds`` and
    ``X-Backlog-Limit-Seconds`` give the queued audio and the bound past which uploads get 429:
    what a batch client sizes its uploads in flight by."""
    if ids is None:
        rows = await d.jobs(who.owner, limit)
    else:
        wanted = list(dict.fromkeys(i for i in (p.strip() for p in ids.split(",")) if i))
        if len(wanted) > MAX_IDS:
            raise BadRequest(f"at most {MAX_IDS} ids per request", field="ids",
                             headers={"x-should-retry": "false"})
        found = {r.id: r for r in await d.some(wanted, who.owner)}
        rows = [found[i] for i in wanted if i in found]
    backlog = await d.backlog_s(BACKLOG_MAX_AGE_S)
    response.headers["X-Backlog-Seconds"] = f"{backlog:.1f}"
    response.headers["X-Backlog-Limit-Seconds"] = f"{d.settings.limits.max_backlog_s:.0f}"
    return JobList(jobs=[to_job(r) for r in rows])


@router.get("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def get_job(job_id: str, d: Door = Depends(door), who: Caller = Depends(caller)) -> Job:
    return to_job(await load_job(d, job_id, who))


@router.get(
    "/jobs/{job_id}/result",
    responses={**NOT_FOUND, 409: {"model": ErrorBody},
               200: {"content": {t: {} for t in MEDIA_TYPES.values()}}},
)
async def get_result(
    job_id: str,
    format: Annotated[Format, Query()] = "json",
    cue: CueOptions = Depends(cue_query),
    d: Door = Depends(door), who: Caller = Depends(caller),
) -> Response:
    job = await load_job(d, job_id, who)
    if job.status != "done" or job.result is None:
        raise Conflict(f"job {job_id} is {job.status}; the result exists once it is done",
                       status=job.status, error=public_error(job.error))
    if format == "json":
        return JSONResponse(job.result)
    return PlainTextResponse(render(job.result, format, cue), media_type=MEDIA_TYPES[format])


@router.delete("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def cancel_job(job_id: str, d: Door = Depends(door),
                     who: Caller = Depends(caller)) -> Job:
    """Cancel a queued or running job; its windows not yet run cost nothing. Idempotent."""
    job = await d.cancel(job_id, who.owner)
    if job is None:  # or another tenant's: "not found", not "forbidden"
        raise NotFound(f"no job {job_id!r}", job_id=job_id)
    return to_job(job)
