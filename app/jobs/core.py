"""The core behind the door (app/jobs/door.py): what HTTP sees of the job runner, the store,
admission, the followers of jobs and the engines, in one object built by the lifespan
(app/main.py) and put on ``app.state.door``.

It holds no logic of its own beyond reading and routing: submissions go to
:class:`app.jobs.intake.Intake`, the backlog bounds to :class:`app.jobs.admission.Admission`,
following a job (every stream, every wait) to the runner's :class:`app.jobs.events.EventHub`,
the work itself to the job runner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import PurePath
from typing import Any

from prometheus_client import generate_latest

from app.audio import server_vad
from app.config import Settings
from app.errors import BadRequest
from app.jobs.admission import Admission
from app.jobs.blobs import BlobStore
from app.jobs.door import Health, LiveCall, LiveEnd, Readiness, ServiceStatus, Upload
from app.jobs.events import Subscription
from app.jobs.fetching import Fetches
from app.jobs.intake import Intake
from app.jobs.live import LiveHall
from app.jobs.pipeline import Pipeline
from app.jobs.runner import JobRunner
from app.jobs.speed import Speed, Speedometer
from app.jobs.store import JobRow, JobStore
from app.jobs.transfers import Hold
from app.jobs.views import JobView
from app.jobs.webhooks import key_secret
from app.live.config import opened_with
from app.live.protocol import ProtocolError, parse_session
from app.metrics import Metrics
from app.net.outbound import OutboundGuard
from app.results.logprobs import entries
from app.speakers.named import reference_voices

log = logging.getLogger(__name__)
STORE_TIMEOUT_S = 2.0  # /metrics and /status: well under Prometheus' default 10 s scrape timeout


class Core:
    """Implements :class:`app.jobs.door.Door`."""

    def __init__(self, settings: Settings, metrics: Metrics, store: JobStore, runner: JobRunner,
                 pipeline: Pipeline, outbound: OutboundGuard, blobs: BlobStore,
                 live: LiveHall) -> None:
        """``pipeline``: what app/jobs/pipeline.py built (engines, batcher, VAD, speakers);
        ``blobs``: where uploads go; ``live``: the live sessions' hall (built there too)."""
        self.settings = settings
        self.metrics = metrics
        self.ready = False  # set by the lifespan once warm; cleared when the drain begins
        self.sizing = pipeline.sizing()  # the batch sizing the warm-up measured (GET /readyz)
        self._store = store
        self._runner = runner
        self._pipeline = pipeline
        self._batcher = pipeline.batcher
        self._engines = engines = pipeline.pool
        self._monitor = pipeline.monitor
        self._speed = Speed(metrics, lambda: engines.workers)
        self._meter = Speedometer(metrics)
        self._admission = Admission(settings, store, runner.backlog, metrics,
                                    self._speed.retry_after_s)
        self._fetches = Fetches(settings, outbound, self._admission, runner.fetched,
                                runner.fail_unqueued)
        self._intake = Intake(settings, store, blobs, outbound, self._admission,
                              runner.submit, self._fetches)
        self._live = live
        live.share(self._admission)  # its sessions' audio counts in their keys' shares
        self._hub = runner.events  # how every stream and wait follows a job
        metrics.watch_outbound(outbound.slots.by_kind, lambda: dict(outbound.cut_offs))

    @property
    def stopped(self) -> bool:
        return self._runner.stopped

    # ---- taking work ---------------------------------------------------------------------------
    def check_speakers(self) -> None:
        self._pipeline.speakers.check()  # off: 400; models that failed to load: 503

    def check_chunking(self, settings: dict[str, float] | None) -> None:
        server_vad.vad_for(self._pipeline.vad, settings)  # a VAD that cannot take them: 400

    async def known_speakers(self, names: Sequence[str], clips: Sequence[bytes | str],
                             names_field: str, refs_field: str,
                             owner: str | None = None) -> list[dict[str, Any]]:
        return await reference_voices(self._pipeline.speakers, names, clips, names_field,
                                      refs_field, lambda s: self._admission.admitted(s, owner))

    async def gate(self, owner: str | None) -> None:
        await self._admission.gate(owner)

    async def submit(self, upload: Upload) -> str:
        return await self._intake.submit(upload)

    def webhook_secret(self, owner: str | None) -> str | None:
        hooks = self.settings.webhooks
        return key_secret(hooks.secret.get_secret_value(), owner) if hooks.enabled else None

    async def transfer(self, owner: str | None) -> Hold:
        return await self._admission.transfers.acquire(owner)

    async def stop_fetches(self) -> None:
        await self._fetches.stop()

    async def replay(self, owner: str | None, key: str) -> JobView | None:
        row = await self._intake.find(owner, key)
        return self._view(row) if row is not None else None

    # ---- jobs ----------------------------------------------------------------------------------
    def _view(self, row: JobRow) -> JobView:
        view = JobView.of(row, self._runner.progress(row.id))
        if row.status == "fetching":
            return replace(view, fetched_bytes=self._fetches.received(row.id))
        return view

    async def _own(self, job_id: str, owner: str | None) -> JobRow | None:
        row = await self._store.get(job_id)
        # Another tenant's job is "not found", not "forbidden": ids must not leak.
        return row if row is not None and row.owner == owner else None

    async def get(self, job_id: str, owner: str | None) -> JobView | None:
        row = await self._own(job_id, owner)
        return self._view(row) if row is not None else None

    async def jobs(self, owner: str | None, limit: int) -> list[JobView]:
        return [self._view(r) for r in await self._store.list(owner, limit)]

    async def some(self, ids: list[str], owner: str | None) -> list[JobView]:
        return [self._view(r) for r in await self._store.get_many(ids, owner)]

    async def cancel(self, job_id: str, owner: str | None) -> JobView | None:
        row = await self._own(job_id, owner)
        if row is None:
            return None
        await self._runner.cancel(row)
        self._fetches.cancel(job_id)  # a download still running stops here
        return await self.get(job_id, owner)

    def follow(self, job_id: str, owner: str | None, *, capped: bool = False) -> Subscription:
        return self._hub.follow(job_id, owner, capped=capped)

    def finished_texts(self, job_id: str, start: int) -> list[str] | None:
        return self._runner.finished_prefix(job_id, start)

    def finished_logprobs(self, job_id: str, start: int
                          ) -> list[tuple[str, list[dict[str, Any]]]] | None:
        done = self._runner.finished_windows(job_id, start)
        return None if done is None else [(w.text, entries([w])) for w in done]

    def live_session(self, session: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        checked = parse_session(session)
        if isinstance(checked, ProtocolError):
            raise BadRequest(checked.message, field=checked.param, no_retry=True)
        return (checked.model_dump(mode="json", exclude_unset=True),
                opened_with(checked, self.settings.live))

    async def live(self, call: LiveCall) -> LiveEnd:
        return await self._live.serve(call)

    def close(self) -> None:
        """After the drain: the live sessions' audio threads."""
        self._live.close()

    # ---- the service ---------------------------------------------------------------------------
    async def backlog_s(self, max_age_s: float = 0.0) -> float:
        return await self._runner.backlog.seconds(max_age_s)

    def speed(self) -> float:
        return self._speed.now()

    def model_name(self) -> str:
        return PurePath(self._engines.engine.info.model).name  # a model folder path: its name

    def health(self) -> Health:
        running = self._batcher.oldest_call_s()
        if running > self.settings.batcher.stall_after_s:
            return Health("engine_stalled", {"engine_call_running_s": round(running)})
        if (reason := self._engines.unhealthy()) is not None:
            return Health("engine_failing", {"reason": reason, "engines": self._engines.status()})
        return Health()

    def readiness(self) -> Readiness:
        info = self._engines.engine.info
        return Readiness(ready=self.ready and self._engines.unhealthy() is None,
                         model=info.model, device=info.device, compute_type=info.compute_type,
                         engines=self._engines.status(), sizing=self.sizing)

    async def status(self) -> ServiceStatus:
        rates = self._meter.read()
        try:
            jobs = await asyncio.wait_for(self._store.counts(), STORE_TIMEOUT_S)
            backlog = await asyncio.wait_for(self.backlog_s(1.0), STORE_TIMEOUT_S)
        except Exception:  # a slow store must not hang the page: show what memory holds
            jobs, backlog = {}, self._runner.backlog.admitting_s
        info = self._engines.engine.info
        return ServiceStatus(
            ready=self.ready, model=PurePath(info.model).name, device=info.device,
            workers=self._engines.workers, backlog_s=round(backlog, 1),
            pending_windows=self._batcher.pending(), jobs=jobs, span_s=rates.span_s,
            throughput=rates.throughput, rtf=rates.rtf, batch_size=rates.batch_size)

    async def metrics_text(self) -> bytes:
        """The store's gauges (jobs by status, the backlog) bounded by a timeout, keeping the
        maintenance loop's last values when the store is slow; then the point-in-time gauges
        (cheap: NVML or /proc, no locks)."""
        try:
            await asyncio.wait_for(self._runner.refresh_gauges(), STORE_TIMEOUT_S)
        except Exception as exc:  # slow or closed store: serve the maintenance loop's last values
            log.warning("metrics: store gauges not refreshed (%s)", type(exc).__name__)
        m = self.metrics
        m.pending_windows.set(self._batcher.pending())
        m.engine_call_age.set(self._batcher.oldest_call_s())
        m.record_memory(self._monitor.read())
        for engine in self._engines.status():
            m.engine_up.labels(engine["engine"]).set(1 if engine["in_rotation"] else 0)
        return generate_latest(m.registry)
