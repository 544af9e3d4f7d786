"""The native job API's routes: ``POST /transcribe`` (a multipart form, or the same fields as a
JSON object with an ``audio_url``: app/api/json_form.py), and ``/jobs``: status, results in six
formats (rttm: diarized jobs), listing and cancellation. Each route parses its request and hands
it to serving.py; the job's progress as Server-Sent Events is events.py."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, Response, UploadFile
from fastapi.responses import JSONResponse

from app.api import idempotency
from app.api.deps import Caller, caller, cue_query, door, load_job, ready_door
from app.api.errors import ErrorBody
from app.api.json_form import JsonFormRoute
from app.api.native.protocol import (
    CHANNELS_HELP,
    DIARIZE_HELP,
    ID_CHARS,
    IDS_HELP,
    LANGUAGE_DETECTION_HELP,
    MAX_IDS,
    Job,
    JobList,
    parse_ids,
    to_job,
)
from app.api.native.serving import TranscribeRequest, job_answer, result_answer, start_job
from app.api.uploads import HOTWORDS_HELP, MAX_SPEAKERS
from app.errors import BadRequest, NotFound
from app.jobs.door import Door
from app.results.formats import MEDIA_TYPES, CueOptions, Format
from app.speakers.limits import MAX_KNOWN

__all__ = ["job_answer", "router", "transcribe_router"]

transcribe_router = APIRouter(tags=["transcription"], route_class=JsonFormRoute)
router = APIRouter(tags=["jobs"])

ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorBody} for code in (400, 413, 415, 422, 429, 502, 503)
}
NOT_FOUND: dict[int | str, dict[str, object]] = {404: {"model": ErrorBody}}
# The backlog headers may be this old (as the pre-body gate's): under load that query cost CPU.
BACKLOG_MAX_AGE_S = 0.5


@transcribe_router.post("/transcribe", status_code=202, response_model=Job, responses=ERRORS,
                        form_limits={"max_files": 1 + MAX_KNOWN})  # the upload and references
async def transcribe(
    request: Request,
    file: Annotated[UploadFile | None, File(
        description="Audio: wav, flac, mp3, ogg, m4a, webm. Or audio_url instead.")] = None,
    language: Annotated[str | None, Form(description="ISO 639-1; detected when absent.")] = None,
    language_detection: Annotated[Literal["per_upload", "per_window"], Form(
        description=LANGUAGE_DETECTION_HELP)] = "per_upload",
    task: Annotated[Literal["transcribe", "translate"], Form()] = "transcribe",
    beam_size: Annotated[int | None, Form(ge=1, le=10)] = None,
    initial_prompt: Annotated[str | None, Form(max_length=1000)] = None,
    hotwords: Annotated[str | None, Form(max_length=1000, description=HOTWORDS_HELP)] = None,
    temperature: Annotated[float, Form(ge=0, le=1, description="0: beam/greedy; > 0: sampling.")] = 0.0,
    word_timestamps: Annotated[bool, Form(description="Add word start/end times.")] = False,
    diarize: Annotated[bool, Form(description=DIARIZE_HELP)] = False,
    num_speakers: Annotated[int | None, Form(
        ge=1, le=MAX_SPEAKERS, description="diarize: exactly this many speakers.")] = None,
    min_speakers: Annotated[int | None, Form(
        ge=1, le=MAX_SPEAKERS, description="diarize: at least this many speakers.")] = None,
    max_speakers: Annotated[int | None, Form(
        ge=1, le=MAX_SPEAKERS, description="diarize: at most this many speakers.")] = None,
    channels: Annotated[Literal["mix", "separate"], Form(description=CHANNELS_HELP)] = "mix",
    known_speaker_names: Annotated[list[str] | None, Form(
        description="diarize: names of known speakers, one per reference file, in order.")] = None,
    known_speaker_references: Annotated[list[UploadFile] | None, File(
        description="diarize: a clip of each known speaker alone (1.5-30 s; 2-10 s is plenty); "
        "speakers who match one are named after it (result.diarization.known_speakers: how "
        "similar each was).")] = None,
    callback_url: Annotated[str | None, Form(
        max_length=2048, description="POSTed the signed job summary when it ends (webhooks on).",
    )] = None,
    audio_url: Annotated[str | None, Form(
        max_length=2048, description="Instead of a file: an http(s):// or s3:// URL the service "
        "fetches (size and duration limits apply while it streams; private addresses only where "
        "the operator allows them).",
    )] = None,
    wait: Annotated[bool, Query(description="Answer with the finished job (200).")] = False,
    idempotency_key: idempotency.KeyHeader = None,
    d: Door = Depends(ready_door),
    who: Caller = Depends(caller),
) -> JSONResponse:
    # A key already known was answered before the body was read (idempotency.IdempotencyGate).
    key = idempotency.parse_key(idempotency_key)
    # The form takes 1 + MAX_KNOWN files (the references), but one audio file: FastAPI would keep
    # the last of several silently. The parsed form is cached: this reads nothing again.
    sent = len((await request.form()).getlist("file"))
    if sent > 1:
        raise BadRequest(f"one audio file per request: {sent} files were sent", field="file",
                         no_retry=True)
    return await start_job(d, who, TranscribeRequest(
        file, audio_url, language, language_detection, task, beam_size, initial_prompt,
        hotwords, temperature, word_timestamps, diarize, num_speakers, min_speakers,
        max_speakers, channels, known_speaker_names or [], known_speaker_references or [],
        callback_url, wait, key))


@router.get("/jobs", response_model=JobList, responses={400: {"model": ErrorBody}})
async def list_jobs(
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ids: Annotated[str | None, Query(
        max_length=MAX_IDS * (ID_CHARS + 1), pattern=r"^[A-Za-z0-9_,-]*$",
        description=IDS_HELP,
    )] = None,
    d: Door = Depends(door), who: Caller = Depends(caller),
) -> JobList:
    """Your jobs, newest first (or the ``ids`` asked for). The headers ``X-Backlog-Seconds`` and
    ``X-Backlog-Limit-Seconds`` give the queued audio and the bound past which uploads get 429:
    what a batch client sizes its uploads in flight by."""
    if ids is None:
        rows = await d.jobs(who.owner, limit)
    else:
        wanted = parse_ids(ids)
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
    responses={**NOT_FOUND, 400: {"model": ErrorBody}, 409: {"model": ErrorBody},
               200: {"content": {t: {} for t in MEDIA_TYPES.values()}}},
)
async def get_result(
    job_id: str,
    format: Annotated[Format, Query()] = "json",
    cue: CueOptions = Depends(cue_query),
    d: Door = Depends(door), who: Caller = Depends(caller),
) -> Response:
    return result_answer(await load_job(d, job_id, who), format, cue)


@router.delete("/jobs/{job_id}", response_model=Job, responses=NOT_FOUND)
async def cancel_job(job_id: str, d: Door = Depends(door),
                     who: Caller = Depends(caller)) -> Job:
    """Cancel a queued or running job; its windows not yet run cost nothing. Idempotent."""
    job = await d.cancel(job_id, who.owner)
    if job is None:  # or another tenant's: "not found", not "forbidden"
        raise NotFound(f"no job {job_id!r}", job_id=job_id)
    return to_job(job)
