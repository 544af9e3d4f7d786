"""The native job API's protocol: a job as it answers with it (what /docs shows), and how the
requests' own fields read (the ids of ``GET /jobs``, the help of ``POST /transcribe``'s form).

The routes are app/api/native/api_router.py; what they do with the door, serving.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.errors import BadRequest, public_error
from app.jobs.door import JobView
from app.results.shapes import Transcription, absent

# Ids per request: 100 ids (24 characters and a comma each) keep even a maliciously encoded URL
# (12 bytes per character at worst) under the HTTP parser's ~64 KiB request line, past which
# the server answers a plain-text 400 before the app runs.
MAX_IDS = 100
ID_CHARS = 24
IDS_HELP = (f"Comma-separated job ids (at most {MAX_IDS}): these of your jobs, in this order, "
            "unknown ones left out, instead of the newest. A client following many jobs polls "
            "them in one request rather than holding a connection per job.")
DIARIZE_HELP = ("Who spoke when: speaker (SPEAKER_00, SPEAKER_01, ...) on segments and words, "
                "segments split at speaker turns. Speaker models on CPU, loaded on first use.")
CHANNELS_HELP = ("separate: transcribe each channel of a multichannel upload (a call recording) "
                 "on its own, speaker = channel_0, channel_1, ..., merged in time order; a mono "
                 "upload is its one channel. mix (default): one mono downmix.")
LANGUAGE_DETECTION_HELP = (
    "Without a language: per_upload (the first speech decides for the whole upload) or "
    "per_window (each <= 30 s window its own: recordings that switch language; each segment "
    "carries its language).")


def parse_ids(ids: str) -> list[str]:
    """``ids=a,b,c`` as a list, duplicates and blanks dropped, in order; 400 past MAX_IDS."""
    wanted = list(dict.fromkeys(i for i in (p.strip() for p in ids.split(",")) if i))
    if len(wanted) > MAX_IDS:
        raise BadRequest(f"at most {MAX_IDS} ids per request", field="ids", no_retry=True)
    return wanted


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
