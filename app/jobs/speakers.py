"""One job's diarization beside its transcription (``diarize=true``).

The job's work (app/jobs/work.py) hands every decoded chunk to :meth:`JobSpeakers.feed` right
after the chunk's windows went to the batcher. The chunk's speaker work (segmentation windows
and CAM++ crops, batched with other jobs' by app/batching/primitive.py) then runs in a task of its
own while the next chunk is prepared and the windows are transcribed; the next ``feed`` first
waits for it. So a stream's calls never overlap (``SpeakerStream`` requires it), and a job holds
at most the chunk being diarized plus the one just decoded (~2 x 60 s of audio, whatever the
upload's length): when the speaker models are slower than decoding, decoding waits.

``busy_s`` is the job's diarization time: wall seconds inside the stream's calls (its model
work, the waits for shared speaker batches, the clustering at the end), not the time spent
waiting for audio or for the models to load. Errors: speaker models that cannot load fail the
job as ``diarization_unavailable``; anything else the speaker work raises fails it as
``diarization_failed`` (never a hang: :meth:`finish` awaits the last chunk's task, and
:meth:`cancel` stops the work of a cancelled or failed job).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np

from app.errors import DiarizationFailed, ServiceError, ShuttingDown
from app.speakers import SpeakerStream, Turn
from app.speakers.service import SpeakerService
from app.windows import JobOptions

log = logging.getLogger(__name__)
T = TypeVar("T")


class JobSpeakers:
    def __init__(self, service: SpeakerService, job_id: str, options: JobOptions) -> None:
        self.service = service
        self.job_id = job_id
        self.options = options
        self.busy_s = 0.0
        self.audio_s = 0.0
        self._stream: asyncio.Task[SpeakerStream] = asyncio.ensure_future(self._open())
        self._last: asyncio.Task[None] | None = None
        self._final: asyncio.Task[list[Turn]] | None = None

    async def _open(self) -> SpeakerStream:
        diarizer = await self.service.diarizer()  # the first diarize job loads the models
        o = self.options
        return diarizer.stream(self.job_id, num_speakers=o.num_speakers,
                               min_speakers=o.min_speakers, max_speakers=o.max_speakers,
                               known=o.known_speakers or ())

    async def feed(self, audio: np.ndarray, start_s: float) -> None:
        """Start this chunk's speaker work once the previous chunk's is done (and raise its
        error, if it failed)."""
        if self._last is not None:
            await self._last
        self._last = asyncio.ensure_future(self._feed(audio, start_s))

    async def _feed(self, audio: np.ndarray, start_s: float) -> None:
        stream = await self._stream
        await self._timed(stream.feed(audio, start_s))
        self.audio_s = stream.duration

    async def finish(self) -> list[Turn]:
        """The job's speaker turns, once its last chunk is in."""
        if self._last is not None:
            await self._last
        self._final = asyncio.ensure_future(self._finish())
        return await self._final

    async def _finish(self) -> list[Turn]:
        stream = await self._stream
        return await self._timed(stream.finish())

    async def _timed(self, work: Awaitable[T]) -> T:
        t0 = time.monotonic()
        try:
            return await work
        except (asyncio.CancelledError, ServiceError, ShuttingDown):
            raise
        except Exception as exc:
            log.exception("speaker work of job %s failed", self.job_id)
            raise DiarizationFailed("speaker diarization failed; see the server log") from exc
        finally:
            self.busy_s += time.monotonic() - t0

    def cancel(self) -> None:
        """Drop the job's speaker work: queued items never reach a model."""
        for t in (self._final, self._last, self._stream):
            if t is not None and not t.done():
                t.cancel()
            elif t is not None and not t.cancelled():
                t.exception()  # retrieved: a failure already reported is not logged again
