"""How many windows the next batch may take: the batch cap, windows x beam, the memory budget.

The cap starts at ``max_batch_size``: on CPU as configured (8, measured there), on GPU what the
start-up sizing measured on the device (app/engine/sizing.py resolves it into the settings the
batcher gets). With ``max_batch_beams`` set (GPU), a batch also holds at most that many windows
x beam size: beam search keeps ``beam`` decoder states per window, each with its own attention
caches, so a beam-10 request's windows take ten times the memory of greedy ones.

An out-of-memory error halves the cap (relative to the batch that failed, counted in windows x
beam, never below what already fits) and ``regrow_after`` clean batches in a row double it
again, up to where it started, so one oversized moment does not cost throughput for good. On
CPU, with ``memory_budget_mb`` set, the windows in flight never exceed what the budget left after
the resident model can hold (``window_memory_mb`` each, measured by ``python -m loadtest.sweep``).

How many batches run at once: one per engine worker (:class:`WorkerSlots`), fewer while an
engine is out of the rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from app.batching.stages import Stage
from app.config import BatcherSettings
from app.metrics import Metrics
from app.windows import DecodeOptions

log = logging.getLogger(__name__)


class BatchCap:
    def __init__(self, settings: BatcherSettings, metrics: Metrics,
                 base_memory_mb: float = 0.0) -> None:
        self.settings = settings
        self.value = settings.max_batch_size  # windows per batch at beam 1; halved after an OOM
        self._base_memory_mb = base_memory_mb  # held before any batch: the resident model
        self._streak = 0
        self._metrics = metrics
        metrics.batch_cap.set(self.value)

    def _scaled(self, full: int) -> int:
        """``full`` (a bound stated at the full cap) scaled down with the cap after an OOM."""
        return max(1, full * self.value // self.settings.max_batch_size)

    def limit(self, stage: Stage, in_flight: int, beam: int = 1) -> int:
        """Windows the next batch may take, with ``in_flight`` windows already in engine calls
        and ``beam`` the batch's beam size (1 for greedy and for sampling). A decoder batch's
        cap is ``max_decode_batch_size``, scaled down with the cap."""
        s = self.settings
        cap = self.value
        if stage == "decode":
            cap = self._scaled(s.max_decode_batch_size)
        if s.max_batch_beams and beam > 1:
            cap = max(1, min(cap, self._scaled(s.max_batch_beams) // beam))
        if not s.memory_budget_mb:
            return cap
        room = int((s.memory_budget_mb - self._base_memory_mb) / s.window_memory_mb)
        return max(1, min(cap, room - in_flight))

    def succeeded(self) -> None:
        """A batch ran: after ``regrow_after`` in a row, a halved cap doubles again."""
        self._streak += 1
        s = self.settings
        if self.value < s.max_batch_size and self._streak >= s.regrow_after:
            self.value = min(s.max_batch_size, self.value * 2)
            self._streak = 0
            self._metrics.batch_cap.set(self.value)
            log.info("batch cap regrown to %d", self.value)

    def out_of_memory(self, failed: int, beam: int = 1) -> None:
        """A batch of ``failed`` windows at beam size ``beam`` ran out of memory: halve the cap
        (with windows x beam counted, what failed was ``failed * beam`` of them)."""
        self._metrics.oom_events.inc()
        units = failed * beam if self.settings.max_batch_beams else failed
        self.value = max(1, min(self.value, units // 2))
        self._streak = 0
        self._metrics.batch_cap.set(self.value)
        log.warning("engine OOM on %d windows (beam %d); cap now %d", failed, beam, self.value)


def beams(options: DecodeOptions) -> int:
    """Decoder states per window: the beam, or 1 when sampling. A wider ``other_beam_size`` is
    not counted: on a GPU the engine decodes those windows in parts that fit (``_decode``)."""
    return options.beam_size if options.temperature == 0 else 1


class WorkerSlots(asyncio.Semaphore):
    """One slot per engine worker: a batch forms only when a slot is free. When an engine leaves
    the rotation (app/engine/placement.py) its slots are retired, so batches form only for
    threads that can run them instead of waiting behind the others with whatever windows had
    arrived; they come back with the engine. Also when each engine call running began."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._workers = workers
        self._retiring: set[asyncio.Task[None]] = set()
        self._retired = 0
        self._calls: dict[int, float] = {}  # engine calls running: id(windows) -> start

    @contextlib.contextmanager
    def call(self, windows: object, start: float) -> Iterator[None]:
        self._calls[id(windows)] = start
        try:
            yield
        finally:  # returned, raised or cancelled: no longer running
            del self._calls[id(windows)]

    @property
    def in_rotation(self) -> int:
        """Workers whose engine is in the rotation (all of them, less the retired slots)."""
        return self._workers - self._retired

    def oldest_call_s(self) -> float:
        return time.monotonic() - min(self._calls.values()) if self._calls else 0.0

    def retire(self, n: int) -> None:
        async def hold() -> None:
            for _ in range(n):
                await self.acquire()
                self._retired += 1

        self._retiring.add(asyncio.ensure_future(hold()))

    def restore(self, n: int) -> None:
        for _ in range(min(n, self._retired)):
            self._retired -= 1
            self.release()

    def stop(self) -> None:
        for t in self._retiring:
            t.cancel()
