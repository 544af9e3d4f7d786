"""The job runner: claims queued jobs from the store, runs each (app/jobs/work.py), finishes it.

Per job: its audio is prepared by the prep stage (app/jobs/prep.py) and its windows go to the
batcher as they are cut (:class:`app.jobs.work.JobWork`); results are reassembled in upload
order. Jobs are claimed only as fast as prep starts them (about ``prep workers + 1`` claimed and
not started), so a replica never sits on work another could start, and a drain gives unstarted
jobs back at no cost. The job's work and housekeeping (app/jobs/upkeep.py) hold no reference to
the runner: they get its shared parts and a few callbacks (``Tools``, ``Hooks``). Whoever
follows a job (event streams, waits) does so through the runner's event hub (``events``,
app/jobs/events.py), which the runner tells of every change and every end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from app.audio.vad import Vad
from app.batching.batcher import Batcher
from app.config import Settings
from app.errors import ServiceError, ShuttingDown, TranscriptionFailed
from app.jobs.admission import Backlog
from app.jobs.blobs import BlobStore, drop_upload, make_blobs
from app.jobs.events import EventHub
from app.jobs.prep import Prep
from app.jobs.store import TERMINAL, JobRow, JobStore
from app.jobs.upkeep import Hooks, Upkeep
from app.jobs.views import JobView
from app.jobs.work import Active, JobWork, Outcome, Tools
from app.metrics import Metrics
from app.results.logprobs import entries as logprob_entries
from app.results.transcript import transcript
from app.speakers import assign_speakers
from app.speakers.service import SpeakerService
from app.windows import JobOptions, WindowResult

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(self, settings: Settings, store: JobStore, batcher: Batcher, vad: Vad,
                 metrics: Metrics, prep: Prep, replica: str | None = None,
                 blobs: BlobStore | None = None, speakers: SpeakerService | None = None) -> None:
        self.settings = settings
        self.speakers = speakers  # diarize=true jobs (None: refused)
        self.store = store
        self.batcher = batcher
        self.vad = vad
        self.metrics = metrics
        self.replica = replica or settings.storage.replica()
        self.lease_s = settings.storage.lease_s
        self.blobs = blobs or make_blobs(settings.storage)
        self.active: dict[str, Active] = {}
        self.prep = prep  # app/jobs/pipeline.py makes it
        self._wake = asyncio.Event()
        # How jobs are followed (streams, waits), told of every change and end here.
        self.events = EventHub(settings.limits.max_event_streams_per_key, self.view, metrics)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._stopped = False  # stop() has finished: nothing more will end in this process
        # Accepted audio not yet transcribed: the store's queue less what is done here.
        self.backlog = Backlog(store, self._audio_done_s)
        self.tools = Tools(settings, store, self.blobs, self.prep, vad, batcher, speakers,
                           started=self.job_started, changed=self.changed,
                           progressed=self.log_progress)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        # SQLite: this is the only process on the file, so every "running" job is one it was
        # running when it stopped. Shared (PostgreSQL): only its own, if its replica id is stable
        # (a restarted container); other replicas' jobs come back when their leases expire.
        n = await self.store.requeue_stale(self.replica, everyone=not self.store.shared)
        if n:
            log.info("resuming %d job(s) interrupted by the last stop", n)
        upkeep = Upkeep(self.store, self.blobs, self.replica, self.lease_s, Hooks(
            progress=lambda: {k: a.windows_done for k, a in self.active.items()},
            abandon=self._abandon, requeued=self.wake, refresh=self.refresh_gauges),
            ttl_s=self.settings.storage.result_ttl_s)
        self._tasks = [asyncio.create_task(self._claim_loop(), name="claim"),
                       asyncio.create_task(upkeep.beat(), name="heartbeat"),
                       asyncio.create_task(upkeep.tidy(), name="maintenance")]
        self.wake()

    async def stop(self, grace_s: float) -> None:
        """Stop claiming, let the batch in flight finish, leave the rest queued."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self._stopping = True
        log.info("draining", extra={"active_jobs": len(self.active), "grace_s": grace_s})
        # The claim loop is told to stop, never cancelled: a cancel landing while its claim
        # commits would leave jobs "running" with no task behind them. Maintenance can be.
        self.wake()
        for t in self._tasks:
            if t.get_name() != "claim":
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Jobs waiting for prep go now, not decoded only to be refused by the stopping batcher.
        self.prep.shutdown()
        await self.batcher.stop(grace_s)
        tasks = [a.task for a in self.active.values()]
        if tasks:
            # Jobs whose last windows were in the batch in flight still have to write their
            # result; the others got ShuttingDown and release themselves. Cancelling at once
            # would throw the finished batch away and re-run those jobs after the restart.
            await asyncio.wait(tasks, timeout=max(0.5, deadline - loop.time()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # No job runs here any more: what the store still shows as ours (a failed release, a
        # task cancelled before it began) is requeued now, not when its lease expires.
        try:
            if n := await self.store.requeue_stale(self.replica):
                log.warning("requeued %d job(s) left running at shutdown", n)
        except Exception:
            log.exception("could not requeue this replica's jobs; their leases will expire")
        self._stopped = True
        log.info("drained", extra={"seconds": round(grace_s - (deadline - loop.time()), 2)})
        # Open ?wait=true requests answer now (202, their job stays queued); streams close.
        self.events.stop()

    # ---- API side ----------------------------------------------------------------------------
    async def submit(self, job_id: str, upload: Path, filename: str | None, options: JobOptions,
                     audio_seconds: float, owner: str | None, callback_url: str | None = None,
                     idempotency_key: str | None = None) -> None:
        """Queue a spooled upload as a job (app/jobs/intake.py calls this once it is admitted).
        ``idempotency_key``: the request key's digest, unique in the store."""
        # The upload is in the shared blob store before its row exists: whoever claims the job
        # finds it. The row holds the key, never this replica's path.
        key = self.blobs.key(upload)
        await asyncio.to_thread(self.blobs.put, key, upload)
        await self.store.insert(
            id=job_id, owner=owner, status="queued", created_at=time.time(), filename=filename,
            upload_path=key, options=options.to_dict(), audio_seconds=audio_seconds,
            windows_done=0, attempts=0, callback_url=callback_url,
            idempotency_key=idempotency_key,  # unique: a second job under one key fails to insert
        )
        self.wake()

    async def fetched(self, job_id: str, upload: Path, audio_seconds: float) -> bool:
        """An ``audio_url`` job's download is complete and admitted (app/jobs/fetching.py):
        into the blob store, and the row from ``fetching`` to ``queued``. False (the upload
        dropped) when the job was cancelled meanwhile."""
        key = self.blobs.key(upload)
        await asyncio.to_thread(self.blobs.put, key, upload)
        if not await self.store.queue_fetched(job_id, audio_seconds):
            await drop_upload(self.blobs, key)
            return False
        self.changed(job_id)
        self.wake()
        return True

    async def fail_unqueued(self, job_id: str, error: dict[str, Any]) -> None:
        """Fail a job that never reached the queue (its download failed)."""
        row = await self.store.get(job_id)
        if row is not None and await self.store.finish(
                job_id, None, "failed", self.settings.storage.result_ttl_s, error=error):
            self._job_ended(job_id, "failed", row)

    async def cancel(self, job: JobRow) -> bool:
        if job.status in TERMINAL:
            return False
        self._ending(job.id)
        ok = await self.store.finish(job.id, None, "cancelled", self.settings.storage.result_ttl_s)
        active = self.active.get(job.id)
        if active:
            active.task.cancel()  # its queued windows are dropped by the batcher for free
        if ok:
            self._job_ended(job.id, "cancelled", job)
            await drop_upload(self.blobs, job.upload_path)
        return ok

    async def view(self, job_id: str) -> JobView | None:
        """The job as its followers see it: its row, with this replica's live progress."""
        row = await self.store.get(job_id)
        return JobView.of(row, self.progress(row.id)) if row is not None else None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def wake(self) -> None:
        """Claim now: a job was queued or requeued, or a slot freed up."""
        self._wake.set()

    def changed(self, job_id: str) -> None:
        """The job changed here (claimed, decoded, a window done): its followers hear of it."""
        self.events.changed(job_id)

    def progress(self, job_id: str) -> tuple[int, int | None] | None:
        a = self.active.get(job_id)
        return (a.windows_done, a.windows_total) if a else None

    def finished_prefix(self, job_id: str, start: int) -> list[str] | None:
        """The texts of the job's windows ``start``, ``start + 1``, ... up to the first one not
        finished yet, in upload order (windows finish in any order; a stream must not skip one).
        None when the job is not active on this replica: queued, ended, or run by another one.
        ``changed`` fires once per finished window, so a follower wakes for each."""
        done = self.finished_windows(job_id, start)
        return None if done is None else [r.text for r in done]

    def finished_windows(self, job_id: str, start: int) -> list[WindowResult] | None:
        """:meth:`finished_prefix`'s windows themselves (their words' token log-probabilities
        for a stream with ``include[]=logprobs``)."""
        a = self.active.get(job_id)
        if a is None:
            return None
        out: list[WindowResult] = []
        while (r := a.results.get(start + len(out))) is not None:
            out.append(r)
        return out

    def _audio_done_s(self) -> float:
        """Audio this replica has transcribed of the jobs it runs (not those being finished:
        their audio leaves the backlog with their final store write)."""
        return sum(a.audio_done_s for a in self.active.values() if not a.ending)

    def _abandon(self, lost: set[str]) -> None:
        """Stop jobs whose lease this replica lost (it stalled past the lease and the job was
        requeued, maybe claimed elsewhere): their result could not be written anyway."""
        for job_id in lost:
            a = self.active.get(job_id)
            if a is not None and not a.ending:  # ending: finished, its lease is already gone
                log.warning("lease of job %s lost; abandoning it", job_id)
                a.task.cancel()

    async def refresh_gauges(self) -> None:
        """Jobs by status and the backlog, from the store: on every scrape and in maintenance."""
        counts = await self.store.counts()
        for status in ("fetching", "queued", "running", *TERMINAL):
            self.metrics.jobs.labels(status).set(counts.get(status, 0))
        self.metrics.backlog.set(await self.backlog.seconds())

    def _ending(self, job_id: str) -> None:
        """Stop subtracting a job's done audio before its final store write (no dip in the
        backlog between that write and the job leaving ``active``)."""
        a = self.active.get(job_id)
        if a:
            a.ending = True

    # ---- claiming ----------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        cap = self.settings.storage.max_active_jobs
        ahead = self.prep.workers + 1  # claimed and not started: enough to keep prep busy
        while not self._stopping:
            self._wake.clear()
            unstarted = sum(1 for a in self.active.values() if not a.started)
            free = min(cap - len(self.active), ahead - unstarted)
            for job in await self.store.claim(self.replica, free, self.lease_s):
                task = asyncio.create_task(self._run(job), name=f"job-{job.id}")
                self.active[job.id] = Active(task)
                self.changed(job.id)
            # Woken by a submit, a job that started or ended; the timeout picks up other
            # replicas' work.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):  # not wait_for: see app/jobs/webhooks.py
                    await self._wake.wait()

    # ---- running one job ---------------------------------------------------------------------
    async def _run(self, job: JobRow) -> None:
        active = self.active[job.id]
        try:
            if self._stopping:
                raise ShuttingDown("service stopping; the job stays queued")
            await self._complete(job, await JobWork(self.tools, job, active).run())
        except asyncio.CancelledError:
            if self._stopping:
                # Cancelled by the drain's deadline: the job was in an engine call that
                # outlived the grace, maybe a stalled one, so the run counts.
                task = asyncio.current_task()
                ran = task is not None and task.cancelling() > 0
                await self.store.release(job.id, self.replica, active.started, counts=ran)
        except ShuttingDown:
            await self.store.release(job.id, self.replica, active.started)
        except ServiceError as exc:
            await self._fail(job, exc.body()["error"])
        except Exception:  # a bug must fail the job visibly, never leave it hanging
            log.exception("job %s crashed", job.id)
            await self._fail(job, {"type": "internal_error",
                                   "message": "internal error; see the server log"})
        finally:
            self.active.pop(job.id, None)
            self.wake()

    async def job_started(self, job: JobRow, active: Active) -> None:
        """Its upload is open on a prep thread: the job's work begins, and an attempt counts."""
        max_attempts = self.settings.storage.max_attempts  # see StorageSettings.max_attempts
        if job.attempts >= max_attempts:
            raise TranscriptionFailed(
                f"the service stopped {job.attempts} times while running this job (a crash "
                "or a stalled engine); it is not retried again", cause="too_many_attempts")
        await self.store.started(job.id, self.replica)
        active.started = True
        self.wake()  # room to claim another

    def log_progress(self, job: JobRow, a: Active) -> None:
        """About ten lines per long job (``progress_log_windows`` windows or more). Windows
        finish while its audio is still being cut, so until then the step comes from the
        header's estimate and `windows_total` is null (not yet known) beside `windows_expected`."""
        total = a.windows_total or max(a.windows_cut, a.windows_expected)
        step = max(1, total // 10)
        at_step = a.windows_done % step == 0 or a.windows_done == a.windows_total
        if total >= self.settings.progress_log_windows and at_step:
            elapsed = max(1e-6, time.time() - (job.started_at or job.created_at))
            log.info("job progress", extra={"job_id": job.id, "windows_done": a.windows_done,
                                            "windows_total": a.windows_total,
                                            "windows_expected": total,
                                            "rtf": round(a.audio_done_s / elapsed, 2)})

    async def _complete(self, job: JobRow, out: Outcome) -> None:
        opts = JobOptions.from_dict(job.options)
        job.audio_seconds = out.seconds  # decoded truth, not the header
        result = transcript(out.windows, out.results, out.language, out.seconds,
                            opts.word_timestamps or out.turns is not None, out.channels)
        if opts.logprobs:  # include[]=logprobs on /v1: per token, OpenAI's shape
            result["logprobs"] = logprob_entries(out.results)
        if out.turns is not None:  # diarize: speakers on segments and words, split at turns
            result = assign_speakers(result, out.turns)
            if not opts.word_timestamps:
                result["words"] = None  # decoded with word times for the split only
        # queue wait: accepted -> claimed; processing: claimed -> done (decode, VAD, batches).
        now = time.time()
        started = job.started_at or job.created_at
        self._ending(job.id)
        ok = await self.store.finish(
            job.id, self.replica, "done", self.settings.storage.result_ttl_s, result=result,
            windows_total=len(out.windows), windows_done=len(out.windows),
            audio_seconds=out.seconds,
            queue_wait_s=started - job.created_at, processing_s=now - started,
            diarization_s=out.diarization_s,
        )
        if ok:
            self.metrics.job_rtf.observe(job.audio_seconds / max(1e-6, now - started))
            self.metrics.job_queue_wait.observe(started - job.created_at)
            if out.diarization_s is not None:
                self.metrics.diarization.observe(out.diarization_s)
                self.metrics.diarized_audio.inc(out.seconds)
            self._job_ended(job.id, "done", job)
            await drop_upload(self.blobs, job.upload_path)

    async def _fail(self, job: JobRow, error: dict[str, Any]) -> None:
        self._ending(job.id)
        if await self.store.finish(job.id, self.replica, "failed",
                                   self.settings.storage.result_ttl_s, error=error):
            self._job_ended(job.id, "failed", job)
            await drop_upload(self.blobs, job.upload_path)

    def _job_ended(self, job_id: str, status: str, job: JobRow) -> None:
        self.events.ended(job_id, status, job.created_at)  # counted, followers, webhooks

