"""The job runner: claims queued jobs from the store, prepares them, feeds the batcher, finishes.

Per job: decode + VAD in the prep pool (overlapping the engine), then the windows go to the
batcher. A job without a language sends its first window alone with detection on, then the
rest with the detected language, so one upload is transcribed in one language, as whisperx does.
Results are reassembled in time order whatever order the batches finished in.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app import audio
from app.batcher import Batcher
from app.config import Settings
from app.engine import SAMPLE_RATE, DecodeOptions, Window, WindowResult
from app.errors import ServiceError, ShuttingDown, TranscriptionFailed
from app.metrics import Metrics
from app.store import TERMINAL, JobRow, JobStore

log = logging.getLogger(__name__)

LEASE_S = 60.0  # a replica that stops heartbeating loses its jobs after this long


@dataclass
class Active:
    task: asyncio.Task[None]
    windows_total: int = 0
    windows_done: int = 0
    audio_done_s: float = 0.0


def new_job_id() -> str:
    return secrets.token_urlsafe(18)  # 144 random bits: ids cannot be guessed or enumerated


class JobRunner:
    def __init__(self, settings: Settings, store: JobStore, batcher: Batcher, vad: audio.Vad,
                 metrics: Metrics, replica: str = "local") -> None:
        self.settings = settings
        self.store = store
        self.batcher = batcher
        self.vad = vad
        self.metrics = metrics
        self.replica = replica
        self.active: dict[str, Active] = {}
        self._prep = ThreadPoolExecutor(settings.prep_workers, thread_name_prefix="prep")
        self._wake = asyncio.Event()
        self._done_events: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        n = await self.store.requeue_stale(self.replica)
        if n:
            log.info("resuming %d job(s) interrupted by the last stop", n)
        self._tasks = [asyncio.create_task(self._claim_loop(), name="claim"),
                       asyncio.create_task(self._maintenance_loop(), name="maintenance")]
        self._wake.set()

    async def stop(self, grace_s: float) -> None:
        """Stop claiming, let the batch in flight finish, leave the rest queued."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.batcher.stop(grace_s)
        tasks = [a.task for a in self.active.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._prep.shutdown(wait=False, cancel_futures=True)

    # ---- API side ----------------------------------------------------------------------------
    async def submit(self, job_id: str, upload: Path, filename: str | None, options: DecodeOptions,
                     audio_seconds: float, owner: str | None) -> None:
        await self.store.insert(
            id=job_id, owner=owner, status="queued", created_at=time.time(), filename=filename,
            upload_path=str(upload), options=_options_dict(options), audio_seconds=audio_seconds,
            windows_done=0, attempts=0,
        )
        self._wake.set()

    async def cancel(self, job: JobRow) -> bool:
        if job.status in TERMINAL:
            return False
        ok = await self.store.finish(job.id, None, "cancelled", self.settings.storage.result_ttl_s)
        active = self.active.get(job.id)
        if active:
            active.task.cancel()  # its queued windows are dropped by the batcher for free
        if ok:
            self._job_ended(job.id, "cancelled", job)
            _unlink(job.upload_path)
        return ok

    async def wait(self, job_id: str, timeout: float) -> None:
        ev = self._done_events.setdefault(job_id, asyncio.Event())
        job = await self.store.get(job_id)
        if job is None or job.status in TERMINAL:
            self._done_events.pop(job_id, None)
            return
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            pass

    def progress(self, job_id: str) -> tuple[int, int] | None:
        a = self.active.get(job_id)
        return (a.windows_done, a.windows_total) if a else None

    async def backlog_seconds(self) -> float:
        """Accepted audio not yet transcribed: what 429 and autoscaling look at."""
        queued = await self.store.queued_audio_seconds()
        return max(0.0, queued - sum(a.audio_done_s for a in self.active.values()))

    # ---- claiming ----------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        cap = self.settings.storage.max_active_jobs
        while True:
            self._wake.clear()
            free = cap - len(self.active)
            for job in await self.store.claim(self.replica, free, LEASE_S):
                task = asyncio.create_task(self._run(job), name=f"job-{job.id}")
                self.active[job.id] = Active(task)
            try:  # woken by a submit or a finished job; the timeout picks up other replicas' work
                await asyncio.wait_for(self._wake.wait(), 2.0)
            except TimeoutError:
                pass

    async def _maintenance_loop(self) -> None:
        while True:
            try:
                progress = {k: a.windows_done for k, a in self.active.items()}
                await self.store.heartbeat(self.replica, progress, LEASE_S)
                if await self.store.requeue_stale("\0no-replica"):  # others' expired leases
                    self._wake.set()
                await self._purge_expired()
                counts = await self.store.counts()
                for status in ("queued", "running", *TERMINAL):
                    self.metrics.jobs.labels(status).set(counts.get(status, 0))
                self.metrics.backlog.set(await self.backlog_seconds())
            except Exception:
                log.exception("maintenance pass failed; retrying")
            await asyncio.sleep(LEASE_S / 6)

    async def _purge_expired(self) -> None:
        old = await self.store.expired(time.time())
        for j in old:
            _unlink(j.upload_path)
        await self.store.delete([j.id for j in old])

    # ---- running one job ---------------------------------------------------------------------
    async def _run(self, job: JobRow) -> None:
        try:
            await self._process(job)
        except asyncio.CancelledError:
            if self._stopping:
                await self.store.release(job.id, self.replica)
        except ShuttingDown:
            await self.store.release(job.id, self.replica)
        except ServiceError as exc:
            await self._fail(job, exc.body()["error"])
        except Exception as exc:  # a bug must fail the job visibly, never leave it hanging
            log.exception("job %s crashed", job.id)
            await self._fail(job, {"type": "internal_error", "message": str(exc)})
        finally:
            self.active.pop(job.id, None)
            self._wake.set()

    async def _process(self, job: JobRow) -> None:
        loop = asyncio.get_running_loop()
        lim = self.settings.limits
        samples, windows = await loop.run_in_executor(
            self._prep, audio.prepare, Path(job.upload_path), self.vad, lim.max_audio_s
        )
        active = self.active[job.id]
        active.windows_total = len(windows)
        job.audio_seconds = round(len(samples) / SAMPLE_RATE, 3)  # decoded truth, not the header
        del samples
        await self.store.update(job.id, windows_total=len(windows), audio_seconds=job.audio_seconds)
        opts = DecodeOptions(**job.options)
        results: list[WindowResult] = []
        if windows and opts.language is None:  # detect once, on the first window, then reuse
            results = await self._transcribe(job, windows[:1], opts, active)
            opts = replace(opts, language=results[0].language)
        results += await self._transcribe(job, windows[len(results):], opts, active)
        await self._complete(job, windows, results, opts)

    async def _transcribe(self, job: JobRow, windows: list[Window], opts: DecodeOptions,
                          active: Active) -> list[WindowResult]:
        if not windows:
            return []
        futures = self.batcher.submit(job.id, windows, opts)

        def tick(w: Window) -> Any:
            def _done(f: asyncio.Future[WindowResult]) -> None:
                if not f.cancelled() and f.exception() is None:
                    active.windows_done += 1
                    active.audio_done_s += w.duration
                    self._log_progress(job, active)
            return _done

        for f, w in zip(futures, windows, strict=True):
            f.add_done_callback(tick(w))
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for f in futures:
                f.cancel()  # on failure or cancellation the job's other windows cost nothing

    def _log_progress(self, job: JobRow, a: Active) -> None:
        step = max(1, a.windows_total // 10)
        if a.windows_total >= 10 and (a.windows_done % step == 0 or a.windows_done == a.windows_total):
            elapsed = max(1e-6, time.time() - (job.started_at or job.created_at))
            log.info("job progress", extra={"job_id": job.id, "windows_done": a.windows_done,
                                            "windows_total": a.windows_total,
                                            "rtf": round(a.audio_done_s / elapsed, 2)})

    async def _complete(self, job: JobRow, windows: list[Window], results: list[WindowResult],
                        opts: DecodeOptions) -> None:
        segments = [
            {"id": k, "start": round(w.start, 3), "end": round(w.end, 3), "text": r.text.strip(),
             "avg_logprob": r.avg_logprob, "no_speech_prob": r.no_speech_prob,
             "compression_ratio": r.compression_ratio, "tokens": r.tokens}
            for k, (w, r) in enumerate(zip(windows, results, strict=True))
        ]
        result = {
            "text": " ".join(s["text"] for s in segments if s["text"]),
            "language": opts.language,
            "language_probability": results[0].language_probability if results else None,
            "duration": job.audio_seconds, "segments": segments,
        }
        # queue wait: accepted -> claimed; processing: claimed -> done (decode, VAD, batches).
        now = time.time()
        started = job.started_at or job.created_at
        ok = await self.store.finish(
            job.id, self.replica, "done", self.settings.storage.result_ttl_s, result=result,
            windows_total=len(windows), windows_done=len(windows),
            queue_wait_s=started - job.created_at, processing_s=now - started,
        )
        if ok:
            self.metrics.job_rtf.observe(job.audio_seconds / max(1e-6, now - started))
            self._job_ended(job.id, "done", job)
            _unlink(job.upload_path)

    async def _fail(self, job: JobRow, error: dict[str, Any]) -> None:
        if await self.store.finish(job.id, self.replica, "failed",
                                   self.settings.storage.result_ttl_s, error=error):
            self._job_ended(job.id, "failed", job)
            _unlink(job.upload_path)

    def _job_ended(self, job_id: str, status: str, job: JobRow) -> None:
        self.metrics.jobs_finished.labels(status).inc()
        self.metrics.job_latency.labels(status).observe(time.time() - job.created_at)
        ev = self._done_events.pop(job_id, None)
        if ev:
            ev.set()


def _options_dict(o: DecodeOptions) -> dict[str, Any]:
    return {"language": o.language, "task": o.task, "beam_size": o.beam_size,
            "initial_prompt": o.initial_prompt}


def _unlink(path: str) -> None:
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)


__all__ = ["JobRunner", "new_job_id", "TranscriptionFailed"]
