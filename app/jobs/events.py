"""Job progress for Server-Sent Event streams: one reader of the store per job, shared by every
stream that watches it, and a cap on open streams per API key.

Each stream used to read the job's row from the store on every change and keep-alive: a client
opening a thousand streams on one job made a thousand readers. Now a job with watchers has one
:class:`EventFeed` task; it reads the job when the runner says it changed (or every
``KEEPALIVE_S``, which is how progress made on another replica arrives), and each stream sends
the newest snapshot it has not sent yet. A key holding ``limits.max_event_streams_per_key``
streams gets 429 for the next one.

The hub is runtime state of the core (built with it, app/jobs/core.py); it reaches the job and
the runner through three callbacks, not the runner itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from app.errors import Overloaded
from app.jobs.views import JobView

log = logging.getLogger(__name__)
KEEPALIVE_S = 15.0

Read = Callable[[str], Awaitable[JobView | None]]  # the job now (None: it no longer exists)
Watch = Callable[[str], AbstractContextManager[asyncio.Event]]  # set on every change here


@dataclass
class EventFeed:
    """The newest state of one job, as every stream on it sees it."""

    job_id: str
    version: int = 0  # bumped on every new progress snapshot
    progress: dict[str, Any] = field(default_factory=dict)
    final: JobView | None = None  # the job once it ended
    gone: bool = False  # the job no longer exists (results expire)
    closed: bool = False  # the service is draining: streams end, clients reconnect elsewhere
    watchers: set[asyncio.Event] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def notify(self) -> None:
        for ev in self.watchers:
            ev.set()

    @property
    def over(self) -> bool:
        return self.final is not None or self.gone or self.closed


class EventHub:
    """The feeds of watched jobs and the count of open streams per key."""

    def __init__(self, max_per_key: int, read: Read, watch: Watch,
                 stopped: Callable[[], bool]) -> None:
        self.max_per_key = max_per_key
        self._read_job, self._watch, self._stopped = read, watch, stopped
        self.feeds: dict[str, EventFeed] = {}
        self.streams: Counter[str | None] = Counter()

    def open(self, job_id: str, owner: str | None) -> Subscription:
        """A new stream on ``job_id`` for ``owner``; 429 past the per-key cap."""
        if self.streams[owner] >= self.max_per_key:
            raise Overloaded(
                f"this API key has {self.streams[owner]} open event streams (limit "
                f"{self.max_per_key}); close one, or poll GET /jobs/{{id}}",
                headers={"Retry-After": str(int(KEEPALIVE_S))},
                limit="max_event_streams_per_key", limit_streams=self.max_per_key)
        self.streams[owner] += 1
        feed = self.feeds.get(job_id)
        if feed is None:
            feed = self.feeds[job_id] = EventFeed(job_id)
            feed.task = asyncio.create_task(self._follow(feed), name=f"feed-{job_id}")
        return Subscription(self, feed, owner)

    def close(self, sub: Subscription) -> None:
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
        """The one reader: runs while the job has watchers. If it fails (the store is down),
        its streams end and their clients reconnect, rather than wait on a dead reader."""
        try:
            await self._read(feed)
        except Exception:
            log.exception("event feed of job %s failed; closing its streams", feed.job_id)
            feed.closed = True
            feed.notify()

    async def _read(self, feed: EventFeed) -> None:
        with self._watch(feed.job_id) as changed:
            while True:
                changed.clear()  # before reading: a change during the read wakes the next wait
                job = await self._read_job(feed.job_id)
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
                    elif self._stopped():
                        feed.closed = True
                feed.notify()
                if feed.over:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KEEPALIVE_S):  # not wait_for: see app/jobs/webhooks.py
                        await changed.wait()


@dataclass(eq=False)
class Subscription:
    """One stream's hold on a feed: ``wake`` is set when the feed has news; release it once."""

    hub: EventHub
    feed: EventFeed
    owner: str | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False

    def __post_init__(self) -> None:
        self.feed.watchers.add(self.wake)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.hub.close(self)
