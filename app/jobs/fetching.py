"""``audio_url`` jobs, answered at once: the download is part of the job.

The request is checked (the URL through the outbound guard, ``s3://`` against its buckets, the
key's transfer cap and share), the job row is committed as ``fetching`` and the client gets its
202 without waiting for a byte. The download then runs here, with its progress
(``fetched_bytes``), under the key's transfer hold (app/jobs/transfers.py); once it is complete
the audio is probed, admitted against the backlog bounds like an upload, put in the blob store
and the row turns ``queued`` (a job cancelled meanwhile stays cancelled). A download that fails
fails its job with the same error an upload would have got (429, 413, 415, 502...).

A row left ``fetching`` by a process that died is failed by the maintenance loop
(app/jobs/upkeep.py) once no download could still be running for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio.to_thread

from app import audio
from app.config import Settings
from app.errors import INTERNAL_MESSAGE, InvalidAudio, ServiceError
from app.jobs.admission import Admission
from app.jobs.door import Upload
from app.jobs.transfers import Hold
from app.net.fetch import check_audio_url, fetch_audio, file_name_of, recorded_url_of
from app.net.outbound import OutboundGuard

log = logging.getLogger(__name__)
RESTARTED = {"type": "fetch_failed", "message": "the service stopped while fetching audio_url; "
             "submit the job again"}

# (job id, spooled audio, audio seconds) -> queued (False: the job was cancelled meanwhile)
Queue = Callable[[str, Path, float], Awaitable[bool]]
# (job id, public error) -> the job failed, waiters and webhooks told
Fail = Callable[[str, dict[str, Any]], Awaitable[None]]


@dataclass
class Download:
    task: asyncio.Task[None]
    received: int = 0


class Fetches:
    """The downloads of ``fetching`` jobs running in this process."""

    def __init__(self, settings: Settings, outbound: OutboundGuard, admission: Admission,
                 queue: Queue, fail: Fail) -> None:
        self.settings = settings
        self._outbound = outbound
        self._admission = admission
        self._queue = queue
        self._fail = fail
        self.running: dict[str, Download] = {}

    async def check(self, up: Upload) -> tuple[str, Hold]:
        """Before the row: the URL (400), the key's transfer cap and share (429). The URL as
        the job records it, and the transfer's hold."""
        assert up.audio_url is not None
        url = await check_audio_url(self.settings, self._outbound, up.audio_url)
        await self._admission.gate(up.owner)  # the key's share, its transfers included
        return url, await self._admission.transfers.acquire(up.owner)

    @staticmethod
    def options_of(up: Upload, url: str) -> tuple[Any, str | None]:
        return replace(up.options, audio_url=recorded_url_of(url)), file_name_of(url)

    def start(self, job_id: str, up: Upload, url: str, dest: Path, hold: Hold) -> None:
        task = asyncio.create_task(self._run(job_id, up, url, dest, hold),
                                   name=f"fetch-{job_id}")
        self.running[job_id] = Download(task)

    def received(self, job_id: str) -> int | None:
        d = self.running.get(job_id)
        return d.received if d is not None else None

    def cancel(self, job_id: str) -> None:
        d = self.running.get(job_id)
        if d is not None:
            d.task.cancel()

    async def stop(self) -> None:
        """Shutdown: stop every download; their jobs fail (the client submits again)."""
        ids = list(self.running)
        for job_id in ids:
            self.cancel(job_id)
        await asyncio.gather(*(self.running[i].task for i in ids if i in self.running),
                             return_exceptions=True)
        for job_id in ids:
            with contextlib.suppress(Exception):
                await self._fail(job_id, dict(RESTARTED))

    async def _run(self, job_id: str, up: Upload, url: str, dest: Path, hold: Hold) -> None:
        s = self.settings
        queued = False  # from then on the file is the job's upload (or dropped with it)

        def progress(n: int) -> None:
            d = self.running.get(job_id)
            if d is not None:
                d.received = n

        try:
            fetched = await fetch_audio(s, self._outbound, url, dest, progress=progress,
                                        owner=up.owner)
            if fetched.size == 0:
                raise InvalidAudio("the fetched file is empty", field="audio_url")
            info = await anyio.to_thread.run_sync(audio.probe, dest, s.limits.max_audio_s)
            if up.check is not None:
                up.check(info.duration_s)
            hold.release()  # the transfer is over: from here the job counts as admitted
            async with self._admission.admitted(info.duration_s, up.owner):
                queued = True
                await self._queue(job_id, dest, info.duration_s)
        except asyncio.CancelledError:
            raise
        except ServiceError as exc:
            await self._fail(job_id, exc.body()["error"])
        except Exception:
            log.exception("audio_url job %s failed", job_id)
            await self._fail(job_id, {"type": "internal_error", "message": INTERNAL_MESSAGE})
        finally:
            hold.release()
            if not queued:
                dest.unlink(missing_ok=True)
            self.running.pop(job_id, None)
