"""How fast the service transcribes, from its own counters: for Retry-After and /status.

:class:`Speed` is the throughput that 429s (Retry-After) and the synchronous /v1 route's
up-front refusal (413) are judged by; :class:`Speedometer` gives /status its rates over the last
minute. Both read the engine-time and audio counters of :class:`app.metrics.Metrics`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from app.metrics import Metrics

RECENT_SPEED_S = 300.0  # the window "current speed" is measured over
MIN_BUSY_S = 5.0  # engine time that window needs before it is trusted over the whole run
# ... and transcribed audio. Encoder calls count their engine time when they end, their windows'
# audio only once decoded (up to batcher.max_decode_wait_ms later), so the first seconds of a run
# read ~0x: in the soak (loadtest/soak.py), 10 s after the start, /v1 refused a 1 s clip with a
# 413 "more than this service transcribes within 540 s", and Retry-After hit its 3600 s cap.
MIN_AUDIO_S = 30.0
DEFAULT_SPEED = 10.0  # audio s per wall s assumed until enough is measured
SPAN_S = 60.0  # /status: rates over about the last minute
MIN_SPAN_S = 3.0  # a younger reading gives rates too noisy to show


class Speed:
    """Audio seconds the service transcribes per wall second now."""

    def __init__(self, metrics: Metrics, workers: Callable[[], int]) -> None:
        self._metrics = metrics
        self._workers = workers  # engine workers running batches at once
        # (monotonic time, audio processed, engine busy s) at recent estimates.
        self._recent: deque[tuple[float, float, float]] = deque()

    def retry_after_s(self, excess_audio_s: float) -> int:
        """Seconds until the backlog has drained by ``excess_audio_s`` at the current speed."""
        return max(1, min(3600, math.ceil(excess_audio_s / max(self.now(), 0.1))))

    def now(self) -> float:
        """Current: over the batches of the last few minutes (the load mix, beam sizes or a
        co-tenant change the speed), falling back to the whole run while those are too few,
        and to ``DEFAULT_SPEED`` while the whole run has measured too little."""
        m = self._metrics
        now, audio, busy = time.monotonic(), m.audio_processed._value.get(), m.processing._value.get()
        recent = self._recent
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
        return (audio / busy) * self._workers()


@dataclass(frozen=True)
class _Reading:
    at: float
    audio: float
    busy: float
    windows: float
    batches: float


@dataclass(frozen=True)
class Rates:
    span_s: float  # what the rates are measured over
    throughput: float | None  # audio s per wall s
    rtf: float | None  # audio s per engine s (per worker)
    batch_size: float | None  # mean windows per batch


class Speedometer:
    """Counter readings of the last ``SPAN_S`` seconds (one a second at most); rates against
    the oldest. Until one is ``MIN_SPAN_S`` old the figures are since start-up."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.readings: deque[_Reading] = deque()

    def read(self) -> Rates:
        get = self._metrics.registry.get_sample_value
        now = _Reading(time.monotonic(), get("batchscribe_audio_processed_seconds_total") or 0.0,
                       get("batchscribe_processing_seconds_total") or 0.0,
                       get("batchscribe_batch_size_windows_sum") or 0.0,
                       get("batchscribe_batch_size_windows_count") or 0.0)
        r = self.readings
        if not r or now.at - r[-1].at >= 1.0:
            r.append(now)
        while len(r) > 1 and now.at - r[1].at >= SPAN_S:
            r.popleft()
        base = r[0] if now.at - r[0].at >= MIN_SPAN_S else None
        span = now.at - base.at if base else 0.0
        audio = now.audio - (base.audio if base else 0.0)
        busy = now.busy - (base.busy if base else 0.0)
        windows = now.windows - (base.windows if base else 0.0)
        batches = now.batches - (base.batches if base else 0.0)
        return Rates(round(span, 1),
                     round(audio / span, 2) if base else None,
                     round(audio / busy, 2) if busy > 0 else None,
                     round(windows / batches, 2) if batches > 0 else None)
