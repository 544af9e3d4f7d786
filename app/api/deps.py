"""Shared request helpers: the app state and job lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Form, Query, Request
from fastapi.responses import JSONResponse

from app.api.schemas import Job, Progress, Transcription, WebhookState
from app.errors import NotFound, NotReady, public_error
from app.jobs.store import TERMINAL, JobRow
from app.results.formats import LINE_CHARS, CueOptions
from app.state import AppState


def state(request: Request) -> AppState:
    st: AppState = request.app.state.bs
    return st


def ready_state(request: Request) -> AppState:
    st = state(request)
    if not st.ready:
        raise NotReady("the model is not loaded yet, or the service is shutting down")
    return st


@dataclass
class Caller:
    owner: str | None  # the API key's id; None when keys are off


def caller(request: Request) -> Caller:
    return Caller(getattr(request.state, "owner", None))


async def load_job(st: AppState, job_id: str, who: Caller) -> JobRow:
    job = await st.store.get(job_id)
    # Another tenant's job is "not found", not "forbidden": ids must not leak.
    if job is None or job.owner != who.owner:
        raise NotFound(f"no job {job_id!r}", job_id=job_id)
    return job


def to_job(row: JobRow, st: AppState, base: str = "") -> Job:
    live = st.runner.progress(row.id) if st.runner else None
    done, total = live if live else (row.windows_done, row.windows_total)
    rtf = None
    if row.status == "done" and row.processing_s:
        rtf = round(row.audio_seconds / row.processing_s, 3)
    return Job(
        id=row.id, status=row.status,  # type: ignore[arg-type]
        status_url=f"{base}/jobs/{row.id}", result_url=f"{base}/jobs/{row.id}/result",
        filename=row.filename, options=row.options, created_at=row.created_at,
        started_at=row.started_at, finished_at=row.finished_at,
        progress=Progress(windows_done=done, windows_total=total),
        audio_seconds=row.audio_seconds, queue_wait_s=row.queue_wait_s,
        processing_s=row.processing_s, diarization_s=row.diarization_s, rtf=rtf,
        result=Transcription.model_validate(row.result) if row.result else None,
        error=public_error(row.error), webhook=webhook_state(row),
    )


def webhook_state(row: JobRow) -> WebhookState | None:
    if not row.callback_url:
        return None
    return WebhookState(
        url=row.callback_url, status=row.webhook_status or "waiting",  # type: ignore[arg-type]
        attempts=row.webhook_attempts or 0,
        next_attempt_at=row.webhook_next_at if row.webhook_status == "pending" else None,
        last_error=row.webhook_last_error, delivered_at=row.webhook_delivered_at,
    )


# Subtitle cue options (srt, vtt, tsv), the same on every route that renders subtitles.
WIDTH_HELP = "Characters per subtitle line (srt, vtt)."
COUNT_HELP = "Lines per cue; a longer segment becomes several cues (srt, vtt, tsv). Unset: no limit."
CUE_S_HELP = "Longest cue in seconds; a longer segment becomes several cues (srt, vtt, tsv)."


def cue_query(
    max_line_width: Annotated[int, Query(ge=10, le=1000, description=WIDTH_HELP)] = LINE_CHARS,
    max_line_count: Annotated[int | None, Query(ge=1, le=20, description=COUNT_HELP)] = None,
    max_cue_s: Annotated[float | None, Query(ge=1, le=600, description=CUE_S_HELP)] = None,
) -> CueOptions:
    return CueOptions(max_line_width, max_line_count, max_cue_s)


def cue_form(
    max_line_width: Annotated[int, Form(ge=10, le=1000, description=WIDTH_HELP)] = LINE_CHARS,
    max_line_count: Annotated[int | None, Form(ge=1, le=20, description=COUNT_HELP)] = None,
    max_cue_s: Annotated[float | None, Form(ge=1, le=600, description=CUE_S_HELP)] = None,
) -> CueOptions:
    return CueOptions(max_line_width, max_line_count, max_cue_s)


async def job_answer(st: AppState, job_id: str, wait: bool, replayed: bool = False) -> JSONResponse:
    """POST /transcribe's answer for a committed job: 202 with the job, or with ``wait`` the job
    once it ends (200), or as it stands when the wait times out (202). ``replayed``: the job was
    made by an earlier request with the same Idempotency-Key (app/api/idempotency.py)."""
    if wait:
        # On timeout the job keeps running; the client gets 202 and polls status_url.
        await st.runner.wait(job_id, st.settings.limits.sync_timeout_s)
    row = await st.store.get(job_id)
    if row is None:  # expired between its commit (or lookup) and now
        raise NotFound(f"no job {job_id!r}", job_id=job_id)
    job = to_job(row, st)
    headers = {"Location": job.status_url}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    code = 200 if wait and row.status in TERMINAL else 202
    return JSONResponse(job.model_dump(mode="json"), status_code=code, headers=headers)
