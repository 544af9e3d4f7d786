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

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from app.config import Settings
from app.errors import Overloaded
from app.jobs.holds import make_holds
from app.jobs.store import JobStore
from app.jobs.transfers import Transfers
from app.metrics import Metrics

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


class Admission:
    """The global and per-key bounds, and the reservations of uploads being committed."""

    def __init__(self, settings: Settings, store: JobStore, backlog: Backlog, metrics: Metrics,
                 retry_after_s: Callable[[float], int], transfers: Transfers | None = None) -> None:
        self.settings = settings
        # Uploads and downloads in flight count in their key's share (app/jobs/transfers.py),
        # held for the deployment on a shared store (app/jobs/holds.py).
        self.transfers = transfers or Transfers(
            settings.limits.max_transfers_per_key,
            make_holds(store, settings.storage.replica(), settings.storage.lease_s))
        self._store = store
        self.backlog = backlog
        self._metrics = metrics
        self._retry_after_s = retry_after_s
        self._lock = asyncio.Lock()  # one backlog check at a time (the commits run freely)
        # Per API key: audio seconds and jobs admitted whose rows are not committed yet, and
        # the last (monotonic time, seconds, jobs) read from the store.
        self._key_s: defaultdict[str | None, float] = defaultdict(float)
        self._key_jobs: defaultdict[str | None, int] = defaultdict(int)
        self._key_load: dict[str | None, tuple[float, float, int]] = {}
        # Audio of a key's live sessions here not transcribed yet (app/jobs/live.py sets it).
        self.live_s: Callable[[str | None], float] = lambda owner: 0.0

    def cost_of(self, audio_s: float) -> float:
        """What a job costs in every budget: its audio, but at least one padded window."""
        return max(audio_s, self.settings.min_job_s())

    async def admit(self, audio_s: float, max_age_s: float = 0.0) -> None:
        """429 unless ``audio_s`` more audio fits in the backlog (``limits.max_backlog_s``)."""
        backlog = await self.backlog.seconds(max_age_s)
        limit = self.settings.limits.max_backlog_s
        if backlog + audio_s > limit:
            retry = self._retry_after_s(backlog + audio_s - limit)
            self._metrics.rejected.labels("backlog").inc()
            raise Overloaded(
                f"the queue holds {backlog:.0f} s of audio (limit {limit:.0f} s); "
                f"retry in about {retry} s", retry_after=retry,
                retry_after_s=retry, backlog_s=round(backlog, 1), limit_s=limit,
                limit="max_backlog_s",
            )

    async def key_load(self, owner: str | None, max_age_s: float = 0.0) -> tuple[float, int]:
        """One key's queued + running audio seconds (each job at least ``min_job_s``) and
        jobs, including admissions not committed yet; a store answer up to ``max_age_s`` old
        may do."""
        now = time.monotonic()
        cached = self._key_load.get(owner)
        if max_age_s > 0 and cached is not None and now - cached[0] <= max_age_s:
            seconds, jobs = cached[1], cached[2]
        else:
            seconds, jobs = await self._store.owner_load(owner)
            cache = self._key_load
            cache[owner] = (now, seconds, jobs)
            if len(cache) > KEY_CACHE_MAX:  # keys come and go: keep the newest answers
                for k in sorted(cache, key=lambda k: cache[k][0])[:KEY_CACHE_MAX // 2]:
                    del cache[k]
        # Transfers: each at least one padded window, not yet admitted.
        moving = await self.transfers.count(owner, max_age_s)
        return (seconds + self._key_s[owner] + moving * self.settings.min_job_s()
                + self.live_s(owner), jobs + self._key_jobs[owner] + moving)

    async def admit_key(self, owner: str | None, cost_s: float, max_age_s: float = 0.0) -> None:
        """429 (Retry-After, naming the limit) when this API key already holds its share: so
        one key flooding the service cannot fill the global backlog and push every other key
        into 429s. Only with keys configured: without them every caller is the one tenant."""
        if not self.settings.security.api_key_sha256:
            return
        lim = self.settings.limits
        seconds, jobs = await self.key_load(owner, max_age_s)
        if jobs + 1 > lim.max_queued_jobs_per_key:
            retry = self._retry_after_s(self.settings.min_job_s())
            self._metrics.rejected.labels("key_jobs").inc()
            raise Overloaded(
                f"this API key has {jobs} jobs queued or running (limit "
                f"{lim.max_queued_jobs_per_key} per key); retry in about {retry} s",
                retry_after=retry, retry_after_s=retry,
                limit="max_queued_jobs_per_key", limit_jobs=lim.max_queued_jobs_per_key,
                jobs=jobs)
        if seconds + cost_s > lim.max_queued_s_per_key:
            retry = self._retry_after_s(seconds + cost_s - lim.max_queued_s_per_key)
            self._metrics.rejected.labels("key_audio").inc()
            raise Overloaded(
                f"this API key has {seconds:.0f} s of audio queued or running (limit "
                f"{lim.max_queued_s_per_key:.0f} s per key); retry in about {retry} s",
                retry_after=retry, retry_after_s=retry,
                limit="max_queued_s_per_key", limit_s=lim.max_queued_s_per_key,
                queued_s=round(seconds, 1))

    async def live_room(self, owner: str | None, seconds: float) -> str | None:
        """Why ``seconds`` more live audio of ``owner``'s does not fit its key's share (None:
        it does). Only with keys, as for uploads; a store answer up to GATE_MAX_AGE_S old does."""
        if not self.settings.security.api_key_sha256:
            return None
        limit = self.settings.limits.max_queued_s_per_key
        queued, _ = await self.key_load(owner, GATE_MAX_AGE_S)
        if queued + seconds <= limit:
            return None
        self._metrics.rejected.labels("key_audio").inc()
        return (f"This API key holds {queued:.0f} s of audio queued or being transcribed, live "
                f"audio included (limit {limit:.0f} s per key): this append was dropped; send "
                "it again once earlier turns are transcribed.")

    async def gate(self, owner: str | None) -> None:
        """The pre-body check: 429 while even the shortest upload would not fit."""
        cost = self.cost_of(MIN_UPLOAD_S)
        await self.admit_key(owner, cost, GATE_MAX_AGE_S)
        await self.admit(cost, GATE_MAX_AGE_S)

    @asynccontextmanager
    async def admitted(self, audio_s: float, owner: str | None = None) -> AsyncIterator[None]:
        """Admit a job of ``audio_s`` for ``owner`` (or raise 429) and count it in the
        backlogs until the job is committed.

        Uploads arriving together would otherwise all read the same backlog from the store and
        all fit. Checks run one at a time, each seeing the reservations of those before it;
        the commits (an S3 put each, with that blob store) run outside the lock.
        """
        cost = self.cost_of(audio_s)
        async with self._lock:
            await self.admit_key(owner, cost)
            await self.admit(cost)
            self.backlog.admitting_s += cost
            self._key_s[owner] += cost
            self._key_jobs[owner] += 1
        try:
            yield
        finally:
            self.backlog.admitting_s -= cost
            self._key_s[owner] -= cost
            self._key_jobs[owner] -= 1
            if self._key_jobs[owner] <= 0:
                del self._key_s[owner], self._key_jobs[owner]
            self._key_load.pop(owner, None)  # the committed job is in the store: read it next time
