"""How many windows the next batch may take: the batch cap and the memory budget.

The cap starts at ``max_batch_size``. An out-of-memory error halves it (relative to the batch
that failed, never below what already fits) and ``regrow_after`` clean batches in a row double
it again, so one oversized moment does not cost throughput for good. On top of the cap, with
``memory_budget_mb`` set, the windows in flight never exceed what the budget left after the
resident model can hold (``window_memory_mb`` each, measured by ``python -m loadtest.sweep``).
"""

from __future__ import annotations

import logging

from app.batching.stages import Stage
from app.config import BatcherSettings
from app.metrics import Metrics

log = logging.getLogger(__name__)


class BatchCap:
    def __init__(self, settings: BatcherSettings, metrics: Metrics,
                 base_memory_mb: float = 0.0) -> None:
        self.settings = settings
        self.value = settings.max_batch_size
        self._base_memory_mb = base_memory_mb  # held before any batch: the resident model
        self._streak = 0
        self._metrics = metrics
        metrics.batch_cap.set(self.value)

    def limit(self, stage: Stage, in_flight: int) -> int:
        """Windows the next batch may take, with ``in_flight`` windows already in engine calls.
        A decoder batch's cap is ``max_decode_batch_size``, scaled down with the cap."""
        s = self.settings
        cap = self.value
        if stage == "decode":
            cap = max(1, s.max_decode_batch_size * self.value // s.max_batch_size)
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

    def out_of_memory(self, failed: int) -> None:
        """A batch of ``failed`` windows ran out of memory: halve the cap."""
        self._metrics.oom_events.inc()
        self.value = max(1, min(self.value, failed // 2))
        self._streak = 0
        self._metrics.batch_cap.set(self.value)
        log.warning("engine OOM on %d windows; cap now %d", failed, self.value)
