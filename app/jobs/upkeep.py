"""The job runner's housekeeping: two loops on the event loop, each every ``lease_s / 6``.

* :meth:`Upkeep.beat` extends this replica's leases (jobs and per-key holds) and records
  progress, and abandons jobs whose lease was lost. It runs alone so that nothing slow beside it
  delays a lease: on a loaded CI host one pass of everything (a spool sweep at start-up, the
  gauges' queries) ran past a 3 s lease, and the holds of a replica still holding its uploads
  expired under it (tests/test_replica_limits.py).
* :meth:`Upkeep.tidy` requeues jobs whose lease expired (a replica died), fails ``audio_url``
  jobs left ``fetching`` by a process that died, purges results past their TTL, removes
  orphaned uploads every ``SPOOL_SWEEP_S``, and refreshes the job gauges.

A failed pass is logged and retried at the next one: a database blip must not stop the leases
from being renewed later.

It talks to the job runner through :class:`Hooks` (four callbacks), not the runner itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.jobs.blobs import BlobStore, drop_upload
from app.jobs.store import TERMINAL, JobStore

log = logging.getLogger(__name__)

SPOOL_SWEEP_S = 300.0  # how often, and how old an unreferenced spool file must be, to remove it
STALE_FETCH_S = 3600.0 + 120.0  # past the longest outbound.fetch_timeout_s: no download is left


@dataclass(frozen=True)
class Hooks:
    """What housekeeping asks of the job runner."""

    progress: Callable[[], dict[str, int]]  # the jobs running here: windows done of each
    abandon: Callable[[set[str]], None]  # stop these jobs: their lease was lost
    requeued: Callable[[], None]  # expired leases went back to the queue: claim now
    refresh: Callable[[], Awaitable[None]]  # the job gauges (jobs by status, the backlog)


class Upkeep:
    def __init__(self, store: JobStore, blobs: BlobStore, replica: str, lease_s: float,
                 hooks: Hooks, ttl_s: float = 86400.0) -> None:
        self.ttl_s = ttl_s
        self.store = store
        self.blobs = blobs
        self.replica = replica
        self.lease_s = lease_s
        self.hooks = hooks

    async def beat(self) -> None:
        while True:
            try:
                progress = self.hooks.progress()
                held = await self.store.heartbeat(self.replica, progress, self.lease_s)
                if lost := set(progress) - held:
                    self.hooks.abandon(lost)
            except Exception:
                log.exception("heartbeat failed; retrying")
            await asyncio.sleep(self.lease_s / 6)

    async def tidy(self) -> None:
        next_sweep = 0.0  # first pass: at start-up, to clean up after a crash
        while True:
            try:
                if await self.store.requeue_stale(None):  # expired leases (a replica died)
                    self.hooks.requeued()
                await self.purge_expired()
                await self.fail_stale_fetches()
                if time.monotonic() >= next_sweep:
                    await self.sweep_spool()
                    next_sweep = time.monotonic() + SPOOL_SWEEP_S
                await self.hooks.refresh()
            except Exception:
                log.exception("maintenance pass failed; retrying")
            await asyncio.sleep(self.lease_s / 6)

    async def sweep_spool(self) -> None:
        """Remove uploads no live job needs: left by a crash between spooling and the commit,
        or between a job's final write and its unlink. Young files may be uploads in progress."""
        stale = await asyncio.to_thread(self.blobs.stale, time.time() - SPOOL_SWEEP_S)
        for key in stale:
            job = await self.store.get(key)  # uploads are stored under their job id
            if job is None or job.status in TERMINAL:
                log.info("removing orphaned upload %s", key)
                await drop_upload(self.blobs, key)

    async def fail_stale_fetches(self) -> None:
        """``fetching`` rows no download can still be running for (any replica's: older than
        the longest fetch deadline): their process died mid-download."""
        for job_id in await self.store.stale_fetches(time.time() - STALE_FETCH_S):
            await self.store.finish(job_id, None, "failed", self.ttl_s, error={
                "type": "fetch_failed",
                "message": "the service stopped while fetching audio_url; submit the job again"})

    async def purge_expired(self) -> None:
        old = await self.store.expired(time.time())
        for j in old:
            await drop_upload(self.blobs, j.upload_path)
        await self.store.delete([j.id for j in old])
