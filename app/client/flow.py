"""Flow control of ``batchscribe dataset``: files in flight per server, keeping it full, never
flooded.

The service batches across requests, so it is fastest with many files queued: a deeper queue
lets its micro-batcher fill decoder batches (at 32 closed-loop clients its throughput is ~0.94x
of the offline engine limit; loadtest/README.md, Performance). But queued audio is also what it answers 429
for (``limits.max_backlog_s``), and what a live request arriving meanwhile waits behind. So the
client keeps a *target backlog* of a few seconds of the service's work:

    target = clamp(throughput x queue_s, min_backlog_s, limit / 2)

with the throughput measured from this client's own finished files on that server and the limit
from the service's ``X-Backlog-Limit-Seconds`` header (or a 429's body). The number of files in
flight (``cap``) starts small, doubles while the backlog is under half the target, grows by a
quarter while under it, shrinks by one while well over it, and halves on a 429, whose
Retry-After pauses new uploads to that server. It never exceeds ``max_in_flight``. A server that
does not answer is paused with a doubling back-off (1 s to 30 s), so its rows go to the others.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

RATE_WINDOW_S = 30.0  # throughput over this many seconds of finished files


@dataclass
class Flow:
    initial: int = 4
    max_in_flight: int = 256
    queue_s: float = 20.0  # seconds of the service's work to keep queued
    min_backlog_s: float = 120.0  # target before the throughput is known (audio seconds)
    cap: float = field(init=False)
    in_flight: int = 0
    backlog_s: float | None = None
    limit_s: float | None = None
    paused_until: float = 0.0  # monotonic
    failures: int = 0  # consecutive transport / 5xx errors
    _done: list[tuple[float, float]] = field(default_factory=list)  # (monotonic, audio s)

    def __post_init__(self) -> None:
        self.cap = float(max(1, min(self.initial, self.max_in_flight)))

    # ---- what may be sent now -------------------------------------------------------------
    def room(self, now: float | None = None) -> int:
        if (now if now is not None else time.monotonic()) < self.paused_until:
            return 0
        return max(0, math.floor(self.cap) - self.in_flight)

    def throughput(self, now: float | None = None) -> float | None:
        """Audio seconds per wall second of this server's finished files (recent window)."""
        now = now if now is not None else time.monotonic()
        self._done = [d for d in self._done if d[0] >= now - RATE_WINDOW_S]
        if len(self._done) < 4:
            return None
        span = max(now - self._done[0][0], 1.0)
        return sum(a for _, a in self._done) / span

    def target(self, now: float | None = None) -> float:
        speed = self.throughput(now)
        t = max(self.min_backlog_s, speed * self.queue_s if speed else 0.0)
        return min(t, self.limit_s / 2) if self.limit_s else t

    def poll_interval(self, now: float | None = None) -> float | None:
        """How often to look for finished jobs: a tenth of the queued work's duration (with 20 s
        queued, every 2 s: refills stay far ahead of the engine). Polling costs CPU the engine
        shares: GET /jobs?ids= of 100 finished jobs took ~7 ms of CPU (service and client in one
        process, null engine), so 256 in flight polled every 0.5 s would take ~4 % of a core.
        None until the speed is known."""
        speed = self.throughput(now)
        if not speed or self.backlog_s is None:
            return None
        return self.backlog_s / speed / 10

    # ---- what the service said ------------------------------------------------------------
    def finished(self, audio_s: float, now: float | None = None) -> None:
        self._done.append((now if now is not None else time.monotonic(), audio_s))

    def observe(self, backlog_s: float, limit_s: float | None, now: float | None = None) -> None:
        """A backlog reading (each status poll): grow or shrink the cap towards the target."""
        self.backlog_s, self.failures = backlog_s, 0
        if limit_s:
            self.limit_s = limit_s
        target = self.target(now)
        if backlog_s < target / 2:
            self.cap *= 2
        elif backlog_s < target:
            self.cap += max(1.0, self.cap / 4)
        elif backlog_s > 1.5 * target:
            self.cap -= 1
        # Never far above what is in flight: a cap grown while idle must not release a burst.
        self.cap = max(1.0, min(self.cap, float(self.max_in_flight), 2.0 * self.in_flight + 8))

    def overloaded(self, retry_after_s: float, limit_s: float | None = None,
                   now: float | None = None) -> None:
        """A 429: halve the cap and send nothing new before Retry-After."""
        self.cap = max(1.0, self.cap / 2)
        if limit_s:
            self.limit_s = limit_s
        now = now if now is not None else time.monotonic()
        self.paused_until = max(self.paused_until, now + max(0.0, retry_after_s))

    def unreachable(self, now: float | None = None) -> float:
        """A transport error or 5xx: pause with a doubling back-off; returns the pause."""
        self.failures += 1
        pause = min(30.0, 2.0 ** (self.failures - 1))
        now = now if now is not None else time.monotonic()
        self.paused_until = max(self.paused_until, now + pause)
        return pause
