"""The job API's response shapes (what /docs shows), and a job as the API renders it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.errors import public_error
from app.jobs.door import JobView
from app.results.shapes import Transcription, absent

JobStatus = Literal["fetching", "queued", "running", "done", "failed", "cancelled"]


class WebhookState(BaseModel):
    url: str
    status: Literal["waiting", "pending", "delivered", "failed"] = Field(
        description="waiting: the job has not ended; pending: being delivered or retried."
    )
    attempts: int = 0
    next_attempt_at: float | None = None
    last_error: str | None = None
    delivered_at: float | None = None


class Progress(BaseModel):
    windows_done: int
    windows_total: int | None = Field(None, description="Known once the upload is decoded.")
    fetched_bytes: int | None = Field(
        None, exclude_if=absent, description="status fetching (an audio_url job): bytes downloaded so far.")


class ErrorInfo(BaseModel):
    type: str
    message: str


class Job(BaseModel):
    id: str
    status: JobStatus
    status_url: str
    result_url: str
    filename: str | None
    options: dict[str, Any]
    created_at: float
    started_at: float | None
    finished_at: float | None
    progress: Progress
    audio_seconds: float
    queue_wait_s: float | None = Field(None, description="Accepted until work started.")
    processing_s: float | None = Field(None, description="Work started until finished.")
    diarization_s: float | None = Field(
        None, exclude_if=absent,
        description="diarize=true: wall seconds of the job's speaker work, which runs beside its "
        "transcription (included in processing_s, not added to it).")
    rtf: float | None = Field(None, description="Real-time factor: audio s / processing s.")
    result: Transcription | None = None
    error: dict[str, Any] | None = None
    webhook: WebhookState | None = Field(None, description="Only for jobs with a callback_url.")


class JobList(BaseModel):
    jobs: list[Job]


class ErrorBody(BaseModel):
    error: ErrorInfo


def to_job(view: JobView, base: str = "") -> Job:
    rtf = None
    if view.status == "done" and view.processing_s:
        rtf = round(view.audio_seconds / view.processing_s, 3)
    return Job(
        id=view.id, status=view.status,  # type: ignore[arg-type]
        status_url=f"{base}/jobs/{view.id}", result_url=f"{base}/jobs/{view.id}/result",
        filename=view.filename, options=view.options, created_at=view.created_at,
        started_at=view.started_at, finished_at=view.finished_at,
        progress=Progress(windows_done=view.windows_done, windows_total=view.windows_total,
                          fetched_bytes=view.fetched_bytes),
        audio_seconds=view.audio_seconds, queue_wait_s=view.queue_wait_s,
        processing_s=view.processing_s, diarization_s=view.diarization_s, rtf=rtf,
        result=Transcription.model_validate(view.result) if view.result else None,
        error=public_error(view.error), webhook=webhook_state(view),
    )


def webhook_state(view: JobView) -> WebhookState | None:
    if not view.callback_url:
        return None
    return WebhookState(
        url=view.callback_url, status=view.webhook_status or "waiting",  # type: ignore[arg-type]
        attempts=view.webhook_attempts or 0,
        next_attempt_at=view.webhook_next_at if view.webhook_status == "pending" else None,
        last_error=view.webhook_last_error, delivered_at=view.webhook_delivered_at,
    )
