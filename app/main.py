"""App factory and lifespan: HTTP is kept apart from the engine; the core is ``app.state.door``.

Nothing heavy happens at import. The lifespan resolves and loads the model (refusing to start,
with the command to run, when there is none), opens the job store, starts the batcher and the
job runner, and on shutdown drains them within the grace period.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, cast

from fastapi import FastAPI

from app.api import asr, docs, events, health, jobs, openai, realtime, transcribe, web
from app.api import webhooks as hooks
from app.api.json_form import describe_json_bodies
from app.api.middleware import install_middleware
from app.audio.vad import make_vad
from app.batching.batcher import Batcher
from app.batching.stages import Stages
from app.config import Settings
from app.engine import StagedEngine
from app.engine.device import DeviceMonitor, resolve_device
from app.engine.loading import REFUSALS, load_whisper
from app.engine.placement import EnginePool, make_pool
from app.engine.sizing import resolve_batcher
from app.engine.startup import EngineFactory, start_engines
from app.engine.whisper import size_class
from app.errors import ServiceError, install_error_handlers
from app.jobs.blobs import make_blobs
from app.jobs.core import Core
from app.jobs.door import Door
from app.jobs.prep import prep_threads
from app.jobs.runner import JobRunner
from app.jobs.store import JobStore, StoreInUse, lock_sqlite
from app.jobs.webhooks import WebhookDispatcher
from app.metrics import Metrics
from app.net.outbound import OutboundGuard
from app.speakers.service import SpeakerService

log = logging.getLogger("batchscribe")
__all__ = ["create_app", "load_whisper", "setup_logging"]


def held_mb(monitor: DeviceMonitor) -> float:
    """Memory this process holds now (RSS on CPU, its VRAM on GPU): the budget's baseline."""
    return sum(r.used_bytes if r.process_bytes is None else r.process_bytes
               for r in monitor.read()) / 2**20


def stages(settings: Settings, pool: EnginePool) -> Stages | None:
    """The encoder and decoder as separate batcher stages, where the engines allow it (CPU)."""
    if not (settings.batcher.split_stages and pool.staged):
        return None
    engine = cast(StagedEngine, pool.engine)
    # The decoder leaves Whisper's fallbacks to calls of their own (app/batching/urgency.py).
    return Stages(pool.encode, partial(pool.decode, redo=False), engine.padded_samples,
                  redo=pool.redo)


