"""The batching primitive (the rules and helpers both batchers share), and the speaker models'
batcher built on nothing else.

Both batchers pool items from many callers into model calls, and share these rules:

* **One owner task, futures out.** One asyncio task owns the queue (no locks); each caller gets
  one future per item, answered only if still pending (:func:`answer`, :func:`fail`), so a
  cancelled caller's items are dropped before they reach the model and cost nothing
  (:func:`live`).
* **Batches form when the model is free.** While it works, every job's items pile up and the
  next call takes them together; when it is idle, an item goes at once.
* **Fair across jobs.** A batch takes every job's next item before any job's second, so a long
  upload cannot hold a short request's few items behind it.
* **A failure is isolated.** A failed batch is split in halves, each run again (and split
  again), so a bad item fails only its own caller (:func:`isolate`; the speech batcher's owner
  splits the same way one engine call at a time, app/batching/owner.py).

Why two batchers, in a sentence: the speech batcher (app/batching/batcher.py) groups windows by
decode options and padded length, sizes each batch by engine memory and beams, and runs several
engine workers and two stages (encode, decode), while the speaker models (app/speakers) take
fixed-shape items, each model on a thread of its own, so a batch there is simply whatever is
queued when that model is free (:class:`ModelBatcher`).

Batching pays on CPU for the speaker models too: per item, segmentation costs 36.7 ms alone and
26.5 ms in batches of 16, a CAM++ crop 41.8 ms alone and 24.7 ms in batches of 16 (one torch
thread, app/speakers/models.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Waiting(Protocol):
    """A queued item: its caller's future."""

    @property
    def future(self) -> asyncio.Future[Any]: ...


W = TypeVar("W", bound=Waiting)


def answer(item: Waiting, result: object) -> None:
    """Give the caller its result, unless it stopped waiting (cancelled, or already failed)."""
    if not item.future.done():
        item.future.set_result(result)


def fail(item: Waiting, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


def live(items: Sequence[W]) -> list[W]:
    """The items whose callers still wait: a cancelled caller's item costs nothing."""
    return [i for i in items if not i.future.done()]


async def isolate(items: list[W], call: Callable[[list[W]], Awaitable[None]],
                  alone: Callable[[W, Exception], None],
                  failed: Callable[[list[W], Exception], None] | None = None) -> None:
    """Run ``call(items)`` (which answers them); if it raises, split the batch in halves and
    run each the same way, so that a failure is pinned on the items that cause it. ``alone``
    answers an item that fails by itself; ``failed`` hears of every failed call first (the
    speech batcher halves its cap there on an OOM)."""
    items = live(items)  # cancelled while waiting: free
    if not items:
        return
    try:
        await call(items)
    except Exception as exc:
        if failed is not None:
            failed(items, exc)
        if len(items) == 1:
            alone(items[0], exc)
            return
        half = len(items) // 2
        await isolate(items[:half], call, alone, failed)
        await isolate(items[half:], call, alone, failed)


@dataclass
class _Item(Generic[T, R]):
    job: Hashable
    value: T
    future: asyncio.Future[R]


class ModelBatcher(Generic[T, R]):
    """Pools items from many callers into calls of ``run(items) -> results`` (same order), on
    ``executor``, one call at a time: for each speaker model, a thread of its own (a model is
    never called by two threads at once; app/speakers/diarizer.py)."""

    def __init__(self, run: Callable[[list[T]], Sequence[R]], executor: Executor,
                 max_batch: int, name: str = "speakers") -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._run = run
        self._executor = executor
        self.max_batch = max_batch
        self.name = name
        self._queues: OrderedDict[Hashable, deque[_Item[T, R]]] = OrderedDict()  # per job
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: list[_Item[T, R]] = []  # the batch inside the model call now
        self.calls = 0  # model calls made (batches, retries included)
        self.items = 0  # items that went through them
        self.shared_calls = 0  # calls that held items of more than one job

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        """Stop the owner task; queued items and the batch in the model fail with
        ``RuntimeError`` (a model call cannot be interrupted; its result is dropped)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for it in [*self._running, *(i for q in self._queues.values() for i in q)]:
            fail(it, RuntimeError(f"{self.name} batcher stopped"))
        self._queues.clear()
        self._running = []

    def submit(self, job: Hashable, values: Sequence[T]) -> list[asyncio.Future[R]]:
        """Queue one job's items; one future per item, in order."""
        if self._task is None or self._task.done():
            raise RuntimeError(f"{self.name} batcher is not running")
        loop = asyncio.get_running_loop()
        q = self._queues.setdefault(job, deque())
        futures: list[asyncio.Future[R]] = []
        for v in values:
            fut: asyncio.Future[R] = loop.create_future()
            q.append(_Item(job, v, fut))
            futures.append(fut)
        self._wake.set()
        return futures

    async def run(self, job: Hashable, values: Sequence[T]) -> list[R]:
        """Submit and wait for all results of one job (cancelling cancels its queued items)."""
        futures = self.submit(job, values)
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for f in futures:
                f.cancel()

    def pending(self) -> int:
        return sum(len(live(q)) for q in self._queues.values())

    def _take(self) -> list[_Item[T, R]]:
        """Round-robin over jobs (every job's next item before any job's second)."""
        batch: list[_Item[T, R]] = []
        while len(batch) < self.max_batch and self._queues:
            for job in list(self._queues):
                q = self._queues[job]
                while q:
                    it = q.popleft()
                    if not it.future.done():  # a cancelled caller's item costs nothing
                        batch.append(it)
                        break
                if not q:
                    del self._queues[job]
                if len(batch) == self.max_batch:
                    break
        return batch

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self._take():
                self._running = batch  # until it is answered, retries included
                await isolate(batch, self._call, fail, self._failed)
                self._running = []

    def _failed(self, batch: list[_Item[T, R]], exc: Exception) -> None:
        if len(batch) > 1:
            log.warning("%s batch of %d failed (%s); retrying it in halves", self.name,
                        len(batch), exc)

    async def _call(self, batch: list[_Item[T, R]]) -> None:
        self.calls += 1
        self.items += len(batch)
        self.shared_calls += len({it.job for it in batch}) > 1
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self._run, [it.value for it in batch])
        if len(results) != len(batch):
            raise RuntimeError(f"{self.name}: {len(results)} results for {len(batch)} items")
        for it, r in zip(batch, results, strict=True):
            answer(it, r)
