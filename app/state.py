"""What the app holds while it runs (``app.state.bs``): built in the lifespan, never at import."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from app.batcher import Batcher
from app.config import Settings
from app.device import DeviceMonitor
from app.jobs import JobRunner
from app.metrics import Metrics
from app.placement import EnginePool
from app.store import JobStore


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    store: JobStore
    spool_dir: Path
    languages: frozenset[str]
    runner: JobRunner
    batcher: Batcher
    engine: EnginePool  # the engines (one per GPU) behind the batcher
    monitor: DeviceMonitor
    ready: bool = False
    extras: dict[str, object] = field(default_factory=dict)

    def retry_after_s(self, excess_audio_s: float) -> int:
        """Seconds until the backlog has drained by ``excess_audio_s`` at the observed speed."""
        m = self.metrics
        audio = m.audio_processed._value.get()
        busy = m.processing._value.get()
        # Throughput in audio s per wall s: per-worker speed times the workers running at once.
        speed = (audio / busy) * self.engine.workers if busy > 0 else 10.0
        return max(1, min(3600, math.ceil(excess_audio_s / max(speed, 0.1))))

    def refresh_gauges(self) -> None:
        """Point-in-time gauges read at scrape time (cheap: NVML or /proc, no locks)."""
        m = self.metrics
        m.pending_windows.set(self.batcher.pending())
        m.record_memory(self.monitor.read())
