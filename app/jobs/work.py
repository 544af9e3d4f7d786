"""One claimed job's work (:class:`JobWork`): its audio prepared by a feed (app/jobs/prep.py),
each delivery's windows handed to the batcher at once, the results collected in upload order.

* **Streaming.** The upload's first windows reach the batcher after one chunk of decoding
  (``prep.chunk_s``), so a long upload's first batch runs within seconds and its decoding
  overlaps inference. In prep processes (app/audio/procs) a seekable long upload is cut into
  parts prepared side by side; their windows arrive in any order between parts and take their
  place in the upload (app/jobs/order.py) once the parts before them have ended.
* **Memory bounded by design.** The feed reads ahead only while the job holds fewer windows
  than its credits (app/audio/feeding.py); a window goes back (its slot, its samples) as soon
  as its result is back. So a 4-hour upload holds a few chunks of audio and its credits'
  worth of windows, never its whole PCM.
* **Language.** Without a language every window carries the upload's
  :class:`~app.windows.LanguageChoice`: the first detection decides it (in the same engine call
  that encodes the window), and no window waits for it or runs alone at 30 s to detect. A split
  upload's later parts get no slot until its first part has sent a window (or ended), so that
  is still the first speech window's detection.
* **Duration truth.** The backlog counts the header's duration until decoding passes it; then
  it counts the decoded length (a header that lies cannot hide audio from the backlog).
* **Speakers** (``diarize=true``): each chunk's samples also go to the job's speaker stream
  (:class:`app.jobs.speakers.JobSpeakers`), whose work runs beside the transcription; the
  windows are decoded with word timestamps, so segments can be split at speaker turns. Such an
  upload is not split (its speaker stream takes the audio in order); a prep process hands the
  chunk's samples back through its pipe (int16, 1.9 MB a minute): ~2 ms of the service's CPU
  per minute of audio to receive and scale, against 1.4 ms (16 kHz WAV), 22 ms (48 kHz stereo
  WAV) and 109 ms (MP3) to decode it again in the service (measured here, one core).
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

from app.audio.feeding import Delivery, Feed, Request
from app.audio.vad import Vad
from app.batching.batcher import Batcher
from app.config import Settings
from app.errors import DiarizationOff, InvalidAudio
from app.jobs.blobs import BlobStore
from app.jobs.order import UploadOrder
from app.jobs.prep import Prep
from app.jobs.speakers import JobSpeakers
from app.jobs.store import JobRow, JobStore
from app.speakers import Turn
from app.speakers.service import SpeakerService
from app.windows import SAMPLE_RATE, WINDOW_S, JobOptions, Window, WindowResult

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


@dataclass(frozen=True)
class Tools:
    """What every job's work uses, built once by the job runner: its shared parts, and three
    callbacks into it (not the runner itself: the work reports, the runner decides)."""

    settings: Settings
    store: JobStore
    blobs: BlobStore
    prep: Prep
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
    """One claimed job's work (see the module doc); :meth:`run` returns its outcome."""

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
        # part -> its windows in order: (window, channel, its future)
        self.parts: dict[int, list[tuple[Window, int, asyncio.Future[WindowResult]]]] = {}
        self.futures: list[asyncio.Future[WindowResult]] = []
        self.order: UploadOrder[WindowResult] = UploadOrder(self._place)
        self._all_cut = False
        self._counted_s = job.audio_seconds
        self.speakers: JobSpeakers | None = None

    async def run(self) -> Outcome:
        try:
            return await self._run()
        finally:
            for f in self.futures:
                f.cancel()  # failed or cancelled: its other windows cost nothing (done: no-op)
            if self.speakers is not None:
                self.speakers.cancel()  # failed or cancelled: its speaker work stops too

    async def _run(self) -> Outcome:
        r = self.tools
        o = self.options
        if o.diarize:
            if r.speakers is None:
                raise DiarizationOff("speaker diarization is not available on this service")
            # Opened now: the first diarize job starts loading the models while it decodes.
            self.speakers = JobSpeakers(r.speakers, self.job.id, o)
        path = await r.prep.run(0, r.blobs.fetch, self.job.upload_path)
        try:
            feed = r.prep.feed(Request(
                self.job.id, str(path), r.settings.limits.max_audio_s, r.settings.prep.chunk_s,
                separate=self.separate, vad=o.vad, audio=o.diarize,
                split=not (o.diarize or self.separate or o.detect_only),
                first_part_first=self.prompt.choice is not None,
                duration_s=self.job.audio_seconds), r.vad)
            try:
                await feed.start()
                await r.started(self.job, self.active)
                while (d := await feed.next()) is not None:
                    self._deliver(feed, d)
                    if self.speakers is not None and d.audio is not None and d.audio.size:
                        await self.speakers.feed(d.audio, d.audio_start_s)
                    await self._count_real_length(feed.samples / SAMPLE_RATE)
                    if o.detect_only and self.order.total:
                        break
                self._all_cut = True
            finally:
                await feed.close()  # a container mid-decode, the windows not yet delivered
        finally:
            await asyncio.to_thread(r.blobs.release, path)
        if not feed.samples:
            raise InvalidAudio("the upload contains no decodable audio samples")
        seconds = round(feed.samples / SAMPLE_RATE, 3)
        placed = [x for k in sorted(self.parts) for x in self.parts[k]]  # upload order
        windows = [w for w, _, _ in placed]
        self.active.windows_total = len(windows)
        # All cut: other replicas (and a replica taking over after this one dies) see the
        # job's size and its decoded length from the store.
        await r.store.update(self.job.id, windows_total=len(windows), audio_seconds=seconds)
        r.changed(self.job.id)
        transcribed = asyncio.gather(*(f for _, _, f in placed))
        if self.speakers is not None:
            results, turns = await asyncio.gather(transcribed, self.speakers.finish())
        else:
            results, turns = await transcribed, None
        choice = self.prompt.choice
        language = o.language or (choice.language if choice else None)
        if language is None and results:
            language = results[0].language
        return Outcome(windows, list(results), seconds, language,
                       channels=[c for _, c, _ in placed] if self.separate else None,
                       turns=turns,
                       diarization_s=(round(self.speakers.busy_s, 3)
                                      if self.speakers is not None else None))

    def _estimate(self) -> int:
        """The job's size in windows, for the batcher (short request or long upload): the
        header's duration until all of it is cut."""
        n = self.order.total
        if self._all_cut:
            return n
        return max(n, math.ceil(self.job.audio_seconds / WINDOW_S))

    def _deliver(self, feed: Feed, d: Delivery) -> None:
        if self.options.detect_only:  # the first speech window only
            keep = 0 if self.order.total else min(1, len(d.windows))
            for t in d.tokens[keep:]:
                feed.release(t)
            d.windows, d.channels, d.tokens = d.windows[:keep], d.channels[:keep], d.tokens[:keep]
        self._submit(feed, d)

    def _submit(self, feed: Feed, d: Delivery) -> None:
        windows = d.windows
        if windows:
            first = self.order.total
            for w in windows:
                w.prompt = self.prompt
            self.active.windows_cut = first + len(windows)
            self.active.windows_expected = self._estimate()
            futures = self.tools.batcher.submit(self.job.id, windows, self.key, first_rank=first,
                                                job_windows=self.active.windows_expected,
                                                owner=self.job.owner)
            part = self.parts.setdefault(d.part, [])
            for f, w, c, t in zip(futures, windows, d.channels, d.tokens, strict=True):
                part.append((w, c, f))
                f.add_done_callback(self._done(feed, d.part, self.order.add(d.part), w, t))
            self.futures += futures
        if d.ended:
            self.order.end(d.part)  # the next part's finished windows take their places
            self.tools.changed(self.job.id)

    def _done(self, feed: Feed, part: int, k: int, w: Window, token: int) -> Any:
        def done(f: asyncio.Future[WindowResult]) -> None:
            duration = w.duration
            w.audio = EMPTY  # its result is back: the samples go
            feed.release(token)  # and its credit (its shared-memory slot)
            if f.cancelled() or f.exception() is not None:
                return
            a = self.active
            a.windows_done += 1
            a.audio_done_s += duration
            self.order.result(part, k, f.result())
            self.tools.progressed(self.job, a)
            self.tools.changed(self.job.id)
        return done

    def _place(self, index: int, result: WindowResult) -> None:
        self.active.results[index] = result

    async def _count_real_length(self, seconds: float) -> None:
        """Past the header's duration (and a margin): the backlog counts the decoded length."""
        if seconds > self._counted_s + DURATION_SLACK_S:
            self._counted_s = seconds
            await self.tools.store.update(self.job.id, audio_seconds=round(seconds, 3))
