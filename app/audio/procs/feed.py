"""One job's upload prepared by the prep processes: its parts, their seams, their retries.

The job's first stream is opened with the most parts it may be cut into (the processes not
busy now, app/jobs/prep.py); the process that opens the upload decides whether it can be split
(app/audio/parts.py) and becomes its first part, and the others are opened on the least loaded
processes. Each part's seam is relayed to the part before it as soon as it is found, and each
part's windows are delivered as they come, part by part in order within a part.

**A process that dies.** Its streams are opened again on another process and replay their
audio from the start of their part, dropping the windows (and chunk audio) already delivered:
decode and VAD are deterministic, so nothing is delivered twice and nothing is missed. The
stream the process was working on when it died is blamed; one blamed twice fails its job
(:class:`app.errors.DecoderCrashed`, a 4xx that says a retry cannot help), the others lose
nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import replace

from app.audio.feeding import Delivery, Request
from app.audio.parts import Part, plan
from app.audio.procs.pool import ProcPool, Stream
from app.audio.procs.wire import Out, Spec
from app.errors import DecoderCrashed, ShuttingDown
from app.windows import SAMPLE_RATE, Window

log = logging.getLogger(__name__)
STRIKES = 2  # crashes blamed on one part before its job fails


class ProcFeed:
    """:class:`app.audio.feeding.Feed` over the prep processes; the owner of its streams."""

    def __init__(self, pool: ProcPool, request: Request, split: int, part_s: float) -> None:
        self.pool = pool
        self.req = request
        self.parts = 1
        first = Spec(request.path, request.max_audio_s, request.chunk_s, request.separate,
                     request.vad, request.audio, split=split if request.split else 1,
                     part_s=part_s, duration_s=request.duration_s)
        self._specs: dict[int, Spec] = {0: first}
        self._streams: dict[int, Stream] = {}  # part -> its stream now
        self._planned = False
        self._seams: dict[int, int] = {}  # part -> its seam (-1: empty)
        self._ends: dict[int, int | None] = {}  # part -> the end relayed to it
        self._delivered: collections.Counter[int] = collections.Counter()  # part -> windows
        self._audio_to = 0  # chunk audio delivered up to this sample
        self._strikes: collections.Counter[int] = collections.Counter()
        self._done: set[int] = set()
        self._queue: collections.deque[tuple[Delivery, Stream]] = collections.deque()
        self._wake = asyncio.Event()
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._error: BaseException | None = None
        self._fed = 0
        self._closed = False
        self._gate = request.first_part_first  # later parts wait for the first one's window

    # ---- the job's side ---------------------------------------------------------------------
    async def start(self) -> None:
        self._open(0)
        await self._opened

    @property
    def samples(self) -> int:
        return self._fed

    async def next(self) -> Delivery | None:
        while True:
            if self._error is not None:
                raise self._error
            if self._queue:
                d, stream = self._queue.popleft()
                if d.audio is not None:
                    self.pool.ack(stream)
                return d
            if self._planned and len(self._done) == self.parts:
                return None
            self._wake.clear()
            await self._wake.wait()

    def release(self, token: int) -> None:
        self.pool.release(token)

    async def close(self) -> None:
        self._closed = True
        for s in self._streams.values():
            self.pool.close(s)
        self._streams.clear()
        while self._queue:
            d, _ = self._queue.popleft()
            for t in d.tokens:
                self.pool.release(t)

    # ---- the pool's side --------------------------------------------------------------------
    def opened(self, stream: Stream, parts: int, duration_s: float | None) -> None:
        if self._part(stream) == 0 and not self._planned:
            self._planned = True
            if parts > 1 and duration_s:
                log.info("upload split", extra={"job_id": self.req.job_id, "parts": parts,
                                                "duration_s": round(duration_s, 1)})
                self.parts = parts
                layout = plan(duration_s, parts)
                base = replace(self._specs[0], split=1)
                for p in layout:
                    self._specs[p.index] = replace(base, part=p)
                for p in layout[1:]:
                    self._open(p.index)
        if not self._opened.done():
            self._opened.set_result(None)

    def out(self, stream: Stream, out: Out) -> None:
        k = self._part(stream)
        if self._streams.get(k) is not stream:  # closed meanwhile: its windows go back
            for slot, *_ in out.windows:
                self.pool.release(slot)
            return
        if k == 0 and self._gate and (out.windows or out.done):
            self._gate = False
            for s in self._streams.values():
                self.pool.ungate(s)
        windows, tokens, channels = [], [], []
        for (slot, _, start, end, channel), samples in zip(out.windows, out.arrays, strict=True):
            windows.append(Window(samples, start / SAMPLE_RATE, end / SAMPLE_RATE))
            tokens.append(slot)
            channels.append(channel)
        self._delivered[k] += len(windows)
        self._fed = max(self._fed, out.fed)
        audio = out.chunk
        if audio is not None:
            self._audio_to = out.audio_start + audio.shape[-1]
        if out.seam is not None:
            self._seams[k] = out.seam
            self._relay()
        if out.done:
            self._done.add(k)
            del self._streams[k]
        if windows or audio is not None or out.done:
            d = Delivery(windows, channels, tokens, part=k, ended=out.done, audio=audio,
                         audio_start_s=out.audio_start / SAMPLE_RATE)
            self._queue.append((d, stream))
            self._wake.set()

    def failed(self, stream: Stream, exc: Exception) -> None:
        if self._streams.get(self._part(stream)) is stream:
            self._fail(exc)

    def lost(self, stream: Stream, blamed: bool) -> None:
        k = self._part(stream)
        if self._streams.get(k) is not stream or self._closed:
            return
        del self._streams[k]
        if self.pool.closed:
            self._fail(ShuttingDown("service stopping; the job stays queued"))
            return
        if blamed:
            self._strikes[k] += 1
        if self._strikes[k] >= STRIKES:
            self._fail(DecoderCrashed(
                f"the upload crashed the audio decoder {self._strikes[k]} times; it cannot be "
                "transcribed, and sending it again will not help"))
            return
        self._open(k)

    # ---- inside -----------------------------------------------------------------------------
    def _open(self, k: int) -> None:
        spec = replace(self._specs[k], skip=self._delivered[k],
                       skip_audio=self._audio_to if k == 0 else 0)
        s = self._streams[k] = self.pool.open(self, self.req.job_id, spec,
                                              gated=self._gate and k > 0)
        if k in self._ends:
            self.pool.stop_at(s, self._ends[k])

    def _relay(self) -> None:
        """Tell each part its end once the next part with audio has found its seam."""
        for j in range(self.parts - 1):
            if j in self._ends or j in self._done:
                continue
            m = j + 1
            while m < self.parts and self._seams.get(m) == -1:
                m += 1
            if m < self.parts and m not in self._seams:
                continue
            end = self._seams[m] if m < self.parts else None
            self._ends[j] = end
            if j in self._streams:
                self.pool.stop_at(self._streams[j], end)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        for s in self._streams.values():
            self.pool.close(s)
        self._streams.clear()
        if not self._opened.done():
            self._opened.set_exception(exc)
            self._opened.exception()  # retrieved: start() raises it
        self._wake.set()

    @staticmethod
    def _part(stream: Stream) -> int:
        part: Part | None = stream.spec.part
        return part.index if part is not None else 0
