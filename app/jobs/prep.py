"""The prep threads, shared fairly: a job's next chunk waits behind every job with fewer done.

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
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from app.errors import ShuttingDown

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
