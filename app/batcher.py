"""Cross-request micro-batcher: pools windows from every pending job into engine batches.

Shape borrowed from Ray Serve's batch queue and text-embeddings-inference's queue: one asyncio task
owns all queue state (no locks), callers get futures that are resolved only if still pending
(cancelled callers cost nothing), and the loop is event-driven: it wakes on a new window or on
the oldest window's deadline, never on a polling sleep.

A batch leaves when a group of compatible windows reaches the cap, or its oldest window has
waited ``max_wait_ms``, and an engine worker is free. Because batches form only when a worker is
free, windows pile up while the engine is busy and the next batch is full: under load the
engine runs full batches; when idle, a lone request waits at most ``max_wait_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from app.config import BatcherSettings
from app.device import is_oom
from app.engine import WINDOW_S, DecodeOptions, Window, WindowResult
from app.errors import ShuttingDown, TranscriptionFailed
from app.metrics import Metrics

log = logging.getLogger(__name__)

RunBatch = Callable[[Sequence[Window], DecodeOptions], Awaitable[list[WindowResult]]]


@dataclass(eq=False)
class Item:
    job_id: str
    rank: int  # position of this window among its job's windows still to submit: fairness key
    window: Window
    options: DecodeOptions
    future: asyncio.Future[WindowResult]
    enqueued: float = field(default_factory=time.monotonic)


class Batcher:
    def __init__(
        self, run_batch: RunBatch, settings: BatcherSettings, workers: int, metrics: Metrics,
        size_class: Callable[[Window], float] | None = None, base_memory_mb: float = 0.0,
    ) -> None:
        self._run_batch = run_batch
        # Windows of one size class batch best together: with the engine's dynamic time axis,
        # its padded-length class (one encoder shape); otherwise duration buckets.
        bucket = settings.duration_bucket_s
        self._size_class = size_class or (lambda w: w.duration // bucket)
        self._base_memory_mb = base_memory_mb  # held before any batch: the resident model
        self._in_flight = 0  # windows handed to the engine and not yet back
        self._job_in_flight: dict[str, int] = {}  # the same, per job
        self._small: set[int] = set()  # id() of running batches of <= cap/4 windows
        self.settings = settings
        self.cap = settings.max_batch_size
        self._streak = 0
        self._metrics = metrics
        self._groups: dict[DecodeOptions, list[Item]] = {}
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(workers)
        self._retiring: set[asyncio.Task[None]] = set()  # see retire_slots
        self._running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        metrics.batch_cap.set(self.cap)

    # ---- caller side -------------------------------------------------------------------------
    def submit(
        self, job_id: str, windows: Sequence[Window], options: DecodeOptions
    ) -> list[asyncio.Future[WindowResult]]:
        """Queue a job's windows; returns one future per window, in the same order."""
        if self._stopping:
            raise ShuttingDown("batcher is stopping")
        loop = asyncio.get_running_loop()
        group = self._groups.setdefault(options, [])
        futures = []
        for rank, w in enumerate(windows):
            fut: asyncio.Future[WindowResult] = loop.create_future()
            group.append(Item(job_id, rank, w, options, fut))
            futures.append(fut)
        self._update_gauges()
        self._wake.set()
        return futures

    def pending(self) -> int:
        return sum(1 for g in self._groups.values() for i in g if not i.future.done())

    def retire_slots(self, n: int) -> None:
        """Take ``n`` worker slots for good (an engine left the pool, see app/placement.py), so
        batches form only for threads that can run them, instead of waiting behind the others
        with whatever windows had arrived."""
        async def hold() -> None:
            for _ in range(n):
                await self._slots.acquire()

        self._retiring.add(asyncio.ensure_future(hold()))

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batcher")

    async def stop(self, grace_s: float) -> None:
        """Stop forming batches, let batches in flight finish (up to ``grace_s``), fail the rest."""
        self._stopping = True
        for t in self._retiring:
            t.cancel()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._running:
            await asyncio.wait(self._running, timeout=grace_s)
        for group in self._groups.values():
            for item in group:
                _fail(item, ShuttingDown("service stopping; the job stays queued"))
        self._groups.clear()

    # ---- the owner loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                key, items = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._dispatch(key, items))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> tuple[DecodeOptions, list[Item]]:
        while True:
            self._wake.clear()
            now = time.monotonic()
            ready, deadline = self._pick(now)
            if ready is not None:
                return ready
            timeout = None if deadline is None else max(0.0, deadline - now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _pick(self, now: float) -> tuple[tuple[DecodeOptions, list[Item]] | None, float | None]:
        """The group to run now (full, or its oldest window is due), else the next deadline."""
        wait_s = self.settings.max_wait_ms / 1000
        best: tuple[float, DecodeOptions] | None = None
        deadline: float | None = None
        for key in list(self._groups):
            live = [i for i in self._groups[key] if not i.future.done()]  # drop cancelled
            if not live:
                del self._groups[key]
                continue
            self._groups[key] = live
            oldest = live[0].enqueued
            if len(live) >= self.limit() or oldest + wait_s <= now:
                if best is None or oldest < best[0]:
                    best = (oldest, key)
            elif deadline is None or oldest + wait_s < deadline:
                deadline = oldest + wait_s
        if best is None:
            return None, deadline
        key = best[1]
        items = self._take(self._groups[key])
        self._update_gauges()
        return (key, items), None

    def limit(self) -> int:
        """Windows the next batch may take: the (OOM-adjusted) cap, within the memory budget."""
        s = self.settings
        if not s.memory_budget_mb:
            return self.cap
        room = int((s.memory_budget_mb - self._base_memory_mb) / s.window_memory_mb)
        return max(1, min(self.cap, room - self._in_flight))

    def _take(self, group: list[Item]) -> list[Item]:
        """Choose up to ``cap`` windows of one group: fair across jobs, similar lengths together.

        Sort key: (rank within its job, size-class distance from the oldest window, age).
        Rank first means every waiting job gets its next window in before any job gets a second
        one, so an hour-long upload cannot starve a 5 s request; among equals, windows of
        similar length share a batch so their decodes finish together.
        """
        seed_class = self._size_class(group[0].window)
        job_rank: dict[str, int] = {}
        ranked = []
        for i in group:
            r = job_rank.get(i.job_id, 0)
            job_rank[i.job_id] = r + 1
            ranked.append((r, abs(self._size_class(i.window) - seed_class), i.enqueued, i))
        ranked.sort(key=lambda t: t[:3])
        limit = self.limit()
        small = max(1, self.cap // 4)
        if self._running:
            # Keep new requests responsive beside a long upload. Windows of jobs with nothing
            # running yet (a short request that just arrived) go in a batch of their own, not
            # padded to the upload's 30 s windows nor waiting on its full batch. With no such
            # job, the last free worker (the others all running full batches) takes only a
            # small batch, so the next short request waits for a small batch, not a full one
            # on every worker; one small batch at a time keeps the rest full for throughput.
            fresh = [t for t in ranked if not self._job_in_flight.get(t[3].job_id)]
            if fresh:
                ranked = fresh
            elif self._slots.locked() and not self._small:
                limit = min(limit, small)
        chosen = [t[3] for t in ranked[:limit]]
        self._in_flight += len(chosen)
        for i in chosen:
            self._job_in_flight[i.job_id] = self._job_in_flight.get(i.job_id, 0) + 1
        taken = set(map(id, chosen))
        group[:] = [i for i in group if id(i) not in taken]
        # Each job's windows in time order inside the batch: cosmetic, but keeps logs readable.
        batch = sorted(chosen, key=lambda i: (i.job_id, i.rank))
        if len(batch) <= small:
            self._small.add(id(batch))  # the same list object reaches _dispatch
        return batch

    # ---- running a batch ---------------------------------------------------------------------
    async def _dispatch(self, key: DecodeOptions, items: list[Item]) -> None:
        now = time.monotonic()
        for i in items:  # once per window, here: OOM retries of a split batch do not count again
            if not i.future.done():
                self._metrics.queue_wait.observe(now - i.enqueued)
        try:
            await self._execute(key, items)
        except BaseException as exc:  # never leave a caller hanging, whatever happened
            for i in items:
                _fail(i, exc if isinstance(exc, Exception) else ShuttingDown("cancelled"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._small.discard(id(items))
            self._in_flight -= len(items)
            for i in items:
                left = self._job_in_flight.get(i.job_id, 1) - 1
                if left:
                    self._job_in_flight[i.job_id] = left
                else:
                    self._job_in_flight.pop(i.job_id, None)
            self._slots.release()
            self._update_gauges()

    async def _execute(self, key: DecodeOptions, items: list[Item]) -> None:
        items = [i for i in items if not i.future.done()]  # cancelled while waiting: free
        if not items:
            return
        m = self._metrics
        start = time.monotonic()
        try:
            results = await self._run_batch([i.window for i in items], key)
        except Exception as exc:
            m.processing.inc(time.monotonic() - start)  # engine time spent, even if wasted
            await self._recover(key, items, exc)
            return
        elapsed = time.monotonic() - start
        audio = sum(i.window.duration for i in items)
        m.batches.labels("ok").inc()
        m.batch_size.observe(len(items))
        m.batch_duration.observe(elapsed)
        m.processing.inc(elapsed)
        m.audio_processed.inc(audio)
        m.batch_fill.observe(min(1.0, audio / (len(items) * WINDOW_S)))
        for i, r in zip(items, results, strict=True):
            if not i.future.done():
                i.future.set_result(r)
        self._streak += 1
        if self.cap < self.settings.max_batch_size and self._streak >= self.settings.regrow_after:
            self.cap = min(self.settings.max_batch_size, self.cap * 2)
            self._streak = 0
            m.batch_cap.set(self.cap)
            log.info("batch cap regrown to %d", self.cap)

    async def _recover(self, key: DecodeOptions, items: list[Item], exc: Exception) -> None:
        """Split a failed batch to isolate the cause; on OOM also halve the cap."""
        m = self._metrics
        m.batches.labels("oom" if is_oom(exc) else "error").inc()
        if is_oom(exc):
            m.oom_events.inc()
            # Halve relative to the batch that failed, never below what already fits.
            self.cap = max(1, min(self.cap, len(items) // 2))
            self._streak = 0
            m.batch_cap.set(self.cap)
            log.warning("engine OOM on %d windows; cap now %d", len(items), self.cap)
        if len(items) == 1:
            log.error("window of job %s failed: %s", items[0].job_id, exc)
            _fail(items[0], TranscriptionFailed(
                f"inference failed for the window at {items[0].window.start:.1f}s: {exc}",
                cause="out_of_memory" if is_oom(exc) else type(exc).__name__,
            ))
            return
        half = len(items) // 2
        await self._execute(key, items[:half])
        await self._execute(key, items[half:])

    def _update_gauges(self) -> None:
        self._metrics.pending_windows.set(self.pending())


def _fail(item: Item, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)
