"""The service's pipeline in one process, without HTTP or a job store: what a Ray actor holds.

Built by the service's own builder (app/jobs/pipeline.py: engines loaded and warmed up, which
on a GPU measures the batch cap; the VAD; the engine pool; the cross-request batcher with its
two CPU stages, duration-aware grouping, dynamic time axis and OOM backoff; the prep pool; the
speaker service), and every row runs as one job through the service's own
:class:`app.jobs.work.JobWork`: probe, decode and VAD-cut a chunk at a time in the prep processes,
windows handed to the batcher as they are cut, language detected inside the batch, the
transcript assembled by :func:`app.results.transcript.transcript` (speakers assigned when
asked). So a row's transcript is the one the service gives for the same file and options.

A job's work gets its shared parts and callbacks as :class:`app.jobs.work.Tools`, built here as
the job runner builds it: what the runner adds around the work (the store row, leases,
attempts, progress events, webhooks) has no meaning here, so the store and blob store are
no-ops and the callbacks only mark the row started. Rows run concurrently up to
``storage.max_active_jobs`` (64), as jobs do in the service, so windows of many rows share
engine batches and a row's decode overlaps others' inference.

Everything runs on a private event loop on its own thread (the engine on its worker threads,
prep in its processes, none of it on the loop): callers on any thread or loop submit rows
with :meth:`LocalPipeline.submit` and get a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from app.audio.media import probe
from app.audio.vad import Vad
from app.batching.batcher import Batcher
from app.config import Settings
from app.engine.loading import load_whisper
from app.engine.startup import EngineFactory
from app.errors import ServiceError, ShuttingDown
from app.jobs.blobs import BlobStore
from app.jobs.pipeline import build
from app.jobs.prep import Prep
from app.jobs.store import JobRow, JobStore
from app.jobs.work import Active, JobWork, Tools
from app.metrics import Metrics
from app.results.transcript import transcript
from app.speakers import assign_speakers
from app.speakers.service import SpeakerService
from app.windows import JobOptions

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    """One row's work: a local audio file and what the request would have asked for."""

    key: str  # unique among the jobs in flight (the row id)
    path: Path
    options: JobOptions


@dataclass
class Done:
    result: dict[str, Any] | None  # the service's transcript (text, segments, language, ...)
    audio_s: float  # decoded length
    processing_s: float  # its work began -> transcript (the service's processing_s)
    error: str | None = None  # "type: message", as the service's failed job reports it
    finished: float = field(default_factory=time.time)  # wall clock, for progress over time

    @property
    def rtf(self) -> float | None:
        return round(self.audio_s / self.processing_s, 2) if self.processing_s > 0 else None


class _Blobs:
    """Rows are already local files (app.dataset.inputs made them so): nothing to fetch."""

    def fetch(self, key: str) -> Path:
        return Path(key)

    def release(self, path: Path) -> None:
        pass


class _Store:
    """The one call a job's work makes on its store; no store here: a row's size and decoded
    length are read from the work's outcome."""

    async def update(self, job_id: str, **fields: Any) -> None:
        pass


async def _started(job: JobRow, active: Active) -> None:
    active.started = True  # no attempts to count: Ray retries a block, not a row


def _changed(job_id: str) -> None:
    pass  # no watchers (SSE) here


def _progressed(job: JobRow, active: Active) -> None:
    pass  # progress is counted per row by the caller


def tools(settings: Settings, prep: Prep, vad: Vad, batcher: Batcher,
          speakers: SpeakerService) -> Tools:
    """What every row's :class:`JobWork` uses, as the job runner builds it, less the store."""
    return Tools(settings, cast(JobStore, _Store()), cast(BlobStore, _Blobs()), prep, vad,
                 batcher, speakers, started=_started, changed=_changed, progressed=_progressed)


