"""One claimed job's work (:class:`JobWork`): its audio prepared chunk by chunk, each chunk's
windows handed to the batcher at once, the results collected in upload order.

* **Streaming.** The upload's first windows reach the batcher after one chunk of decoding
  (``prep.chunk_s``), so a long upload's first batch runs within seconds and its decoding
  overlaps inference; its later chunks wait their turn on the prep pool behind short uploads
  (:class:`app.jobs.prep.PrepPool`).
* **Memory bounded by design.** The next chunk is prepared only while fewer than
  ``prep.ahead_windows`` of the job's windows are waiting for results; a window's samples are
  released as soon as its result is back. So a 4-hour upload holds about a chunk of audio and
  that many windows, never its whole PCM.
* **Language.** Without a language every window carries the upload's
  :class:`~app.windows.LanguageChoice`: the first detection decides it (in the same engine call
  that encodes the window), and no window waits for it or runs alone at 30 s to detect.
* **Duration truth.** The backlog counts the header's duration until decoding passes it; then
  it counts the decoded length (a header that lies cannot hide audio from the backlog).
* **Speakers** (``diarize=true``): each chunk's samples also go to the job's speaker stream
  (:class:`app.jobs.speakers.JobSpeakers`), whose work runs beside the transcription; the
  windows are decoded with word timestamps, so segments can be split at speaker turns.
  ``channels=separate``: every channel is cut into windows of its own, each window's channel
  kept (``Outcome.channels``) for the transcript to label and merge.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from app.audio import AudioStream
from app.audio.stream import Chunk
from app.audio.vad import Vad
from app.batching.batcher import Batcher
from app.config import Settings
from app.errors import DiarizationOff, InvalidAudio
from app.jobs.blobs import BlobStore
from app.jobs.prep import PrepPool
from app.jobs.speakers import JobSpeakers
from app.jobs.store import JobRow, JobStore
from app.speakers import Turn
from app.speakers.service import SpeakerService
from app.windows import WINDOW_S, JobOptions, Window, WindowResult

EMPTY = np.zeros(0, dtype=np.float32)
DURATION_SLACK_S = 10.0  # decoded audio past the header's duration before the backlog is told


@dataclass
class Active:
    """A job running in this process, as the API and housekeeping see it."""

    task: asyncio.Task[None]
    started: bool = False  # its work began (an attempt counts); claimed but unstarted otherwise
    windows_total: int | None = None  # known once its audio is all cut
    windows_cut: int = 0
    windows_expected: int = 0  # the header's guess while it is being cut (see _estimate)
    windows_done: int = 0
    audio_done_s: float = 0.0
    ending: bool = False  # being finished: its audio leaves the backlog with its store row
    results: dict[int, WindowResult] = field(default_factory=dict)  # by window index
    room: asyncio.Event = field(default_factory=asyncio.Event)  # set: the next chunk may go


@dataclass(frozen=True)
class Tools:
    """What every job's work uses, built once by the job runner: its shared parts, and three
    callbacks into it (not the runner itself: the work reports, the runner decides)."""

    settings: Settings
    store: JobStore
    blobs: BlobStore
    prep: PrepPool
    vad: Vad
    batcher: Batcher
    speakers: SpeakerService | None  # diarize=true jobs (None: refused)
    started: Callable[[JobRow, Active], Awaitable[None]]  # its work begins: an attempt counts
    changed: Callable[[str], None]  # the job changed (a window done, all cut): wake watchers
    progressed: Callable[[JobRow, Active], None]  # a window finished (the progress log)


@dataclass
class Outcome:
    windows: list[Window]  # their samples released; start and end kept
    results: list[WindowResult]
    seconds: float  # decoded length
    language: str | None
    channels: list[int] | None = None  # each window's channel (channels=separate)
    turns: list[Turn] | None = None  # speaker turns (diarize)
    diarization_s: float | None = None  # wall seconds of the job's speaker work


class JobWork:
    """One claimed job's work (see the module docstring); :meth:`run` returns its outcome."""

    def __init__(self, tools: Tools, job: JobRow, active: Active) -> None:
        self.tools = tools
        self.job = job
        self.active = active
        self.options = o = JobOptions.from_dict(job.options)
        # Speakers split segments at word times: diarize decodes with word timestamps (the
        # result keeps its words only if they were asked for).
        self.key = replace(o.decode_options(), word_timestamps=o.word_timestamps or o.diarize)
        self.prompt = o.prompt()
        self.separate = o.channels == "separate"
        self.windows: list[Window] = []
        self.channels: list[int] = []
        self.futures: list[asyncio.Future[WindowResult]] = []
        self._counted_s = job.audio_seconds
        self.speakers: JobSpeakers | None = None

    async def run(self) -> Outcome:
        try:
            return await self._run()
        finally:
            if self.speakers is not None:
                self.speakers.cancel()  # failed or cancelled: its speaker work stops too

    async def _run(self) -> Outcome:
        r = self.tools
        prep = r.prep
        if self.options.diarize:
            if r.speakers is None:
                raise DiarizationOff("speaker diarization is not available on this service")
            # Opened now: the first diarize job starts loading the models while it decodes.
            self.speakers = JobSpeakers(r.speakers, self.job.id, self.options)
        path = await prep.run(0, r.blobs.fetch, self.job.upload_path)
        try:
            stream = await prep.run(0, AudioStream, path, r.vad, r.settings.limits.max_audio_s,
                                    r.settings.prep.chunk_s, self.separate)
            try:
                await r.started(self.job, self.active)
                rank = 0
                while not stream.done:
                    await self._room()
                    chunk: Chunk = await prep.run(rank, stream.read_chunk)
                    rank += 1
                    self._submit(chunk, stream)
                    if self.speakers is not None and chunk.audio.size:
                        await self.speakers.feed(chunk.audio, chunk.start_s)
                    del chunk  # its samples: the speaker stream holds what it still needs
                    await self._count_real_length(stream.seconds)
                    if self.options.detect_only and self.windows:
                        break
            finally:
                await asyncio.to_thread(stream.close)  # a container mid-decode: close it
        finally:
            await asyncio.to_thread(r.blobs.release, path)
        if not stream.samples:
            raise InvalidAudio("the upload contains no decodable audio samples")
        self.active.windows_total = len(self.windows)
        # All cut: other replicas (and a replica taking over after this one dies) see the
        # job's size and its decoded length from the store.
        await r.store.update(self.job.id, windows_total=len(self.windows),
                             audio_seconds=round(stream.seconds, 3))
        r.changed(self.job.id)
        try:
            transcribed = asyncio.gather(*self.futures)
            if self.speakers is not None:
                results, turns = await asyncio.gather(transcribed, self.speakers.finish())
            else:
                results, turns = await transcribed, None
        finally:
            for f in self.futures:
                f.cancel()  # on failure or cancellation the job's other windows cost nothing
        choice = self.prompt.choice
        language = self.options.language or (choice.language if choice else None)
        if language is None and results:
            language = results[0].language
        return Outcome(self.windows, list(results), round(stream.seconds, 3), language,
                       channels=self.channels if self.separate else None, turns=turns,
                       diarization_s=(round(self.speakers.busy_s, 3)
                                      if self.speakers is not None else None))

    def _estimate(self, stream: AudioStream) -> int:
        """The job's size in windows, for the batcher (short request or long upload): the
        header's duration until all of it is cut."""
        if stream.done:
            return len(self.windows)
        return max(len(self.windows), math.ceil(self.job.audio_seconds / WINDOW_S))

    def _submit(self, chunk: Chunk, stream: AudioStream) -> None:
        windows, channels = chunk.windows, chunk.channels
        if self.options.detect_only:
            windows = windows[:1] if not self.windows else []
        if not windows:
            return
        first = len(self.windows)
        for w in windows:
            w.prompt = self.prompt
        self.windows += windows
        self.channels += channels[: len(windows)]
        self.active.windows_cut = len(self.windows)
        self.active.windows_expected = self._estimate(stream)
        futures = self.tools.batcher.submit(self.job.id, windows, self.key, first_rank=first,
                                             job_windows=self.active.windows_expected,
                                             owner=self.job.owner)
        for k, (f, w) in enumerate(zip(futures, windows, strict=True)):
            f.add_done_callback(self._done(first + k, w))
        self.futures += futures

    def _done(self, index: int, w: Window) -> Any:
        def done(f: asyncio.Future[WindowResult]) -> None:
            duration = w.duration
            w.audio = EMPTY  # its result is back: the samples go
            self._update_room()
            if f.cancelled() or f.exception() is not None:
                return
            a = self.active
            a.results[index] = f.result()
            a.windows_done += 1
            a.audio_done_s += duration
            self.tools.progressed(self.job, a)
            self.tools.changed(self.job.id)
        return done

    def _waiting(self) -> int:
        return sum(1 for f in self.futures if not f.done())

    def _update_room(self) -> None:
        if self._waiting() < self.tools.settings.prep.ahead_windows:
            self.active.room.set()
        else:
            self.active.room.clear()

    async def _room(self) -> None:
        self._update_room()
        await self.active.room.wait()

    async def _count_real_length(self, seconds: float) -> None:
        """Past the header's duration (and a margin): the backlog counts the decoded length."""
        if seconds > self._counted_s + DURATION_SLACK_S:
            self._counted_s = seconds
            await self.tools.store.update(self.job.id, audio_seconds=round(seconds, 3))

