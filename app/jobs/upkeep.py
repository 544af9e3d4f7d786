"""The job runner's housekeeping: one pass every ``lease_s / 6``, on the event loop.

Each pass extends this replica's leases (and records progress), abandons jobs whose lease was
lost, requeues jobs whose lease expired (a replica died), purges results past their TTL, removes
orphaned uploads every ``SPOOL_SWEEP_S``, and refreshes the job gauges. A failed pass is logged
and retried at the next one: a database blip must not stop the leases from being renewed later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from app.jobs.store import TERMINAL

if TYPE_CHECKING:
    from app.jobs.runner import JobRunner

log = logging.getLogger(__name__)

SPOOL_SWEEP_S = 300.0  # how often, and how old an unreferenced spool file must be, to remove it


class Upkeep:
    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner
        self.store = runner.store

    async def loop(self) -> None:
        r = self.runner
        next_sweep = 0.0  # first pass: at start-up, to clean up after a crash
        while True:
            try:
                progress = {k: a.windows_done for k, a in r.active.items()}
                held = await self.store.heartbeat(r.replica, progress, r.lease_s)
                self.drop_lost(set(progress) - held)
                if await self.store.requeue_stale(None):  # expired leases (a replica died)
                    r.wake()
                await self.purge_expired()
                if time.monotonic() >= next_sweep:
                    await self.sweep_spool()
                    next_sweep = time.monotonic() + SPOOL_SWEEP_S
                await r.refresh_gauges()
            except Exception:
                log.exception("maintenance pass failed; retrying")
            await asyncio.sleep(r.lease_s / 6)

    def drop_lost(self, lost: set[str]) -> None:
        """Stop jobs whose lease this replica lost (it stalled past the lease and the job was
        requeued, maybe claimed elsewhere): their result could not be written anyway."""
        for job_id in lost:
            a = self.runner.active.get(job_id)
            if a is not None and not a.ending:  # ending: finished, its lease is already gone
                log.warning("lease of job %s lost; abandoning it", job_id)
                a.task.cancel()

    async def sweep_spool(self) -> None:
        """Remove uploads no live job needs: left by a crash between spooling and the commit,
        or between a job's final write and its unlink. Young files may be uploads in progress."""
        stale = await asyncio.to_thread(self.runner.blobs.stale, time.time() - SPOOL_SWEEP_S)
        for key in stale:
            job = await self.store.get(key)  # uploads are stored under their job id
            if job is None or job.status in TERMINAL:
                log.info("removing orphaned upload %s", key)
                await self.runner.drop_upload(key)

    async def purge_expired(self) -> None:
        old = await self.store.expired(time.time())
        for j in old:
            await self.runner.drop_upload(j.upload_path)
        await self.store.delete([j.id for j in old])