def create_app(settings: Settings | None = None,
               engine_factory: EngineFactory = load_whisper) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # before the model loads: a second process on the same SQLite file fails fast
            db_lock = lock_sqlite(settings.database_url())
        except StoreInUse as exc:
            log.critical("cannot start: %s", exc)
            raise
        try:
            async with running(app):
                yield
        finally:
            if db_lock is not None:
                db_lock.close()  # releases the flock (an app restarted in-process takes it again)

    @asynccontextmanager
    async def running(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics()
        monitor = await asyncio.to_thread(DeviceMonitor, resolve_device(settings.model.device))
        try:  # a GPU that fails its load or warm-up is left out (app/engine/startup.py)
            started = await start_engines(settings, engine_factory, monitor)
        except REFUSALS as exc:
            QuietRefusal.refused = True  # uvicorn's copy of the traceback is dropped
            log.critical("cannot start: %s", exc)
            raise
        engines, sizings = started.engines, started.sizings
        engine = engines[0]  # model, device and compute type are the same on every engine
        device = engine.info.device if engine.info.device != "auto" else resolve_device("auto")
        vad_kind = settings.model.vad
        if vad_kind == "auto":  # Silero runs on the prep threads' CPU, one per prep thread
            vad_kind = "silero"
        vad = await asyncio.to_thread(make_vad, vad_kind, device, settings.prep.speech_pad_s)
        metrics.model_info.info({"model": engine.info.model, "device": engine.info.device,
                                 "compute_type": engine.info.compute_type, "vad": vad_kind,
                                 "workers": str(engine.info.num_workers),
                                 "speakers": settings.speakers.load})
        # Speaker diarization: loaded on the first diarize job unless speakers.load says.
        speakers = SpeakerService(settings.speakers, settings.model.cache_dir)
        try:
            await speakers.start()
        except ServiceError as exc:
            log.critical("cannot start: %s", exc.message)
            raise
        store = JobStore(settings.database_url(), min_job_s=settings.min_job_s(),
                         fair=bool(settings.security.api_key_sha256))
        settings.storage.data_dir.mkdir(parents=True, exist_ok=True)
        blobs = make_blobs(settings.storage)  # uploads: where every replica can read them
        spool = blobs.spool_dir
        spool.mkdir(parents=True, exist_ok=True)
        await store.init()
        # One engine per GPU, least loaded first; those that did not start are only reported.
        runner_engine = make_pool(engines, settings, started.failed)
        if device != monitor.device:  # an injected engine on another device (tests)
            monitor = await asyncio.to_thread(DeviceMonitor, device)
        # GPU: the cap the warm-up measured per engine (the smallest); CPU: as configured.
        batcher_settings = resolve_batcher(settings.batcher, sizings)
        batcher = Batcher(runner_engine.run, batcher_settings, runner_engine.workers, metrics,
                          size_class=size_class(settings.model, device),
                          base_memory_mb=held_mb(monitor) if device == "cpu" else 0.0,
                          stages=stages(settings, runner_engine),
                          padded=getattr(engine, "padded_samples", None))
        restore = getattr(batcher, "restore_slots", None)
        if restore is not None:  # retire an engine's slots only if they can come back
            runner_engine.on_remove, runner_engine.on_restore = batcher.retire_slots, restore
        runner = JobRunner(settings, store, batcher, vad, metrics, blobs=blobs,
                           prep_workers=prep_threads(settings.prep.workers, len(engines)),
                           speakers=speakers)
        outbound = OutboundGuard(settings.outbound)
        sizing = {"engines": [z.as_dict() for z in sizings],
                  "max_batch_size": batcher_settings.max_batch_size,
                  "max_batch_beams": batcher_settings.max_batch_beams}
        if sizings:
            log.info("batch sizing", extra=sizing)
        core = Core(settings, metrics, store, runner, batcher, runner_engine, monitor, outbound,
                    sizing)
        door: Door = core  # what the routers and middleware see (mypy checks Core is a Door)
        app.state.door = door
        # Webhooks only with a signing secret; pending deliveries of earlier runs resume here.
        webhooks = (WebhookDispatcher(settings.webhooks, store, outbound)
                    if settings.webhooks.enabled else None)
        if webhooks is not None:
            runner.on_end.append(webhooks.wake)
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Future[None]] = []

        def drain() -> asyncio.Future[None]:
            """Refuse new work (503), finish the batch in flight, requeue the rest. Idempotent."""
            core.ready = False
            if not stopping:
                stopping.append(asyncio.ensure_future(runner.stop(settings.shutdown_grace_s)))
            return stopping[0]

        # Called from the SIGTERM handler (see __main__): uvicorn runs the lifespan shutdown only
        # after open requests end, and an open ?wait=true request ends when the drain does.
        app.state.begin_shutdown = lambda: loop.call_soon_threadsafe(drain)
        batcher.start()
        await runner.start()
        if webhooks is not None:
            webhooks.start()
        # The model, torch and whisperx leave millions of long-lived objects, and every full
        # collection walked them all: ~0.36 s with the GIL held (every thread and the event loop
        # stopped), about once a minute under load. Frozen, they are skipped from now on.
        gc.collect()
        gc.freeze()
        core.ready = True
        log.info("ready", extra={"model": engine.info.model, "device": engine.info.device,
                                 "workers": engine.info.num_workers, "vad": vad_kind})
        try:
            yield
        finally:
            await drain()
            await core.stop_fetches()  # downloads in flight: their jobs fail (submit again)
            await speakers.stop()  # after the drain: no job feeds a speaker stream any more
            if webhooks is not None:
                await webhooks.stop()
            await outbound.aclose()
            core.close()
            await asyncio.to_thread(runner_engine.close)
            await store.close()
            log.info("stopped")

    app = FastAPI(title="batchscribe", version="0.1.0", lifespan=lifespan,
                  description="Batched Whisper transcription service.", form_limits=FORM_LIMITS,
                  docs_url=None, redoc_url=None, swagger_ui_oauth2_redirect_url=None)
    install_error_handlers(app)
    app.include_router(transcribe.router)
    app.include_router(jobs.router)
    app.include_router(health.router)
    app.include_router(events.router)
    app.include_router(realtime.router)  # live transcription (before /v1's catch-all 404)
    app.include_router(openai.router)
    app.include_router(asr.router)  # whisper-asr-webservice's API (Bazarr)
    app.include_router(hooks.router)  # each key's webhook secret
    app.include_router(web.router)  # the page at /
    app.include_router(docs.router)  # /docs: Swagger UI from the service, no CDN
    install_middleware(app, settings)  # the whole stack, in order: app/api/middleware
    describe_json_bodies(app)  # after the API key check's own change to the OpenAPI spec
    return app


# Starlette's parser allows 1000 file parts and 1000 fields per form by default: each part a
# temporary file and a parse. Every route takes one file and a handful of fields. FastAPI has
# form_limits from 0.165.0 (the floor in pyproject.toml): releases before 0.145 took unknown
# keywords silently (the caps did not hold), 0.145-0.164 refuse them.
FORM_LIMITS: Any = {"max_files": 1, "max_fields": 32, "max_part_size": 64 * 1024}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with any ``extra=`` fields: greppable and machine-readable."""

    _std = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in self._std})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class QuietRefusal(logging.Filter):
    """Drops uvicorn's copy of a start-up refusal's traceback: the lifespan has already logged
    the one line that says why (``cannot start: ...``), and a refusal is not a crash."""

    refused = False  # set by the lifespan when it refuses to start

    def filter(self, record: logging.LogRecord) -> bool:
        return not (QuietRefusal.refused and record.name.startswith("uvicorn")
                    and record.getMessage().startswith("Traceback"))


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    handler.addFilter(QuietRefusal())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # FFmpeg's own messages (PyAV's "libav" loggers) are about what a client sent: a refused
    # playlist or a 0 Hz header is a 4xx answered to that client, not an ERROR line for the
    # operator, and a client must not be able to fill the log with them.
    logging.getLogger("libav").setLevel(logging.CRITICAL)