class LocalPipeline:
    """Load once (blocking: the model, its warm-up and, on a GPU, its batch sizing), then
    :meth:`submit` rows from any thread; :meth:`close` drains and frees the model."""

    def __init__(self, settings: Settings | None = None,
                 engine_factory: EngineFactory = load_whisper) -> None:
        self.settings = settings or Settings()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pipeline-loop",
                                        daemon=True)
        self._thread.start()
        self.sizing: dict[str, Any] = {}
        try:
            self._call(self._start(engine_factory))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, factory: EngineFactory) -> None:
        s = self.settings
        # The service's own builder: the same engines, stages, batcher, VAD, prep and speakers.
        self.pipeline = p = await build(s, factory, Metrics())
        self.vad, self.pool, self.batcher, self.prep, self.speakers = (
            p.vad, p.pool, p.batcher, p.prep, p.speakers)
        self._tools = tools(s, self.prep, self.vad, self.batcher, self.speakers)
        self._admitted = asyncio.Semaphore(s.storage.max_active_jobs)
        engine = p.engine
        self.sizing = {"device": p.device, "compute_type": engine.info.compute_type,
                       "engines": p.engines, "workers": self.pool.workers,
                       "prep_threads": self.prep.workers,
                       "max_batch_size": p.batcher_settings.max_batch_size,
                       "sized": [z.as_dict() for z in p.sizings]}
        p.start()
        gc.collect()
        gc.freeze()  # as the service does: the model's objects are skipped by every collection
        log.info("pipeline ready", extra=self.sizing)

    # ---- rows ---------------------------------------------------------------------------------
    def submit(self, jobs: Sequence[Job]) -> concurrent.futures.Future[list[Done]]:
        """Run ``jobs`` (concurrently, sharing batches with every other submission); the
        results in the same order. Failed rows are a :class:`Done` with ``error`` set."""
        return asyncio.run_coroutine_threadsafe(self._run(jobs), self._loop)

    def transcribe(self, jobs: Sequence[Job]) -> list[Done]:
        return self.submit(jobs).result()

    async def _run(self, jobs: Sequence[Job]) -> list[Done]:
        return list(await asyncio.gather(*(self._one(j) for j in jobs)))

    async def _one(self, job: Job) -> Done:
        s = self.settings
        async with self._admitted:
            t0 = time.monotonic()
            try:
                # As the API does before it accepts an upload: the header's duration (the
                # batcher's size estimate) and the service's refusals (415, 413, 422).
                head = await self.prep.run(0, probe, job.path, s.limits.max_audio_s)
                row = job_row(job, head.duration_s)
                task = asyncio.current_task()
                assert task is not None
                out = await JobWork(self._tools, row, Active(task)).run()
            except ShuttingDown:
                raise  # not the row's fault: its batch is retried, never recorded as failed
            except ServiceError as exc:
                err = exc.body()["error"]
                return Done(None, 0.0, time.monotonic() - t0, f"{err['type']}: {err['message']}")
            except Exception as exc:  # a row must fail alone, never the batch
                log.exception("row %s failed", job.key)
                return Done(None, 0.0, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
            o = job.options
            result = transcript(out.windows, out.results, out.language, out.seconds,
                                o.word_timestamps or out.turns is not None, out.channels)
            if out.turns is not None:  # diarize: as the job runner completes such a job
                result = assign_speakers(result, out.turns)
                if not o.word_timestamps:
                    result["words"] = None
            if out.diarization_s is not None:
                result["diarization_s"] = out.diarization_s
            return Done(result, out.seconds, time.monotonic() - t0)

    # ---- the end ------------------------------------------------------------------------------
    def close(self, grace_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._stop(grace_s))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    async def _stop(self, grace_s: float) -> None:
        self.prep.shutdown()
        await self.batcher.stop(grace_s)
        await self.pipeline.close()


def job_row(job: Job, audio_seconds: float) -> JobRow:
    """The store row a job's work reads (id, options, upload, the header's duration)."""
    now = time.time()
    return JobRow(id=job.key, owner=None, status="running", created_at=now, started_at=now,
                  finished_at=None, expires_at=None, filename=job.path.name,
                  upload_path=str(job.path), options=job.options.to_dict(),
                  audio_seconds=audio_seconds, windows_total=None, windows_done=0,
                  queue_wait_s=None, processing_s=None, result=None, error=None, attempts=0,
                  lease_owner=None, lease_expires_at=None)
