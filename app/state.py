"""What the app holds while it runs (``app.state.bs``): built in the lifespan, never at import."""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from app.api.feeds import EventHub
from app.batching.batcher import Batcher
from app.config import Settings
from app.engine.device import DeviceMonitor
from app.engine.placement import EnginePool
from app.jobs.runner import JobRunner
from app.jobs.store import JobStore
from app.metrics import Metrics
from app.net.outbound import OutboundGuard

RECENT_SPEED_S = 300.0  # the window "current speed" is measured over
MIN_BUSY_S = 5.0  # engine time that window needs before it is trusted over the whole run
# ... and transcribed audio. Encoder calls count their engine time when they end, their windows'
# audio only once decoded (up to batcher.max_decode_wait_ms later), so the first seconds of a run
# read ~0x: in the soak (loadtest/soak.py), 10 s after the start, /v1 refused a 1 s clip with a
# 413 "more than this service transcribes within 540 s", and Retry-After hit its 3600 s cap.
MIN_AUDIO_S = 30.0
DEFAULT_SPEED = 10.0  # audio s per wall s assumed until enough is measured


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    store: JobStore
    spool_dir: Path
    runner: JobRunner
    batcher: Batcher
    engine: EnginePool  # the engines (one per GPU) behind the batcher
    monitor: DeviceMonitor
    outbound: OutboundGuard  # every request to a URL a client named (webhooks, audio_url)
    feeds: EventHub  # event streams: one store reader per watched job, capped per key
    ready: bool = False
    admission: asyncio.Lock = field(default_factory=asyncio.Lock)  # one backlog check at a time
    # Per API key: audio seconds and jobs admitted whose rows are not committed yet (see
    # api.limits.admitted), and the last (monotonic time, seconds, jobs) read from the store.
    key_admitting_s: defaultdict[str | None, float] = field(
        default_factory=lambda: defaultdict(float))
    key_admitting_jobs: defaultdict[str | None, int] = field(
        default_factory=lambda: defaultdict(int))
    key_load: dict[str | None, tuple[float, float, int]] = field(default_factory=dict)
    extras: dict[str, object] = field(default_factory=dict)
    # (monotonic time, audio processed, engine busy s) at recent Retry-After estimates.
    _speed: deque[tuple[float, float, float]] = field(default_factory=deque)

    def retry_after_s(self, excess_audio_s: float) -> int:
        """Seconds until the backlog has drained by ``excess_audio_s`` at the current speed."""
        return max(1, min(3600, math.ceil(excess_audio_s / max(self.speed(), 0.1))))

    def speed(self) -> float:
        """Audio seconds the service transcribes per wall second now.

        Current: over the batches of the last few minutes (the load mix, beam sizes or a
        co-tenant change the speed), falling back to the whole run while those are too few,
        and to ``DEFAULT_SPEED`` while the whole run has measured too little.
        """
        m = self.metrics
        now, audio, busy = time.monotonic(), m.audio_processed._value.get(), m.processing._value.get()
        recent = self._speed
        if not recent or now - recent[-1][0] >= 1.0:  # one sample a second bounds the deque
            recent.append((now, audio, busy))
        while len(recent) > 1 and recent[0][0] < now - RECENT_SPEED_S:
            recent.popleft()
        _, audio0, busy0 = recent[0]
        if busy - busy0 >= MIN_BUSY_S and audio - audio0 >= MIN_AUDIO_S:
            audio, busy = audio - audio0, busy - busy0
        elif busy < MIN_BUSY_S or audio < MIN_AUDIO_S:
            return DEFAULT_SPEED
        # Throughput in audio s per wall s: per-worker speed times the workers running at once.
        return (audio / busy) * self.engine.workers

    def refresh_gauges(self) -> None:
        """Point-in-time gauges read at scrape time (cheap: NVML or /proc, no locks)."""
        m = self.metrics
        m.pending_windows.set(self.batcher.pending())
        m.engine_call_age.set(self.batcher.oldest_call_s())
        m.record_memory(self.monitor.read())
