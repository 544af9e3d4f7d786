"""The backlog bound (429): an upload is admitted only while its audio fits.

An upload is admitted only if its audio fits under ``limits.max_backlog_s`` of queued audio
and, with API keys, under its key's share (``limits.max_queued_s_per_key`` and
``max_queued_jobs_per_key``), else 429 with ``Retry-After`` naming the limit
(:meth:`Admission.admitted`). Every job costs at least one padded window
(``Settings.min_job_s``): a 0.1 s clip is encoded as a 10 s window, so it is counted as one.
While the backlog is already full, :meth:`Admission.gate` answers 429 before the body is read
(app/api/middleware/limits.py).

Retry-After is the time the service needs, at its current speed (app/jobs/speed.py), to work
the backlog down far enough for this upload.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from app.jobs.store import JobStore

KEY_CACHE_MAX = 4096  # keys whose recent load the pre-body gate remembers
MIN_UPLOAD_S = 0.1  # the gate assumes the shortest upload worth sending
# The gate may read a backlog this old instead of querying the store on every request (the
# exact check after the upload always queries): under load that query cost engine CPU.
GATE_MAX_AGE_S = 0.5


class Backlog:
    """Accepted audio not yet transcribed: what 429 and autoscaling look at. Queued audio in
    the store, less what this replica has done of the jobs it runs (``done_s``), plus the audio
    admitted whose job rows are not committed yet (``admitting_s``): counted so that concurrent
    uploads cannot all see the same room."""

    def __init__(self, store: JobStore, done_s: Callable[[], float]) -> None:
        self._store = store
        self._done_s = done_s
        self.admitting_s = 0.0
        self._last, self._last_at = 0.0, -math.inf  # the last answer, and when

    async def seconds(self, max_age_s: float = 0.0) -> float:
        """``max_age_s`` > 0 accepts the last answer if it is that recent (no store query):
        for early, approximate checks such as the pre-body gate."""
        now = time.monotonic()
        if max_age_s > 0 and now - self._last_at <= max_age_s:
            return self._last
        # Reservations read before the query: a job committed meanwhile is counted twice at
        # worst (for an instant), never missed.
        pending = self.admitting_s
        queued = await self._store.queued_audio_seconds()
        self._last, self._last_at = max(0.0, queued - self._done_s()) + pending, now
        return self._last
