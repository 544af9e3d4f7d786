"""What the core shows of a job: its store row as its owner may see it, with this replica's
live progress. A plain value: HTTP renders it (app/api/native/protocol.py), event streams carry it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.jobs.store import TERMINAL, JobRow
from app.speakers.named import public_options

__all__ = ["TERMINAL", "JobView"]


@dataclass(frozen=True)
class JobView:
    """A job as its owner sees it: the store's row, with this replica's live progress (its
    known speakers by name: their voices stay in the store)."""

    id: str
    owner: str | None
    status: str
    filename: str | None
    options: dict[str, Any]
    created_at: float
    started_at: float | None
    finished_at: float | None
    audio_seconds: float
    windows_done: int
    windows_total: int | None
    queue_wait_s: float | None
    processing_s: float | None
    diarization_s: float | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    callback_url: str | None = None
    webhook_status: str | None = None
    webhook_attempts: int | None = None
    webhook_next_at: float | None = None
    webhook_last_error: str | None = None
    webhook_delivered_at: float | None = None
    fetched_bytes: int | None = None  # an audio_url job's download so far (status "fetching")

    @classmethod
    def of(cls, row: JobRow, live: tuple[int, int | None] | None = None) -> JobView:
        done, total = live if live else (row.windows_done, row.windows_total)
        return cls(
            id=row.id, owner=row.owner, status=row.status, filename=row.filename,
            options=public_options(row.options), created_at=row.created_at,
            started_at=row.started_at, finished_at=row.finished_at,
            audio_seconds=row.audio_seconds, windows_done=done,
            windows_total=total, queue_wait_s=row.queue_wait_s, processing_s=row.processing_s,
            diarization_s=row.diarization_s, result=row.result, error=row.error,
            callback_url=row.callback_url, webhook_status=row.webhook_status,
            webhook_attempts=row.webhook_attempts, webhook_next_at=row.webhook_next_at,
            webhook_last_error=row.webhook_last_error,
            webhook_delivered_at=row.webhook_delivered_at)

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL
