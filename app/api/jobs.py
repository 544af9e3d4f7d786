"""Job status, results in four formats, listing and cancellation."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.api.deps import Caller, caller, load_job, state, to_job
from app.errors import Conflict, public_error
from app.formats import MEDIA_TYPES, render
from app.schemas import ErrorBody, Job, JobList
from app.state import AppState

router = APIRouter(tags=["jobs"])
NOT_FOUND: dict[int | str, dict[str, object]] = {404: {"model": ErrorBody}}


@router.get("/jobs", response_model=JobList)
async def list_jobs(
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    st: AppState = Depends(state), who: Caller = Depends(caller),
) -> JobList:
    return JobList(jobs=[to_job(r, st) for r in await st.store.list(who.owner, limit)])


@router.get("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def get_job(job_id: str, st: AppState = Depends(state), who: Caller = Depends(caller)) -> Job:
    return to_job(await load_job(st, job_id, who), st)


@router.get(
    "/jobs/{job_id}/result",
    responses={**NOT_FOUND, 409: {"model": ErrorBody},
               200: {"content": {t: {} for t in MEDIA_TYPES.values()}}},
)
async def get_result(
    job_id: str,
    format: Annotated[Literal["json", "text", "srt", "vtt"], Query()] = "json",
    st: AppState = Depends(state), who: Caller = Depends(caller),
) -> Response:
    job = await load_job(st, job_id, who)
    if job.status != "done" or job.result is None:
        raise Conflict(f"job {job_id} is {job.status}; the result exists once it is done",
                       status=job.status, error=public_error(job.error))
    if format == "json":
        return JSONResponse(job.result)
    return PlainTextResponse(render(job.result, format), media_type=MEDIA_TYPES[format])


@router.delete("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def cancel_job(job_id: str, st: AppState = Depends(state),
                     who: Caller = Depends(caller)) -> Job:
    """Cancel a queued or running job; its windows not yet run cost nothing. Idempotent."""
    job = await load_job(st, job_id, who)
    await st.runner.cancel(job)
    row = await st.store.get(job_id)
    assert row is not None
    return to_job(row, st)
