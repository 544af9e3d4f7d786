"""The job API's response shapes (what /docs shows), and a job as the API renders it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.results.shapes import Transcription, absent

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]


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
