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
from typing import Any

from fastapi import FastAPI

from app.api import docs, health, web
from app.api import webhooks as hooks
from app.api.asr import api_router as asr
from app.api.errors import install_error_handlers
from app.api.json_form import describe_json_bodies
from app.api.middleware import install_middleware
from app.api.native import api_router as native
from app.api.native import events
from app.api.openai import api_router as openai
from app.api.realtime import api_router as realtime
from app.config import Settings
from app.engine.loading import REFUSALS, load_whisper
from app.engine.startup import EngineFactory
from app.errors import ServiceError
from app.jobs.blobs import make_blobs
from app.jobs.core import Core
from app.jobs.door import Door
from app.jobs.pipeline import build
from app.jobs.runner import JobRunner
from app.jobs.store import JobStore, StoreInUse, lock_sqlite
from app.jobs.webhooks import WebhookDispatcher
from app.metrics import Metrics
from app.net.outbound import OutboundGuard

log = logging.getLogger("batchscribe")
__all__ = ["create_app", "load_whisper", "setup_logging"]


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
        try:  # a GPU that fails its load or warm-up is left out (app/engine/startup.py)
            pipeline = await build(settings, engine_factory, metrics)
        except REFUSALS as exc:
            QuietRefusal.refused = True  # uvicorn's copy of the traceback is dropped
            log.critical("cannot start: %s", exc)
            raise
        except ServiceError as exc:  # speaker models asked for at start-up failed to load
            log.critical("cannot start: %s", exc.message)
            raise
        engine = pipeline.engine
        metrics.model_info.info({"model": engine.info.model, "device": engine.info.device,
                                 "compute_type": engine.info.compute_type,
                                 "vad": pipeline.vad_kind,
                                 "workers": str(engine.info.num_workers),
                                 "speakers": settings.speakers.load})
        store = JobStore(settings.database_url(), min_job_s=settings.min_job_s(),
                         fair=bool(settings.security.api_key_sha256))
        settings.storage.data_dir.mkdir(parents=True, exist_ok=True)
        blobs = make_blobs(settings.storage)  # uploads: where every replica can read them
        spool = blobs.spool_dir
        spool.mkdir(parents=True, exist_ok=True)
        await store.init()
        batcher = pipeline.batcher
        runner = JobRunner(settings, store, batcher, pipeline.vad, metrics, pipeline.prep,
                           blobs=blobs, speakers=pipeline.speakers)
        outbound = OutboundGuard(settings.outbound)
        if pipeline.sizings:
            log.info("batch sizing", extra=pipeline.sizing())
        # A session kept as a job ends through the runner's hub, as every job does.
        core = Core(settings, metrics, store, runner, pipeline, outbound, blobs,
                    pipeline.live_hall(store, outbound, runner.events.ended))
        door: Door = core  # what the routers and middleware see (mypy checks Core is a Door)
        app.state.door = door
        # Webhooks only with a signing secret; pending deliveries of earlier runs resume here.
        webhooks = (WebhookDispatcher(settings.webhooks, store, outbound)
                    if settings.webhooks.enabled else None)
        if webhooks is not None:
            runner.events.on_end.append(webhooks.wake)
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
        pipeline.start()
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
                                 "workers": engine.info.num_workers, "vad": pipeline.vad_kind})
        try:
            yield
        finally:
            await drain()
            await core.stop_fetches()  # downloads in flight: their jobs fail (submit again)
            if webhooks is not None:
                await webhooks.stop()
            await outbound.aclose()
            core.close()
            await pipeline.close()  # after the drain: the speaker models, then the engines
            await store.close()
            log.info("stopped")

    app = FastAPI(title="batchscribe", version="0.1.0", lifespan=lifespan,
                  description="Batched Whisper transcription service.", form_limits=FORM_LIMITS,
                  docs_url=None, redoc_url=None, swagger_ui_oauth2_redirect_url=None)
    install_error_handlers(app)
    app.include_router(native.transcribe_router)
    app.include_router(native.router)
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
