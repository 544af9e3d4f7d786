"""The speech batcher's engine calls: run one batch, split a failure until it is pinned on its
window, answer each window, and send a window whose decode asks for Whisper's fallback to a call
of its own (stage ``redo``, app/batching/urgency.py says why). A part of
:class:`app.batching.batcher.Batcher`, kept apart to keep each file readable; the batcher's owner
task decides what runs, this runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

from app.batching.capacity import BatchCap, WorkerSlots, beams
from app.batching.queue import answer, isolate
from app.batching.stages import Batch, DecodePool, Item, Stage, Stages, encoded_of
from app.batching.urgency import CostModel
from app.engine.device import is_oom
from app.errors import ShuttingDown, TranscriptionFailed
from app.metrics import Metrics
from app.windows import SAMPLE_RATE, WINDOW_S, DecodeOptions, Urgency, Window, WindowResult

log = logging.getLogger("app.batching.batcher")

RunBatch = Callable[[Sequence[Window], DecodeOptions], Awaitable[list[WindowResult]]]


class EngineCalls:
    """The state it shares with the owner task (set by :class:`Batcher`'s constructor)."""

    _run_batch: RunBatch
    _stages: Stages | None
    _metrics: Metrics
    _slots: WorkerSlots
    _cap: BatchCap
    _pool: DecodePool
    _cost: CostModel
    _redo: list[Item]  # decoded windows waiting for their fallback call
    _small: set[int]
    _in_flight: int
    _padded: Callable[[Window], int]
    _stopping: bool

    async def _run(self, batch: Batch) -> None:
        items = batch.items
        now = time.monotonic()
        if batch.stage in ("run", "encode"):  # once per window: OOM retries do not count
            for i in items:
                if not i.future.done():
                    self._metrics.queue_wait.observe(now - i.enqueued)
        try:
            await self._execute(batch.stage, batch.options, items)
        except BaseException as exc:  # never leave a caller hanging, whatever happened
            for i in items:
                i.fail(exc if isinstance(exc, Exception) else ShuttingDown("cancelled"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._small.discard(id(items))
            self._in_flight -= len(items)
            if batch.stage == "encode":
                self._pool.encoding(items, -1)

    async def _execute(self, stage: Stage, key: DecodeOptions, items: list[Item]) -> None:
        """Run one batch, a failure split until it is pinned on its window (the primitive's
        :func:`app.batching.queue.isolate`)."""
        await isolate(items, partial(self._call, stage, key), self._alone,
                      partial(self._failed, key))

    async def _call(self, stage: Stage, key: DecodeOptions, items: list[Item]) -> None:
        m = self._metrics
        windows = [i.window for i in items]
        start = time.monotonic()
        try:
            with self._slots.call(windows, start):
                if stage == "encode":
                    assert self._stages is not None
                    encoded = await self._stages.encode(windows, key)
                elif stage in ("decode", "redo"):
                    assert self._stages is not None
                    call = self._stages.redo if stage == "redo" else self._stages.decode
                    assert call is not None
                    results = await call(windows, encoded_of(items), key)
                else:
                    results = await self._run_batch(windows, key)
        except Exception:
            m.processing.inc(time.monotonic() - start)  # engine time spent, even if wasted
            raise
        elapsed = time.monotonic() - start
        m.batch_duration.observe(elapsed)
        m.processing.inc(elapsed)
        self._cost.observe(stage, sum(map(self._padded_s, items)), elapsed)
        if stage == "encode" and key.detect_only:  # the language was all it asked for
            for i, e in zip(items, encoded, strict=True):
                answer(i, WindowResult.detection(e.language, e.language_probability))
        elif stage == "encode":
            self._pool.add(items, encoded)
        else:
            if stage != "redo":  # its window was counted in its decoder batch
                m.batch_done(len(items), sum(w.duration for w in windows), WINDOW_S)
            for i, r in zip(items, results, strict=True):
                if r.redo and i.urgency is not Urgency.LIVE_INTERIM and not self._stopping:
                    self._redo.append(i)  # its fallback: a call of its own (see _pick)
                    continue
                r.redo = False  # an interim keeps its first pass: the final supersedes it
                i.encoded = None
                answer(i, r)
        self._cap.succeeded()

    def _padded_s(self, item: Item) -> float:
        return (item.padded or self._padded(item.window)) / SAMPLE_RATE

    def _failed(self, key: DecodeOptions, items: list[Item], exc: Exception) -> None:
        """A failed call (before it is split): on OOM the cap halves too."""
        oom = is_oom(exc)
        self._metrics.batches.labels("oom" if oom else "error").inc()
        if oom:
            self._cap.out_of_memory(len(items), beams(key))

    @staticmethod
    def _alone(item: Item, exc: Exception) -> None:
        log.error("window of job %s failed: %s", item.job_id, exc)
        # The exception's text stays in the log: it may name paths, devices or data.
        item.fail(TranscriptionFailed(
            f"inference failed for the window at {item.window.start:.1f}s",
            cause="out_of_memory" if is_oom(exc) else "engine_error",
        ))
