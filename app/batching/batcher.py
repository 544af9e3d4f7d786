"""Cross-request micro-batcher: pools windows from every pending job into engine batches.

Shape borrowed from Ray Serve's batch queue and text-embeddings-inference's queue, on the
batching primitive (app/batching/queue.py, which says how this batcher differs from the speaker
models' one): one asyncio task owns all queue state (no locks), callers get futures that are
resolved only if still pending (cancelled callers cost nothing), a failed batch is split until
the failure is pinned on its window, and the loop is event-driven: it wakes on a new window or
on the oldest window's deadline, never on a polling sleep.

A batch leaves when a group of compatible windows reaches the cap, or its oldest window has
waited ``max_wait_ms``, and an engine worker is free. Because batches form only when a worker is
free, windows pile up while the engine is busy and the next batch is full: under load the
engine runs full batches; when idle, a lone request waits at most ``max_wait_ms`` (with two
stages, windows to encode do not wait: see _to_encode).

Two stages (CPU): a batch may instead be an *encode* of queued windows or a *decode* of
encoded ones gathered across calls; see app/batching/stages.py. Urgency (live finals first,
interim decodes shed), the workers kept free of bulk work, the cost budget of a batch and the
fallback decode run apart from its batch: app/batching/urgency.py, with the measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from app.batching.calls import EngineCalls, RunBatch
from app.batching.capacity import BatchCap, WorkerSlots, beams
from app.batching.fairness import JobLedger, fair_order
from app.batching.stages import Batch, DecodePool, GroupKey, Item, Stage, Stages, urgent_first
from app.batching.urgency import (
    CostModel,
    SlotPolicy,
    has_final,
    oldest_final,
    shed_stale,
    supersede,
)
from app.config import BatcherSettings
from app.errors import ShuttingDown
from app.metrics import Metrics
from app.windows import N_SAMPLES, DecodeOptions, Refresh, Urgency, Window, WindowResult

log = logging.getLogger(__name__)


class Batcher(EngineCalls):
    def __init__(
        self, run_batch: RunBatch, settings: BatcherSettings, workers: int, metrics: Metrics,
        size_class: Callable[[Window], float] | None = None, base_memory_mb: float = 0.0,
        stages: Stages | None = None, padded: Callable[[Window], int] | None = None,
    ) -> None:
        self._run_batch = run_batch
        self._stages = stages
        # Windows of one size class batch best together: with the engine's dynamic time axis,
        # its padded-length class (one encoder shape); otherwise duration buckets.
        bucket = settings.duration_bucket_s
        self._size_class = size_class or (lambda w: w.duration // bucket)
        self._in_flight = 0  # windows inside engine calls right now
        self._small: set[int] = set()  # id() of running batches of <= cap/4 windows
        self.settings = settings
        self._cap = BatchCap(settings, metrics, base_memory_mb)  # OOM backoff, memory budget
        self._metrics = metrics
        self._groups: dict[DecodeOptions, list[Item]] = {}  # queued, by options
        self._pool = DecodePool()  # two stages: encoded windows waiting for a decoder batch
        self._wake = asyncio.Event()
        self._slots = WorkerSlots(workers)
        self.workers = workers
        # Windows per job taken and not answered, and the engine memory they hold.
        padded = padded or (stages.padded if stages else (lambda w: N_SAMPLES))
        self._padded = padded
        self._jobs = JobLedger(settings, workers, padded, self._wake)
        self._redo: list[Item] = []  # decoded windows waiting for their fallback call
        self._cost = CostModel(settings.batch_cost_s)
        self._live = 0  # live windows submitted and not answered: the cost budget is on
        self._policy = SlotPolicy(settings.reserved_slots if stages else 0,
                                  live_share=settings.bulk_share_beside_live)
        self._shed_count = metrics.interim_shed.inc
        self._running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ---- caller side -------------------------------------------------------------------------
    def submit(
        self, job_id: str, windows: Sequence[Window], options: DecodeOptions, *,
        first_rank: int = 0, job_windows: int | None = None, owner: str | None = None,
        urgency: Urgency = Urgency.REQUEST, refresh: Refresh = (0, 0.0),
    ) -> list[asyncio.Future[WindowResult]]:
        """Queue windows of a job; returns one future per window, in the same order.

        A long upload arrives in several calls as its audio is prepared: ``first_rank`` is the
        first window's index in the job, and ``job_windows`` the job's size (estimated from its
        duration until it is all cut), which tells a short request from a long one.
        ``urgency``: live finals go first; a live interim's future may raise ``Shed`` (see
        app/batching/urgency.py), and a newer interim of the job sheds the older ones waiting;
        ``refresh``: an interim's place among the interims waiting (app/windows.Refresh)."""
        if self._stopping:
            raise ShuttingDown("batcher is stopping")
        loop = asyncio.get_running_loop()
        if urgency is Urgency.LIVE_INTERIM:
            supersede(self._waiting(), job_id, self._shed_count)
        group = self._groups.setdefault(options, [])
        size = max(job_windows or 0, first_rank + len(windows))
        if urgency is not Urgency.REQUEST or size <= self.cap:  # short or live: keep the reserve
            self._policy.saw_light(time.monotonic(), live=urgency is not Urgency.REQUEST)
        futures = []
        for k, w in enumerate(windows):
            fut: asyncio.Future[WindowResult] = loop.create_future()
            padded = self._stages.padded(w) if self._stages else 0
            group.append(Item(job_id, first_rank + k, w, options, fut, job_windows=size,
                              padded=padded, owner=owner, urgency=urgency, refresh=refresh))
            if urgency is not Urgency.REQUEST:
                self._live += 1
                fut.add_done_callback(self._live_done)
            futures.append(fut)
        self._update_gauges()
        self._wake.set()
        return futures

    def demote(self, job_id: str) -> None:
        """A live final that became an interim (its turn went on after the pause it was
        started at, app/live/session.py): its windows not yet in an engine call wait as
        interims from now on, behind every true final (and may be shed like one)."""
        for i in self._waiting():
            if i.job_id == job_id and i.urgency is Urgency.LIVE_FINAL:
                i.urgency, i.refresh = Urgency.LIVE_INTERIM, (0, i.enqueued)

    def oldest_call_s(self) -> float:
        """How long the oldest engine call still running has run (0.0: none). A call the
        engine never returns from keeps growing this: /healthz reports it as a stall."""
        return self._slots.oldest_call_s()

    def pending(self) -> int:
        """Windows waiting: for an engine call, or (two stages) between encode and decode."""
        queued = sum(1 for g in self._groups.values() for i in g if not i.future.done())
        return queued + self._pool.pending() + sum(not i.future.done() for i in self._redo)

    def _live_done(self, _: object) -> None:
        self._live -= 1

    def _waiting(self) -> list[Item]:
        """Windows not in an engine call: queued, encoded in the pool, waiting for a redo."""
        return [*(i for g in self._groups.values() for i in g),
                *(i for g in self._pool.groups.values() for i in g), *self._redo]

    def retire_slots(self, n: int) -> None:
        """Take ``n`` worker slots: an engine left the rotation (see WorkerSlots)."""
        self._slots.retire(n)

    def restore_slots(self, n: int) -> None:
        """Give back ``n`` retired slots (the engine is back in rotation)."""
        self._slots.restore(n)
        self._wake.set()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batcher")

    async def stop(self, grace_s: float) -> None:
        """Stop forming batches, let batches in flight finish (up to ``grace_s``), fail the rest.
        Windows already encoded are decoded within the grace too (the encoder was most of their
        cost)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        self._stopping = True
        self._slots.stop()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._running:
            await asyncio.wait(self._running, timeout=grace_s)
        while self._pool.groups and loop.time() < end:
            key = next(iter(self._pool.groups))
            batch = Batch("decode", key[0], self._pool.take(key, self.limit("decode", key[0])))
            self._in_flight += len(batch.items)
            task = asyncio.create_task(self._run(batch))
            await asyncio.wait({task}, timeout=max(0.0, end - loop.time()))
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for item in [*(i for g in self._groups.values() for i in g), *self._pool.drain(),
                     *self._redo]:
            item.fail(ShuttingDown("service stopping; the job stays queued"))
        self._groups.clear()
        self._redo.clear()

    # ---- the owner loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            self._policy.bulk_running += batch.bulk
            task = asyncio.create_task(self._dispatch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> Batch:
        while True:
            self._wake.clear()
            now = time.monotonic()
            ready, deadline = self._pick(now)
            if ready is not None:
                return ready
            timeout = None if deadline is None else max(0.0, deadline - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # not wait_for: see app/jobs/webhooks.py
                    await self._wake.wait()

    def _pick(self, now: float) -> tuple[Batch | None, float | None]:
        """The batch to run now, else when to look again.

        One stage: a group of queued windows that is full, or whose oldest is due (two stages:
        or that holds windows to encode, see _to_encode).
        Two stages, in this order: an encoded group that is full or has waited
        ``max_decode_wait_ms``; queued windows to encode, as above (the encoder costs the same
        per window in any batch, so encoding early loses nothing, and the windows it moves to
        the pool grow the decoder batches); else the largest encoded group, so that a worker
        never idles while there is work. Before all that, a group holding a live final (it is
        ready at once) and, on a worker bulk may take, a window waiting for its redo.
        """
        wait_s = self.settings.max_wait_ms / 1000
        ready: list[tuple[bool, float, DecodeOptions]] = []
        deadline: float | None = None
        shed_stale(self._waiting(), now, self.settings.interim_max_wait_ms / 1000, self._shed_count)
        for key in list(self._groups):
            live = [i for i in self._groups[key] if not i.future.done()]  # drop cancelled
            if not live:
                del self._groups[key]
                continue
            self._groups[key] = live
            oldest = live[0].enqueued
            final = has_final(live)
            if (len(live) >= self.limit("run", key) or oldest + wait_s <= now or final
                    or self._to_encode(live)):
                ready.append((not final, oldest, key))
            elif deadline is None or oldest + wait_s < deadline:
                deadline = oldest + wait_s
        ready.sort(key=lambda r: r[:2])
        self._redo = [i for i in self._redo if not i.future.done()]
        # Live finals in arrival order, wherever they wait: a final's fallback, an encoded final
        # in the pool, a final still to encode (oldest_final). Measured at 16 streams (trace at
        # 91694fb): a queued-finals-first rule left a final's 30 s fallback waiting 10-25 s
        # behind a stream of newer finals, and an encoded one up to 7 s.
        where = oldest_final(self._groups.values(), self._pool.groups.values(), self._redo)
        if where == "redo":
            item = next(i for i in self._redo if i.urgency is Urgency.LIVE_FINAL)
            self._redo.remove(item)
            self._in_flight += 1
            return Batch("redo", item.options, [item]), None
        first = where == "queue"  # a final is queued: it goes before the pool
        if self._stages is not None and not first:
            decode, due = self._pick_decode(now, idle=not ready)
            if decode is not None:
                return decode, None
            deadline = min((d for d in (deadline, due) if d is not None), default=None)
        if self._redo and not first and self._policy.bulk_ok(self._slots.in_rotation):
            item = self._redo.pop(0)
            self._in_flight += 1
            return Batch("redo", item.options, [item], bulk=True), None
        # The first ready group whose windows may go now: a job at its memory share
        # (job_memory_mb) waits for one of its windows to finish, which wakes this loop, and a
        # long job's windows wait for a worker bulk may take (app/batching/urgency.py).
        items: list[Item] = []
        for _, _, key in ready:
            items = self._take(self._groups[key])
            if items:
                break
        if not items:
            if first and self._stages is not None:  # the final's group could not go: decode
                return self._pick_decode(now, idle=True)[0], deadline
            held = self._policy.held_until(now)  # bulk waits out its share beside live sessions
            if held is not None:
                deadline = held if deadline is None else min(deadline, held)
            return None, deadline
        # An upload of more windows than a batch holds fills decoder batches by itself: its
        # windows run both stages in one call and stay out of the pool. An upload of a few
        # windows (say 50 s: one of 15 s, two of 30 s) does not: its one-call sub-batches of
        # one or two windows per length decode at 1.5-2.3x the cost per window of a pooled
        # batch of six (30 s windows, one thread: 461 ms alone, 310 ms in two, 200 ms in six),
        # so it goes through the pool like a short request.
        staged = self._to_encode(items)
        batch = Batch("encode" if staged else "run", key, items,
                      bulk=any(self._policy.heavy(i, self.cap) for i in items))
        if staged:
            self._pool.encoding(items, +1)
        self._update_gauges()
        return batch, None

    def _to_encode(self, items: list[Item]) -> bool:
        """Two stages: these windows are encoded and pooled, not run in one call (any of them
        from an upload of at most a batch of windows, see above). They need not wait for a
        fuller batch either: the encoder costs the same per window in a batch of one as of
        eight, and batching pays in the decoder groups they join once encoded. So a lone
        request no longer waits ``max_wait_ms`` (50 ms) for company; under load, where a worker
        frees up only after windows have piled up, decoder batches stayed the same (32
        clients: mean 8.2 both ways)."""
        return self._stages is not None and any(i.job_windows <= self.cap for i in items)

    def _pick_decode(self, now: float, idle: bool, among: set[GroupKey] | None = None
                     ) -> tuple[Batch | None, float | None]:
        """An encoded group to decode, if one is ready (see app/batching/stages.py). A group of only long
        uploads' windows, on the last free worker, decodes a small batch, as in _take."""
        small = self.small_batch
        limit = self.limit("decode")
        key, deadline = self._pool.select(
            now, wait_s=self.settings.max_decode_wait_ms / 1000, limit=limit, small=small,
            idle=idle, queued=(i for g in self._groups.values() for i in g),
            shorts_in_flight=self._jobs.short_in_flight, among=among)
        if key is None:
            return None, deadline
        limit = self.limit("decode", key[0])
        group = self._pool.groups[key]
        if self._live:  # the cost budget, while live windows are in the service
            limit = max(1, len(self._cost.within("decode", group[:limit], self._padded_s)))
        if all(i.job_windows > small for i in group) and self._slots.locked() and not self._small:
            limit = min(limit, small)
        items = self._pool.take(key, limit)
        self._in_flight += len(items)
        if len(items) <= small:
            self._small.add(id(items))
        self._update_gauges()
        return Batch("decode", key[0], items), None

    @property
    def small_batch(self) -> int:  # beside a long upload; also the most windows of a short job
        return max(1, self.cap // 4)

    @property
    def cap(self) -> int:  # the batch cap now (halved after an OOM, see app/batching/capacity.py)
        return self._cap.value

    def limit(self, stage: Stage = "run", options: DecodeOptions | None = None) -> int:
        """Windows the next batch may take (see app/batching/capacity.py): windows x beam count
        where the cap is sized in them (GPU)."""
        return self._cap.limit(stage, self._in_flight, beams(options) if options else 1)

    def _take(self, group: list[Item]) -> list[Item]:
        """Choose up to ``cap`` windows of one group: in fair order (see
        app/batching/fairness.py), within each job's memory, and beside a long upload a batch of
        its own for new requests."""
        ranked = urgent_first(fair_order(group, self._size_class))
        if not self._policy.bulk_ok(self._slots.in_rotation):  # a reserved worker: no bulk
            ranked = [i for i in ranked if not self._policy.heavy(i, self.cap)]
        limit = self.limit("run", group[0].options)
        small = self.small_batch
        if self._running:
            # Keep new requests responsive beside a long upload. Windows of jobs with nothing
            # running yet (a short request that just arrived) go in a batch of their own, not
            # padded to the upload's 30 s windows nor waiting on its full batch. With no such
            # job, the last free worker (the others all running full batches) takes only a
            # small batch, so the next short request waits for a small batch, not a full one
            # on every worker; one small batch at a time keeps the rest full for throughput.
            # Live finals always go (first).
            finals = [i for i in ranked if i.urgency is Urgency.LIVE_FINAL]
            fresh = [i for i in ranked if self._jobs.fresh(i.job_id) and i not in finals]
            if finals or fresh:
                ranked = finals + fresh
            elif self._slots.locked() and not self._small:
                limit = min(limit, small)
        chosen = self._jobs.within_memory(ranked, limit)
        if self._live and self._to_encode(chosen):
            # One window per encoder call while live windows are in: the encoder costs the same
            # per window in a batch of one as of eight (see _to_encode), so a batch only makes
            # its first windows wait for the others. Measured at 16 streams (91694fb): finals
            # waited for encoder calls of 6-8 windows (1.9-2.7 s) before their own decode.
            chosen = chosen[:1]
        elif self._live and not any(self._policy.heavy(i, self.cap) for i in chosen):
            chosen = self._cost.within("run", chosen, self._padded_s)
        self._in_flight += len(chosen)
        self._jobs.taken(chosen, small)
        taken = set(map(id, chosen))
        group[:] = [i for i in group if id(i) not in taken]
        # Each job's windows in time order inside the batch: cosmetic, but keeps logs readable.
        batch = sorted(chosen, key=lambda i: (i.job_id, i.rank))
        if batch and len(batch) <= small:
            self._small.add(id(batch))  # the same list object reaches _dispatch
        return batch

    # ---- running a batch ---------------------------------------------------------------------
    async def _dispatch(self, batch: Batch) -> None:
        """Run a batch on the slot it was given; after an encode, decode on the same slot any
        group of its windows that is ready (a short request then waits for one free worker,
        not two), and only then hand the slot back."""
        started = time.monotonic()
        try:
            next_batch: Batch | None = batch
            while next_batch is not None:
                await self._run(next_batch)
                next_batch = self._chained(next_batch)
        finally:
            self._policy.bulk_running -= batch.bulk
            if batch.bulk:
                self._policy.bulk_done(started, time.monotonic())
            self._slots.release()
            self._update_gauges()
            self._wake.set()  # encoded windows may complete a decode group

    def _chained(self, done: Batch) -> Batch | None:
        if done.stage != "encode" or self._stopping:
            return None
        mine = {(done.options, i.padded) for i in done.items}
        return self._pick_decode(time.monotonic(), idle=False, among=mine)[0]

    def _update_gauges(self) -> None:
        self._metrics.pending_windows.set(self.pending())

