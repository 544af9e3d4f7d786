"""Job progress for Server-Sent Event streams: one reader of the store per job, shared by every
stream that watches it, and a cap on open streams per API key.

Each stream used to read the job's row from the store on every change and keep-alive: a client
opening a thousand streams on one job made a thousand readers. Now a job with watchers has one
:class:`JobFeed` task; it reads the row when the runner says the job changed (or every
``KEEPALIVE_S``, which is how progress made on another replica arrives), and each stream sends
the newest snapshot it has not sent yet. A key holding ``limits.max_event_streams_per_key``
streams gets 429 for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import Overloaded
from app.jobs.store import TERMINAL

if TYPE_CHECKING:
    from app.state import AppState

log = logging.getLogger(__name__)
KEEPALIVE_S = 15.0


@dataclass
class JobFeed:
    """The newest state of one job, as every stream on it sees it."""

    job_id: str
    version: int = 0  # bumped on every new progress snapshot
    progress: dict[str, Any] = field(default_factory=dict)
    final: tuple[str, dict[str, Any]] | None = None  # (status, job) once it ended
    gone: bool = False  # the row no longer exists (results expire)
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

    def __init__(self, max_per_key: int) -> None:
        self.max_per_key = max_per_key
        self.feeds: dict[str, JobFeed] = {}
        self.streams: Counter[str | None] = Counter()

    def open(self, st: AppState, job_id: str, owner: str | None) -> Subscription:
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
            feed = self.feeds[job_id] = JobFeed(job_id)
            feed.task = asyncio.create_task(self._follow(st, feed), name=f"feed-{job_id}")
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

    async def _follow(self, st: AppState, feed: JobFeed) -> None:
        """The one reader: runs while the job has watchers. If it fails (the store is down),
        its streams end and their clients reconnect, rather than wait on a dead reader."""
        try:
            await self._read(st, feed)
        except Exception:
            log.exception("event feed of job %s failed; closing its streams", feed.job_id)
            feed.closed = True
            feed.notify()

    async def _read(self, st: AppState, feed: JobFeed) -> None:
        from app.api.deps import to_job  # deps imports the state, which imports this module

        with st.runner.watch(feed.job_id) as changed:
            while True:
                changed.clear()  # before reading: a change during the read wakes the next wait
                row = await st.store.get(feed.job_id)
                if row is None:
                    feed.gone = True
                else:
                    job = to_job(row, st)
                    snap = {"id": job.id, "status": job.status,
                            "windows_done": job.progress.windows_done,
                            "windows_total": job.progress.windows_total,
                            "audio_seconds": job.audio_seconds}
                    if snap != feed.progress:
                        feed.progress = snap
                        feed.version += 1
                    if row.status in TERMINAL:
                        feed.final = (row.status, job.model_dump(mode="json", exclude={"result"}))
                    elif st.runner.stopped:
                        feed.closed = True
                feed.notify()
                if feed.over:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), KEEPALIVE_S)


@dataclass(eq=False)
class Subscription:
    hub: EventHub
    feed: JobFeed
    owner: str | None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    released: bool = False

    def __post_init__(self) -> None:
        self.feed.watchers.add(self.wake)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.hub.close(self)


class FeedResponse(StreamingResponse):
    """A stream whose subscription is released however it ends (the client may leave before
    the body iterator ever starts, and then a generator's ``finally`` never runs)."""

    def __init__(self, content: AsyncIterator[bytes], sub: Subscription, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.sub = sub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sub.release()
