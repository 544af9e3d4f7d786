"""Cross-request batching for the speaker models: one model call for many jobs' windows.

The idea of app/batcher.py applied to the second model, kept simple: one asyncio task owns the
queue (no locks); callers get one future per item; a batch is formed only when the model thread
is free, so while it works the items of every job pile up and the next call takes them
together (up to ``max_batch``). When idle, an item goes at once: no deadline to wait for.
Batching pays on CPU: per item, segmentation costs 36.7 ms alone and 26.5 ms in batches of 16,
a CAM++ crop 41.8 ms alone and 24.7 ms in batches of 16 (one torch thread, models.py).

Fair across jobs: a batch takes every job's next item before any job's second, so a long
upload's 60 s chunk (60 windows) cannot hold a short request's few windows behind it.
A failing batch is retried item by item, so a bad item fails only its own caller. Cancelled
callers' items are dropped before they reach the model. Inference runs on ``executor``: a
dedicated thread (the speaker models are not thread-safe across concurrent calls, and one
thread keeps speaker work to one core beside the Whisper engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Item(Generic[T, R]):
    job: Hashable
    value: T
    future: asyncio.Future[R]


class ModelBatcher(Generic[T, R]):
    """Pools items from many callers into calls of ``run(items) -> results`` (same order)."""

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
            if not it.future.done():
                it.future.set_exception(RuntimeError(f"{self.name} batcher stopped"))
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
        return sum(1 for q in self._queues.values() for it in q if not it.future.done())

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
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self._take():
                self._running = batch  # until it is answered, retries included
                await self._execute(loop, batch)
                self._running = []

    async def _execute(self, loop: asyncio.AbstractEventLoop, batch: list[_Item[T, R]]) -> None:
        self.shared_calls += len({it.job for it in batch}) > 1
        try:
            results = await self._call(loop, [it.value for it in batch])
        except Exception as exc:
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(exc)
                return
            log.warning("%s batch of %d failed (%s); retrying one by one", self.name,
                        len(batch), exc)
            for it in batch:
                if not it.future.done():
                    await self._execute(loop, [it])
            return
        for it, r in zip(batch, results, strict=True):
            if not it.future.done():
                it.future.set_result(r)

    async def _call(self, loop: asyncio.AbstractEventLoop, values: list[T]) -> Sequence[R]:
        self.calls += 1
        self.items += len(values)
        results = await loop.run_in_executor(self._executor, self._run, values)
        if len(results) != len(values):
            raise RuntimeError(f"{self.name}: {len(results)} results for {len(values)} items")
        return results
