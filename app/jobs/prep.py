"""The prep stage: feeds of prepared windows for jobs (prep processes, or threads), and the
prep threads, shared fairly: a job's next chunk waits behind every job with fewer done.

:func:`make_prep` builds it for the pipeline builder: prep processes (app/audio/procs) with the
service's Silero VAD, their shared-memory slots sized from the engines' batches
(app/audio/feeding.py), and threads for the small blocking calls around them (a blob fetch, a
probe) and for what processes cannot run (the pyannote VAD, a VAD object a test injects).

Each upload is prepared a chunk at a time (:class:`app.audio.AudioStream`), and every chunk is
one call here with a rank: the number of chunks its job has had before. The first free thread
takes the lowest rank, then the oldest. A short upload's only chunk has rank 0, so it goes ahead
of a long upload's tenth chunk and waits at most for the chunks already running; two long
uploads take turns. Measured before (one prep thread, whole uploads): a 20-minute upload held
every short request behind its decode and VAD, p95 0.77 s idle -> 9.65 s beside it.

The turn is granted on the event loop (one heap, no locks); the work runs on the pool's threads,
and a thread stays counted as busy until its call really returns, even if the waiting task was
cancelled meanwhile (a cancelled caller cannot stop a decode in progress).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from app.audio import AudioStream
from app.audio.feeding import Credits, Delivery, Feed, Request
from app.audio.procs import ProcFeed, ProcPool
from app.audio.procs.slots import SLOT_BYTES, shm_room
from app.audio.server_vad import vad_for
from app.audio.stream import Chunk
from app.audio.vad import SileroVad, Vad
from app.config import Settings
from app.errors import ShuttingDown

log = logging.getLogger(__name__)
MIN_SLOTS = 8  # fewer (a container's /dev/shm nearly full) and prep runs in threads

T = TypeVar("T")


def prep_threads(configured: int, engines: int = 1) -> int:
    """``prep.workers`` (0: one per core), and at least one per engine: one thread decoding and
    VAD-cutting uploads for every GPU would leave all but one of them waiting for windows."""
    return max(engines, configured or len(os.sched_getaffinity(0)))


class PrepPool:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="prep")
        self._free = workers
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._closed = False

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._queue if not f.done())

    async def run(self, rank: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a prep thread, when no lower rank (then no older call) waits."""
        if self._closed:
            raise ShuttingDown("service stopping; the job stays queued")
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._queue, (rank, next(self._seq), turn))
        self._grant()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted just as we were cancelled
                self._release()
            raise
        try:
            work = self._executor.submit(fn, *args)
        except RuntimeError as exc:  # shut down meanwhile
            self._release()
            raise ShuttingDown("service stopping; the job stays queued") from exc
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        return await asyncio.wrap_future(work)

    def _grant(self) -> None:
        while self._free and self._queue:
            *_, turn = heapq.heappop(self._queue)
            if turn.done():  # its caller gave up
                continue
            self._free -= 1
            turn.set_result(None)

    def _release(self) -> None:
        self._free += 1
        self._grant()

    def shutdown(self) -> None:
        """Refuse new calls, drop waiting ones (their callers get ShuttingDown), let running
        calls finish on their threads."""
        self._closed = True
        for *_, turn in self._queue:
            if not turn.done():
                turn.set_exception(ShuttingDown("service stopping; the job stays queued"))
        self._queue.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)


class Prep:
    """The prep stage one pipeline uses (see the module doc): ``workers`` processes (or
    threads), :meth:`feed` for a job's upload, :meth:`run` for a small blocking call."""

    def __init__(self, threads: PrepPool, credits: Credits, procs: ProcPool | None = None,
                 vad: Vad | None = None, part_s: float = 300.0) -> None:
        self.threads = threads
        self.credits = credits
        self.procs = procs
        self._vad = vad  # the VAD the processes run: a job cut with it gets a process feed
        self.part_s = part_s
        self.jobs = 0  # thread feeds open (the processes' pool counts its own)
        self._started = False

    @property
    def workers(self) -> int:
        return self.procs.size if self.procs is not None else self.threads.workers

    async def start(self, ready_s: float = 120.0) -> None:
        """Spawn the processes (once) and wait until they have started (~1 s of CPU each), so
        the service is ready only when prep is; a stream opened meanwhile would wait in their
        pipes. Processes that do not start in ``ready_s`` are reported, and jobs wait for them
        (or fail, once every one keeps dying: app/audio/procs/pool.py)."""
        if self.procs is not None and not self._started:
            self._started = True
            await self.procs.start()
            try:
                async with asyncio.timeout(ready_s):
                    await self.procs.ready()
            except TimeoutError:
                log.error("prep processes not started after %.0f s", ready_s)

    async def run(self, rank: int, fn: Callable[..., T], *args: object) -> T:
        return await self.threads.run(rank, fn, *args)

    def feed(self, req: Request, vad: Vad) -> Feed:
        if self.procs is not None and vad is self._vad:
            return ProcFeed(self.procs, req, self._idle(), self.part_s)
        return ThreadFeed(self, req, vad)

    def _idle(self) -> int:
        """Processes with no stream open: the most parts a new upload may be cut into (one
        20-minute upload alone goes on every core; sixteen at once, one process each)."""
        procs = self.procs
        assert procs is not None
        busy = {s.proc.index for s in procs.streams.values() if not s.ended}
        return max(1, procs.size - len(busy))

    def shutdown(self) -> None:
        self.threads.shutdown()
        if self.procs is not None:
            self.procs.shutdown()


