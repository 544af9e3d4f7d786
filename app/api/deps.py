"""Shared request helpers: the app state and job lookups."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from app.errors import NotFound, NotReady, public_error
from app.jobs.store import JobRow
from app.schemas import Job, Progress, Transcription, WebhookState
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
        processing_s=row.processing_s, rtf=rtf,
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
