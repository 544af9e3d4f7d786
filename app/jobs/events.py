"""How a job is followed, and where its end is told: one hub per service.

Every stream and every wait follows a job the same way: a :class:`Subscription` to the job's
one :class:`EventFeed`. A feed is a task that reads the job when something here says it changed
(:meth:`EventHub.changed`: claimed, decoded, a window done, ended), or every ``RECHECK_S`` when
nothing does (how a job run by another replica is seen to progress and end), and wakes each
subscriber with the newest state. So GET /jobs/{id}/events, OpenAI's ``stream=true``, and the
waits of ``?wait=true``, /v1, /asr and /detect-language read the store once per change of a
job, however many of them follow it: the streams of /v1 used to read the job's row once per
change *per stream*, and the waits had a mechanism of their own (an event per job set at its
end, and a store re-read every 15 s), the runner a third (an event per watcher, set on every
change). A key holding ``limits.max_event_streams_per_key`` event streams gets 429 for the
next one; the waits and the /v1 streams a request holds anyway are not counted.

A job's end is told here, once, by whoever ended it (:meth:`EventHub.ended`): the job runner
for uploads, the live hall for a session kept as a job. It is counted (``jobs_finished``, and
``job_latency`` for a submitted job), its followers woken, and the end hooks (webhooks) called.
A live session kept as a job used to tell the hooks only, and was missing from
``jobs_finished``.

The hub is built by the job runner (app/jobs/runner.py), which reads jobs for it; the core
(app/jobs/core.py) hands its subscriptions through the door.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from app.errors import Overloaded
from app.jobs.views import JobView
from app.metrics import Metrics

log = logging.getLogger(__name__)
RECHECK_S = 15.0  # a followed job nothing here changes (another replica runs it): re-read

Read = Callable[[str], Awaitable[JobView | None]]  # the job now (None: it no longer exists)
EndHook = Callable[[str, str], None]  # (job_id, final status)


@dataclass
class EventFeed:
    """The newest state of one job, as everyone following it sees it."""

    job_id: str
    version: int = 0  # bumped on every new progress snapshot
    progress: dict[str, Any] = field(default_factory=dict)
    final: JobView | None = None  # the job once it ended
    gone: bool = False  # the job no longer exists (results expire)
    closed: bool = False  # the service has drained, or the feed failed: followers stop
    failed: bool = False  # closed because the job could not be read (the store is away)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set by EventHub.changed
    watchers: set[asyncio.Event] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def notify(self) -> None:
        for ev in self.watchers:
            ev.set()

    @property
    def over(self) -> bool:
        return self.final is not None or self.gone or self.closed


class EventHub:
    """The feeds of followed jobs, the count of event streams per key, and the end hooks."""

    def __init__(self, max_per_key: int, read: Read, metrics: Metrics | None = None) -> None:
        self.max_per_key = max_per_key
        self._read_job = read
        self._metrics = metrics
        self.feeds: dict[str, EventFeed] = {}
        self.streams: Counter[str | None] = Counter()
        self.on_end: list[EndHook] = []  # webhooks' wake-up (app/main.py)
        self.stopped = False  # the runner has drained: nothing more ends in this process

    # ---- what changes jobs says so here -------------------------------------------------------
    def changed(self, job_id: str) -> None:
        """The job changed on this replica: its feed (if anyone follows it) reads it again."""
        feed = self.feeds.get(job_id)
        if feed is not None:
            feed.changed.set()

    def ended(self, job_id: str, status: str, created_at: float | None = None) -> None:
        """The job ended here with ``status`` (its final row is written): counted, its followers
        woken, the end hooks called. ``created_at``: when it was submitted, for
        ``job_latency``; None for a live session kept as a job, whose length is no wait."""
        if self._metrics is not None:
            self._metrics.jobs_finished.labels(status).inc()
            if created_at is not None:
                self._metrics.job_latency.labels(status).observe(time.time() - created_at)
        self.changed(job_id)
        for hook in self.on_end:
            hook(job_id, status)

    def stop(self) -> None:
        """The drain is over: every feed closes (streams end, their clients reconnect to
        another replica; waits answer with the job as it stands)."""
        self.stopped = True
        for feed in self.feeds.values():
            feed.changed.set()

    # ---- following ----------------------------------------------------------------------------
    def follow(self, job_id: str, owner: str | None = None, *,
               capped: bool = False) -> Subscription:
        """A new follower of ``job_id``. ``capped``: an event stream a client opened for its
        own sake, counted against ``owner``'s ``limits.max_event_streams_per_key`` (429 past
        it)."""
        if capped and self.streams[owner] >= self.max_per_key:
            raise Overloaded(
                f"this API key has {self.streams[owner]} open event streams (limit "
                f"{self.max_per_key}); close one, or poll GET /jobs/{{id}}",
                retry_after=int(RECHECK_S),
                limit="max_event_streams_per_key", limit_streams=self.max_per_key)
        if capped:
            self.streams[owner] += 1
        feed = self.feeds.get(job_id)
        if feed is None:
            feed = self.feeds[job_id] = EventFeed(job_id)
            feed.task = asyncio.create_task(self._follow(feed), name=f"feed-{job_id}")
        return Subscription(self, feed, owner, capped)

    async def wait(self, job_id: str, timeout_s: float) -> None:
        """Until the job ends (here, or on another replica: seen within ``RECHECK_S``), the
        service has drained, or ``timeout_s`` passes."""
        if self.stopped:
            return
        with self.follow(job_id) as sub:
            await sub.until_over(timeout_s)

    def _close(self, sub: Subscription) -> None:
        if sub.capped:
            self.streams[sub.owner] -= 1
            if self.streams[sub.owner] <= 0:
                del self.streams[sub.owner]
        feed = sub.feed
        feed.watchers.discard(sub.wake)
        if not feed.watchers and self.feeds.get(feed.job_id) is feed:
            del self.feeds[feed.job_id]
            if feed.task is not None:
                feed.task.cancel()

    async def _follow(self, feed: EventFeed) -> None:
        """The one reader: runs while the job has followers. If it fails (the store is down),
        they stop, rather than wait on a dead reader: streams end and their clients
        reconnect, waits answer with what a fresh read gives."""
        try:
            await self._read(feed)
        except Exception:
            log.exception("event feed of job %s failed; closing its streams", feed.job_id)
            feed.closed = feed.failed = True
            feed.notify()

    async def _read(self, feed: EventFeed) -> None:
        """Followers are woken only by news (a new snapshot, the end, the close): a re-read that
        finds nothing new leaves their keep-alive timers running."""
        while True:
            feed.changed.clear()  # before reading: a change during the read wakes the next wait
            job = await self._read_job(feed.job_id)
            version = feed.version
            if job is None:
                feed.gone = True
            else:
                snap = {"id": job.id, "status": job.status,
                        "windows_done": job.windows_done,
                        "windows_total": job.windows_total,
                        "audio_seconds": job.audio_seconds}
                if snap != feed.progress:
                    feed.progress = snap
                    feed.version += 1
                if job.ended:
                    feed.final = job
                elif self.stopped:
                    feed.closed = True
            if feed.version != version or feed.over:
                feed.notify()
            if feed.over:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECHECK_S):  # not wait_for: see app/jobs/webhooks.py
                    await feed.changed.wait()


@dataclass(eq=False)
class Subscription:
    """One follower's hold on a feed: ``wake`` is set when the feed has news. Release it once
    (or use it as a context manager)."""

    hub: EventHub
    feed: EventFeed
    owner: str | None
    capped: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False

    def __post_init__(self) -> None:
        self.feed.watchers.add(self.wake)

    async def until_over(self, timeout_s: float) -> None:
        """Until the feed is over (the job ended or is gone, or the feed closed) or
        ``timeout_s`` passes."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):  # not wait_for: see app/jobs/webhooks.py
                while True:
                    self.wake.clear()  # before looking: news meanwhile wakes the wait
                    if self.feed.over:
                        return
                    await self.wake.wait()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.hub._close(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