def make_prep(settings: Settings, engines: int = 1, *, batch: int | None = None,
              workers: int | None = None, vad: Vad | None = None) -> Prep:
    """The prep stage (the pipeline builder's one call, app/jobs/pipeline.py): ``prep.workers``
    processes (0: one per core), at least one per engine; their read-ahead from the batch cap
    the sizing chose (``batch``) and the engines' ``workers``. Processes unless ``prep.mode``
    says threads or ``vad`` is not the Silero VAD they run. Start it with :meth:`Prep.start`."""
    s = settings.prep
    n = prep_threads(s.workers, engines)
    credits = Credits.sized(batch or settings.batcher.max_batch_size, workers or engines,
                            s.ahead_windows)
    threads = PrepPool(n)
    if s.mode != "processes" or not isinstance(vad, SileroVad):
        return Prep(threads, credits)
    slots = slot_count(s.slots, credits)
    if slots < MIN_SLOTS:
        log.warning("prep runs in threads: /dev/shm has room for %d windows only; give the "
                    "container more shared memory (docker --shm-size, a memory emptyDir)", slots)
        return Prep(threads, credits)
    procs = ProcPool(n, slots, vad.model(), credits, nice=s.nice,
                     step_timeout_s=s.step_timeout_s)
    return Prep(threads, credits, procs, vad, s.part_s)


def slot_count(configured: int, credits: Credits) -> int:
    """``prep.slots`` (0: twice the shared read-ahead, at least 4 x the per-job floor), within
    half of the shared memory free now."""
    want = configured or max(2 * credits.feed, 4 * credits.floor)
    room = shm_room()
    if room is not None and want * SLOT_BYTES > room // 2:
        fit = int(room // 2 // SLOT_BYTES)
        log.warning("prep: %d shared-memory slots wanted, /dev/shm has room for %d: the jobs' "
                    "read-ahead is cut to that (give the container more shared memory: docker "
                    "--shm-size, a memory emptyDir)", want, fit)
        want = fit
    return want


class ThreadFeed:
    """:class:`app.audio.feeding.Feed` on the prep threads: a chunk at a time on the pool
    (rank: chunks the job had before), the next one only while the job holds fewer windows
    than its credits."""

    parts = 1

    def __init__(self, prep: Prep, req: Request, vad: Vad) -> None:
        self._prep = prep
        self._req = req
        self._vad = vad
        self._stream: AudioStream | None = None
        self._rank = 0
        self._held = 0
        self._room = asyncio.Event()
        self._room.set()
        self._open = False

    async def start(self) -> None:
        r = self._req
        self._stream = await self._prep.threads.run(
            0, AudioStream, Path(r.path), vad_for(self._vad, r.vad), r.max_audio_s, r.chunk_s,
            r.separate)
        self._prep.jobs += 1
        self._open = True

    @property
    def samples(self) -> int:
        return self._stream.samples if self._stream is not None else 0

    async def next(self) -> Delivery | None:
        stream = self._stream
        assert stream is not None
        while not stream.done:
            while self._held >= self._prep.credits.per_job(self._prep.jobs):
                self._room.clear()
                await self._room.wait()
            chunk: Chunk = await self._prep.threads.run(self._rank, stream.read_chunk)
            self._rank += 1
            n = len(chunk.windows)
            if not n and not self._req.audio and not stream.done:
                continue
            self._held += n
            return Delivery(chunk.windows, chunk.channels, list(range(n)), ended=stream.done,
                            audio=chunk.audio if self._req.audio else None,
                            audio_start_s=chunk.start_s)
        return None

    def release(self, token: int) -> None:
        self._held -= 1
        self._room.set()

    async def close(self) -> None:
        if self._open:
            self._open = False
            self._prep.jobs -= 1
            assert self._stream is not None
            await asyncio.to_thread(self._stream.close)  # mid-decode: close waits for it
